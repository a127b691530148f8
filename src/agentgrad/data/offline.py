"""Offline agent logs (OpenAI chat format with tool calls, one episode per JSONL line) <-> trajectories.

Expected line shape (fields other than `messages` are optional):

    {"messages": [
        {"role": "system", "content": "Use the calculator, then answer with the number."},
        {"role": "user", "content": "12 + 34 = ?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "calculator", "arguments": "{\"expression\": \"12 + 34\"}"}}],
         "logprobs": [-0.01, -0.20, ...]},
        {"role": "tool", "tool_call_id": "c1", "content": "46"},
        {"role": "assistant", "content": "46", "logprobs": {"content": [{"token": "4", "logprob": -0.1}, ...]}}],
     "tools": [{"type": "function", "function": {"name": "calculator", ...}}],
     "task": {"task_id": "a-17", "answer": "46"},
     "reward": 1.0, "success": true}

Encoding is token-in/token-out through the same `ChatCodec` calls a rollout makes: the prompt (every message
before the first assistant one) with `prompt_ids`, each assistant message with `assistant_ids` (loss mask 1),
the tool messages that follow it with `observation_ids` (loss mask 0). So an imported episode has exactly the
ids the policy would have had to generate, and the ids the loop appends for observations.

Behaviour logprobs: an assistant message's `logprobs` is either a list of floats or OpenAI's
`{"content": [{"token", "logprob"}, ...]}`, one entry per token *of our tokenisation of that turn* (its eos
included). When any assistant turn lacks them, or their count does not match (another tokenizer wrote the
log), `encode_episode` says so and the importer rescores the episode (`pipelines/data.py`). No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentgrad.types import FinalAnswer, Message, StopReason, Task, ToolCall, Trajectory, Turn


class LogFormatError(ValueError):
    """A log line that is not an OpenAI-format chat episode; the message says which line and why."""


class Codec(Protocol):
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]: ...

    def assistant_ids(self, message: Message) -> list[int]: ...

    def observation_ids(self, tool_messages: Sequence[Message]) -> list[int]: ...


@dataclass(frozen=True)
class ParsedEpisode:
    """One log line, validated: the chat as our `Message`s plus what the log says about it."""

    task: Task
    messages: tuple[Message, ...]
    tools: tuple[dict, ...] | None
    assistant_logprobs: tuple[tuple[float, ...] | None, ...]
    """Per assistant message, in order: the logged logprobs, or None."""
    reward: float | None = None
    success: bool | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def _logprob_list(raw: Any, where: str) -> tuple[float, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        raw = [entry["logprob"] for entry in raw.get("content") or []]
    if not isinstance(raw, list) or not all(isinstance(x, (int, float)) for x in raw):
        raise LogFormatError(f"{where}: logprobs must be a list of numbers or {{'content': [{{'logprob': ..}}]}}")
    return tuple(float(x) for x in raw)


def _tool_call(raw: Mapping[str, Any], where: str) -> ToolCall:
    fn = raw.get("function", raw)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise LogFormatError(f"{where}: tool call arguments are not JSON: {exc}") from None
    if "name" not in fn or not isinstance(args, dict):
        raise LogFormatError(f"{where}: a tool call needs a name and an arguments object")
    return ToolCall(fn["name"], args)


def parse_line(data: Mapping[str, Any], line_no: int) -> ParsedEpisode:
    where = f"line {line_no}"
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise LogFormatError(f"{where}: expected a non-empty 'messages' list")
    messages, logprobs = [], []
    for i, m in enumerate(raw_messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise LogFormatError(f"{where}, message {i}: unknown role {role!r}")
        calls = tuple(_tool_call(c, f"{where}, message {i}") for c in m.get("tool_calls") or [])
        messages.append(Message(role, m.get("content") or "", tool_calls=calls))
        if role == "assistant":
            logprobs.append(_logprob_list(m.get("logprobs"), f"{where}, message {i}"))
    if not logprobs:
        raise LogFormatError(f"{where}: no assistant message to learn from")
    task_raw = data.get("task") or {}
    first_user = next((m.content for m in messages if m.role == "user"), "")
    task = Task(task_id=str(task_raw.get("task_id", f"import-{line_no}")), prompt=task_raw.get("prompt", first_user),
                answer=str(task_raw.get("answer", "")), suite=task_raw.get("suite", "custom"),
                metadata=task_raw.get("metadata", {}))
    reward = data.get("reward")
    return ParsedEpisode(task, tuple(messages), tuple(data["tools"]) if data.get("tools") else None, tuple(logprobs),
                         reward=None if reward is None else float(reward), success=data.get("success"))


def read_log(lines: Iterable[str]) -> Iterator[ParsedEpisode | LogFormatError]:
    """Parse a JSONL log; a bad line yields its LogFormatError (to be counted) instead of stopping the import."""
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield parse_line(json.loads(line), n)
        except json.JSONDecodeError as exc:
            yield LogFormatError(f"line {n}: not JSON: {exc}")
        except LogFormatError as exc:
            yield exc


def encode_episode(ep: ParsedEpisode, codec: Codec, default_tools: Sequence[dict] | None = None
                   ) -> tuple[Trajectory, bool]:
    """The episode as a Trajectory; the bool says whether every assistant turn had matching logged logprobs
    (if not, `logprobs` are zeros on policy tokens and must be rescored)."""
    msgs = list(ep.messages)
    first = next(i for i, m in enumerate(msgs) if m.role == "assistant")
    tools = list(ep.tools) if ep.tools is not None else (list(default_tools) if default_tools else None)
    ids = codec.prompt_ids(msgs[:first], tools)
    mask, lps = [0] * len(ids), [0.0] * len(ids)
    prompt_length = len(ids)
    turns: list[Turn] = []
    complete = True
    k, i = 0, first
    stop = StopReason.MAX_TURNS
    while i < len(msgs):
        m = msgs[i]
        if m.role != "assistant":
            raise LogFormatError(f"task {ep.task.task_id}: a {m.role} message where an assistant turn was expected")
        turn_ids = codec.assistant_ids(m)
        logged = ep.assistant_logprobs[k]
        ok = logged is not None and len(logged) == len(turn_ids)
        complete &= ok
        start = len(ids)
        ids += turn_ids
        mask += [1] * len(turn_ids)
        lps += list(logged) if ok else [0.0] * len(turn_ids)
        j = i + 1
        while j < len(msgs) and msgs[j].role == "tool":
            j += 1
        observations = msgs[i + 1:j]
        if m.tool_calls and not observations and j == len(msgs):
            stop = StopReason.ENV_TERMINATED  # the env ended the episode on this call (a game won): no tool reply
        text = m.content
        if m.tool_calls:
            for c, call in enumerate(m.tool_calls):
                obs = observations[c].content if c < len(observations) else None
                turns.append(Turn(start if c == 0 else len(ids), len(ids), text, call, obs))
        else:
            turns.append(Turn(start, len(ids), text, FinalAnswer(text), None))
            stop = StopReason.ANSWERED
        if observations:
            obs_ids = codec.observation_ids(observations)
            ids += obs_ids
            mask += [0] * len(obs_ids)
            lps += [0.0] * len(obs_ids)
        i, k = j, k + 1
        if stop is StopReason.ANSWERED:
            break
    final_info = {"success": ep.success} if ep.success is not None and stop is not StopReason.MAX_TURNS else {}
    traj = Trajectory(task=ep.task, token_ids=tuple(ids), loss_mask=tuple(mask), logprobs=tuple(lps),
                      prompt_length=prompt_length, turns=tuple(turns), stop_reason=stop, messages=tuple(msgs[:i]),
                      final_info=final_info)
    return traj, complete


def to_chat_line(traj: Trajectory, *, reward: float | None = None, success: bool | None = None,
                 tools: Sequence[dict] | None = None) -> dict[str, Any]:
    """A trajectory as a log line of the format above, with per-turn logprobs (the inverse of the import for
    episodes whose generated text is in the template's canonical form)."""
    spans = [(t.start, t.end) for t in traj.turns if t.end > t.start]
    out_msgs, k = [], 0
    for m in traj.messages:
        d = m.to_chat()
        if m.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                                 "arguments": json.dumps(dict(c.arguments))}}
                               for c in m.tool_calls]
        if m.role == "assistant" and k < len(spans):
            s, e = spans[k]
            d["logprobs"] = list(traj.logprobs[s:e])
            k += 1
        out_msgs.append(d)
    line: dict[str, Any] = {"messages": out_msgs,
                            "task": {"task_id": traj.task.task_id, "prompt": traj.task.prompt,
                                     "answer": traj.task.answer, "suite": traj.task.suite}}
    if tools:
        line["tools"] = list(tools)
    if reward is not None:
        line["reward"] = reward
    if success is not None:
        line["success"] = success
    return line

