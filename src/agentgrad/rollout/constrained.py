"""Constrained decoding of tool names: the env's action mask enforced while the policy writes a call (and, with
`rollout.copy_args`, copy constraints on arguments and answers: rollout/copying.py).

Inside a `<tool_call>` whose name string is still open, a token is legal only if the turn's text stays a prefix
of `<tool_call>` + header + (a legal tool name) + `"` (anything may follow the closing quote). The header
(`\\n{"name": "` for Qwen2.5 / Hermes) is read off the chat template, so the exact bytes are the template's.
When the mask forbids answering (`final_answer=False`), a turn that holds no tool call may not end (eos gets
-inf). Illegal tokens get -inf in the logits, so the sampled token's logprob is that of the masked softmax.

Exact ratios: each constrained step is recorded as a `TokenMask` (the legal set, or the few illegal ids) on
the trajectory; `collate` turns them into `TokenBatch.logit_masks` and the learner scores those tokens with
the same masked softmax (`algos.masked_token_logprobs`).

Legal sets are computed over the vocabulary's token strings (token-prefix matching against the set of name
prefixes), looking only at tokens whose first character can continue the text, and are cached per
(legal names, text so far). The mask of the state at the start of a turn applies to every call in that turn.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from agentgrad.envs.base import ActionMask
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.copying import (
    CopySpec,
    LiteralState,
    answer_ids,
    episode_source,
    literal_chars,
    literal_ids,
    literal_state,
    open_value,
    value_ids,
)
from agentgrad.rollout.parser import CLOSE, OPEN
from agentgrad.types import Message, TokenMask, ToolCall

MaskMode = Literal["auto", "on", "off"]
_SENTINEL = "zqxname"

# (token ids, allow): only these ids are legal (allow=True), or every id but these (allow=False)
Rule = tuple[tuple[int, ...], bool]
_CACHE_LIMIT = 50_000  # cached rules and tensors per decoder; copy rules are keyed by each episode's source


def call_header(codec: ChatCodec) -> str | None:
    """The text the chat template writes between `<tool_call>` and the tool's name, or None if it has none."""
    call = Message("assistant", "", tool_calls=(ToolCall(_SENTINEL, {}),))
    text = codec.render([Message("user", "u"), call])
    start = text.find(OPEN)
    end = text.find(_SENTINEL, start)
    return text[start + len(OPEN):end] if 0 <= start < end else None


