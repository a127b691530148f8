"""Copy constraints: arguments (and answers) that must be copied from what the episode has read so far.

Extractive tools take a string that is already on the page: a search for the entity the question names, `open`
of a document id a result listed, an answer read off an observation. A small policy that writes such a name
token by token miscopies it (docs/algorithms.md, "the tiny model cannot copy names"); a copy constraint lets it
write only a span of the episode's source (the prompt and every observation so far): text that starts and ends
at word boundaries, so a name, number or id is copied whole or not at all. What remains to learn is which span.
`rollout.copy_args` names them: `tool.argument` for a string argument of a Hermes `<tool_call>` (shell-style
patterns: `*.city`), `answer` for a turn's final answer (a turn with no call).

Composed arguments (a SQL query, Python code, a calculator expression) are written, not copied, but the facts in
them were read: `rollout.copy_literals` names arguments whose *literals* must be whole spans of the source: each
number (a run of digits not glued to a name, `x1` is a name) and each '-quoted string. The rest of the argument is
free. A hallucinated or half-copied number (`4186 + 418` for `4186 + 3321`) or a misspelt name in a WHERE clause
then cannot be written.

The legal sets are computed on decoded text, like tool-name masks (rollout/constrained.py), and recorded the
same way, so the learner scores those tokens with the same masked softmax. Values are matched as the policy
writes them inside the JSON string (escapes are not decoded), so sources with quotes or backslashes in the
names to copy are not supported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache

from agentgrad.rollout.parser import OPEN
from agentgrad.types import Message

ANSWER = "answer"
# the last string value still open in a call's JSON: `"key": "partial` at the end of the text
_OPEN_VALUE = re.compile(r'"([^"\\]+)":\s*"([^"\\]*)$')
# the same, for values with JSON escapes (code: `import statistics\nprint(...)`), possibly ending mid-escape
_OPEN_ESCAPED = re.compile(r'"([^"\\]+)":\s*"((?:[^"\\]|\\.)*\\?)$')


@dataclass(frozen=True)
class CopySpec:
    """What must be copied: `tool.argument` patterns (shell-style, e.g. `*.city` or `*.*`), and whether final
    answers are."""

    args: frozenset[str] = frozenset()
    answer: bool = False
    literals: frozenset[str] = frozenset()  # composed arguments whose numbers and '-quoted strings are copied

    @classmethod
    def parse(cls, names: Iterable[str], literals: Iterable[str] = ()) -> CopySpec:
        """From `rollout.copy_args` entries (`tool.argument` or `answer`) and `rollout.copy_literals` entries
        (`tool.argument`); raises ValueError on a bad entry."""
        args, answer = set(), False
        for name in names:
            if name == ANSWER:
                answer = True
                continue
            args.add(_tool_argument(name, "copy_args"))
        lits = {_tool_argument(name, "copy_literals") for name in literals}
        return cls(frozenset(args), answer, frozenset(lits))

    def copies(self, tool: str, arg: str) -> bool:
        """Whether argument `arg` of `tool` must be copied."""
        return _matches(self.args, f"{tool}.{arg}")

    def copies_literals(self, tool: str, arg: str) -> bool:
        """Whether the literals in argument `arg` of `tool` must be copied."""
        return _matches(self.literals, f"{tool}.{arg}")

    def __bool__(self) -> bool:
        return bool(self.args) or self.answer or bool(self.literals)


def _tool_argument(name: str, key: str) -> str:
    tool, dot, arg = name.rpartition(".")
    if not dot or not tool or not arg:
        also = " or 'answer'" if key == "copy_args" else ""
        raise ValueError(f"{key} entry {name!r} is not 'tool.argument'{also}")
    return name


@lru_cache(maxsize=4096)
def _matches(patterns: frozenset[str], name: str) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def episode_source(messages: Iterable[Message]) -> str:
    """The text an episode may copy from: its user and tool messages."""
    return "\n".join(m.content for m in messages if m.role in ("user", "tool"))


def _boundary(source: str, i: int) -> bool:
    """Whether position i of `source` lies between words: not inside a run of letters and digits."""
    return i <= 0 or i >= len(source) or not (source[i - 1].isalnum() and source[i].isalnum())


def word_starts(source: str, text: str) -> list[int]:
    """Where `text` occurs in `source` starting at a word boundary (every boundary when `text` is empty)."""
    bounds = _boundaries(source)
    if not text:
        return [i for i in range(len(source)) if bounds[i]]
    out, i = [], source.find(text)
    while i >= 0:
        if bounds[i]:
            out.append(i)
        i = source.find(text, i + 1)
    return out


def is_span(source: str, text: str) -> bool:
    """Whether `text` is a non-empty span of `source` that starts and ends at word boundaries (a name, a number,
    an id: never part of one)."""
    return bool(text) and any(_boundary(source, i + len(text)) for i in word_starts(source, text))


def open_value(name_and_rest: str, escapes: bool = False) -> tuple[str, str, str] | None:
    """(tool, argument, value so far) when a call's text, from its name on, ends inside a string argument
    (`escapes`: the value may hold JSON escapes such as `\\n`, kept as written)."""
    name, quote, rest = name_and_rest.partition('"')
    m = (_OPEN_ESCAPED if escapes else _OPEN_VALUE).search(rest) if quote else None
    return (name, m.group(1), m.group(2)) if m else None


@lru_cache(maxsize=256)  # a rollout asks about the same few sources (its open turns') many times a step
def _boundaries(source: str) -> bytes:
    """Flag i: whether position i of `source` lies between words (`_boundary`), for i in 0..len(source)."""
    return bytes(_boundary(source, i) for i in range(len(source) + 1))


def _at_word_start(source: str, text: str, bounds: bytes) -> bool:
    """Whether `text` (non-empty) occurs in `source` starting at a word boundary."""
    i = source.find(text)
    while i >= 0:
        if bounds[i]:
            return True
        i = source.find(text, i + 1)
    return False


def _candidates(by_first: Mapping[str, Sequence[int]], source: str, partial: str) -> list[int]:
    """The tokens that may follow `partial` where it occurs at a word start of `source`: those whose first
    character follows it somewhere, and `"`'s."""
    n = len(partial)
    firsts = {source[i + n] for i in word_starts(source, partial) if i + n < len(source)} | {'"'}
    return [i for c in firsts for i in by_first.get(c, ())]


