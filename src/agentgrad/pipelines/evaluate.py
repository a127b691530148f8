"""Held-out evaluation: success rate over distinct tasks, with a Wilson confidence interval.

Tasks are counted by content (`Task.content_hash`), not by id: a suite whose held-out stream repeats problems
(a game with few secrets) would otherwise report an interval over n = 200 episodes of 20 games, far too narrow.
Each distinct task runs once; when the suite has fewer distinct tasks than asked, the result says so (`note`).
Where tasks name their kind (`task.metadata["kind"]`, as the built-in suites do), the result counts successes per
kind too: an overall rate hides a kind the policy never solves, or splits whose kinds differ.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentgrad.backends.base import Policy, SamplingParams
from agentgrad.envs.base import TaskSuite, close_envs, episode_success
from agentgrad.logging import ProgressFn, no_progress
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.types import Task


@dataclass(frozen=True)
class EvalResult:
    success_rate: float
    ci_low: float
    ci_high: float
    num_tasks: int  # distinct tasks evaluated: the n of the interval
    num_successes: int
    mean_turns: float
    invalid_calls_per_episode: float
    stop_reasons: dict[str, int] = field(default_factory=dict)
    requested_tasks: int = 0  # eval.num_tasks (num_tasks is smaller when the suite has fewer distinct ones)
    by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)  # kind -> (successes, tasks)

    @property
    def note(self) -> str | None:
        """A warning for the user when the suite could not give as many distinct tasks as asked."""
        if self.num_tasks >= self.requested_tasks:
            return None
        return (f"warning: only {self.num_tasks} distinct tasks of the {self.requested_tasks} asked (tasks are "
                f"counted by content); the interval is over n={self.num_tasks}")

    def to_dict(self) -> dict:
        return {"success_rate": self.success_rate, "ci95": [self.ci_low, self.ci_high], "num_tasks": self.num_tasks,
                "requested_tasks": self.requested_tasks, "num_successes": self.num_successes,
                "mean_turns": self.mean_turns, "invalid_calls_per_episode": self.invalid_calls_per_episode,
                "stop_reasons": self.stop_reasons,
                "by_kind": {k: {"successes": w, "tasks": n} for k, (w, n) in self.by_kind.items()}}

    def kinds_line(self) -> str | None:
        """"per kind: a 3/28, b 15/18, ..." (None when the tasks name no kind)."""
        if not self.by_kind:
            return None
        return "per kind: " + ", ".join(f"{k} {w}/{n}" for k, (w, n) in self.by_kind.items())


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (Wilson 1927): well-behaved near 0% and 100%, unlike the normal approximation."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def distinct_tasks(tasks: Sequence[Task]) -> list[Task]:
    """The first task of each content hash, in order."""
    seen: set[str] = set()
    out = []
    for t in tasks:
        key = t.content_hash()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def sample_distinct(suite: TaskSuite, n: int, *, split: str, seed: int, oversample: int = 4) -> list[Task]:
    """Up to `n` distinct tasks of a split: the first `n` of the stream when they are distinct (the usual case),
    else the first `n` distinct ones among `oversample * n` (suites extend a shorter list with a longer one)."""
    tasks = distinct_tasks(suite.sample_tasks(n, split=split, seed=seed))
    if len(tasks) < n:
        tasks = distinct_tasks(suite.sample_tasks(oversample * n, split=split, seed=seed))
    return tasks[:n]


def evaluate(policy: Policy, codec: ChatCodec, suite: TaskSuite, limits: EpisodeLimits, sampler: SamplerSettings, *,
             num_tasks: int, seed: int, temperature: float = 0.0, batch_size: int = 100,
             split: str = "heldout", progress: ProgressFn = no_progress) -> EvalResult:
    """Success over `num_tasks` distinct tasks of `split`; `progress(done, total)` as episodes end."""
    tasks = sample_distinct(suite, num_tasks, split=split, seed=seed)
    sampling = SamplingParams(max_new_tokens=limits.max_new_tokens_per_turn, temperature=temperature, seed=seed)
    trajectories = []
    ended = [0]
    progress(0, len(tasks))

    def one_more(_: int) -> None:
        ended[0] += 1
        progress(ended[0], None)

    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i:i + batch_size]
        envs = [suite.make_env() for _ in chunk]
        try:
            trajectories += run_episodes(policy, codec, envs, chunk, sampling=sampling, limits=limits,
                                         sampler=sampler, seeds=[seed] * len(chunk), on_episode_end=one_more)
        finally:
            close_envs(envs)
    successes = [episode_success(suite, t) for t in trajectories]
    wins = sum(successes)
    low, high = wilson_interval(wins, len(tasks))
    n = max(len(trajectories), 1)
    return EvalResult(success_rate=wins / max(len(tasks), 1), ci_low=low, ci_high=high, num_tasks=len(tasks),
                      num_successes=wins, mean_turns=sum(len(t.turns) for t in trajectories) / n,
                      invalid_calls_per_episode=sum(t.num_invalid_calls for t in trajectories) / n,
                      stop_reasons=dict(Counter(t.stop_reason.value for t in trajectories)),
                      requested_tasks=num_tasks,
                      by_kind=count_by_kind([t.task for t in trajectories], successes))


def count_by_kind(tasks: Sequence[Task], successes: Sequence[bool]) -> dict[str, tuple[int, int]]:
    """(successes, tasks) per `task.metadata["kind"]`, kinds sorted; empty when no task names a kind."""
    counts: dict[str, list[int]] = {}
    for task, ok in zip(tasks, successes, strict=True):
        kind = task.metadata.get("kind")
        if kind is not None:
            c = counts.setdefault(str(kind), [0, 0])
            c[0] += bool(ok)
            c[1] += 1
    return {k: (w, n) for k, (w, n) in sorted(counts.items())}