def token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The text each token adds after a plain context. Decoding after an anchor keeps the leading space that
    SentencePiece tokenizers drop from a token decoded alone."""
    anchor = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    base = tokenizer.decode(anchor)
    texts = tokenizer.batch_decode([anchor + [i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return tuple(t[len(base):] if t.startswith(base) else "" for t in texts)


class ToolNameDecoder:
    """Per tokenizer: token strings, the call header, and legal next-token sets cached per text state."""

    def __init__(self, codec: ChatCodec, header: str) -> None:
        self.header = header
        self.strings = token_strings(codec.tokenizer)
        self.eos_token_ids = tuple(sorted(set(codec.eos_token_ids)))
        self._by_first: dict[str, list[int]] = {}
        for i, s in enumerate(self.strings):
            if s:
                self._by_first.setdefault(s[0], []).append(i)
        self._rules: dict[tuple[frozenset[str], str], Rule | None] = {}
        self._prefixes: dict[frozenset[str], frozenset[str]] = {}
        # id(rule) -> (rule, its ids as a tensor): rules are the cached objects below, and hashing a rule's id
        # tuple (hundreds of ids) per row and token cost more than the masking; holding the rule keeps its id
        self._tensors: dict[int, tuple[Rule, torch.Tensor]] = {}
        self._no_answer: Rule = (self.eos_token_ids, False)
        self._copy_rules: dict[tuple[str, str, str | LiteralState], Rule | None] = {}
        self._literal_tokens = [i for i, s in enumerate(self.strings) if literal_chars(s)]
        self._literal_states: dict[str, LiteralState] = {}  # a composed value so far -> its state

    def rule(self, mask: ActionMask | None, text: str, copy: CopySpec = CopySpec(), source: str = "") -> Rule | None:
        """What may follow `text` (the turn so far) under `mask` (None: names and answering free) and the copy
        constraints `copy` over `source` (rollout/copying.py); None when nothing is constrained."""
        start = text.rfind(OPEN)
        if start >= 0 and text.find(CLOSE, start) < 0:
            tail = text[start + len(OPEN):]
            if self._in_name(tail):
                return self._name_rule(mask.tools, tail) if mask is not None else None
            if (copy.args or copy.literals) and tail.startswith(self.header):
                return self._value_rule(copy, source, tail[len(self.header):])
            return None
        if mask is not None and not mask.final_answer and OPEN not in text:
            return self._no_answer  # answering is illegal: this turn may not end without a call
        if copy.answer and start < 0:
            return self._cached(("answer", source, text), lambda: (answer_ids(
                self.strings, self._by_first, source, text, self.eos_token_ids), True))
        return None

    def _value_rule(self, copy: CopySpec, source: str, name_and_rest: str) -> Rule | None:
        opened = open_value(name_and_rest)
        if opened is not None and copy.copies(opened[0], opened[1]):
            partial = opened[2]
            return self._cached(("value", source, partial),
                                lambda: (value_ids(self.strings, self._by_first, source, partial), True))
        opened = open_value(name_and_rest, escapes=True) if copy.literals else None
        if opened is not None and copy.copies_literals(opened[0], opened[1]):
            return self._literal_rule(source, opened[2])
        return None

    def _literal_rule(self, source: str, partial: str) -> Rule | None:
        state = self._literal_state(partial)
        return self._cached(("literal", source, state), lambda: literal_ids(
            self.strings, self._by_first, self._literal_tokens, source, state))

    def _literal_state(self, partial: str) -> LiteralState:
        """The state of `partial`, stepped from the longest of its recent prefixes already seen (a row grows its
        value a token at a time), so a value is read once, not once per token."""
        states = self._literal_states
        if partial not in states:
            if len(states) > _CACHE_LIMIT:
                states.clear()
            k = next((k for k in range(len(partial) - 1, max(-1, len(partial) - 33), -1) if partial[:k] in states), 0)
            states[partial] = literal_state(partial[k:], states.get(partial[:k], LiteralState()))
        return states[partial]

    def _cached(self, key: tuple[str, str, str | LiteralState], rule: Callable[[], tuple[list[int], bool]]
                ) -> Rule | None:
        """The copy rule under `key`, computed once by `rule` as (ids, allow)."""
        if key not in self._copy_rules:
            if len(self._copy_rules) > _CACHE_LIMIT:
                self._copy_rules.clear()
            ids, allow = rule()
            # no id listed: nothing legal (e.g. a source without the text; leave the row free rather than all
            # -inf) or nothing illegal; either way no rule
            self._copy_rules[key] = (tuple(sorted(set(ids))), allow) if ids else None
        return self._copy_rules[key]

    def _in_name(self, tail: str) -> bool:
        h = self.header
        if len(tail) < len(h):
            return h.startswith(tail)
        return tail.startswith(h) and '"' not in tail[len(h):]

    def _name_rule(self, names: frozenset[str], tail: str) -> Rule | None:
        key = (names, tail)
        if key not in self._rules:
            self._rules[key] = self._compute(names, tail)
        return self._rules[key]

    def _compute(self, names: frozenset[str], tail: str) -> Rule | None:
        h = self.header
        if names not in self._prefixes:
            self._prefixes[names] = frozenset(n[:k] for n in names for k in range(len(n) + 1))
        prefixes = self._prefixes[names]
        if len(tail) < len(h):
            firsts = {h[len(tail)]}
        else:
            partial = tail[len(h):]
            firsts = {n[len(partial)] for n in names if n.startswith(partial) and len(n) > len(partial)}
            if partial in names:
                firsts.add('"')

        def legal(s: str) -> bool:
            if len(s) <= len(h):
                return h.startswith(s)
            if not s.startswith(h):
                return False
            rest = s[len(h):]
            quote = rest.find('"')
            return rest in prefixes if quote < 0 else rest[:quote] in names

        ids = tuple(sorted(i for c in firsts for i in self._by_first.get(c, ()) if legal(tail + self.strings[i])))
        return (ids, True) if ids else None  # no token continues: leave the row free rather than all -inf

    def apply(self, logits: torch.Tensor, rule: Rule) -> torch.Tensor:
        ids, allow = rule
        hit = self._tensors.get(id(rule))
        if hit is None or hit[0] is not rule or hit[1].device != logits.device:
            if len(self._tensors) > _CACHE_LIMIT:
                self._tensors.clear()
            hit = self._tensors[id(rule)] = (rule, torch.tensor(ids, dtype=torch.long, device=logits.device))
        index = hit[1]
        if allow:
            return torch.full_like(logits, float("-inf")).index_copy(0, index, logits[index])
        return logits.index_fill(0, index, float("-inf"))


class MaskedTurn:
    """The logits processor of one `Policy.generate` call: row b is constrained by `masks[b]` (None: free).

    Remembers the rule applied at each generated position of each row, for `token_masks`.
    """

    def __init__(self, decoder: ToolNameDecoder, masks: Sequence[ActionMask | None],
                 copy: CopySpec = CopySpec()) -> None:
        self.decoder, self.copy = decoder, copy
        self.masks = list(masks)
        self.sources: list[str | None] = [None] * len(masks)  # what row b may copy from (None: no copying)
        self._texts = [""] * len(masks)
        self._seen = [0] * len(masks)
        self._applied: list[dict[int, Rule]] = [{} for _ in masks]

    def __call__(self, row: int, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        mask, source = self.masks[row], self.sources[row]
        if mask is None and source is None:
            return logits
        if len(generated) > self._seen[row]:
            self._texts[row] += "".join(self.decoder.strings[i] if i < len(self.decoder.strings) else ""
                                        for i in generated[self._seen[row]:])
            self._seen[row] = len(generated)
        if source is None:
            rule = self.decoder.rule(mask, self._texts[row])
        else:
            rule = self.decoder.rule(mask, self._texts[row], self.copy, source)
        if rule is None:
            return logits
        self._applied[row][len(generated)] = rule
        return self.decoder.apply(logits, rule)

    def start_turn(self, row: int, mask: ActionMask | None, source: str | None = None) -> None:
        """Row `row` begins a new turn under `mask` (None: free), copying from `source` (None: no copy rule):
        positions count from the turn's start again."""
        self.masks[row], self.sources[row] = mask, source
        self._texts[row], self._seen[row], self._applied[row] = "", 0, {}

    def token_masks(self, row: int) -> list[TokenMask]:
        """The rules applied to row `row`, positions relative to the start of its generation."""
        return [TokenMask(pos, ids, allow) for pos, (ids, allow) in sorted(self._applied[row].items())]


