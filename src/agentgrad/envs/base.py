"""Env protocol (Gymnasium conventions), action masks, task suites, and `check_env`.

Environments see actions and text, never tokens or groups. They are deterministic given
(task, seed, action history), so tree search can restore any node by replaying its actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from agentgrad.registry import Registry
from agentgrad.types import Action, FinalAnswer, InvalidAction, Task, ToolCall


@dataclass(frozen=True)
class ActionMask:
    """Which categories and tools are legal in the current state. `final_answer` says whether answering is."""

    categories: frozenset[str]
    tools: frozenset[str]
    final_answer: bool = True

    def allows(self, action: Action) -> bool:
        if isinstance(action, ToolCall):
            return action.name in self.tools
        if isinstance(action, FinalAnswer):
            return self.final_answer
        return True  # invalid text is always "legal": it earns an error observation


StepResult = tuple[str, float, bool, bool, dict[str, Any]]  # observation, reward, terminated, truncated, info


@runtime_checkable
class Env(Protocol):
    """One episode at a time. `reset` takes the task in options; `step` takes exactly one parsed action.

    Observations are text: the task prompt after reset, the tool's result after a tool call.
    `info` after reset holds "tools" (JSON schemas) and "system" (the system prompt); after a step,
    "tool_ok", "tool_error" and "signals" describe the tool call.
    """

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: Action) -> StepResult: ...

    def legal_actions(self) -> ActionMask: ...


@runtime_checkable
class TaskSuite(Protocol):
    """A family of tasks: a generator, an expert that writes demonstrations, a verifier, and an env factory."""

    name: str

    def sample_tasks(self, n: int, *, split: str, seed: int) -> list[Task]: ...

    def expert_actions(self, task: Task) -> list[Action]: ...

    def verify(self, task: Task, answer: str | None) -> bool: ...

    def make_env(self) -> Env: ...


# Factories taking the suite's options (a plain mapping from config `env.options`).
SUITES: Registry[Any] = Registry("task suite", plugins=True, entry_point_group="agentgrad.suites")


class EnvCheckError(AssertionError):
    pass


def check_env(env: Env, task: Task, *, seed: int = 0, actions: Sequence[Action] = ()) -> None:
    """Check an env against the protocol and its promises, in the spirit of Gymnasium's `check_env`.

    Checks: reset returns (str, dict) with tools; the same seed and actions replay to the same observations;
    malformed and unknown-tool actions become error observations (no exception, not terminated);
    a final answer terminates; stepping after termination raises. Raises EnvCheckError on failure.
    """

    def run(acts: Sequence[Action]) -> list[tuple]:
        obs, info = env.reset(seed=seed, options={"task": task})
        if not isinstance(obs, str) or not isinstance(info, dict):
            raise EnvCheckError(f"reset must return (str, dict), got ({type(obs).__name__}, {type(info).__name__})")
        if "tools" not in info:
            raise EnvCheckError("reset info must include 'tools' (the JSON schemas to render)")
        if not isinstance(env.legal_actions(), ActionMask):
            raise EnvCheckError("legal_actions() must return an ActionMask")
        trace: list[tuple] = [(obs,)]
        for a in acts:
            out = env.step(a)
            if not (isinstance(out, tuple) and len(out) == 5):
                raise EnvCheckError("step must return (observation, reward, terminated, truncated, info)")
            o, r, term, trunc, inf = out
            if not isinstance(o, str) or not isinstance(r, (int, float)) or not isinstance(inf, dict):
                raise EnvCheckError("step returned values of the wrong types")
            if not isinstance(term, bool) or not isinstance(trunc, bool):
                raise EnvCheckError("terminated and truncated must be bools")
            trace.append((o, float(r), term, trunc))
            if term or trunc:
                break
        return trace

    probes: list[Action] = [
        InvalidAction(text="<tool_call>{not json", error="malformed JSON"),
        ToolCall(name="definitely_not_a_tool", arguments={}),
        *actions,
    ]
    first = run(probes)
    for o, _, term, _ in first[1:3]:
        if term:
            raise EnvCheckError("a malformed or unknown tool call must not terminate the episode")
        if "error" not in o.lower():
            raise EnvCheckError(f"a malformed or unknown tool call must yield an error observation, got {o!r}")
    if first != run(probes):
        raise EnvCheckError("env is not deterministic given (task, seed, action history)")
    run([])
    _, _, terminated, _, _ = env.step(FinalAnswer(text=""))
    if not terminated:
        raise EnvCheckError("a final answer must terminate the episode")
    try:
        env.step(FinalAnswer(text=""))
    except RuntimeError:
        pass
    else:
        raise EnvCheckError("step after termination must raise RuntimeError (call reset first)")
