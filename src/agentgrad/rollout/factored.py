"""Tool names chosen by a factored action head (`rollout.action_head=factored`) inside the agent loop.

A turn is generated as text until it has written `<tool_call>` + the call header (`\\n{"name": "`): there the
engine pauses (`DecodeSession` `pause`). The policy's forward gives the final hidden states of the context so
far (`context_states`, the learner's forward, so sampler and learner read the same states), and the head picks
(category, tool) over the env's legal tools from them (the last one is the state the name's first token would
have been sampled from); the name's tokens are
written in as context (loss_mask 0, logprob 0.0: the LM did not sample them) and the turn goes on as text (the
arguments). One turn can hold several such decisions. Each is recorded as a `HeadDecision` (the position whose
hidden state was read, the name's span, the tool, its logprob, the legal set).

After a decision the open name may only close: the tool-name mask of that row is narrowed to the chosen name,
so the LM cannot extend `weather.get_rain` into a longer legal name (the masked token is recorded as usual).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from agentgrad.algos.sampling import counter_uniform
from agentgrad.backends.base import Generation, LogitsProcessor, SamplingParams
from agentgrad.envs.base import ActionMask
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.constrained import EpisodeMasks, ToolNameDecoder, tool_name_decoder
from agentgrad.rollout.parser import OPEN
from agentgrad.types import ToolCall


class ToolHead(Protocol):
    """What the loop needs of a head (`models.factored_head.FactoredToolHead` is one)."""

    tool_names: tuple[str, ...]

    def decide(self, states: torch.Tensor, legal: frozenset[str], *, temperature: float,
               uniform: float) -> tuple[str, float]:
        """states (L, H) of the context up to the call position -> (tool name, its logprob under the legal set),
        sampled by inverse CDF with `uniform`."""
        ...


ContextStates = Callable[[Sequence[int]], torch.Tensor]  # ids (L,) -> final hidden states (L, H)


@dataclass(frozen=True)
class HeadSpan:
    """One decision, positions relative to the turn's first generated token."""

    name_start: int  # first token of the name; the head read the hidden state of token name_start - 1
    name_end: int
    tool: str
    logprob: float
    legal: tuple[str, ...]


@dataclass
class _Turn:
    ids: list[int] = field(default_factory=list)  # the turn so far: sampled parts and written-in names
    logprobs: list[float] = field(default_factory=list)
    spans: list[HeadSpan] = field(default_factory=list)
    text: str = ""
    seen: int = 0
    budget: int = 0
    legal: frozenset[str] = frozenset()


