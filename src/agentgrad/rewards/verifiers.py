"""Outcome verifiers: pure functions `(answer, expected) -> bool` (or a float in [0, 1] for partial credit),
and `VerifierReward`, which turns one into a reward function. The built-in rules are `agentgrad.answers`, the
same ones the task suites verify with.

A verifier never raises on a missing or malformed answer: `None` or unparseable text is simply wrong.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

from agentgrad.answers import (
    MATCHERS,
    exact_match,
    normalize_text,
    normalized_match,
    numeric_match,
    parse_number,
    set_match,
    split_items,
)
from agentgrad.registry import Registry
from agentgrad.rewards.base import REWARDS, RewardSpecError, _import_ref, masked
from agentgrad.types import RewardBreakdown, Trajectory

__all__ = ["VERIFIERS", "Verifier", "VerifierReward", "exact_match", "get_verifier", "make_verifier_reward",
           "normalize_text", "normalized_match", "numeric_match", "parse_number", "set_match", "split_items"]

Verifier = Callable[[str | None, str], bool | float]

VERIFIERS: Registry[Callable[..., Any]] = Registry("verifier")


for _name, _rule in MATCHERS.items():  # the rules of `agentgrad.answers`, which the task suites also use
    VERIFIERS.add(_name, _rule)


def get_verifier(spec: str | Verifier, **options: Any) -> Verifier:
    """A verifier by registered name ("exact", "normalized", "numeric", "set"), by "module:callable", or a
    callable; `options` are bound as keyword arguments (e.g. `get_verifier("numeric", rel_tol=1e-3)`)."""
    if isinstance(spec, str):
        fn = _import_ref(spec) if ":" in spec else VERIFIERS.get(spec)
    elif callable(spec):
        fn = spec
    else:
        raise RewardSpecError(f"verifier must be a name, 'module:callable' or a callable, got {spec!r}")
    if not callable(fn):
        raise RewardSpecError(f"verifier {spec!r} is not callable")
    return functools.partial(fn, **options) if options else fn


def final_answer_of(trajectory: Trajectory) -> str | None:
    return trajectory.final_answer


def expected_answer_of(trajectory: Trajectory) -> str:
    return trajectory.task.answer


class VerifierReward:
    """Outcome reward from a verifier: `verifier(answer_of(traj), expected_of(traj))`, True -> 1.0, False -> 0.0
    (a float result is used as is, e.g. partial credit). A non-finite result masks the sample; process rewards
    are zeros.

    >>> from agentgrad.rewards.testing import make_trajectory, answer_turn
    >>> VerifierReward("normalized")(make_trajectory([answer_turn("paris.")])).outcome
    1.0
    """

    def __init__(self, verifier: str | Verifier = "exact", *,
                 answer_of: Callable[[Trajectory], str | None] = final_answer_of,
                 expected_of: Callable[[Trajectory], str] = expected_answer_of, **verifier_options: Any) -> None:
        self.verifier = get_verifier(verifier, **verifier_options)
        self.answer_of = answer_of
        self.expected_of = expected_of
        self.name = f"verifier:{verifier if isinstance(verifier, str) else getattr(verifier, '__name__', 'custom')}"

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        result = self.verifier(self.answer_of(trajectory), self.expected_of(trajectory))
        if not isinstance(result, numbers.Real):
            raise TypeError(f"verifier returned {type(result).__name__}, expected bool or float")
        value = float(result)
        if not math.isfinite(value):
            return masked(f"verifier returned non-finite {value}")
        return RewardBreakdown(outcome=value, process=(0.0,) * len(trajectory.turns))

    def __repr__(self) -> str:
        return f"VerifierReward({self.name})"


def make_verifier_reward(suite: Any, *, verifier: str = "exact", answer_of: str | None = None,
                         expected_of: str | None = None, **verifier_options: Any) -> VerifierReward:
    """Registered as "verifier": `REWARDS.get("verifier")(suite, verifier="numeric", abs_tol=1e-6)`.

    `suite` is unused (the verifier compares against `task.answer`). `verifier` is a registered name or
    "module:callable"; `answer_of` / `expected_of`, if given, are "module:callable" references; the remaining
    options are bound to the verifier.
    """
    extract: dict[str, Any] = {}
    if answer_of is not None:
        extract["answer_of"] = _import_ref(answer_of)
    if expected_of is not None:
        extract["expected_of"] = _import_ref(expected_of)
    return VerifierReward(verifier, **extract, **verifier_options)


REWARDS.add("verifier", make_verifier_reward)
