"""ReplayBuffer of trajectory groups (fresh rollouts and imported offline logs) and the online/offline mix.

The unit is a `TrajectoryGroup` (all samples of one task): group-relative advantages (GRPO, RLOO) need the
group, and a replayed group's advantages are recomputed from its stored rewards, which do not depend on the
policy. What does depend on the policy is the probability of the tokens; `agentgrad.algos.off_policy` corrects
for that with importance weights pi_theta / pi_behaviour, using the behaviour logprobs stored in each sample.

Sampling is deterministic given a `random.Random`: the RL pipeline seeds one from (run seed, step), so a resumed
run draws the same replayed groups as an uninterrupted one. No torch here.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentgrad.data.store import StoreRecord, from_json, to_json
from agentgrad.registry import Registry
from agentgrad.types import TrajectoryGroup


@dataclass(frozen=True)
class ReplayItem:
    group: TrajectoryGroup
    source: str
    """"rollout" (this run's own samples) or "import:<file>" (an offline log)."""
    added_step: int

    @property
    def mean_reward(self) -> float:
        scored = [s.total_reward for s in self.group.samples if not s.reward.masked]
        return sum(scored) / len(scored) if scored else 0.0


# (items, n, rng, temperature) -> n distinct indices into items (fewer if the buffer holds fewer).
Sampler = Callable[[Sequence[ReplayItem], int, random.Random, float], list[int]]
REPLAY_SAMPLERS: Registry[Sampler] = Registry("replay sampler")


@REPLAY_SAMPLERS.register("uniform")
def _uniform(items: Sequence[ReplayItem], n: int, rng: random.Random, temperature: float) -> list[int]:
    return rng.sample(range(len(items)), min(n, len(items)))


@REPLAY_SAMPLERS.register("reward")
def _reward_prioritised(items: Sequence[ReplayItem], n: int, rng: random.Random, temperature: float) -> list[int]:
    """Without replacement, P(item) proportional to exp(mean reward / temperature) (a softmax priority, in the
    spirit of prioritised replay, Schaul et al. 2016, with reward as the priority). Weighted sampling without
    replacement by Efraimidis & Spirakis (2006): keep the n largest keys u^(1/w), u ~ U(0, 1)."""
    if not items:
        return []
    rewards = [it.mean_reward for it in items]
    top = max(rewards)
    keys = []
    for i, r in enumerate(rewards):
        w = math.exp((r - top) / temperature)  # in (0, 1]; the max-shift keeps exp finite
        u = rng.random()
        keys.append((math.log(u) / w if u > 0 else -math.inf, i))  # log(u^(1/w)): same order, no underflow
    keys.sort(reverse=True)
    return [i for _, i in keys[:n]]


class ReplayBuffer:
    """A FIFO buffer of at most `capacity_groups` groups: adding past capacity evicts the oldest."""

    def __init__(self, capacity_groups: int, *, sampling: str = "uniform", priority_temperature: float = 1.0) -> None:
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if priority_temperature <= 0:
            raise ValueError(f"priority_temperature must be > 0, got {priority_temperature}")
        self.capacity_groups = capacity_groups
        self._sampler = REPLAY_SAMPLERS.get(sampling)
        self.priority_temperature = priority_temperature
        self._items: deque[ReplayItem] = deque(maxlen=capacity_groups)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, items: Iterable[ReplayItem]) -> None:
        for item in items:
            if len(self._items) == self.capacity_groups:
                self.evicted += 1
            self._items.append(item)

    def sample(self, n: int, rng: random.Random) -> list[ReplayItem]:
        items = list(self._items)
        return [items[i] for i in self._sampler(items, n, rng, self.priority_temperature)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able contents, so a checkpoint restores exactly what was in the buffer."""
        return {"evicted": self.evicted,
                "items": [{"group": to_json(it.group), "source": it.source, "added_step": it.added_step}
                          for it in self._items]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._items.clear()
        self._items.extend(ReplayItem(from_json(d["group"]), d["source"], d["added_step"]) for d in state["items"])
        self.evicted = state["evicted"]


def groups_from_records(records: Iterable[StoreRecord]) -> list[ReplayItem]:
    """Regroup stored samples by their `group` key, in first-appearance order."""
    by_key: dict[str, list[StoreRecord]] = defaultdict(list)
    for r in records:
        by_key[r.group].append(r)
    return [ReplayItem(TrajectoryGroup(rs[0].sample.trajectory.task, tuple(r.sample for r in rs)), rs[0].source,
                       rs[0].step) for rs in by_key.values()]


@dataclass(frozen=True)
class MixSchedule:
    """Fraction of each step's groups drawn from the replay buffer (the rest are fresh rollouts).

    "constant": always `offline_fraction`. "success": start at `offline_fraction` and move linearly to
    `final_offline_fraction` as the measured rollout success (an exponential moving average) reaches
    `success_target`: while the policy is weak, logged data carries most of the learning signal; once it
    succeeds on its own, fresh on-policy samples are worth more and need no correction.
    """

    offline_fraction: float = 0.7
    kind: Literal["constant", "success"] = "constant"
    final_offline_fraction: float = 0.0
    success_target: float = 0.8

    def fraction(self, success_ema: float) -> float:
        if self.kind == "constant":
            return self.offline_fraction
        progress = min(1.0, max(0.0, success_ema / self.success_target))
        return self.offline_fraction + (self.final_offline_fraction - self.offline_fraction) * progress


def split_groups(total_groups: int, offline_fraction: float, available: int) -> tuple[int, int]:
    """(fresh, replayed) group counts for one step: replayed = round(fraction * total), capped by what the
    buffer holds; at least one fresh group unless the fraction is 1 (success must still be measured)."""
    replayed = min(available, round(offline_fraction * total_groups))
    if offline_fraction < 1.0:
        replayed = min(replayed, total_groups - 1)
    return total_groups - replayed, replayed
