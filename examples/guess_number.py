"""An outside game as a task suite: the env owns the outcome (a won game ends the episode, no answer step).

`NumberGame` stands for a game you did not write (a TextArena-style text game with its own `reset` / `step`
API and its own idea of winning); `GuessNumberEnv` adapts it to agentgrad's Gymnasium-style protocol, and
`GuessNumberSuite` adds tasks, an expert (binary search) and the rollout limits the game needs.

Check it, then train on it, from the repository root (docs/your-own-env.md):

    agentgrad check env=examples.guess_number:GuessNumberSuite
    agentgrad train env=examples.guess_number:GuessNumberSuite

Standard library and agentgrad's env/tool modules only (no torch), as every env.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentgrad.envs import ActionMask
from agentgrad.envs.tasks import split_of, stream_rng
from agentgrad.tools import ToolSet, tool
from agentgrad.types import Action, FinalAnswer, InvalidAction, Task, ToolCall

# ---- the outside game: its own API, its own rules -----------------------------------------------------------

class NumberGame:
    """Guess a secret integer in [low, high]; after each guess the game says higher or lower.
    `step` takes the player's text ("[17]") and returns (done, message); `won` says how it ended."""

    def __init__(self, low: int, high: int, secret: int, max_guesses: int) -> None:
        self.low, self.high, self.secret, self.max_guesses = low, high, secret, max_guesses
        self.guesses = 0
        self.done = self.won = False

    def step(self, text: str) -> tuple[bool, str]:
        found = re.fullmatch(r"\s*\[(-?\d+)\]\s*", text)
        if found is None:
            return False, "Invalid move: write your guess as [number]."
        guess = int(found.group(1))
        self.guesses += 1
        if guess == self.secret:
            self.done = self.won = True
            return True, f"Correct! The number was {self.secret}."
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        if self.guesses >= self.max_guesses:
            self.done = True
            return True, f"Out of guesses. The number was {self.secret}."
        return False, f"{guess} is too {'low' if guess < self.secret else 'high'}; it is in {self.low}..{self.high}."


# ---- the adapter: the game behind agentgrad's Env protocol --------------------------------------------------

@tool(category="game")
def guess(number: int) -> str:
    """Guess the secret number.

    Args:
        number: your guess
    """
    raise NotImplementedError  # the schema is what matters: GuessNumberEnv plays the call in its game


SYSTEM_PROMPT = "Find the number with guess calls."


class GuessNumberEnv:
    """reset(options={"task": Task}) starts a game; a `guess` call is one move. The game, not a verifier, says
    who won: a win or the last guess ends the episode (`terminated`) with `info["success"]` and reward 1 or 0.
    Answering is not a move (the mask forbids it; a final answer anyway forfeits the game)."""

    def __init__(self, max_guesses: int) -> None:
        self.max_guesses = max_guesses
        self.tools = ToolSet([guess])  # schemas for the prompt (and the factored head's catalog)
        self._game: NumberGame | None = None

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        task = (options or {}).get("task")
        if not isinstance(task, Task):
            raise ValueError("GuessNumberEnv.reset needs options={'task': Task(...)}")
        # The game is deterministic given the task (the secret is in it), so `seed` changes nothing.
        self._game = NumberGame(1, int(task.metadata["high"]), int(task.answer), self.max_guesses)
        return task.prompt, {"tools": self.tools.schemas(), "system": SYSTEM_PROMPT, "task_id": task.task_id}

    def legal_actions(self) -> ActionMask:
        return ActionMask(categories=frozenset({"game"}), tools=frozenset({"guess"}), final_answer=False)

    def step(self, action: Action) -> tuple[str, float, bool, bool, dict[str, Any]]:
        game = self._game
        if game is None or game.done:
            raise RuntimeError("episode is over; call reset() first")
        if isinstance(action, FinalAnswer):
            game.done = True
            return "", 0.0, True, False, {"success": False, "guesses": game.guesses, "forfeit": True}
        if isinstance(action, InvalidAction):
            return (f"error (bad_arguments): invalid tool call: {action.error}", 0.0, False, False,
                    {"tool_ok": False, "tool_error": "bad_arguments", "signals": {}})
        if action.name != "guess":
            return (f"error (not_found): unknown tool {action.name!r}; available: guess", 0.0, False, False,
                    {"tool_ok": False, "tool_error": "not_found", "signals": {}})
        number = action.arguments.get("number")
        if isinstance(number, bool) or not isinstance(number, int):
            return ("error (bad_arguments): number must be an integer", 0.0, False, False,
                    {"tool_ok": False, "tool_error": "bad_arguments", "signals": {}})
        done, message = game.step(f"[{number}]")
        info = {"tool_ok": True, "tool_error": None, "signals": {"guesses": game.guesses}}
        if done:
            info |= {"success": game.won, "guesses": game.guesses}
            return message, 1.0 if game.won else 0.0, True, False, info
        return message, 0.0, False, False, info

    def close(self) -> None:
        self._game = None


class GuessNumberSuite:
    """Secrets in 1..high for high in [min_high, max_high]. The prompt shows the range, not the secret, so many
    tasks share a prompt: tasks are told apart (and split) by (high, secret), and evaluation counts them by
    content. The expert plays binary search, which wins within ceil(log2(high + 1)) guesses."""

    name = "guess-number"
    success_from = "env"  # the game says who won; there is no answer to verify
    # Limits this game needs instead of the defaults (sized for two-turn arithmetic): up to 6 guesses of
    # ~20 tokens each, and the observations between them.
    config_defaults = {"rollout": {"max_turns": 7, "max_total_tokens": 448}}

    def __init__(self, min_high: int = 8, max_high: int = 63, max_guesses: int = 7) -> None:
        if not 2 <= min_high <= max_high or max_high.bit_length() > max_guesses:
            raise ValueError("need 2 <= min_high <= max_high and enough guesses for binary search")
        self.min_high, self.max_high, self.max_guesses = min_high, max_high, max_guesses

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        rng = stream_rng(self.name, split, seed, self.min_high, self.max_high)
        tasks: list[Task] = []
        while len(tasks) < n:
            high = rng.randint(self.min_high, self.max_high)
            secret = rng.randint(1, high)
            if split_of(f"{high}:{secret}") != split:  # the split follows the game, not the (shared) prompt
                continue
            tasks.append(Task(task_id=f"guess-{split}-{seed}-{len(tasks)}",
                              prompt=f"I picked a number from 1 to {high}.", answer=str(secret), suite=self.name,
                              metadata={"high": high}))
        return tasks

    def expert_actions(self, task: Task) -> list[Action]:
        low, high, secret = 1, int(task.metadata["high"]), int(task.answer)
        actions: list[Action] = []
        while True:
            mid = (low + high) // 2
            actions.append(ToolCall("guess", {"number": mid}))
            if mid == secret:
                return actions
            low, high = (mid + 1, high) if mid < secret else (low, mid - 1)

    def verify(self, task: Task, answer: str | None) -> bool:
        # Not used for success (success_from = "env"); kept so the suite follows the protocol.
        return (answer or "").strip() == task.answer

    def make_env(self) -> GuessNumberEnv:
        return GuessNumberEnv(self.max_guesses)


if __name__ == "__main__":
    from agentgrad.envs import check_suite

    report = check_suite(GuessNumberSuite())
    print({k: v for k, v in report.items() if k != "episodes"})
