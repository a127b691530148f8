"""Chaos testing: an Env wrapper that makes a fraction of tool calls time out or crash.

The failures look exactly like a real tool timeout or crash (a `tool_error` of "timeout" or "crashed" and an
error observation), so the pipeline's handling of real faults is what gets tested. Deterministic given the
seed and the order of calls, so a resumed run injects the same faults as an uninterrupted one. No torch.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from agentgrad.envs.base import ActionMask, Env, StepResult, close_env
from agentgrad.types import Action, ToolCall


class FaultInjectingEnv:
    def __init__(self, env: Env, rate: float, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {rate}")
        self.env = env
        self.rate = rate
        self._rng = random.Random(seed)
        self.injected = 0

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return self.env.reset(seed=seed, options=options)

    def legal_actions(self) -> ActionMask:
        return self.env.legal_actions()

    def close(self) -> None:
        close_env(self.env)

    def step(self, action: Action) -> StepResult:
        if isinstance(action, ToolCall) and self._rng.random() < self.rate:
            self.injected += 1
            kind = "timeout" if self._rng.random() < 0.5 else "crashed"
            message = "tool did not return within its time limit" if kind == "timeout" else "tool process died"
            return f"error ({kind}): {message}", 0.0, False, False, {"tool_ok": False, "tool_error": kind,
                                                                     "signals": {}}
        return self.env.step(action)
