"""Copy constraints (rollout/copying.py): which next tokens keep an argument or answer copied from the source."""

from __future__ import annotations

import pytest

from agentgrad.rollout.copying import (
    CopySpec,
    LiteralState,
    answer_ids,
    episode_source,
    is_span,
    literal_chars,
    literal_ids,
    literal_state,
    literal_step,
    open_value,
    value_ids,
    word_starts,
)
from agentgrad.types import Message

# a toy vocabulary: id -> the text the token adds
STRINGS = ("Pik", "rux", "P", "ik", '"', '"}}', "x", "Kez", "ia", "<tool_call>", "<|im_end|>", "1", "38", " ", "")
EOS = (10,)


def _by_first(strings=STRINGS):
    out: dict[str, list[int]] = {}
    for i, s in enumerate(strings):
        if s:
            out.setdefault(s[0], []).append(i)
    return out


SOURCE = "What is the population of Pikrux?\n[1] d9: Pikrux has 380 people; Kezia 138."


def test_parse_names_tool_arguments_and_answer_and_rejects_the_rest():
    spec = CopySpec.parse(["search.query", "mcp.docs.open.doc_id", "*.city", "answer"])
    assert spec.answer and spec.copies("search", "query") and spec.copies("mcp.docs.open", "doc_id")
    assert spec.copies("weather.get", "city") and not spec.copies("search", "k")
    assert not spec.copies("open", "doc_id") and not CopySpec.parse(["answer"]).copies("search", "query")
    assert not CopySpec() and CopySpec.parse(["answer"])
    for bad in ("query", ".query", "search."):
        with pytest.raises(ValueError, match="not 'tool.argument' or 'answer'"):
            CopySpec.parse([bad])


def test_source_is_the_user_and_tool_messages():
    messages = [Message("system", "S"), Message("user", "Q"), Message("assistant", "A"), Message("tool", "O")]
    assert episode_source(messages) == "Q\nO"


def test_spans_start_and_end_between_words():
    assert word_starts("abcab ab", "ab") == [0, 6]  # the "ab" at 3 is inside a word
    assert is_span("ab abc", "ab") and not is_span("abc", "ab") and not is_span("abc", "")
    assert is_span(SOURCE, "Pikrux") and is_span(SOURCE, "138") and not is_span(SOURCE, "38")
    assert word_starts("ab cd", "") == [0, 2, 3]  # a span starts at a word's first character or between words


def test_open_value_finds_the_string_argument_being_written():
    assert open_value('search", "arguments": {"query": "Pik') == ("search", "query", "Pik")
    assert open_value('search", "arguments": {"query": "') == ("search", "query", "")
    assert open_value('search", "arguments": {"query": "Pikrux"') is None  # closed
    assert open_value('search", "arguments": {"k": 3, "query": "P') == ("search", "query", "P")
    assert open_value('search", "arguments": {"query": "a", "lang": "e') == ("search", "lang", "e")
    assert open_value('search", "arguments": {"k": 3') is None
    assert open_value('sear') is None  # the name is still open


def test_value_tokens_keep_a_whole_span_and_close_only_after_one():
    # "" -> a token that starts a span ("rux", "ik", "x", "ia" only occur inside words); never a bare quote
    assert set(value_ids(STRINGS, _by_first(), SOURCE, "")) == {0, 2, 7, 11, 12, 13}
    # "Pik" -> "rux" only: "Pik" is not a whole word, so no quote yet
    assert set(value_ids(STRINGS, _by_first(), SOURCE, "Pik")) == {1}
    # "Pikrux" is followed by "?" and " " in the source: a space token, or close
    assert set(value_ids(STRINGS, _by_first(), SOURCE, "Pikrux")) == {4, 5, 13}
    assert value_ids(STRINGS, _by_first(), SOURCE, "Pikz") == []  # off the source: nothing (the row stays free)


