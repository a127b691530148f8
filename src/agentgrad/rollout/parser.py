"""Parse a policy turn's text into one or more actions (Hermes / Qwen2.5 `<tool_call>{json}</tool_call>`; the
other formats, and the registry that picks one per chat template, are in rollout/formats.py).

Total: any string parses to a list of actions; text that tried to call a tool but failed becomes an
`InvalidAction` carrying the reason, which the env turns into an error observation.
"""

from __future__ import annotations

import json
from typing import Any

from agentgrad.types import Action, FinalAnswer, InvalidAction, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS_PER_TURN = 8


def _to_call(body: str, raw: str) -> Action:
    try:
        obj: Any = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, over-long integers, absurd nesting
        return InvalidAction(raw, f"tool call is not valid JSON ({exc.__class__.__name__}: {exc})"[:300])
    return call_from_json(obj, raw)


def call_from_json(obj: Any, raw: str) -> Action:
    """A decoded call object `{"name": ..., "arguments" (or "parameters"): {...}}` as an action; `raw` is the
    text it came from, kept on an InvalidAction."""
    if not isinstance(obj, dict):
        return InvalidAction(raw, "tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return InvalidAction(raw, "tool call needs a non-empty string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI-style arguments serialised as a string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return InvalidAction(raw, "tool call 'arguments' string is not valid JSON")
    if not isinstance(args, dict):
        return InvalidAction(raw, "tool call 'arguments' must be a JSON object")
    return ToolCall(name=name, arguments=args)


def parse_turn(text: str) -> list[Action]:
    """Actions in one assistant turn: the tool calls in order, or a single FinalAnswer when there are none.

    >>> parse_turn('<tool_call>\\n{"name": "calculator", "arguments": {"expression": "1+2"}}\\n</tool_call>')
    [ToolCall(name='calculator', arguments={'expression': '1+2'})]
    >>> parse_turn('The answer is 3.')
    [FinalAnswer(text='The answer is 3.')]
    """
    if OPEN not in text and CLOSE not in text:
        return [FinalAnswer(text=text.strip())]
    actions: list[Action] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        stray_close = text.find(CLOSE, pos)
        if start < 0:
            if stray_close >= 0:
                actions.append(InvalidAction(text[pos:], f"'{CLOSE}' without a matching '{OPEN}'"))
            break
        if 0 <= stray_close < start:
            actions.append(InvalidAction(text[pos:start], f"'{CLOSE}' without a matching '{OPEN}'"))
        end = text.find(CLOSE, start)
        if end < 0:
            actions.append(InvalidAction(text[start:], f"unterminated tool call: '{OPEN}' without '{CLOSE}'"))
            break
        body = text[start + len(OPEN):end]
        raw = text[start:end + len(CLOSE)]
        if OPEN in body:
            actions.append(InvalidAction(raw, f"nested '{OPEN}' tags"))
        else:
            actions.append(_to_call(body.strip(), raw))
        pos = end + len(CLOSE)
        if len(actions) >= MAX_CALLS_PER_TURN:
            actions.append(InvalidAction(text[pos:], f"more than {MAX_CALLS_PER_TURN} tool calls in one turn"))
            break
    return actions
