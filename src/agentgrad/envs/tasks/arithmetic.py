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
    # Defaults: three 2-digit operands and a 4-digit positive result (e.g. "47 * 83 - 29"). Fixed lengths put
    # every copied number at a constant distance from its source, which a ~1M-parameter model learns within
    # the CPU budget of the default run; variable lengths need an induction circuit, which took several times
    # longer to form here (measured: 97% of expressions but 12% of variable-length results copied correctly).
    min_operands: int = 3
    max_operands: int = 3
    min_digits: int = 2
    max_digits: int = 2
    operators: str = "+-*"
    result_digits: int | None = 4  # keep only tasks whose result is positive with this many digits (None: any)


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
        if o.result_digits is not None:
            largest = ((10**o.max_digits - 1) ** o.max_operands if "*" in o.operators
                       else o.max_operands * 10**o.max_digits)
            if not 1 <= o.result_digits <= len(str(largest)):
                raise ValueError(f"result_digits={o.result_digits} is unreachable with these operand options")

    def _expression(self, rng: random.Random) -> str:
        o = self.options
        n = rng.randint(o.min_operands, o.max_operands)
        nums = [str(rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1))
                for d in (rng.randint(o.min_digits, o.max_digits) for _ in range(n))]
        expr = nums[0]
        for num in nums[1:]:
            expr += f" {rng.choice(o.operators)} {num}"
        return expr

    def _accepts(self, expression: str) -> bool:
        digits = self.options.result_digits
        if digits is None:
            return True
        value = evaluate(expression)
        return isinstance(value, int) and 10 ** (digits - 1) <= value < 10**digits

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"unknown split {split!r}; valid: {sorted(_SPLIT_OFFSET)}")
        rng = random.Random(seed * 7919 + _SPLIT_OFFSET[split])
        tasks = []
        for i in range(n):
            expr = self._expression(rng)
            while not self._accepts(expr):
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
