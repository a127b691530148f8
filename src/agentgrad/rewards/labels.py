"""Human-labelled examples for judge calibration: a JSONL file whose records become `Trajectory`s, the one thing
a judge reads.

A record is {"prompt", "response", "reference"?, "transcript"?} or {"trajectory": <a store record, or a
transcript string>} (whose "prompt", "response" and "reference" keys, when given, win over the trajectory's),
plus its "label" (0 or 1, "fail" or "pass"). A labelled trajectory carries text only (no tokens): the task, the
final answer as its one turn, and the messages a transcript is rendered from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrad.types import (
    FinalAnswer,
    Message,
    StopReason,
    Task,
    ToolCall,
    Trajectory,
    Turn,
)

_TRANSCRIPT_LINE = re.compile(r"(system|user|assistant|tool): ?(.*)", re.DOTALL)


class CalibrationError(ValueError):
    """The labels cannot calibrate a judge (malformed file, too few examples, a single class)."""


@dataclass(frozen=True)
class LabelledExample:
    trajectory: Trajectory
    label: int
    line: int


def _tool_call(call: Mapping[str, Any]) -> ToolCall:
    """A tool call of a stored message: our own record ({"name", "arguments"}) or OpenAI's ({"function": ...},
    arguments as a JSON string)."""
    fn = call.get("function", call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return ToolCall(str(fn.get("name")), args if isinstance(args, dict) else {"arguments": args})


def _message(m: Mapping[str, Any]) -> Message:
    calls = tuple(_tool_call(c) for c in m.get("tool_calls") or [] if isinstance(c, Mapping))
    return Message(str(m.get("role", "?")), m.get("content") or "", tool_calls=calls)


def transcript_messages(text: str) -> tuple[Message, ...]:
    """The messages of a transcript in `render_transcript`'s form ("role: text" lines; a line without a role
    continues the message before it), so that rendering them gives the transcript back."""
    messages: list[Message] = []
    for line in text.splitlines():
        m = _TRANSCRIPT_LINE.fullmatch(line)
        if m:
            messages.append(Message(m.group(1), m.group(2)))
        elif messages:
            messages[-1] = Message(messages[-1].role, messages[-1].content + "\n" + line)
        else:
            messages.append(Message("user", line))
    return tuple(messages)


def _stored_answer(traj: Mapping[str, Any]) -> str | None:
    """The final answer of a stored trajectory: its last FinalAnswer turn, else its last plain assistant message."""
    for turn in reversed(traj.get("turns") or []):
        action = turn.get("action") if isinstance(turn, Mapping) else None
        if isinstance(action, Mapping) and action.get("__type__") == "FinalAnswer":
            return action.get("text")
    for m in reversed(traj.get("messages") or []):
        if isinstance(m, Mapping) and m.get("role") == "assistant" and m.get("content") and not m.get("tool_calls"):
            return m["content"]
    return traj.get("final_answer") or traj.get("response")


def text_trajectory(task: Task, answer: str | None, messages: tuple[Message, ...] = ()) -> Trajectory:
    """A trajectory of text only: no tokens, the final answer (if any) as its one turn."""
    turns = (Turn(0, 0, answer, FinalAnswer(answer), None),) if answer is not None else ()
    return Trajectory(task=task, token_ids=(), loss_mask=(), logprobs=(), prompt_length=0, turns=turns,
                      stop_reason=StopReason.ANSWERED if turns else StopReason.MAX_TURNS, messages=messages)


def labelled_trajectory(record: Mapping[str, Any]) -> Trajectory:
    """The trajectory a labelled record describes (see the module docstring); ValueError/TypeError if none."""
    traj = record.get("trajectory")
    if isinstance(traj, Mapping) and isinstance(traj.get("trajectory"), Mapping):
        traj = traj["trajectory"]  # a ScoredTrajectory record from the store
    if traj is None and ("prompt" not in record or "response" not in record):
        raise ValueError("a judge record needs 'trajectory', or 'prompt' and 'response'")
    if traj is not None and not isinstance(traj, (str, Mapping)):
        raise TypeError(f"'trajectory' must be an object or a string, got {type(traj).__name__}")
    stored = traj if isinstance(traj, Mapping) else {}
    task = stored.get("task") if isinstance(stored.get("task"), Mapping) else {}
    prompt = record.get("prompt") or task.get("prompt") or stored.get("prompt") or ""
    response = record.get("response") or (_stored_answer(stored) if stored else None)
    reference = record.get("reference", task.get("answer"))
    if isinstance(traj, str):
        messages = transcript_messages(traj)
    elif stored:
        messages = tuple(_message(m) for m in stored.get("messages") or [] if isinstance(m, Mapping))
    else:
        messages = transcript_messages(record["transcript"]) if record.get("transcript") else ()
    return text_trajectory(Task("labelled", str(prompt), "" if reference is None else str(reference)),
                           None if response is None else str(response), messages)


def _label(value: Any, line: int, path: Path) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in ("0", "1", "pass", "fail"):
        return 1 if value.strip().lower() in ("1", "pass") else 0
    raise CalibrationError(f"{path}:{line}: label must be 0 or 1, got {value!r}")


def load_labels(path: str | Path) -> list[LabelledExample]:
    """Read a labels JSONL file. Raises CalibrationError with the line number of the first bad record."""
    path = Path(path)
    if not path.exists():
        raise CalibrationError(f"labels file {path} does not exist")
    out = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise CalibrationError(f"{path}:{n}: not JSON: {exc}") from None
            if not isinstance(rec, dict) or "label" not in rec:
                raise CalibrationError(f"{path}:{n}: each line must be an object with a 'label'")
            try:
                trajectory = labelled_trajectory(rec)
            except (ValueError, TypeError) as exc:
                raise CalibrationError(f"{path}:{n}: {exc}") from None
            out.append(LabelledExample(trajectory, _label(rec["label"], n, path), n))
    return out
