"""Shared set-up for the speed benchmarks: the default tiny model after a short BC warm-up (so episodes are
multi-turn: a calculator call, then an answer), cached on disk between runs."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

CACHE = Path(os.environ.get("AGENTGRAD_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))


def bench_config(overrides: list[str] | None = None):
    from agentgrad.config import build_config

    return build_config(overrides=["run.threads=1", "run.progress=false", *(overrides or [])])


def bc_model_dir(bc_steps: int = 150, seed: int = 0) -> Path:
    """The default tiny model (0.84M parameters) after `bc_steps` of BC on arithmetic demos (~1-2 min once)."""
    out = CACHE / f"tiny-bc{bc_steps}-seed{seed}"
    if (out / "model.safetensors").exists():
        return out
    from agentgrad.pipelines.bc import bc_step, expert_demos
    from agentgrad.pipelines.components import build_components

    config = bench_config([f"run.seed={seed}"])
    c = build_components(config, CACHE / f"build-seed{seed}")
    demos = expert_demos(c, 500, seed=seed + 1)
    rng = random.Random(seed)
    for step in range(bc_steps):
        bc_step(c, demos, rng, step)
    c.loaded.model.save_pretrained(out)
    c.loaded.tokenizer.save_pretrained(out)
    return out


def alternate(named: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run each measurement `repeats` times, interleaved (A B A B ...), so machine load hits both sides alike."""
    out: dict[str, list[float]] = {k: [] for k in named}
    for _ in range(repeats):
        for name, fn in named.items():
            out[name].append(fn())
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float], fmt: str = "{:.1%}") -> str:
    """Median (min-max), each formatted with `fmt`."""
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def set_threads(n: int) -> None:
    torch.set_num_threads(n)


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


class MultiTurnRollout:
    """Times one rollout of `episodes` arithmetic episodes (8 samples per task; a calculator call, then the answer)
    through the one scheduler, `run_episodes`, with a given policy: called with a policy, it returns generated
    tokens per second and appends the episodes' mean turns to `turns[id(policy)]`. Every call draws a new sampling
    seed, so peers timed in turn see the same tasks, limits and sampling. Tokens per CPU second (the process's
    threads, tool calls included) go to `cpu_rates[id(policy)]`."""

    def __init__(self, config, codec, episodes: int) -> None:
        from agentgrad.envs import SUITES
        from agentgrad.pipelines.components import episode_limits

        self.suite = SUITES.get("arithmetic")()
        self.limits = episode_limits(config)
        self.codec = codec
        self.episodes = episodes
        self.tasks = [t for t in self.suite.sample_tasks(episodes // 8, split="train", seed=5) for _ in range(8)]
        self.seed = 0
        self.turns: dict[int, list[float]] = {}
        self.cpu_rates: dict[int, list[float]] = {}  # generated tokens per CPU second (all threads), per call

    def __call__(self, policy) -> float:
        from agentgrad.backends.base import SamplingParams
        from agentgrad.rollout.loop import SamplerSettings, run_episodes

        self.seed += 1
        cpu0 = time.process_time()
        sampling = SamplingParams(max_new_tokens=self.limits.max_new_tokens_per_turn, temperature=0.7,
                                  seed=self.seed)
        dt, trajs = timed(lambda: run_episodes(policy, self.codec, [self.suite.make_env() for _ in self.tasks],
                                               self.tasks, sampling=sampling, limits=self.limits,
                                               sampler=SamplerSettings(max_concurrent_episodes=self.episodes)))
        cpu = time.process_time() - cpu0
        tokens = sum(t.num_generated_tokens for t in trajs)
        self.turns.setdefault(id(policy), []).append(sum(len(t.turns) for t in trajs) / len(trajs))
        self.cpu_rates.setdefault(id(policy), []).append(tokens / cpu)
        return tokens / dt
