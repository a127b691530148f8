"""Tool names chosen by a factored action head (`rollout.action_head=factored|category`) inside the agent loop.

A turn is generated as text until it has written `<tool_call>` + the call header (`\\n{"name": "`): there the
engine pauses (`DecodeSession` `pause`). The policy's forward gives the final hidden states of the context so
far (`context_states`, the learner's forward, so sampler and learner read the same states), and the head picks
from them over the env's legal tools (the last state is the one the name's first token would have been sampled
from): under `factored` a tool (category, then tool), whose name's tokens are written in; under `category` a
category, and the tokens that the category's legal tool names all start with are written in (`NameWriter`).
Written tokens are context (loss_mask 0, logprob 0.0: the LM did not sample them) and the turn goes on as text:
under `category` the LM writes the rest of the name, then the arguments. One turn can hold several decisions.
Each is recorded as a `HeadDecision` (the position whose hidden state was read, the written span, the choice,
its logprob, the legal choices).

After a decision the tool-name mask of that row is narrowed to the names the choice allows (the chosen tool, or
the category's legal tools), so the LM cannot extend `weather.get_rain` into a longer legal name or leave the
category (the masked tokens are recorded as usual).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
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

    decides: str  # "tool" or "category"
    tool_names: tuple[str, ...]
    category_of: dict[str, str]

    def legal_choices(self, legal_tools: Iterable[str]) -> frozenset[str]: ...

    def decide(self, states: torch.Tensor, legal: frozenset[str], *, temperature: float,
               uniform: float) -> tuple[str, float]:
        """states (L, H) of the context up to the call position, legal tool names -> (choice, its logprob under
        the legal choices), sampled by inverse CDF with `uniform`."""
        ...


ContextStates = Callable[[Sequence[int]], torch.Tensor]  # ids (L,) -> final hidden states (L, H)

# What the head of each `rollout.action_head` mode decides (`FactoredToolHead.decides`).
HEAD_DECIDES = {"factored": "tool", "category": "category"}


@dataclass(frozen=True)
class HeadSpan:
    """One decision, positions relative to the turn's first generated token."""

    name_start: int  # first written token; the head read the hidden state of token name_start - 1
    name_end: int  # after the last written token
    choice: str  # a tool name, or a category
    logprob: float
    legal: tuple[str, ...]  # the legal choices


class NameWriter:
    """What a head's choice writes into the turn: the chosen tool's name tokens, or (a category) the tokens that
    the names of the category's legal tools all begin with, and which names the LM may then complete."""

    def __init__(self, head: ToolHead, codec: ChatCodec) -> None:
        self.head, self.codec = head, codec
        self._ids: dict[str, list[int]] = {}
        if head.decides == "category":
            for category in dict.fromkeys(head.category_of.values()):
                names = [n for n, c in head.category_of.items() if c == category]
                if not self.common_ids(names):
                    raise ValueError(f"rollout.action_head=category writes the chosen category's shared name "
                                     f"prefix in, but the tools of category {category!r} ({', '.join(names[:3])}"
                                     f"{', ...' if len(names) > 3 else ''}) share no whole token: name them "
                                     "<category>.<tool>, or use rollout.action_head=factored")

    def name_ids(self, name: str) -> list[int]:
        if name not in self._ids:
            self._ids[name] = self.codec.encode(name)
        return self._ids[name]

    def common_ids(self, names: Sequence[str]) -> list[int]:
        encoded = [self.name_ids(n) for n in names]
        k = 0
        while all(len(e) > k and e[k] == encoded[0][k] for e in encoded):
            k += 1
        return encoded[0][:k]

    def write(self, choice: str, legal_tools: frozenset[str]) -> tuple[list[int], frozenset[str]]:
        """(ids written after the call header, the tool names the LM may complete from there)."""
        if self.head.decides == "tool":
            return self.name_ids(choice), frozenset({choice})
        names = frozenset(n for n in legal_tools if self.head.category_of.get(n) == choice)
        return self.common_ids(sorted(names)), names

    def choice_of(self, tool: str) -> str:
        return tool if self.head.decides == "tool" else self.head.category_of[tool]

    def span(self, start: int, choice: str, logprob: float, legal_tools: frozenset[str]
             ) -> tuple[HeadSpan, list[int], frozenset[str]]:
        """The decision as a span from turn position `start`, the ids it writes, and the names the LM may then
        complete (`write`)."""
        ids, names = self.write(choice, legal_tools)
        legal = tuple(sorted(self.head.legal_choices(legal_tools)))
        return HeadSpan(start, start + len(ids), choice, logprob, legal), ids, names


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
        self.writer = NameWriter(head, codec)
        self.decoder: ToolNameDecoder = tool_name_decoder(codec)
        self.trigger = OPEN + self.decoder.header
        self.temperature = sampling.temperature
        self.seed = sampling.seed if sampling.seed is not None else random.getrandbits(62)
        self.known = frozenset(head.tool_names)
        self.turns = [_Turn() for _ in range(num_rows)]

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

    def decide(self, row: int, gen: Generation, context: Sequence[int], masks: EpisodeMasks | None
               ) -> list[int] | None:
        """A paused turn: choose from the states of `context` (the episode's ids before this turn) and the turn so
        far, write the choice's tokens in (`NameWriter`). Returns the ids to submit and continue with, or None
        when the turn budget has no room for them and at least one more token. The draw is keyed by (seed, row,
        the name's first position), so seeded runs repeat."""
        turn = self.turns[row]
        turn.ids += gen.token_ids
        turn.logprobs += gen.logprobs
        position = len(context) + len(turn.ids)
        u = float(counter_uniform(self.seed, torch.tensor([row]), torch.tensor([position]))[0])
        states = self.context_states(list(context) + turn.ids)  # (position, H)
        choice, logprob = self.head.decide(states, turn.legal, temperature=self.temperature, uniform=u)
        span, ids, names = self.writer.span(len(turn.ids), choice, logprob, turn.legal)
        if len(turn.ids) + len(ids) >= turn.budget:
            return None
        turn.spans.append(span)
        turn.ids += ids
        turn.logprobs += [0.0] * len(ids)
        if masks is not None:
            masks.restrict_names(row, names)
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


def expert_spans(writer: NameWriter, ids: Sequence[int], call: ToolCall | None, legal: frozenset[str]
                 ) -> tuple[HeadSpan, ...]:
    """Where an expert turn's head decision sits in its ids (the tokens its choice writes in; logprob 0: the
    expert's), the choice being the called tool or its category.

    The name must be whole tokens (the tokenizer does not merge it with the header or the closing quote), as
    byte-level BPE pre-tokenisation keeps punctuation and letters apart; otherwise a head cannot write it in."""
    if call is None:
        return ()
    codec = writer.codec
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
                                 "tokenizer: a head cannot write it in (use rollout.action_head=tokens)")
            span, _, _ = writer.span(start, writer.choice_of(call.name), 0.0, legal)
            return (span,)
    raise ValueError(f"no call header before {call.name!r} in the expert turn")
