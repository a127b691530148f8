"""Multi-turn rollout throughput: agentgrad's engine against Hugging Face `generate`, same model and episodes.

Both sides run the same 64 arithmetic episodes (8 tasks x 8 samples, calculator call then answer) through
`run_episodes` with the same tools, limits and sampling (temperature 0.7, logprobs recorded):
- peer: every turn is one `model.generate` call over the left-padded batch of whole prefixes (prompt, earlier
  turns, observations), so each turn re-prefills everything before it; episodes advance in lockstep rounds;
- agentgrad: `HFPolicy` sessions: one KV-cache row per episode kept across turns (a turn prefills only the new
  observation), continuous batching, prompt de-duplication, a lean decode path.
Runs alternate (ours, peer, ours, ...) so machine load hits both; the table gives medians with their range of
the per-round ratios (each of our runs over the peer's run after it), in wall and in CPU time.

    nice -n 19 python benchmarks/rollout_throughput.py [--threads 1 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MultiTurnRollout, alternate, bc_model_dir, bench_config, median, set_threads, spread, table

from agentgrad.backends.base import Generation, SamplingParams


class HFGeneratePolicy:
    """The peer: `transformers` `generate` per turn over left-padded whole prefixes, logprobs from its scores."""

    def __init__(self, model, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        self.model, self.eos, self.pad = model, list(eos_token_ids), pad_token_id

    @torch.no_grad()
    def generate(self, prompts, sampling: SamplingParams, logits_processor=None) -> list[Generation]:
        self.model.eval()
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p)
            mask[b, L - len(p):] = 1
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=sampling.temperature > 0,
                                  temperature=sampling.temperature or None, top_p=sampling.top_p, top_k=None,
                                  max_new_tokens=sampling.max_new_tokens, eos_token_id=self.eos,
                                  pad_token_id=self.pad, output_scores=True, return_dict_in_generate=True)
        lps = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)  # (B, N)
        gens = []
        for b in range(B):
            row, lp = out.sequences[b, L:].tolist(), lps[b].tolist()
            n = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            gens.append(Generation(tuple(row[:n]), tuple(lp[:n]), "stop" if row[n - 1] in self.eos else "length"))
        return gens

    def load_weights(self, state) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--bc-steps", type=int, default=150)
    args = ap.parse_args()

    from agentgrad.models.hf import load_model
    from agentgrad.pipelines.components import inference, quiet_hf

    quiet_hf()
    config = bench_config()
    loaded = load_model(bc_model_dir(args.bc_steps))
    ours, codec = inference(loaded)
    peer = HFGeneratePolicy(loaded.model, loaded.eos_token_ids, loaded.pad_token_id)
    rollout = MultiTurnRollout(config, codec, args.episodes)

    rows = []
    for threads in args.threads:
        set_threads(threads)
        rollout.turns.clear()
        rollout.cpu_rates.clear()
        rollout(ours), rollout(peer)  # warm-up
        res = alternate({"agentgrad": lambda: rollout(ours), "hf_generate": lambda: rollout(peer)}, args.repeats)
        ours_cpu, peer_cpu = rollout.cpu_rates[id(ours)][1:], rollout.cpu_rates[id(peer)][1:]  # no warm-up
        rows.append((str(threads), spread(res["agentgrad"], "{:.0f}"), spread(res["hf_generate"], "{:.0f}"),
                     spread([a / p for a, p in zip(res["agentgrad"], res["hf_generate"])], "{:.2f}x"),
                     spread([a / p for a, p in zip(ours_cpu, peer_cpu)], "{:.2f}x"),
                     f"{median(rollout.turns[id(ours)]):.2f} / {median(rollout.turns[id(peer)]):.2f}"))
    print(f"\nmulti-turn rollout, {args.episodes} episodes in flight, default tiny model "
          f"({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.2f}M params), "
          f"median (min-max) of {args.repeats} alternated rounds")
    print(table(rows, ("threads", "agentgrad tok/s", "HF generate tok/s", "ratio, wall (target >= 3x)",
                       "ratio, CPU time", "turns/episode ours / peer")))


if __name__ == "__main__":
    main()
