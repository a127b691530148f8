"""Tool latency hiding: 64 concurrent episodes whose tool takes 50 ms, against the same episodes with an
instant tool (the ideal). Same model, tasks and seed on both sides, so the sampled tokens are identical and the
ratio is a pure wall-clock ratio.

Rows: agentgrad's continuous batching (an episode rejoins the decode batch when its own tool answers), and the
round-based schedule that any `generate`-only policy gets (all episodes' tools run concurrently, but a round
waits for the slowest). Runs alternate (0 ms, 50 ms, ...) so machine load hits both; medians.

    nice -n 19 python benchmarks/tool_latency.py [--latency-ms 50] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, bc_model_dir, bench_config, median, set_threads, table, timed

from agentgrad.types import ToolCall


class LatencyEnv:
    """Wraps an env: every tool call takes `latency_s` longer (an I/O-bound tool: the GIL is free meanwhile)."""

    def __init__(self, env, latency_s: float) -> None:
        self.env, self.latency_s = env, latency_s

    def reset(self, *, seed=None, options=None):
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        if isinstance(action, ToolCall) and self.latency_s:
            time.sleep(self.latency_s)
        return self.env.step(action)

    def legal_actions(self):
        return self.env.legal_actions()


class GenerateOnly:
    """The same policy seen through the plain `Policy.generate` protocol: the scheduler runs it through
    `GenerateSession`, waiting for every tool after each step (rounds)."""

    def __init__(self, policy) -> None:
        self.generate = policy.generate

    def load_weights(self, state) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bc-steps", type=int, default=150)
    args = ap.parse_args()

    from agentgrad.backends.base import SamplingParams
    from agentgrad.envs import SUITES
    from agentgrad.models.hf import load_model
    from agentgrad.pipelines.components import episode_limits, inference, quiet_hf
    from agentgrad.rollout.loop import SamplerSettings, run_episodes

    quiet_hf()
    set_threads(args.threads)
    loaded = load_model(bc_model_dir(args.bc_steps))
    policy, codec = inference(loaded)
    suite = SUITES.get("arithmetic")()
    limits = episode_limits(bench_config())
    tasks = [t for t in suite.sample_tasks(args.episodes // 8, split="train", seed=5) for _ in range(8)]
    sampling = SamplingParams(max_new_tokens=limits.max_new_tokens_per_turn, temperature=0.7, seed=1)
    calls: dict[str, float] = {}

    def rollout(pol, latency_s: float) -> float:
        envs = [LatencyEnv(suite.make_env(), latency_s) for _ in tasks]
        dt, trajs = timed(lambda: run_episodes(pol, codec, envs, tasks, sampling=sampling, limits=limits,
                                               sampler=SamplerSettings(max_concurrent_episodes=args.episodes)))
        calls["per_episode"] = sum(isinstance(t.action, ToolCall) for tr in trajs for t in tr.turns) / len(trajs)
        return sum(t.num_generated_tokens for t in trajs) / dt

    latency = args.latency_ms / 1e3
    rows = []
    for name, pol in (("continuous (agentgrad HFPolicy)", policy),
                      ("rounds (generate-only policy)", GenerateOnly(policy))):
        rollout(pol, 0.0)  # warm-up
        res = alternate({"ideal": lambda pol=pol: rollout(pol, 0.0), "slow": lambda pol=pol: rollout(pol, latency)},
                        args.repeats)
        ideal, slow = median(res["ideal"]), median(res["slow"])
        rows.append((name, f"{ideal:.0f}", f"{slow:.0f}", f"{slow / ideal:.2f}x"))
    print(f"\n{args.episodes} concurrent episodes, {calls['per_episode']:.2f} tool calls per episode, "
          f"threads={args.threads}, median of {args.repeats}")
    print(table(rows, ("schedule", "tok/s, 0 ms tool", f"tok/s, {args.latency_ms:.0f} ms tool",
                       "ratio (target >= 0.8x)")))


if __name__ == "__main__":
    main()
