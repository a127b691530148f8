"""Outcome verifiers: pure functions `(answer, expected) -> bool` (or a float in [0, 1] for partial credit),
and `VerifierReward`, which turns one into a reward function.

A verifier never raises on a missing or malformed answer: `None` or unparseable text is simply wrong.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import unicodedata
from typing import Any, Callable, Union

from agentgrad.registry import Registry
from agentgrad.rewards.base import REWARDS, RewardSpecError, _import_ref, masked
from agentgrad.types import RewardBreakdown, Trajectory

Verifier = Callable[[Union[str, None], str], Union[bool, float]]

VERIFIERS: Registry[Callable[..., Any]] = Registry("verifier")


def exact_match(answer: str | None, expected: str) -> bool:
    """Equal strings, after trimming surrounding whitespace only (case and punctuation count).

    >>> exact_match(" Paris\\n", "Paris")
    True
    >>> exact_match("paris", "Paris")
    False
    >>> exact_match(None, "Paris")
    False
    """
    return answer is not None and answer.strip() == expected.strip()


def normalize_text(text: str) -> str:
    """Unicode NFKC, case-folded, punctuation removed, whitespace collapsed.

    >>> normalize_text("  Hello,   WORLD!\\n")
    'hello world'
    >>> normalize_text("U.S.A.")
    'usa'
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
    return " ".join(text.split())


def normalized_match(answer: str | None, expected: str) -> bool:
    """Equal after `normalize_text` (case, whitespace and punctuation do not count).

    >>> normalized_match("the  Eiffel tower.", "The Eiffel Tower")
    True
    >>> normalized_match("Eiffel", "The Eiffel Tower")
    False
    """
    return answer is not None and normalize_text(answer) == normalize_text(expected)


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
_FRACTION = re.compile(r"\s*([-+]?\d+)\s*/\s*(\d+)\s*")


def parse_number(text: str | None) -> float | None:
    """The number a text states: the whole text if it is a number (thousands separators, a leading currency
    sign, a trailing % and simple fractions allowed), else the last number in it; None if there is none.

    >>> parse_number("1,234.5")
    1234.5
    >>> parse_number("The answer is -42.")
    -42.0
    >>> parse_number("3/4")
    0.75
    >>> parse_number("3,4")  # not a thousands separator: two numbers, the last one counts
    4.0
    >>> parse_number("no digits") is None
    True
    """
    if text is None:
        return None
    stripped = text.strip().lstrip("$€£").rstrip("%").strip()
    m = _FRACTION.fullmatch(stripped)
    if m:
        den = int(m.group(2))
        return int(m.group(1)) / den if den else None
    if _NUMBER.fullmatch(stripped):
        number = stripped
    else:
        found = _NUMBER.findall(text)
        if not found:
            return None
        number = found[-1]
    value = float(number.replace(",", ""))
    return value if math.isfinite(value) else None  # "1e999" overflows to inf: not a usable answer


def numeric_match(answer: str | None, expected: str, *, abs_tol: float = 1e-6, rel_tol: float = 1e-6) -> bool:
    """The stated numbers agree within `abs_tol` or `rel_tol` (as `math.isclose`).

    >>> numeric_match("The result is 3.14159", "3.1416", abs_tol=1e-3)
    True
    >>> numeric_match("100", "101", rel_tol=0.05)
    True
    >>> numeric_match("100", "101")
    False
    >>> numeric_match("about twelve", "12")
    False
    """
    got, want = parse_number(answer), parse_number(expected)
    if got is None or want is None:
        return False
    return math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol)


_SEPARATORS = re.compile(r"[,;\n]")
_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s+")


def split_items(text: str, *, normalize: bool = True) -> list[str]:
    """Items of a comma-, semicolon- or line-separated list, bullets removed, empty items dropped.

    >>> split_items("- Apples\\n- pears; Plums,")
    ['apples', 'pears', 'plums']
    """
    items = [_BULLET.sub("", part).strip() for part in _SEPARATORS.split(text)]
    if normalize:
        items = [normalize_text(i) for i in items]
    return [i for i in items if i]


def set_match(answer: str | None, expected: str, *, normalize: bool = True) -> bool:
    """The same set of items, in any order, duplicates ignored (see `split_items`).

    >>> set_match("Paris, berlin", "Berlin\\nParis")
    True
    >>> set_match("Paris", "Paris, Berlin")
    False
    """
    if answer is None:
        return False
    return set(split_items(answer, normalize=normalize)) == set(split_items(expected, normalize=normalize))


VERIFIERS.add("exact", exact_match)
VERIFIERS.add("normalized", normalized_match)
VERIFIERS.add("numeric", numeric_match)
VERIFIERS.add("set", set_match)


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
