"""Tool latency hiding: a queue of 128 episodes, 64 decoding at once, whose tool takes 50 or 200 ms, against the
same episodes with an instant tool (the ideal). Same model, tasks and seed everywhere.

Rows are schedules (`SamplerSettings`):
- drain: the deterministic schedule with `waiting_episodes=0` (the default run's): every tool call is waited for
  after the decode step that made it, so each tool round is a full stall;
- queued, deterministic: `waiting_episodes=64`: an episode waiting on a tool gives its decode slot to a queued
  one, and its answer is taken back `tool_wait_steps` decode steps later (or when nothing else decodes). The
  schedule is a function of the step count, so tokens and logprobs are the same at every latency (checked:
  the `same floats` column) and the ratio is pure waiting;
- queued, eager: `waiting_episodes=64` without the deterministic schedule (answers rejoin when they arrive);
- continuous, eager: `waiting_episodes=0` without the deterministic schedule (a waiting episode keeps its slot).

Every schedule and latency runs once per round, interleaved, so machine load drift hits all alike; medians,
with the range of the per-round ratios (latency over 0 ms, same schedule, same round).

    nice -n 19 python benchmarks/tool_latency.py [--repeats 5] [--threads 1] [--tool-wait-steps 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bc_model_dir, bench_config, median, set_threads, spread, table, timed

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latencies-ms", default="50,200")
    ap.add_argument("--episodes", type=int, default=128, help="episodes in the queue")
    ap.add_argument("--in-flight", type=int, default=64, help="episodes decoding at once")
    ap.add_argument("--tool-wait-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bc-steps", type=int, default=150)
    ap.add_argument("--schedules", default="drain,queued-det,queued-eager,continuous-eager")
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
    n, w = args.in_flight, args.episodes - args.in_flight
    schedules = {
        "drain": SamplerSettings(max_concurrent_episodes=n, deterministic_schedule=True),
        "queued-det": SamplerSettings(max_concurrent_episodes=n, waiting_episodes=w, deterministic_schedule=True,
                                      tool_wait_steps=args.tool_wait_steps),
        "queued-eager": SamplerSettings(max_concurrent_episodes=n, waiting_episodes=w),
        "continuous-eager": SamplerSettings(max_concurrent_episodes=n),
    }
    latencies = [0.0] + [float(x) / 1e3 for x in args.latencies_ms.split(",")]
    info: dict[str, float] = {}

    def rollout(sampler: SamplerSettings, latency_s: float):
        envs = [LatencyEnv(suite.make_env(), latency_s) for _ in tasks]
        c0 = time.process_time()
        dt, trajs = timed(lambda: run_episodes(policy, codec, envs, tasks, sampling=sampling, limits=limits,
                                               sampler=sampler))
        info["calls"] = sum(isinstance(t.action, ToolCall) for tr in trajs for t in tr.turns) / len(trajs)
        info["cpu"] = time.process_time() - c0
        return sum(t.num_generated_tokens for t in trajs) / dt, [(t.token_ids, t.logprobs) for t in trajs]

    names = args.schedules.split(",")
    speed = {(name, lat): [] for name in names for lat in latencies}
    same = dict.fromkeys(speed, True)
    reference = {}
    for name in names:
        rollout(schedules[name], 0.0)  # warm-up
    for _ in range(args.repeats):  # every schedule and latency once per round: load drift hits all alike
        for name in names:
            for lat in latencies:
                tok_s, out = rollout(schedules[name], lat)
                speed[name, lat].append(tok_s)
                reference.setdefault(name, out)
                same[name, lat] &= out == reference[name]
    rows = []
    for name in names:
        base = speed[name, 0.0]
        row = [name, spread(base, "{:.0f}")]
        for lat in latencies[1:]:
            ratios = [s / i for s, i in zip(speed[name, lat], base)]
            row.append(f"{median(speed[name, lat]):.0f}: {median(speed[name, lat]) / median(base):.2f}x "
                       f"({min(ratios):.2f}-{max(ratios):.2f}){'' if same[name, lat] else ' *'}")
        rows.append(tuple(row))
    print(f"\n{args.episodes} episodes queued, {n} decoding at once, {info['calls']:.2f} tool calls per episode, "
          f"threads={args.threads}, tool_wait_steps={args.tool_wait_steps}, median of {args.repeats} "
          f"(range of per-round ratios); * = tokens or logprobs differ from the 0 ms run")
    print(table(rows, ("schedule", "tok/s, 0 ms tool", *(f"{lat * 1e3:.0f} ms tool: tok/s, ratio"
                                                          for lat in latencies[1:]))))


if __name__ == "__main__":
    main()
