"""Training throughput as a fraction of the machine's measured matmul throughput (model FLOPs utilisation).

The peer is the hardware: FLOP/s of a large fp32 matmul (torch.mm, n=1024) measured in the same run. Training
is agentgrad's GRPO update (TorchLearner: forward, clipped loss, backward, AdamW) over a real rollout batch of
128 arithmetic episodes, in minibatches of 64 as the default run does. Model FLOPs, counted on the tokens the
forward really runs (a group's shared prompt once, `backends.shared_prefix`; padding is waste): 6 * N per token
(N = non-embedding parameters + the tied lm head, V * H) plus 12 * layers * H per key a token attends (scores and
values, forward and backward; causal: the token at position t attends t + 1 keys, masked keys not counted).
Each run token's own keys are counted: the tokens a shared prefix skips are the early, short-context ones, so the
plain forward's mean context (which this script used until 2026-12-06) undercounted by ~3%. "trained tok/s"
counts every row's tokens, what the user gets. The default width (128) and a wider model (512) on the same tokens
show how the fraction grows with the matmul sizes.

Both sides are measured in CPU time (`time.process_time`: other jobs' load does not count) and alternated in
`--repeats` rounds (bound, training, bound, ...); each round's fraction is its training rate over the mean of the
bounds measured just before and after it, and the table gives the median with its range. Where the CPU computes
bf16 natively (avx512_bf16 / AMX) the same update under bf16 autocast (`model.compute_dtype=bf16`) runs in the
same rounds, with the bf16 matmul bound beside it.

    nice -n 19 python benchmarks/train_mfu.py [--threads 1 2] [--widths 128 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bc_model_dir, bench_config, set_threads, spread, table


def matmul_flops(n: int = 1024, reps: int = 8, dtype: torch.dtype = torch.float32) -> float:
    """FLOP per CPU second of an n x n matmul (the machine's bound)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    t0 = time.process_time()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.process_time() - t0)


def model_flops(model, tokens: float, keys: float) -> float:
    """FLOPs of a forward and backward over `tokens` tokens that attend `keys` keys in all."""
    cfg = model.config
    H, V, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    embed = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embed + V * H  # the tied head still does a V x H matmul
    return 6 * n * tokens + 12 * layers * H * keys


def _keys(first: torch.Tensor, end: torch.Tensor) -> int:
    """Keys attended by the tokens at positions [first, end) of each row, causally: t + 1 for position t."""
    return int((end * (end + 1) - first * (first + 1)).sum()) // 2


def computed_tokens(learner, mb) -> tuple[int, int, int, int]:
    """(trained tokens, tokens the forward really runs, the same with padding, keys those run tokens attend) of
    one minibatch. With a shared prefix (`backends.shared_prefix`) a group's common prompt runs once, so it is
    counted once: the FLOP rate is what the machine did, while trained tokens/s is what the user gets."""
    from agentgrad.backends.hf import length_buckets
    from agentgrad.backends.shared_prefix import plan_shared_prefixes

    lengths = mb.attention_mask.sum(1)  # (b,)
    plan = plan_shared_prefixes(mb) if learner.lean is not None else None
    if plan is None:
        padded = sum(len(rows) * int(lengths[rows].max()) for rows in length_buckets(lengths, learner.max_buckets))
        return int(lengths.sum()), int(lengths.sum()), padded, _keys(torch.zeros_like(lengths), lengths)
    start = plan.prefix_len[plan.source]  # (b,)
    tails = lengths - start
    padded = int(plan.prefix_len.max()) * len(plan.prefix_len) + sum(
        len(rows) * int(tails[rows].max()) for rows in learner.continuation_buckets(plan))
    ran = int(plan.prefix_len.sum() + tails.sum())
    keys = _keys(torch.zeros_like(plan.prefix_len), plan.prefix_len) + _keys(start, lengths)
    return int(lengths.sum()), ran, padded, keys


def train_tokens_per_s(learner, batch, epochs: int = 2,
                       minibatch: int = 64) -> tuple[float, float, float, float]:
    """(trained tokens, run tokens, run tokens padding included, keys the run tokens attend) per CPU second of
    clipped-loss updates over the batch."""
    from agentgrad.algos.losses import ppo_clip_loss

    starts = range(0, batch.num_sequences, minibatch)
    # counted before the clock starts: counting re-plans the prefixes, the benchmark's work, not the training's
    counts = [computed_tokens(learner, batch.select(slice(s, s + minibatch))) for s in starts]
    trained, ran, padded, keys = (epochs * sum(n) for n in zip(*counts))
    t0 = time.process_time()
    for _ in range(epochs):
        for start in starts:
            mb = batch.select(slice(start, start + minibatch))
            logprobs = learner.logprobs(mb)
            loss = ppo_clip_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, clip_low=0.2,
                                 clip_high=0.28, agg="token-mean").loss
            learner.step(loss)
    dt = time.process_time() - t0
    return trained / dt, ran / dt, padded / dt, keys / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--bc-steps", type=int, default=60, help="BC steps of the model that samples the batch: at 60 "
                    "a group's 8 samples differ as in the default run's RL steps (as benchmark a's); from ~80 the "
                    "model solves nearly every task the same way, a group's rows share all but their last token "
                    "and the update runs 1-token continuations (a zero-signal batch the default run would skip)")
    ap.add_argument("--buckets", type=int, default=4, help="TorchLearner.max_buckets (1: one padded forward)")
    ap.add_argument("--repeats", type=int, default=5, help="alternated rounds of (bound, training)")
    args = ap.parse_args()

    from agentgrad.backends.base import SamplingParams
    from agentgrad.backends.hf import TorchLearner
    from agentgrad.backends.precision import FP32, cpu_has_bf16, resolve_compute_dtype
    from agentgrad.batch import collate
    from agentgrad.envs import SUITES
    from agentgrad.models.hf import load_model
    from agentgrad.models.tiny import build_tiny_model
    from agentgrad.pipelines.components import episode_limits, inference, quiet_hf
    from agentgrad.rewards.base import OutcomeReward, score
    from agentgrad.rollout.loop import run_episodes

    quiet_hf()
    set_threads(1)
    loaded = load_model(bc_model_dir(args.bc_steps))
    policy, codec = inference(loaded)
    suite = SUITES.get("arithmetic")()
    tasks = [t for t in suite.sample_tasks(16, split="train", seed=5) for _ in range(8)]
    trajs = run_episodes(policy, codec, [suite.make_env() for _ in tasks], tasks,
                         sampling=SamplingParams(temperature=0.7, seed=0), limits=episode_limits(bench_config()))
    scored = score(trajs, OutcomeReward(suite), suite)
    batch = collate(scored, pad_token_id=loaded.pad_token_id, group_index=[i // 8 for i in range(len(scored))])
    batch = batch.replace(advantages=torch.randn(batch.loss_mask.shape) * batch.loss_mask)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    computes = {"fp32": FP32}
    if cpu_has_bf16():
        computes["bf16"] = resolve_compute_dtype("bf16", "cpu")
    rows = []
    for width in args.widths:
        if width == loaded.model.config.hidden_size:
            model = loaded.model
        else:
            torch.manual_seed(0)
            model = build_tiny_model(loaded.tokenizer, hidden_size=width, num_layers=4, num_heads=8,
                                     num_kv_heads=4, intermediate_size=3 * width)
        learners = {name: TorchLearner(model, lr=1e-5, max_buckets=args.buckets, compute=compute)
                    for name, compute in computes.items()}
        params = sum(p.numel() for p in model.parameters()) / 1e6
        for threads in args.threads:
            set_threads(threads)
            for learner in learners.values():
                train_tokens_per_s(learner, batch, epochs=1)  # warm-up
            bound = {name: [matmul_flops(dtype=dtypes[name])] for name in learners}
            runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in learners}
            for _ in range(args.repeats):  # bound, training, bound, ...: each round between two bound samples
                for name, learner in learners.items():
                    runs[name].append(train_tokens_per_s(learner, batch))
                    bound[name].append(matmul_flops(dtype=dtypes[name]))
            # each round's bound: the mean of the samples just before and after it
            round_bound = {name: [(a + b) / 2 for a, b in zip(xs, xs[1:])] for name, xs in bound.items()}
            for name, measured in runs.items():
                peaks, fp32_peaks = round_bound[name], round_bound["fp32"]
                flops = [model_flops(model, real, keys) for _, real, _, keys in measured]
                rows.append((str(width), f"{params:.2f}M", str(threads), name,
                             spread([p / 1e9 for p in peaks], "{:.1f}"),
                             spread([t for t, *_ in measured], "{:.0f}"),
                             spread([r for _, r, *_ in measured], "{:.0f}"),
                             f"{statistics.median(r / p for _, r, p, _ in measured):.0%}",
                             spread([f / 1e9 for f in flops], "{:.2f}"),
                             spread([f / p for f, p in zip(flops, fp32_peaks)]),
                             spread([f / p for f, p in zip(flops, peaks)])))
    _, ran, _, keys = runs["fp32"][0]  # per CPU second; their ratio is the batch's, whatever the round
    lengths = batch.attention_mask.sum(1)
    plain = _keys(torch.zeros_like(lengths), lengths) / int(lengths.sum())
    print(f"\nattention counted per run token: {keys / ran:.1f} keys on average (a plain forward's tokens: "
          f"{plain:.1f})")
    print(f"\nGRPO update on {batch.num_sequences} episodes ({int(batch.attention_mask.sum())} real tokens, "
          f"{batch.attention_mask.numel()} padded to one width), minibatch 64, length buckets <= {args.buckets}; "
          f"per CPU second, median (min-max) of {args.repeats} alternated rounds")
    print(table(rows, ("width", "params", "threads", "compute", "its matmul bound GFLOP/s", "trained tok/s",
                       "run tok/s", "real/padded", "model GFLOP/s", "of the fp32 bound (target >= 50%)",
                       "of its own bound")))


if __name__ == "__main__":
    main()