def test_answer_tokens_open_a_call_or_copy_and_end_only_after_a_whole_span():
    # empty turn: <tool_call>, or a token that starts a span; not eos (an empty answer)
    assert set(answer_ids(STRINGS, _by_first(), SOURCE, "", EOS)) == {0, 2, 7, 9, 11, 12, 13}
    # "38" only starts "380": no token continues it with "0", and it may not end there (not a whole number)
    assert answer_ids(STRINGS, _by_first(), SOURCE, "38", EOS) == []
    assert set(answer_ids(STRINGS, _by_first(), SOURCE, "Kez", EOS)) == {8}
    assert set(answer_ids(STRINGS, _by_first(), SOURCE, "Kezia", EOS)) == {10, 13}  # end, or go on: "Kezia 138"
    assert answer_ids(STRINGS, _by_first(), SOURCE, "Kezz", EOS) == []


def test_legal_sets_equal_the_definition_token_by_token():
    """value_ids and answer_ids read the continuations off the source once; each must give exactly the tokens
    the definition allows, checked here token by token: the value (or answer) with the token stays the start
    of a span; a quote closes only a non-empty whole span; eos ends only a non-empty whole span."""
    source = SOURCE + ' "Pik" 1 38x Pik Pikrux. ia'
    strings = (*STRINGS, "ux", "ux.", " Kezia", "1 ", "0 people", "?\n", 'rux"', 'x"}', '"x', " 3")
    by_first = _by_first(strings)

    def starts_span(v: str) -> bool:
        return bool(word_starts(source, v))

    def value_ok(partial: str, s: str) -> bool:
        v = partial + s
        q = v.find('"')
        return starts_span(v) if q < 0 else is_span(source, v[:q])

    def answer_ok(text: str, s: str) -> bool:
        v = text + s
        return starts_span(v) or "<tool_call>".startswith(v) or (v.startswith("<tool_call>") and not text)

    for partial in ("", "P", "Pik", "Pikr", "Pikrux", "1", "38", "Kezia", "Kezia 1", "ia", "q"):
        want = {i for i, s in enumerate(strings) if s and value_ok(partial, s)}
        assert set(value_ids(strings, by_first, source, partial)) == want, partial
        want = {i for i, s in enumerate(strings) if s and i not in EOS and answer_ok(partial, s)}
        want |= set(EOS) if is_span(source, partial) else set()
        assert set(answer_ids(strings, by_first, source, partial, EOS)) == want, partial


# composed arguments (rollout.copy_literals): only numbers and '-quoted strings are copied
LIT_SOURCE = "Pikrux was founded in 2015. Kez was born in 1948; x12 has 300 rows."
LIT_STRINGS = ("20", "15", "1", "5", " - ", "'", "Pik", "rux", "'}", '"}}', "x", "ab", "9")


def _literal_ids(partial: str) -> tuple[set[int], bool]:
    special = [i for i, s in enumerate(LIT_STRINGS) if literal_chars(s)]
    assert special == [0, 1, 2, 3, 5, 8, 9, 12]
    ids, allow = literal_ids(LIT_STRINGS, _by_first(LIT_STRINGS), special, LIT_SOURCE, literal_state(partial))
    return set(ids), allow


def test_parse_literal_arguments_and_reject_the_rest():
    spec = CopySpec.parse([], ["sql.query", "*.expression"])
    assert spec and spec.copies_literals("sql", "query") and spec.copies_literals("calculator", "expression")
    assert not spec.copies_literals("python", "code") and not spec.copies("sql", "query") and not spec.answer
    with pytest.raises(ValueError, match="copy_literals entry 'answer' is not 'tool.argument'$"):
        CopySpec.parse([], ["answer"])


def test_open_value_with_escapes_reads_code_values():
    call = 'python", "arguments": {"code": "import statistics\\nprint(1'
    assert open_value(call) is None  # an extractive value never holds a backslash
    assert open_value(call, escapes=True) == ("python", "code", "import statistics\\nprint(1")
    assert open_value('python", "arguments": {"code": "a\\', escapes=True) == ("python", "code", "a\\")
    assert open_value('python", "arguments": {"code": "a"', escapes=True) is None  # closed


