"""Held-out evaluation: success rate with a Wilson confidence interval."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from agentgrad.backends.base import Policy, SamplingParams
from agentgrad.envs.base import TaskSuite
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import RolloutLimits, run_episodes


@dataclass(frozen=True)
class EvalResult:
    success_rate: float
    ci_low: float
    ci_high: float
    num_tasks: int
    num_successes: int
    mean_turns: float
    invalid_calls_per_episode: float
    stop_reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"success_rate": self.success_rate, "ci95": [self.ci_low, self.ci_high], "num_tasks": self.num_tasks,
                "num_successes": self.num_successes, "mean_turns": self.mean_turns,
                "invalid_calls_per_episode": self.invalid_calls_per_episode, "stop_reasons": self.stop_reasons}


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (Wilson 1927): well-behaved near 0% and 100%, unlike the normal approximation."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(policy: Policy, codec: ChatCodec, suite: TaskSuite, limits: RolloutLimits, *, num_tasks: int,
             seed: int, temperature: float = 0.0, batch_size: int = 100, split: str = "heldout") -> EvalResult:
    tasks = suite.sample_tasks(num_tasks, split=split, seed=seed)
    sampling = SamplingParams(max_new_tokens=limits.max_new_tokens_per_turn, temperature=temperature, seed=seed)
    trajectories = []
    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i:i + batch_size]
        trajectories += run_episodes(policy, codec, [suite.make_env() for _ in chunk], chunk, sampling=sampling,
                                     limits=limits, seeds=[seed] * len(chunk))
    wins = sum(suite.verify(t.task, t.final_answer) for t in trajectories)
    low, high = wilson_interval(wins, len(tasks))
    n = max(len(trajectories), 1)
    return EvalResult(success_rate=wins / len(tasks), ci_low=low, ci_high=high, num_tasks=len(tasks),
                      num_successes=wins, mean_turns=sum(len(t.turns) for t in trajectories) / n,
                      invalid_calls_per_episode=sum(t.num_invalid_calls for t in trajectories) / n,
                      stop_reasons=dict(Counter(t.stop_reason.value for t in trajectories)))
