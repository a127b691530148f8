"""ToolEnv: the generic environment of a task suite: tools to call, a verifier for the final answer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentgrad.envs.base import ActionMask
from agentgrad.tools.base import Tool, ToolResult, ToolSet
from agentgrad.types import Action, FinalAnswer, InvalidAction, Task, ToolCall


class ToolEnv:
    """Observation after reset is the task prompt; a tool call's observation is the tool's text (or a typed
    error); a final answer terminates with reward 1.0 if `verify(task, answer)` else 0.0."""

    def __init__(self, tools: ToolSet, verify: Callable[[Task, str | None], bool], *, system_prompt: str = "",
                 on_tool_result: Callable[[ToolCall, ToolResult], None] | None = None) -> None:
        self._served: tuple[Tool, ...] = ()
        self.tools = tools
        self.verify = verify
        self.system_prompt = system_prompt
        self._on_tool_result = on_tool_result
        self._task: Task | None = None
        self._done = True
        self.history: list[Action] = []

    @property
    def tools(self) -> ToolSet:
        """The tools this env offers: its suite's, with any `serve_tools` on top."""
        return self._tools

    @tools.setter
    def tools(self, tools: ToolSet) -> None:
        self._own = tools
        self._tools = tools.overlaid(self._served) if self._served else tools

    def serve_tools(self, tools: Sequence[Tool]) -> None:
        """Offer `tools` too, from now on and after every reset (an env whose tools change per task keeps them):
        one named like a suite tool replaces it, schema and all (e.g. a calculator an MCP server serves)."""
        self._served = tuple(tools)
        self.tools = self._own

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        task = (options or {}).get("task")
        if not isinstance(task, Task):
            raise ValueError("ToolEnv.reset needs options={'task': Task(...)}")
        self._task = task
        self._done = False
        self.history = []
        return task.prompt, {"tools": self.prompt_schemas(), "system": self.system_prompt, "task_id": task.task_id}

    def prompt_schemas(self) -> list[dict[str, Any]]:
        """The tool schemas the prompt lists (`info["tools"]` after reset): every tool's, unless a suite lists
        fewer."""
        return self.tools.schemas()

    def close(self) -> None:
        """Nothing to release: the tools belong to the suite (shared by its envs), which closes them."""
        self._done = True

    def legal_actions(self) -> ActionMask:
        cats = self.tools.categories()
        return ActionMask(categories=frozenset(cats), tools=frozenset(self.tools.names))

    def step(self, action: Action) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done or self._task is None:
            raise RuntimeError("episode is over; call reset() first")
        self.history.append(action)
        if isinstance(action, FinalAnswer):
            self._done = True
            correct = self.verify(self._task, action.text)
            return "", 1.0 if correct else 0.0, True, False, {"correct": correct, "success": correct}
        if isinstance(action, InvalidAction):
            obs = f"error (bad_arguments): invalid tool call: {action.error}"
            return obs, 0.0, False, False, {"tool_ok": False, "tool_error": "bad_arguments", "signals": {}}
        if self.tools.get(action.name) is not None and not self.legal_actions().allows(action):
            # a known tool the mask excludes; an unknown one falls through to the toolset's `not_found` error
            obs = f"error (denied): tool {action.name!r} is not available in this state"
            return obs, 0.0, False, False, {"tool_ok": False, "tool_error": "denied", "signals": {}}
        result = self.tools.call(action)
        if self._on_tool_result is not None:
            self._on_tool_result(action, result)
        info = {"tool_ok": result.ok, "tool_error": result.error_kind.value if result.error_kind else None,
                "signals": dict(result.signals)}
        return result.text, 0.0, False, False, info