def value_ids(strings: Sequence[str], by_first: Mapping[str, Sequence[int]], source: str, partial: str) -> list[int]:
    """Tokens that keep a string value the start of a span of `source`; a token may close the string (`"` and
    anything after it) once the value is a whole span (`is_span`). A token string s keeps it so when
    `partial + s` occurs at a word start: one search of the source per candidate, in C."""
    bounds = _boundaries(source)

    def legal(s: str) -> bool:
        q = s.find('"')
        if q < 0:
            return _at_word_start(source, partial + s, bounds)
        return bool(partial or q) and is_span(source, partial + s[:q])

    return [i for i in _candidates(by_first, source, partial) if legal(strings[i])]


def answer_ids(strings: Sequence[str], by_first: Mapping[str, Sequence[int]], source: str, text: str,
               eos_ids: Sequence[int]) -> list[int]:
    """Tokens that keep a turn either the start of a `<tool_call>` or the start of a span of `source`; the turn
    may end (eos) once it is a whole span."""
    bounds = _boundaries(source)
    candidates = _candidates(by_first, source, text)
    if len(text) < len(OPEN) and OPEN.startswith(text):
        candidates += by_first.get(OPEN[len(text)], ())

    def legal(s: str) -> bool:
        v = text + s
        return _at_word_start(source, v, bounds) or OPEN.startswith(v) or (v.startswith(OPEN) and not text)

    ids = [i for i in set(candidates) if legal(strings[i])]
    if text and is_span(source, text):
        ids += list(eos_ids)
    return ids


@dataclass(frozen=True)
class LiteralState:
    """Where a composed value stands: inside a '-quoted string (`quoted`; `text` is the string so far) or outside
    (`text`: the digit run at the end, if any; `glued`: the run, or the next one, follows a name character, so it
    belongs to a name such as `x1`, not a number; `escaped`: the last character is an escaping backslash)."""

    quoted: bool = False
    text: str = ""
    glued: bool = False
    escaped: bool = False


def literal_step(state: LiteralState, chars: str, source: str | None) -> LiteralState | None:
    """The state after writing `chars`, or None when they break a literal: a closed number or quoted string that
    is not a whole span of `source`, or an open one that no span starts with (`source` None: no checks, just
    the state). A `"` ends the value, and the check."""
    quoted, text, glued, escaped = state.quoted, state.text, state.glued, state.escaped
    for c in chars:
        if quoted:
            if c == '"':
                return None if source is not None else LiteralState()  # the value would end mid-literal
            if c != "'":
                text += c
                continue
            if source is not None and not is_span(source, text):
                return None
            quoted, text, glued = False, "", False
            continue
        if escaped:  # the letter of `\n` or `\t` is no name character
            escaped, glued = False, False
            continue
        if c.isdigit():
            text += c
            continue
        if text and not glued and source is not None and not is_span(source, text):
            return None
        if c == '"':
            return LiteralState()
        text, quoted, escaped = "", c == "'", c == "\\"
        glued = c.isalnum() or c == "_"
    if source is not None and text and (quoted or not glued) and not word_starts(source, text):
        return None
    return LiteralState(quoted, text, glued, escaped)


def literal_state(partial: str, start: LiteralState = LiteralState()) -> LiteralState:
    """The state after writing `partial` from `start` (nothing is checked)."""
    state = literal_step(start, partial, None)
    assert state is not None  # without a source nothing is checked
    return state


def literal_chars(s: str) -> bool:
    """Whether token string `s` can touch a literal (a digit, a quote, a backslash); others only close a number."""
    return any(c.isdigit() or c in "'\"\\" for c in s)


def literal_ids(strings: Sequence[str], by_first: Mapping[str, Sequence[int]], special: Sequence[int], source: str,
                state: LiteralState) -> tuple[list[int], bool]:
    """The tokens that may follow a composed value (`rollout.copy_literals`) in `state` (`literal_state`), as
    (ids, allow): the legal ones (allow) or the illegal ones (not allow). A token is illegal when it breaks a
    literal (`literal_step`). `special`: the tokens with `literal_chars`; every other token is legal unless it closes a
    number that is not a whole span, so only `special` is checked one by one outside quoted strings."""
    if state.quoted:  # like value_ids: the tokens whose first character follows the text somewhere, or a quote
        n = len(state.text)
        firsts = {source[j + n] for j in word_starts(source, state.text) if j + n < len(source)} | {"'"}
        ids = {i for c in firsts for i in by_first.get(c, ()) if literal_step(state, strings[i], source) is not None}
        return sorted(ids), True
    plain_legal = not state.text or state.glued or is_span(source, state.text)
    bad = {i for i in special if literal_step(state, strings[i], source) is None}
    if plain_legal:
        return sorted(bad), False
    return sorted(set(special) - bad), True
