"""Arithmetic suite: multi-digit, multi-step expressions a tiny model cannot do in its head.

The expert copies the expression into the calculator, then copies the result into its answer. Train and
held-out tasks come from disjoint seed streams, so held-out success measures generalisation.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from agentgrad.envs.base import SUITES
from agentgrad.envs.tool_env import ToolEnv
from agentgrad.tools.base import ToolSet
from agentgrad.tools.calculator import calculator, evaluate
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

SYSTEM_PROMPT = "Use the calculator, then answer with the number."
_SPLIT_OFFSET = {"train": 0, "heldout": 1_000_003, "test": 2_000_003}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class ArithmeticOptions:
    min_operands: int = 2
    max_operands: int = 3
    min_digits: int = 2
    max_digits: int = 3
    operators: str = "+-*"


def extract_number(text: str | None) -> str | None:
    """The last number in the text, or None."""
    if not text:
        return None
    found = _NUMBER.findall(text)
    return found[-1] if found else None


class ArithmeticSuite:
    name = "arithmetic"

    def __init__(self, **options) -> None:
        self.options = ArithmeticOptions(**options)
        o = self.options
        if not (2 <= o.min_operands <= o.max_operands and 1 <= o.min_digits <= o.max_digits):
            raise ValueError(f"invalid arithmetic options: {o}")
        if not o.operators or set(o.operators) - set("+-*"):
            raise ValueError("arithmetic operators must be a non-empty subset of '+-*'")

    def _expression(self, rng: random.Random) -> str:
        o = self.options
        n = rng.randint(o.min_operands, o.max_operands)
        nums = [str(rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1))
                for d in (rng.randint(o.min_digits, o.max_digits) for _ in range(n))]
        expr = nums[0]
        for num in nums[1:]:
            expr += f" {rng.choice(o.operators)} {num}"
        return expr

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"unknown split {split!r}; valid: {sorted(_SPLIT_OFFSET)}")
        rng = random.Random(seed * 7919 + _SPLIT_OFFSET[split])
        tasks = []
        for i in range(n):
            expr = self._expression(rng)
            tasks.append(Task(task_id=f"arith-{split}-{seed}-{i}", prompt=f"{expr} = ?",
                              answer=str(evaluate(expr)), suite=self.name, metadata={"expression": expr}))
        return tasks

    def expert_actions(self, task: Task) -> list[Action]:
        expr = task.metadata["expression"]
        return [ToolCall("calculator", {"expression": expr}), FinalAnswer(str(evaluate(expr)))]

    def verify(self, task: Task, answer: str | None) -> bool:
        got = extract_number(answer)
        return got is not None and float(got) == float(task.answer)

    def make_env(self) -> ToolEnv:
        return ToolEnv(ToolSet([calculator]), self.verify, system_prompt=SYSTEM_PROMPT)


SUITES.add("arithmetic", ArithmeticSuite)
