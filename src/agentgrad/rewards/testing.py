"""Hand-built recorded trajectories, for testing reward functions without a model or an environment.

>>> traj = make_trajectory([tool_turn("search", {"query": "paris"}, results=3), answer_turn("Paris")])
>>> [type(t.action).__name__ for t in traj.turns], traj.final_answer, traj.stop_reason.value
(['ToolCall', 'FinalAnswer'], 'Paris', 'answered')
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentgrad.types import FinalAnswer, InvalidAction, Message, StopReason, Task, ToolCall, Trajectory, Turn

_TOKENS_PER_TURN = 2
_PROMPT_TOKENS = 3


def tool_turn(name: str, arguments: Mapping[str, Any] | None = None, *, ok: bool = True, error: str | None = None,
              observation: str = "ok", **signals: Any) -> Turn:
    """A tool-call turn as the agent loop records it (`start`/`end` are filled in by `make_trajectory`)."""
    if not ok and error is None:
        error = "crashed"
    return Turn(0, 0, "", ToolCall(name, dict(arguments or {})), observation, tool_ok=ok,
                tool_error=None if ok else error, signals=dict(signals))


def invalid_turn(text: str = "<tool_call>oops", error: str = "unparseable tool call") -> Turn:
    return Turn(0, 0, text, InvalidAction(text, error), f"error (bad_arguments): {error}", tool_ok=False,
                tool_error="bad_arguments")


def answer_turn(text: str) -> Turn:
    return Turn(0, 0, text, FinalAnswer(text), None)


def make_trajectory(turns: Sequence[Turn], *, task: Task | None = None, stop_reason: StopReason | None = None,
                    same_span: Sequence[int] = ()) -> Trajectory:
    """A consistent Trajectory around `turns`: each turn owns a fresh 2-token span, except the indices in
    `same_span` (later actions parsed from the previous turn's text, which own no tokens, as in the loop).

    `stop_reason` defaults to ANSWERED when the last turn is a final answer, else MAX_TURNS. Messages are
    rebuilt from the turns so that judges can render a transcript.
    """
    task = task or Task("t0", "What is the capital of France?", "Paris")
    ids: list[int] = list(range(_PROMPT_TOKENS))
    mask: list[int] = [0] * _PROMPT_TOKENS
    out: list[Turn] = []
    messages: list[Message] = [Message("user", task.prompt)]
    for i, turn in enumerate(turns):
        if i in same_span and out:
            start = end = len(ids)
        else:
            start = len(ids)
            ids += [10 + i] * _TOKENS_PER_TURN
            mask += [1] * _TOKENS_PER_TURN
            end = len(ids)
        a = turn.action
        text = turn.text or (a.text if isinstance(a, FinalAnswer) else
                             "<tool_call>"
                             f"{json.dumps({'name': a.name, 'arguments': dict(a.arguments)}, default=str)}</tool_call>"
                             if isinstance(a, ToolCall) else a.text)
        out.append(Turn(start, end, text, a, turn.observation, tool_ok=turn.tool_ok, tool_error=turn.tool_error,
                        signals=turn.signals, env_reward=turn.env_reward))
        if isinstance(a, ToolCall):
            messages.append(Message("assistant", "", tool_calls=(a,)))
        else:
            messages.append(Message("assistant", text))
        if turn.observation is not None and not isinstance(a, FinalAnswer):
            messages.append(Message("tool", turn.observation))
            ids += [1] * 2  # observation tokens
            mask += [0] * 2
    if stop_reason is None:
        stop_reason = (StopReason.ANSWERED if out and isinstance(out[-1].action, FinalAnswer)
                       else StopReason.MAX_TURNS)
    return Trajectory(task=task, token_ids=tuple(ids), loss_mask=tuple(mask), logprobs=(0.0,) * len(ids),
                      prompt_length=_PROMPT_TOKENS, turns=tuple(out), stop_reason=stop_reason,
                      messages=tuple(messages))
