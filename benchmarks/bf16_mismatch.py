"""bf16 learner vs fp32 sampler: the train/inference logprob mismatch it adds, and the RL update's speed.

    python benchmarks/bf16_mismatch.py --steps 3 --repeats 5
    python benchmarks/bf16_mismatch.py --bc-steps 70      # a policy about where BC hands over to RL

The default model after --bc-steps BC steps (benchmarks/_common.py) samples GRPO groups (fp32, the rollout temperature,
logprobs recorded) as an RL step would; the learner then scores them (fp32 and bf16 autocast) and the mismatch
monitor's statistics (`algos.mismatch.mismatch_stats`, what `mismatch.monitor=true` logs) are printed for each:
mean and max |log pi_learner - log mu_sampler| over the policy tokens, and the 1%/99% quantiles of the ratio.
Then one GRPO-sized forward + backward (shared-prefix learner) per dtype, interleaved, wall and CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bc_model_dir, bench_config, median

from agentgrad.algos.mismatch import mismatch_stats
from agentgrad.backends.precision import resolve_compute_dtype
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.rl import make_batch, rl_tasks, rollout_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="RL steps' worth of rollouts to score")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bc-steps", type=int, default=150, help="BC steps of the sampling model (fewer: less sure)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = bc_model_dir(args.bc_steps)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(bench_config([f"model.path={model}"]), Path(tmp))
        T = c.config.rollout.temperature
        batches = [make_batch(c, rollout_groups(c, rl_tasks(c, step), step)) for step in range(args.steps)]
        print(f"{sum(b.num_sequences for b in batches)} episodes, {sum(int(b.loss_mask.sum()) for b in batches)} "
              f"policy tokens, sampled in fp32 at temperature {T}")
        print(f"{'learner':<8} {'mean|d|':>9} {'max|d|':>8} {'ratio p01':>9} {'ratio p99':>9}")
        for dtype in ("fp32", "bf16"):
            c.learner.compute = resolve_compute_dtype(dtype, "cpu")
            with torch.no_grad():
                lp = torch.cat([(c.learner.logprobs(b, temperature=T) * b.loss_mask).sum(1) for b in batches])
                stats = [mismatch_stats(c.learner.logprobs(b, temperature=T), b.old_logprobs, b.loss_mask)
                         for b in batches]
            n = sum(s.num_tokens for s in stats)
            mean_abs = sum(float(s.mean_abs_diff) * s.num_tokens for s in stats) / n
            print(f"{dtype:<8} {mean_abs:9.2e} {max(float(s.max_abs_diff) for s in stats):8.2e} "
                  f"{min(float(s.ratio_quantiles[0]) for s in stats):9.4f} "
                  f"{max(float(s.ratio_quantiles[-1]) for s in stats):9.4f}   (sum of logprobs {float(lp.sum()):.2f})")
        wall = {"fp32": [], "bf16": []}
        cpu = {"fp32": [], "bf16": []}
        for _ in range(args.repeats):
            for dtype in wall:
                c.learner.compute = resolve_compute_dtype(dtype, "cpu")
                t0, p0 = time.perf_counter(), time.process_time()
                for b in batches:
                    (c.learner.logprobs(b, temperature=T) * b.loss_mask).sum().backward()
                c.learner.optimizer.zero_grad(set_to_none=True)
                wall[dtype].append(time.perf_counter() - t0)
                cpu[dtype].append(time.process_time() - p0)
        for dtype in wall:
            print(f"update forward+backward, {dtype}: {median(wall[dtype]):.3f} s wall, {median(cpu[dtype]):.3f} s CPU "
                  f"({median(cpu['fp32']) / median(cpu[dtype]):.2f}x)")


if __name__ == "__main__":
    main()