@pytest.mark.parametrize(("written", "legal"), [
    ("2015 - 1948", True),
    ("2015 - 194", True),  # still the start of 1948
    ("2015 - 1949", False),  # no number read starts so
    ("201 - 1948", False),  # 201 is closed and only part of 2015
    ("x1 + 300", True),  # the 1 of x1 belongs to a name
    ("12 + 300", False),  # 12 is read only inside x12
    ("median([300, 2015])", True),
    ("2015\"}", True),  # the value ends: the JSON after it is not checked
    ("20\"", False),  # ...but not on half a number
    ("name = 'Pikrux' AND n > 300", True),
    ("name = 'Pik", True),  # an open string that starts a span
    ("name = 'Pikru'", False),  # closed on half a name
    ("name = 'Pikz", False),
    ("name = ''", False),  # empty
    ("name = 'Pikrux\"", False),  # the value may not end inside a quoted string
    ("import statistics\\nprint(1948)", True),  # the n of an escape is no name character...
    ("import statistics\\n12", False),  # ...so a number after it is checked
])
def test_literal_step_checks_numbers_and_quoted_strings(written, legal):
    assert (literal_step(LiteralState(), written, LIT_SOURCE) is not None) == legal


def test_literal_state_is_the_same_written_at_once_or_in_pieces():
    text = "SELECT n FROM t WHERE name = 'Pikrux' AND x1 > 20"
    for cut in range(len(text) + 1):
        assert literal_state(text[cut:], literal_state(text[:cut])) == literal_state(text)
    assert literal_state(text) == LiteralState(text="20")
    assert literal_state("a\\") == LiteralState(escaped=True) and literal_state("'Pik") == LiteralState(True, "Pik")


def test_literal_ids_worked_by_hand():
    # nothing open: every plain token; of the rest, those that start no number read, and a quote run into "}"
    assert _literal_ids("") == ({1, 3, 8, 12}, False)
    # "20" open and not a whole number: only "15" (2015) and "1" (201...) go on; nothing may close it
    assert _literal_ids("20") == ({1, 2}, True)
    # "2015" is whole: anything that closes it; no digit makes a longer number read
    assert _literal_ids("2015") == ({0, 1, 2, 3, 8, 12}, False)
    # a quoted string just opened: tokens that start a span ("20", "1", "Pik", "x"); not an empty string
    assert _literal_ids("name = '") == ({0, 2, 6, 10}, True)
    # "'Pikrux" is whole: close it, with or without what follows; " - " runs off the source
    assert _literal_ids("name = 'Pikrux") == ({5, 8}, True)
    assert _literal_ids("print(x") == ({8}, False)  # glued to a name: "15", "5", "9" are fine here


def test_literal_ids_equal_the_definition_token_by_token():
    """The shortcuts (plain tokens judged at once; quoted strings by their continuations) must give exactly the
    tokens the definition allows: the written value with the token passes `literal_step`."""
    strings = (*LIT_STRINGS, "0", "48", " 3", "'Kez", "Kez'", "2015'", "\\", "n1", "_", "00 r", ".")
    by_first = _by_first(strings)
    special = [i for i, s in enumerate(strings) if literal_chars(s)]
    for partial in ("", "1", "19", "1948", "3", "300", "x", "x1", "'", "'K", "'Kez", "'Kez'", "a\\", "a\\n",
                    "f(2015, ", "'Pikrux' ", "7", "'zz"):
        state = literal_state(partial)
        want = {i for i, s in enumerate(strings) if literal_step(state, s, LIT_SOURCE) is not None}
        ids, allow = literal_ids(strings, by_first, special, LIT_SOURCE, state)
        got = set(ids) if allow else set(range(len(strings))) - set(ids)
        assert got == want, partial
