"""`Wrapper`: the base for env wrappers (Gymnasium's `gymnasium.Wrapper`, without spaces).

A wrapper changes one thing and hides nothing: `reset`, `step` and `legal_actions` pass through unless a
subclass overrides them, and every other attribute (`tools`, `history`, a suite's own fields ...) is read from
the wrapped env. `unwrapped` is the innermost env, however many wrappers are stacked. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentgrad.envs.base import ActionMask, Env, StepResult, close_env
from agentgrad.types import Action


class Wrapper:
    def __init__(self, env: Env) -> None:
        self.env = env

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Action) -> StepResult:
        return self.env.step(action)

    def legal_actions(self) -> ActionMask:
        return self.env.legal_actions()

    def close(self) -> None:
        close_env(self.env)

    @property
    def unwrapped(self) -> Env:
        env = self.env
        return env.unwrapped if isinstance(env, Wrapper) else env

    def __getattr__(self, name: str) -> Any:
        # Only called for names this wrapper lacks. `env` itself is looked up in __dict__ first; guarding it stops
        # infinite recursion when it is not set yet (e.g. during unpickling, before __init__ has run).
        if name == "env" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.env, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{self.env!r}>"
