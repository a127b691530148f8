"""The one answer matcher: hand-written cases for each rule, and the suites and verifier rewards agreeing."""

from __future__ import annotations

import doctest

import pytest

from agentgrad import answers
from agentgrad.answers import normalize_text, normalized_match
from agentgrad.envs.tasks import verify_by_kind
from agentgrad.rewards.testing import answer_turn, make_trajectory
from agentgrad.rewards.verifiers import VerifierReward
from agentgrad.types import Task


def test_doctests_pass():
    result = doctest.testmod(answers)
    assert result.attempted > 15 and result.failed == 0


@pytest.mark.parametrize("text,normal", [
    ("It is Velmora.", "it is velmora"),
    ("The answer is A", "the answer is a"),  # articles kept: "A" can be the answer
    ("U.S.A.", "usa"),  # dots between letters dropped, the last one is punctuation
    ("don't", "dont"), ("don\u2019t", "dont"),  # both apostrophes
    ("12.5", "12 5"),  # a dot between digits splits: never "125", which "125" would then match
    ("rock-and-roll", "rock and roll"),
    ("$5 + 3", "5 3"),  # symbols split words like punctuation
    ("\uff30\uff41\uff52\uff49\uff53", "paris"),  # full-width letters: NFKC
    ("STRASSE", "strasse"), ("Stra\u00dfe", "strasse"),  # case-folded, not only lower-cased
    (None, ""),
])
def test_normalize_text(text, normal):
    assert normalize_text(text) == normal


@pytest.mark.parametrize("answer,expected,ok", [
    ("It is Velmora.", "Velmora", True),  # 2 extra words before the answer
    ("The Velmora", "Velmora", True),
    ("The answer is A.", "a", True),  # a multiple-choice letter
    ("I think it is Velmora", "Velmora", True),  # 4 extra words, the limit
    ("I really think it is Velmora", "Velmora", False),  # 5 extra words: not a sentence about it
    ("Velmora, Tarsk, Quen, Brel, Dova, Zim", "Zim", False),  # a list of candidates ending with the answer
    ("Velmora is it", "Velmora", False),  # the answer must end the text
    ("Paris, France", "Paris France", True),
    ("Paris", "Paris France", False),
    ("Eiffel", "The Eiffel Tower", False),  # a part of the answer is not the answer
    ("Xvelmora", "Velmora", False),  # a suffix of a word is not the word
    ("", "Velmora", False), (None, "Velmora", False),
    ("", "", True), (None, "", False),
])
def test_normalized_match(answer, expected, ok):
    assert normalized_match(answer, expected) is ok


@pytest.mark.parametrize("rule,answer,expected", [
    ("normalized", "It is Velmora.", "Velmora"),
    ("numeric", "The answer is 1,234.", "1234"),
    ("numeric", "3/4", "0.75"),
    ("exact", " 42\n", "42"),
    ("set", "red, Green", "green\nred"),
])
def test_a_suite_and_a_verifier_reward_of_one_name_agree(rule, answer, expected):
    task = Task("t", "?", expected, metadata={"verifier": rule})
    reward = VerifierReward(rule)(make_trajectory([answer_turn(answer)], task=task))
    assert verify_by_kind(task, answer) is True and reward.outcome == 1.0
    wrong = "Tarsk, Velmora, Quen, Brel, Dova, Zim, 7" if rule != "exact" else "42."
    assert verify_by_kind(task, wrong) is False
    assert VerifierReward(rule)(make_trajectory([answer_turn(wrong)], task=task)).outcome == 0.0