_DECODERS: weakref.WeakKeyDictionary[ChatCodec, ToolNameDecoder | None] = weakref.WeakKeyDictionary()


def _decoder(codec: ChatCodec, mode: MaskMode) -> ToolNameDecoder | None:
    if codec not in _DECODERS:
        header = call_header(codec)
        _DECODERS[codec] = ToolNameDecoder(codec, header) if header is not None else None
        if header is None and mode == "auto":
            warnings.warn("the chat template writes no <tool_call> blocks: tool-name masks are not enforced "
                          "while decoding (illegal calls still get a typed 'denied' observation)", stacklevel=3)
    if _DECODERS[codec] is None and mode == "on":
        raise ValueError("rollout.tool_name_mask=on needs a chat template that writes <tool_call> blocks")
    return _DECODERS[codec]


def needs_mask(mode: MaskMode, mask: ActionMask, offered: frozenset[str]) -> bool:
    """'on': always; 'auto': when the mask restricts what the prompt offers (or forbids answering)."""
    if mode == "off":
        return False
    return mode == "on" or not mask.final_answer or mask.tools != offered


class EpisodeMasks:
    """The logits processor of a whole rollout (row = episode index), for engines where episodes start their
    turns at different times: each turn begins with `start_turn(row, env.legal_actions())`, so a mask that
    changes with the state (e.g. after `auth.login`) applies from the next turn on."""

    def __init__(self, decoder: ToolNameDecoder, mode: MaskMode, offered: Sequence[frozenset[str]],
                 copy: CopySpec = CopySpec()) -> None:
        self.mode, self.offered = mode, list(offered)
        self.turn = MaskedTurn(decoder, [None] * len(offered), copy)

    def start_turn(self, row: int, mask: ActionMask, messages: Sequence[Message] = ()) -> None:
        """`messages`: the episode so far; what it has read is the copy source when copy rules are set."""
        self.turn.start_turn(row, mask if needs_mask(self.mode, mask, self.offered[row]) else None,
                             episode_source(messages) if self.turn.copy else None)

    def __call__(self, row: int, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return self.turn(row, generated, logits)

    def token_masks(self, row: int) -> list[TokenMask]:
        return self.turn.token_masks(row)

    def restrict_names(self, row: int, names: frozenset[str]) -> None:
        """An action head chose (rollout/factored.py): the open name may now only become one of `names` (the
        chosen tool: close, not grow into a longer legal name; a category: one of its legal tools). Lasts until
        the row's next turn."""
        mask = self.turn.masks[row]
        if mask is not None:
            self.turn.masks[row] = dataclasses.replace(mask, tools=names)


def tool_name_decoder(codec: ChatCodec) -> ToolNameDecoder:
    """The codec's decoder (token strings and call header); raises if its template writes no <tool_call>."""
    decoder = _decoder(codec, "on")
    assert decoder is not None  # mode "on" raises instead
    return decoder


def episode_masks(codec: ChatCodec, mode: MaskMode, masks: Sequence[ActionMask],
                  offered: Sequence[frozenset[str]], copy: CopySpec = CopySpec()) -> EpisodeMasks | None:
    """The masker for a rollout, or None when no episode needs one in its first state and nothing is copied.
    Deciding once keeps the per-token processor off the fast path of unconstrained rollouts; an env whose first
    state is unrestricted but a later one is not should use `rollout.tool_name_mask=on`."""
    if not copy and not any(needs_mask(mode, m, o) for m, o in zip(masks, offered)):
        return None
    decoder = _decoder(codec, mode)
    if decoder is None and copy:
        raise ValueError("rollout.copy_args needs a chat template that writes <tool_call> blocks")
    return EpisodeMasks(decoder, mode, offered, copy) if decoder is not None else None
