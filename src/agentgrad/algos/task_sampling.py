"""Signal-weighted task sampling: draw more training tasks of the kinds whose groups carry signal.

A group-relative update learns nothing from a group whose samples all scored the same (zero advantage). DAPO
(Yu et al. 2025) drops such groups after sampling them (`algo.zero_signal`); a suite whose kinds the policy always
solves (or never does) then spends most of its rollouts on them step after step. Sampling tasks in proportion to
their learnability instead, the chance that a group of them has signal, is the curriculum of Rutherford et al.
2024 ("No Regrets", which samples levels by p(1 - p)) and of Prioritized Level Replay (Jiang et al. 2021). We
estimate it per task kind (`task.metadata["kind"]`), not per task: training tasks rarely repeat. The measured rate
of groups with signal is the estimate itself, so it needs no assumption about group size or reward shape.

Pure functions; the RL stage keeps the counts (`RLState.kind_counts`) and saves them with its state.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DECAY = 0.9  # per step: the counts forget with a horizon of ~10 steps, as the policy moves
FLOOR = 0.05  # every kind keeps being drawn, so a rate that changes (a kind solved, or forgotten) is seen


@dataclass(frozen=True)
class KindCounts:
    """Decayed counts of one kind's groups: all of them, and those with signal (not every sample scored alike)."""

    groups: float = 0.0
    signal: float = 0.0


def signal_rate(counts: KindCounts) -> float:
    """The estimated chance a group of this kind has signal: (signal + 1) / (groups + 2), Laplace's rule, so a
    kind not yet seen counts as 1/2 and a few groups do not settle it."""
    return (counts.signal + 1.0) / (counts.groups + 2.0)


def observe(counts: Mapping[str, KindCounts], groups: Iterable[tuple[str, bool]], decay: float = DECAY
            ) -> dict[str, KindCounts]:
    """The counts after one step: every kind's decayed by `decay`, plus this step's groups, each given as
    (kind, has signal)."""
    out = {k: KindCounts(c.groups * decay, c.signal * decay) for k, c in counts.items()}
    for kind, has_signal in groups:
        c = out.get(kind, KindCounts())
        out[kind] = KindCounts(c.groups + 1.0, c.signal + float(has_signal))
    return out


def kind_weight(counts: Mapping[str, KindCounts], kind: str, floor: float = FLOOR) -> float:
    """How strongly a task of `kind` is drawn: its signal rate, at least `floor`."""
    return max(floor, signal_rate(counts.get(kind, KindCounts())))


def weighted_pick(weights: Sequence[float], n: int, seed: int) -> list[int]:
    """Indices of `n` of the items without replacement, each drawn with probability in proportion to its weight
    among those left (Efraimidis & Spirakis 2006: the `n` largest keys u ** (1 / w), u uniform). In input order,
    and a function of `seed` alone."""
    if any(w <= 0 for w in weights):
        raise ValueError("weighted_pick needs positive weights")
    rng = random.Random(seed)
    keys = [rng.random() ** (1.0 / w) for w in weights]
    return sorted(sorted(range(len(weights)), key=lambda i: keys[i], reverse=True)[:n])
