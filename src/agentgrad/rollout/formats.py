"""Tool-call formats: how a policy turn's text becomes actions, for each chat-template family. One registry
(`TOOL_FORMATS`), one signature (`parse(text) -> list[Action]`).

- `hermes`: Qwen2.5 / Hermes, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks, several per
  turn (rollout/parser.py).
- `qwen3`: Qwen3's, the same blocks after an optional `<think>...</think>` block. The reasoning is not parsed:
  a `<tool_call>` written while thinking is a thought, not a call, and a final answer is the text after
  `</think>`. A turn that ends inside `<think>` is an `InvalidAction`.
- `llama3_json`: Llama 3.1 / 3.3's JSON tool calling: the whole turn is one JSON object `{"name": ...,
  "parameters": {...}}` (`arguments` is read too), optionally after `<|python_tag|>`. A turn that starts with
  `{` is a call attempt; any other turn is a final answer. One call per turn, as Meta's template renders them.

Every parser is total: any string gives a list of actions, and text that tried to call a tool but cannot be read
is an `InvalidAction` carrying the reason, which the env turns into an error observation (never an exception).
`detect_tool_format` picks the format from a chat template's text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentgrad.registry import Registry
from agentgrad.rollout.parser import CLOSE, OPEN, call_from_json, parse_turn
from agentgrad.types import Action, FinalAnswer, InvalidAction, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolFormat:
    """How one template family writes tool calls. `parse` reads a turn's text; `content` is the assistant
    message's `content` for that turn (what the template would render back before the calls); `call_open` is the
    text that opens a call, which tool-name masks and the factored head key on (None: they are unavailable)."""

    name: str
    parse: Callable[[str], list[Action]]
    content: Callable[[str, Sequence[Action]], str]
    call_open: str | None
    description: str


TOOL_FORMATS: Registry[ToolFormat] = Registry("tool-call format")


def _has_calls(actions: Sequence[Action]) -> bool:
    return any(isinstance(a, ToolCall) for a in actions)


def _hermes_content(text: str, actions: Sequence[Action]) -> str:
    return text.split(OPEN)[0].strip() if _has_calls(actions) else text


TOOL_FORMATS.add("hermes", ToolFormat("hermes", parse_turn, _hermes_content, OPEN,
                                      "Qwen2.5 / Hermes: <tool_call>{json}</tool_call> blocks"))


def split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """(reasoning or None, the text after it, whether the think block is unterminated).

    >>> split_reasoning('<think>\\nadd them\\n</think>\\n\\n42')
    ('add them', '42', False)
    >>> split_reasoning('42')
    (None, '42', False)
    """
    if THINK_CLOSE in text:
        head, _, rest = text.partition(THINK_CLOSE)
        return head.split(THINK_OPEN)[-1].strip("\n"), rest.lstrip("\n"), False
    if text.lstrip().startswith(THINK_OPEN):
        return text.lstrip()[len(THINK_OPEN):].strip("\n"), "", True
    return None, text, False


def parse_qwen3(text: str) -> list[Action]:
    """Actions in a Qwen3 turn: the `<tool_call>` blocks after the think block, or the answer after it.

    >>> parse_qwen3('<think>\\n\\n</think>\\n\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    [ToolCall(name='f', arguments={'x': 1})]
    >>> parse_qwen3('<think>\\nmaybe <tool_call> here?\\n</think>\\n\\nThe answer is 3.')
    [FinalAnswer(text='The answer is 3.')]
    """
    _, rest, unterminated = split_reasoning(text)
    if unterminated:
        return [InvalidAction(text, f"unterminated think block: the turn ended before '{THINK_CLOSE}'")]
    return parse_turn(rest)


def _qwen3_content(text: str, actions: Sequence[Action]) -> str:
    if not _has_calls(actions):
        return text
    _, rest, _ = split_reasoning(text)
    return (text[:len(text) - len(rest)] + rest.split(OPEN)[0]).strip()


TOOL_FORMATS.add("qwen3", ToolFormat("qwen3", parse_qwen3, _qwen3_content, OPEN,
                                     "Qwen3: an optional <think> block, then <tool_call>{json}</tool_call> blocks"))


def parse_llama3_json(text: str) -> list[Action]:
    """The action of a Llama 3 JSON tool-calling turn: one call, or the final answer.

    >>> parse_llama3_json('{"name": "calculator", "parameters": {"expression": "1+2"}}')
    [ToolCall(name='calculator', arguments={'expression': '1+2'})]
    >>> parse_llama3_json('The answer is 3.')
    [FinalAnswer(text='The answer is 3.')]
    """
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return [FinalAnswer(text=text.strip())]
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, over-long integers, absurd nesting
        return [InvalidAction(text, f"tool call is not valid JSON ({exc.__class__.__name__}: {exc})"[:300])]
    rest = body[end:].strip()
    if rest.startswith((";", "{")):
        return [InvalidAction(text, "one tool call per turn: the Llama 3 JSON format has no multiple calls")]
    if rest:
        return [InvalidAction(text, "text after the tool call's JSON object")]
    return [call_from_json(obj, text)]


def _llama3_content(text: str, actions: Sequence[Action]) -> str:
    return "" if _has_calls(actions) else text


TOOL_FORMATS.add("llama3_json", ToolFormat("llama3_json", parse_llama3_json, _llama3_content, None,
                                           'Llama 3.x JSON: the turn is {"name": ..., "parameters": {...}}'))


def detect_tool_format(template: str | None) -> str:
    """The format a chat template writes calls in, read off its text; `hermes` when it shows none."""
    text = template or ""
    if OPEN in text and CLOSE in text:
        return "qwen3" if THINK_OPEN in text else "hermes"
    if '"parameters"' in text or PYTHON_TAG in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def tool_format(name: str, template: str | None = None) -> ToolFormat:
    """The registered format `name`, or the template's own for `auto`."""
    return TOOL_FORMATS.get(detect_tool_format(template) if name == "auto" else name)