class HeadCalls:
    """Per-episode turn state of a rollout whose tool names a head chooses (row = episode index)."""

    def __init__(self, head: ToolHead, codec: ChatCodec, sampling: SamplingParams, num_rows: int,
                 context_states: ContextStates) -> None:
        self.head, self.codec, self.context_states = head, codec, context_states
        self.decoder: ToolNameDecoder = tool_name_decoder(codec)
        self.trigger = OPEN + self.decoder.header
        self.temperature = sampling.temperature
        self.seed = sampling.seed if sampling.seed is not None else random.getrandbits(62)
        self.known = frozenset(head.tool_names)
        self.turns = [_Turn() for _ in range(num_rows)]
        self._name_ids: dict[str, list[int]] = {}

    def start_turn(self, row: int, mask: ActionMask, budget: int) -> None:
        self.turns[row] = _Turn(budget=budget, legal=mask.tools & self.known)

    def _text(self, row: int, generated: Sequence[int]) -> str:
        turn = self.turns[row]
        full = len(turn.ids) + len(generated)
        if full > turn.seen:
            new = list(turn.ids[turn.seen:]) if turn.seen < len(turn.ids) else []
            new += list(generated[max(0, turn.seen - len(turn.ids)):])
            strings = self.decoder.strings
            turn.text += "".join(strings[i] if i < len(strings) else "" for i in new)
            turn.seen = full
        return turn.text

    def pause(self, row: int, generated: Sequence[int]) -> bool:
        """The engine's `pause`: stop when the turn has just written a call header and a known tool is legal."""
        return bool(self.turns[row].legal) and self._text(row, generated).endswith(self.trigger)

    def processor(self, inner: LogitsProcessor | None) -> LogitsProcessor | None:
        """`inner` sees the whole turn (sampled parts and written-in names), not only the current generation."""
        if inner is None:
            return None
        return lambda row, generated, logits: inner(row, self.turns[row].ids + list(generated), logits)

    def name_ids(self, name: str) -> list[int]:
        if name not in self._name_ids:
            self._name_ids[name] = self.codec.encode(name)
        return self._name_ids[name]

    def decide(self, row: int, gen: Generation, context: Sequence[int], masks: EpisodeMasks | None
               ) -> list[int] | None:
        """A paused turn: choose the tool from the states of `context` (the episode's ids before this turn) and
        the turn so far, write its name in. Returns the ids to submit and continue with, or None when the turn
        budget has no room for the name and at least one more token. The draw is keyed by (seed, row, the
        name's first position), so seeded runs repeat."""
        turn = self.turns[row]
        turn.ids += gen.token_ids
        turn.logprobs += gen.logprobs
        position = len(context) + len(turn.ids)
        u = float(counter_uniform(self.seed, torch.tensor([row]), torch.tensor([position]))[0])
        states = self.context_states(list(context) + turn.ids)  # (position, H)
        name, logprob = self.head.decide(states, turn.legal, temperature=self.temperature, uniform=u)
        ids = self.name_ids(name)
        if len(turn.ids) + len(ids) >= turn.budget:
            return None
        start = len(turn.ids)
        turn.spans.append(HeadSpan(start, start + len(ids), name, logprob, tuple(sorted(turn.legal))))
        turn.ids += ids
        turn.logprobs += [0.0] * len(ids)
        if masks is not None:
            masks.restrict_name(row, name)
        return ids

    def remaining(self, row: int) -> int:
        return self.turns[row].budget - len(self.turns[row].ids)

    def finish(self, row: int, gen: Generation) -> tuple[Generation, tuple[HeadSpan, ...]]:
        """The whole turn as one Generation (its last part's finish reason) and the head's spans in it."""
        turn = self.turns[row]
        whole = Generation(tuple(turn.ids) + gen.token_ids, tuple(turn.logprobs) + gen.logprobs, gen.finish_reason)
        return whole, tuple(turn.spans)

    def cut(self, row: int) -> Generation:
        """A paused turn with no room left: what was sampled, ending as if cut by the token limit."""
        turn = self.turns[row]
        return Generation(tuple(turn.ids), tuple(turn.logprobs), "length")


def expert_spans(codec: ChatCodec, ids: Sequence[int], call: ToolCall | None, legal: frozenset[str]
                 ) -> tuple[HeadSpan, ...]:
    """Where an expert turn's tool name sits in its ids, as a head decision (logprob 0: the expert's).

    The name must be whole tokens (the tokenizer does not merge it with the header or the closing quote), as
    byte-level BPE pre-tokenisation keeps punctuation and letters apart; otherwise a head cannot write it in."""
    if call is None:
        return ()
    decoder = tool_name_decoder(codec)
    trigger = OPEN + decoder.header
    text = ""
    start = None
    for k, i in enumerate(ids):
        if start is None and text.endswith(trigger):
            start, text = k, ""
        text += decoder.strings[i] if i < len(decoder.strings) else ""
        if start is not None and len(text) >= len(call.name):
            if text != call.name or codec.encode(call.name) != list(ids[start:k + 1]):
                raise ValueError(f"tool name {call.name!r} is not whole tokens after the call header in this "
                                 "tokenizer: rollout.action_head=factored cannot write it in")
            return (HeadSpan(start, k + 1, call.name, 0.0, tuple(sorted(legal))),)
    raise ValueError(f"no call header before {call.name!r} in the expert turn")
