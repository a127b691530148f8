"""Outcome verifiers (pure functions) and VerifierReward."""

from __future__ import annotations

import doctest
import math

import pytest

from agentgrad.rewards import verifiers
from agentgrad.rewards.base import score
from agentgrad.rewards.testing import answer_turn, make_trajectory, tool_turn
from agentgrad.rewards.verifiers import (
    VerifierReward,
    exact_match,
    get_verifier,
    normalize_text,
    normalized_match,
    numeric_match,
    parse_number,
    set_match,
    split_items,
)
from agentgrad.types import Task


class ExactSuite:
    name = "exact"

    def verify(self, task, answer):
        return answer is not None and answer.strip() == task.answer


def test_doctests_pass():
    result = doctest.testmod(verifiers)
    assert result.attempted >= 1 and result.failed == 0  # the rules' own doctests are in agentgrad.answers


@pytest.mark.parametrize("answer,expected,ok", [
    ("Paris", "Paris", True),
    ("  Paris\n", "Paris", True),
    ("paris", "Paris", False),
    ("Paris.", "Paris", False),
    (None, "Paris", False),
    ("", "", True),
])
def test_exact(answer, expected, ok):
    assert exact_match(answer, expected) is ok


@pytest.mark.parametrize("answer,expected,ok", [
    ("The  EIFFEL tower!", "the eiffel tower", True),
    ("don't", "dont", True),
    ("Ｐａｒｉｓ", "paris", True),  # full-width letters: NFKC
    ("Paris, France", "Paris France", True),
    ("Paris", "Paris France", False),
    (None, "x", False),
])
def test_normalized(answer, expected, ok):
    assert normalized_match(answer, expected) is ok


def test_normalize_text_collapses_whitespace_and_strips_punctuation():
    assert normalize_text("\tA  b\n\nC?!") == "a b c"


@pytest.mark.parametrize("text,value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,234,567", 1234567.0), ("$12.50", 12.5), ("45%", 45.0),
    ("1/8", 0.125), ("1e3", 1000.0), ("so the total is 17 apples", 17.0), ("x = 2, y = -7", -7.0),
    ("nothing", None), (None, None), ("1/0", None), ("1e999", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_tolerances():
    assert numeric_match("3.0000001", "3")  # within the default 1e-6
    assert not numeric_match("3.01", "3")
    assert numeric_match("3.01", "3", abs_tol=0.02)
    assert not numeric_match("3.01", "3", abs_tol=0.005)
    assert numeric_match("1010", "1000", rel_tol=0.01)  # |10| <= 0.01 * 1010
    assert not numeric_match("1020", "1000", rel_tol=0.01)
    assert numeric_match("The answer is 1,000.", "1000")
    assert not numeric_match(None, "1")
    assert not numeric_match("nan", "1")
    assert not numeric_match("1", "not a number")


def test_set_match():
    assert split_items("a, b\nc; d") == ["a", "b", "c", "d"]
    assert split_items("1. Red\n2) green\n* Blue") == ["red", "green", "blue"]
    assert set_match("red, green, blue", "Blue\nGreen\nRed")
    assert set_match("red, red, green", "green, red")  # duplicates ignored
    assert not set_match("red, green", "red, green, blue")
    assert not set_match("red, green", "Red, Green", normalize=False)
    assert not set_match(None, "a")
    assert set_match("", "")  # both empty sets


def test_get_verifier_by_name_options_reference_and_callable():
    assert get_verifier("exact") is exact_match
    loose = get_verifier("numeric", abs_tol=0.5)
    assert loose("10.4", "10") and not loose("10.6", "10")
    assert get_verifier("agentgrad.rewards.verifiers:set_match") is set_match
    fn = lambda a, e: 0.5  # noqa: E731
    assert get_verifier(fn) is fn
    with pytest.raises(KeyError, match="valid names: exact, normalized, numeric, set"):
        get_verifier("fuzzy")


def test_verifier_reward_outcome_and_process_alignment():
    traj = make_trajectory([tool_turn("search", {"q": "x"}, results=2), answer_turn("the answer is 1,024")],
                           task=Task("t", "2**10?", "1024"))
    r = VerifierReward("numeric")(traj)
    assert r.outcome == 1.0 and r.process == (0.0, 0.0) and not r.masked
    assert VerifierReward("exact")(traj).outcome == 0.0


def test_verifier_reward_custom_callable_partial_credit_and_answer_of():
    def overlap(answer, expected):
        got, want = set(split_items(answer or "")), set(split_items(expected))
        return len(got & want) / len(want)

    traj = make_trajectory([answer_turn("red, green")], task=Task("t", "colours?", "red, green, blue, white"))
    assert VerifierReward(overlap)(traj).outcome == 0.5
    # answer_of: judge the last observation instead of the final answer
    traj2 = make_trajectory([tool_turn("calc", {"e": "6*7"}, observation="42"), answer_turn("done")],
                            task=Task("t", "6*7", "42"))
    last_obs = VerifierReward("exact", answer_of=lambda t: t.turns[0].observation)
    assert last_obs(traj2).outcome == 1.0


def test_verifier_reward_failures_mask_through_score():
    traj = make_trajectory([answer_turn("x")], task=Task("t", "p", "x"))
    nan = VerifierReward(lambda a, e: math.nan)
    boom = VerifierReward(lambda a, e: 1 / 0)
    wrong_type = VerifierReward(lambda a, e: "yes")
    out = score([traj, traj, traj], nan, ExactSuite()) + score([traj], boom, ExactSuite()) + \
        score([traj], wrong_type, ExactSuite())
    assert [s.reward.masked for s in out] == [True] * 5
    assert "non-finite" in out[0].reward.reason
    assert "ZeroDivisionError" in out[3].reward.reason
    assert "TypeError" in out[4].reward.reason
    assert all(s.success for s in out)  # success is the suite's verdict, independent of the reward
