"""Answer matching: the one set of rules by which a final answer is compared with the expected one.

Task suites (`envs.tasks.verify_by_kind`) and outcome rewards (`rewards.verifiers`) both use these, so a suite's
notion of success and a verifier reward of the same name never disagree. Pure functions `(answer, expected) ->
bool`; a missing answer (None) is never correct, and they never raise on malformed text. Standard library only.

The rules:
- exact: equal after trimming surrounding whitespace.
- normalized: equal after `normalize_text`, or the answer *ends with* the expected answer after at most
  `extra_words` (4) other words, so "It is Velmora." matches "Velmora" while a list of every city does not.
- numeric: the stated numbers (`parse_number`) agree within a tolerance.
- set: the same items, in any order (`split_items`).
"""

from __future__ import annotations

import math
import re
import unicodedata

_APOSTROPHE = re.compile(r"['\u2019]")
_DOT_IN_WORD = re.compile(r"(?<=[^\W\d_])\.(?=[^\W\d_])")  # U.S.A, e.g: a dot between two letters
_NOT_WORD = re.compile(r"[^\w\s]")


def normalize_text(text: str | None) -> str:
    """Unicode NFKC and case-folded; apostrophes and dots inside words dropped ("don't" is "dont", "U.S.A." is
    "usa"); any other punctuation or symbol splits words (so "12.5" stays two numbers, never "125");
    whitespace collapsed. Articles are kept: "A" is a multiple-choice answer (a leading "The" in an answer is
    covered by `normalized_match`'s extra words).

    >>> normalize_text("  Hello,   WORLD!\\n")
    'hello world'
    >>> normalize_text("U.S.A.")
    'usa'
    >>> normalize_text("The rock-and-roll hall")
    'the rock and roll hall'
    """
    text = unicodedata.normalize("NFKC", text or "").casefold()
    text = _APOSTROPHE.sub("", _DOT_IN_WORD.sub("", text))
    return " ".join(_NOT_WORD.sub(" ", text).split())


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


def normalized_match(answer: str | None, expected: str, *, extra_words: int = 4) -> bool:
    """Equal after `normalize_text`, or the answer ends with the expected one after at most `extra_words` other
    words (a sentence around the answer, not a list of candidates).

    >>> normalized_match("It is Velmora.", "Velmora")
    True
    >>> normalized_match("the  Eiffel tower.", "The Eiffel Tower")
    True
    >>> normalized_match("Velmora, Tarsk, Quen, Brel, Dova, Zim", "Zim")  # a list of candidates
    False
    """
    a, g = normalize_text(answer), normalize_text(expected)
    if answer is None:
        return False
    if a == g:
        return True
    return bool(g) and a.endswith(" " + g) and len(a.split()) <= len(g.split()) + extra_words


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


MATCHERS = {"exact": exact_match, "normalized": normalized_match, "numeric": numeric_match, "set": set_match}
"""The rules by name: what a task's `metadata["verifier"]` and a verifier reward's `verifier` option name."""
