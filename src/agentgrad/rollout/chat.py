"""Token-in/token-out chat encoding.

Training ids are never re-tokenised from a rendered chat: the prompt is encoded once, the policy's sampled ids
are kept as they were sampled, and each observation is encoded as the *suffix* the chat template adds after
the policy's end-of-turn token. The same codec encodes expert turns for BC, so demonstrations and RL rollouts
are byte-identical in format.

That needs an *incremental* template: rendering a longer chat repeats the shorter one's text. `check_incremental`
renders an agent episode turn by turn and reports where a template breaks that (`PrefixBreak`: the step, the
first differing character, the text around it on both sides); Qwen3's own template does, and agentgrad ships an
incremental variant of it (models/templates/qwen3_incremental.jinja, docs/chat-templates.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentgrad.rollout.formats import ToolFormat
from agentgrad.rollout.formats import tool_format as resolve_tool_format
from agentgrad.types import Action, Message, ToolCall


class ChatTemplateError(ValueError):
    pass


@dataclass(frozen=True)
class PrefixBreak:
    """Where appending messages rewrote text that an earlier render had already produced."""

    step: str  # what was appended, to what
    position: int  # index of the first character of the earlier render that the later one changes
    line: int  # 1-based line and column of `position` in the earlier render
    column: int
    before: str  # the earlier render around `position` (up to `context` characters each side)
    after: str  # the later render around the same position

    def __str__(self) -> str:
        return (f"{self.step} changed earlier text at character {self.position} (line {self.line}, column "
                f"{self.column}):\n  before: {self.before!r}\n  after:  {self.after!r}")


def prefix_break(before: str, after: str, step: str, *, context: int = 40) -> PrefixBreak | None:
    """None if `after` starts with `before`; else where it stops doing so."""
    if after.startswith(before):
        return None
    pos = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    line = before.count("\n", 0, pos) + 1
    column = pos - (before.rfind("\n", 0, pos) + 1) + 1
    lo = max(0, pos - context)
    return PrefixBreak(step, pos, line, column, before[lo:pos + context], after[lo:pos + context])


# One agent episode as the rollout loop writes it: a call, its result, a call with text before it, its result,
# the answer. Tool arguments hold a quote and a non-ASCII character, as real ones do.
PROBE_TOOLS: tuple[dict, ...] = ({"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},)
PROBE_EPISODE: tuple[Message, ...] = (
    Message("system", "Use the calculator, then answer with the number."),
    Message("user", "What is 12 * 30 + 7?"),
    Message("assistant", "", tool_calls=(ToolCall("calculator", {"expression": "12 * 30"}),)),
    Message("tool", "360"),
    Message("assistant", "Now add 7 (\"seven\", ±0).",
            tool_calls=(ToolCall("calculator", {"expression": "360 + 7"}),)),
    Message("tool", "367"),
    Message("assistant", "367"),
)


def check_incremental(render: Callable[..., str], episode: Sequence[Message] = PROBE_EPISODE,
                      tools: Sequence[dict] | None = PROBE_TOOLS) -> list[PrefixBreak]:
    """Render `episode` the way a rollout grows it and return every step that rewrites earlier text (empty: the
    template is incremental for agent episodes).

    `render(messages, tools, *, add_generation_prompt)` is e.g. `ChatCodec.render`. The steps: an assistant
    turn appended to the generation prompt (what the policy generates must follow the prompt), then tool results
    plus the next generation prompt appended after that turn (the observation ids the codec appends)."""
    breaks = []
    k = next(i for i, m in enumerate(episode) if m.role == "assistant")
    text = render(list(episode[:k]), tools, add_generation_prompt=True)
    while k < len(episode):
        m = episode[k]
        if m.role == "assistant":
            nxt, step = render(list(episode[:k + 1]), tools), f"an assistant turn after {_roles(episode[:k])}"
            k += 1
        else:
            j = k
            while j < len(episode) and episode[j].role != "assistant":
                j += 1
            nxt = render(list(episode[:j]), tools, add_generation_prompt=True)
            step = f"{_roles(episode[k:j])} and the generation prompt after {_roles(episode[:k])}"
            k = j
        found = prefix_break(text, nxt, f"appending {step}")
        if found is not None:
            breaks.append(found)
        text = nxt
    return breaks


def _roles(messages: Sequence[Message]) -> str:
    return "[" + ", ".join(m.role for m in messages) + "]"


class ChatCodec:
    """Renders and encodes chats with a tokenizer's template. `template_kwargs` go to every render (e.g.
    `enable_thinking=False` for Qwen3); `tool_format` names how turns are parsed (rollout/formats.py; `auto`
    reads it off the template)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], *,
                 template_kwargs: Mapping[str, Any] | None = None, tool_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos_texts = [tokenizer.convert_ids_to_tokens(i) for i in self.eos_token_ids]
        self.template_kwargs = dict(template_kwargs or {})
        self.tool_format: ToolFormat = resolve_tool_format(tool_format, getattr(tokenizer, "chat_template", None))
        # observation_ids is a pure function of the tool messages' (role, content): a GRPO group's samples mostly
        # see the same observations, and rendering plus encoding was ~10% of a rollout's CPU time (profiled)
        self._observations: dict[tuple[tuple[str, str], ...], tuple[int, ...]] = {}
        # prompt_ids likewise, for a GRPO group's samples of one task (the 8 renders of one prompt were ~6% of a
        # 64-episode rollout's CPU, profiled); recent prompts only, as tasks change every step
        self._prompts: OrderedDict[tuple[tuple[tuple[str, str], ...], str], tuple[int, ...]] = OrderedDict()

    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template([m.to_chat() for m in messages], tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids. Tool tags are added-but-not-special tokens, so they survive skip_special."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def parse(self, text: str) -> list[Action]:
        """The actions of one generated turn, in this template's tool-call format (total: never raises)."""
        return self.tool_format.parse(text)

    def assistant_message(self, text: str, actions: Sequence[Action]) -> Message:
        """The assistant message a generated turn stands for in the chat."""
        calls = tuple(a for a in actions if isinstance(a, ToolCall))
        return Message("assistant", self.tool_format.content(text, actions), tool_calls=calls)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Ids of a chat's prompt up to the generation prompt (the last PROMPT_CACHE distinct ones remembered)."""
        if any(m.tool_calls for m in messages):
            return self.encode(self.render(messages, tools, add_generation_prompt=True))
        key = (tuple((m.role, m.content) for m in messages), json.dumps(tools, sort_keys=True, default=str))
        ids = self._prompts.get(key)
        if ids is None:
            ids = tuple(self.encode(self.render(messages, tools, add_generation_prompt=True)))
            self._prompts[key] = ids
            while len(self._prompts) > PROMPT_CACHE:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return list(ids)

    def check(self) -> list[PrefixBreak]:
        """`check_incremental` with this codec's template and kwargs."""
        return check_incremental(self.render)

    def _after_eos(self, text: str) -> str:
        """What the template writes after the last end-of-turn token (e.g. Qwen's trailing newline)."""
        cut = max((text.rfind(e), e) for e in self._eos_texts)
        if cut[0] < 0:
            raise ChatTemplateError("the chat template does not end assistant turns with the eos token")
        return text[cut[0] + len(cut[1]):]

    def observation_ids(self, tool_messages: Sequence[Message]) -> list[int]:
        """Ids to append after a policy turn that ended with eos: the observation plus the next generation
        prompt, exactly as the template renders them (remembered per distinct observation, up to
        OBSERVATION_CACHE of them)."""
        cacheable = not any(m.tool_calls for m in tool_messages)
        key = tuple((m.role, m.content) for m in tool_messages) if cacheable else None
        ids = self._observations.get(key) if cacheable else None
        if ids is None:
            ids = tuple(self._render_observation(tool_messages))
            if cacheable and len(self._observations) < OBSERVATION_CACHE:
                self._observations[key] = ids
        return list(ids)

    def _render_observation(self, tool_messages: Sequence[Message]) -> list[int]:
        base = [Message("user", "u"), Message("assistant", "a")]
        base_text = self.render(base)
        full_text = self.render([*base, *tool_messages], add_generation_prompt=True)
        found = prefix_break(base_text, full_text, f"appending {_roles(tool_messages)} after [user, assistant]")
        if found is not None:
            raise ChatTemplateError(f"the chat template is not incremental: {found}\n{INCREMENTAL_HINT}")
        return self.encode(self._after_eos(base_text) + full_text[len(base_text):])

    def assistant_ids(self, message: Message) -> list[int]:
        """Ids of one assistant turn, ending with its eos token, as the policy would have to generate them."""
        base = [Message("user", "u")]
        base_text = self.render(base, add_generation_prompt=True)
        full_text = self.render([*base, message])
        found = prefix_break(base_text, full_text, "appending an assistant turn after [user] + generation prompt")
        if found is not None:
            raise ChatTemplateError(f"the chat template is not incremental for assistant turns: {found}\n"
                                    f"{INCREMENTAL_HINT}")
        turn = full_text[len(base_text):]
        tail = self._after_eos(turn)
        return self.encode(turn[: len(turn) - len(tail)] if tail else turn)


OBSERVATION_CACHE = 4096
"""Distinct observations a codec remembers the ids of (a bound on memory for runs with unbounded tool outputs)."""

PROMPT_CACHE = 1024
"""Most recent distinct prompts a codec remembers the ids of."""

INCREMENTAL_HINT = ("Token-in/token-out training needs a template whose earlier text never changes as the chat "
                    "grows. For Qwen3 set model.chat_template=qwen3 (agentgrad's incremental variant); otherwise "
                    "model.chat_template=PATH.jinja with a fixed template (docs/chat-templates.md).")
