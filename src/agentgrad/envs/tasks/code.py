"""code: tasks whose answer needs a small program (count primes, k-th smallest, simulate a process...).

Tool: `python` (the sandbox). Each suite instance owns one `SandboxPool`, created on the first call (so building a
suite or an env starts no process) and stopped by `close()`. The expert writes a short program that prints the
answer; the gold answer comes from the same computation on the host and is checked by value.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentgrad.envs.base import SUITES
from agentgrad.envs.tasks import sample_in_split, stream_rng, verify_by_kind
from agentgrad.envs.tool_env import ToolEnv
from agentgrad.tools.base import FunctionTool, ToolSet
from agentgrad.tools.python_tool import make_python_tool
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

SYSTEM_PROMPT = "Write a short python program that prints the answer, then answer with the number."


class LazySandbox:
    """One sandbox pool per owner, created on first use; `close()` stops it (a later call starts a new one).

    Duck-types the two things `make_python_tool` uses from a pool: `config` and `run`."""

    def __init__(self, *, timeout_s: float = 5.0, workers: int = 1, memory_mb: int = 512) -> None:
        self.timeout_s = timeout_s
        self.workers = workers
        self.memory_mb = memory_mb
        self._pool: Any = None
        self._lock = threading.Lock()

    def pool(self) -> Any:
        with self._lock:
            if self._pool is None or self._pool._closed:
                from agentgrad.tools.sandbox import SandboxConfig, SandboxPool

                self._pool = SandboxPool(SandboxConfig(timeout_s=self.timeout_s, memory_mb=self.memory_mb),
                                         size=self.workers)
            return self._pool

    @property
    def started(self) -> bool:
        return self._pool is not None and not self._pool._closed

    @property
    def config(self) -> Any:
        return self.pool().config

    def run(self, code: str, *, timeout_s: float | None = None) -> Any:
        return self.pool().run(code, timeout_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def tool(self) -> FunctionTool:
        return make_python_tool(self, timeout_s=self.timeout_s)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CodeOptions:
    kinds: tuple[str, ...] | None = None  # default: every kind
    timeout_s: float = 5.0  # per python call
    workers: int = 1  # sandbox servers in this suite's pool

    def __post_init__(self) -> None:
        if self.kinds is not None:
            object.__setattr__(self, "kinds", tuple(self.kinds))
            unknown = set(self.kinds) - set(KINDS)
            if unknown or not self.kinds:
                raise ValueError(f"unknown code kinds {sorted(unknown)}; valid: {', '.join(KINDS)}")
        if self.timeout_s <= 0 or self.workers < 1:
            raise ValueError(f"invalid code options: {self}")


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _is_prime(k: int) -> bool:
    return k >= 2 and all(k % d for d in range(2, int(k ** 0.5) + 1))


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _balance(start: int, pct: int, withdraw: int, years: int) -> int:
    b = start
    for _ in range(years):
        b = b * (100 + pct) // 100 - withdraw
    return b


def _primes_below(rng) -> tuple[str, int, str]:
    n = rng.randint(100, 5000)
    return (f"How many primes are below {n}?", sum(map(_is_prime, range(n))),
            f"print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))")


def _kth_smallest(rng) -> tuple[str, int, str]:
    nums = rng.sample(range(10, 1000), 8)
    k = rng.randint(2, 7)
    listed = ", ".join(map(str, nums))
    return (f"What is the {_ordinal(k)} smallest of {listed}?", sorted(nums)[k - 1],
            f"print(sorted([{listed}])[{k - 1}])")


def _collatz_steps(rng) -> tuple[str, int, str]:
    n = rng.randint(10, 3000)
    return (f"How many Collatz steps take {n} to 1?", _collatz(n),
            f"n, s = {n}, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    s += 1\nprint(s)")


def _digit_sum_power(rng) -> tuple[str, int, str]:
    a, b = rng.randint(2, 9), rng.randint(20, 200)
    return (f"What is the digit sum of {a}**{b}?", sum(int(c) for c in str(a ** b)),
            f"print(sum(int(c) for c in str({a} ** {b})))")


def _divisible_count(rng) -> tuple[str, int, str]:
    n = rng.randint(100, 10_000)
    a, b = sorted(rng.sample(range(3, 20), 2))
    count = sum(1 for i in range(1, n + 1) if i % a == 0 or i % b == 0)
    return (f"How many of 1..{n} are divisible by {a} or {b}?", count,
            f"print(sum(1 for i in range(1, {n + 1}) if i % {a} == 0 or i % {b} == 0))")


def _fib_mod(rng) -> tuple[str, int, str]:
    n, m = rng.randint(20, 400), rng.randint(7, 1000)
    return (f"What is Fibonacci({n}) mod {m}, with F(1) = F(2) = 1?", _fib(n) % m,
            f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nprint(a % {m})")


def _savings(rng) -> tuple[str, int, str]:
    start, pct, years = rng.randint(100, 5000), rng.randint(2, 15), rng.randint(3, 12)
    withdraw = rng.randint(1, max(1, start * pct // 200))
    return (f"A balance of {start} grows {pct}% a year (rounded down), then {withdraw} is taken out. "
            f"What is it after {years} years?", _balance(start, pct, withdraw, years),
            f"b = {start}\nfor _ in range({years}):\n    b = b * {100 + pct} // 100 - {withdraw}\nprint(b)")


GENERATORS: dict[str, Callable[[Any], tuple[str, int, str]]] = {
    "primes_below": _primes_below, "kth_smallest": _kth_smallest, "collatz_steps": _collatz_steps,
    "digit_sum_power": _digit_sum_power, "divisible_count": _divisible_count, "fib_mod": _fib_mod,
    "savings": _savings,
}
KINDS = tuple(GENERATORS)


class CodeSuite:
    name = "code"

    def __init__(self, **options: Any) -> None:
        self.options = CodeOptions(**options)
        self.sandbox = LazySandbox(timeout_s=self.options.timeout_s, workers=self.options.workers)
        self._tool: FunctionTool | None = None

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        rng = stream_rng(self.name, split, seed)
        kinds = self.options.kinds or KINDS

        def make(_world: int, i: int) -> Task:
            kind = rng.choice(kinds)
            prompt, answer, code = GENERATORS[kind](rng)
            return Task(task_id=f"code-{split}-{seed}-{i}", prompt=prompt, answer=str(answer), suite=self.name,
                        metadata={"kind": kind, "verifier": "numeric", "code": code})

        return sample_in_split(n, split, make)

    def expert_actions(self, task: Task) -> list[Action]:
        return [ToolCall("python", {"code": task.metadata["code"]}), FinalAnswer(task.answer)]

    def verify(self, task: Task, answer: str | None) -> bool:
        return verify_by_kind(task, answer, default="numeric")

    def python_tool(self) -> FunctionTool:
        if self._tool is None:
            self._tool = self.sandbox.tool()
        return self._tool

    def make_env(self) -> ToolEnv:
        return ToolEnv(ToolSet([self.python_tool()]), self.verify, system_prompt=SYSTEM_PROMPT)

    def close(self) -> None:
        """Stop this suite's sandbox servers (idempotent; a later python call starts a fresh pool)."""
        self.sandbox.close()

    def __enter__(self) -> CodeSuite:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


SUITES.add("code", CodeSuite)
