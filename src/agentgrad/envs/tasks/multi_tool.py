"""multi-tool: tasks that chain tools: search then calculator, or sql then python.

Every env offers all five tools (search, open, calculator, sql, python), so choosing the tool is part of the task.
Each world (a corpus and a database, generated as in search-qa and sql-qa) is shared by a few tasks. The python
sandbox pool belongs to the suite instance (created on first use, stopped by `close()`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrad.envs.base import SUITES
from agentgrad.envs.tasks import LRUCache, TaskToolEnv, sample_in_split, stream_rng, verify_by_kind
from agentgrad.envs.tasks.code import LazySandbox
from agentgrad.envs.tasks.search_qa import (
    SearchQAOptions,
    SearchWorld,
    _hop,
    build_search_world,
    hop_actions,
    hop_documents,
)
from agentgrad.envs.tasks.sql_qa import JOIN, SCHEMA, SqlQAOptions, SqlWorld, build_sql_world
from agentgrad.tools.base import ToolSet
from agentgrad.tools.calculator import calculator
from agentgrad.tools.search import Corpus, make_search_tools
from agentgrad.tools.sql import make_sql_tool
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

SYSTEM_PROMPT = (f"Tools: search the documents, sql over tables {SCHEMA}, calculator, python. "
                 "Chain them, then answer with the number.")
SEARCH_KINDS = ("years_between", "total_employees", "founder_age")
SQL_KINDS = ("median_salary", "median_hire_year")


@dataclass(frozen=True)
class MultiToolOptions:
    tasks_per_world: int = 4
    sql_fraction: float = 0.5  # share of sql -> python tasks (the rest: search -> calculator)
    timeout_s: float = 5.0  # per python call
    workers: int = 1  # sandbox servers in this suite's pool
    cache_dir: str | None = None  # where the generated databases go

    def __post_init__(self) -> None:
        if self.tasks_per_world < 1 or not 0.0 <= self.sql_fraction <= 1.0 or self.timeout_s <= 0 or self.workers < 1:
            raise ValueError(f"invalid multi-tool options: {self}")


@dataclass
class MultiWorld:
    search: SearchWorld
    sql: SqlWorld
    tools: ToolSet


def _fmt(x: float | int) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class MultiToolSuite:
    name = "multi-tool"

    def __init__(self, **options: Any) -> None:
        self.options = MultiToolOptions(**options)
        self._search_opts = SearchQAOptions()
        self._sql_opts = SqlQAOptions(cache_dir=self.options.cache_dir)
        self.sandbox = LazySandbox(timeout_s=self.options.timeout_s, workers=self.options.workers)
        self._python = self.sandbox.tool()
        self._worlds = LRUCache(self._build_world, capacity=128)
        self._template: ToolSet | None = None

    def _build_world(self, key: str) -> MultiWorld:
        search = build_search_world(key, self._search_opts, namespace="multi-search-world")
        sql = build_sql_world(key, self._sql_opts, namespace="multi-sql-world")
        return MultiWorld(search, sql, ToolSet([*search.tools, calculator, *sql.tools, self._python]))

    def world(self, task_or_key: Task | str) -> MultiWorld:
        key = task_or_key.metadata["world"] if isinstance(task_or_key, Task) else task_or_key
        return self._worlds.get(key)

    def _search_question(self, world: SearchWorld, kind: str, rng) -> tuple[str, str, dict[str, Any]]:
        c1, c2 = (world.companies[n] for n in rng.sample(sorted(world.companies), 2))
        if kind == "years_between":
            hi, lo = max(c1.founded, c2.founded), min(c1.founded, c2.founded)
            return (f"How many years apart were {c1.name} and {c2.name} founded?", str(hi - lo),
                    {"hops": [_hop(c1.name, c1.doc_id, c1.founded), _hop(c2.name, c2.doc_id, c2.founded)],
                     "expression": f"{hi} - {lo}"})
        if kind == "total_employees":
            return (f"How many employees do {c1.name} and {c2.name} have together?", str(c1.employees + c2.employees),
                    {"hops": [_hop(c1.name, c1.doc_id, c1.employees), _hop(c2.name, c2.doc_id, c2.employees)],
                     "expression": f"{c1.employees} + {c2.employees}"})
        if kind == "founder_age":
            p = world.people[c1.founder]
            return (f"How old was the founder of {c1.name} when it was founded?", str(c1.founded - p.birth_year),
                    {"hops": [_hop(c1.name, c1.doc_id, c1.founder, c1.founded), _hop(p.name, p.doc_id, p.birth_year)],
                     "expression": f"{c1.founded} - {p.birth_year}"})
        raise ValueError(f"unknown multi-tool question kind {kind!r}")

    def _sql_question(self, world: SqlWorld, kind: str, rng) -> tuple[str, str, dict[str, Any]]:
        dept = world.departments[rng.randrange(len(world.departments))]["name"]
        column, what = {"median_salary": ("salary", "salary"), "median_hire_year": ("hire_year", "hire year")}[kind]
        values = [e[column] for e in world.staff(dept)]  # rowid order, as the query returns them
        median = statistics.median(values)
        code = f"import statistics\nprint(statistics.median([{', '.join(map(str, values))}]))"
        return (f"What is the median {what} in the {dept} department?", _fmt(median),
                {"sql": f"SELECT e.{column} {JOIN} WHERE d.name = '{dept}' ORDER BY e.id", "code": code})

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        rng = stream_rng(self.name, split, seed)

        def make(w: int, i: int) -> Task:
            key = f"{split}-{seed}-{w}"
            world = self.world(key)
            if rng.random() < self.options.sql_fraction:
                kind = rng.choice(SQL_KINDS)
                prompt, answer, meta = self._sql_question(world.sql, kind, rng)
            else:
                kind = rng.choice(SEARCH_KINDS)
                prompt, answer, meta = self._search_question(world.search, kind, rng)
            return Task(task_id=f"multi-tool-{split}-{seed}-{i}", prompt=prompt, answer=answer, suite=self.name,
                        metadata={"world": key, "kind": kind, "verifier": "numeric", **meta})

        return sample_in_split(n, split, make, per_world=self.options.tasks_per_world)

    def expert_actions(self, task: Task) -> list[Action]:
        m = task.metadata
        if m["kind"] in SQL_KINDS:
            calls = [ToolCall("sql", {"query": m["sql"]}), ToolCall("python", {"code": m["code"]})]
        else:
            calls = [*hop_actions(self.world(task).search.tools, m["hops"]),
                     ToolCall("calculator", {"expression": m["expression"]})]
        return [*calls, FinalAnswer(task.answer)]

    def verify(self, task: Task, answer: str | None) -> bool:
        return verify_by_kind(task, answer, default="numeric")

    def make_env(self) -> TaskToolEnv:
        if self._template is None:  # the same tools without a world: what legal_actions shows before reset
            self._template = ToolSet([*make_search_tools(Corpus([]), k=self._search_opts.k), calculator,
                                      make_sql_tool(Path(os.devnull)), self._python])
        return TaskToolEnv(self._template, self.verify, toolset_for=lambda task: self.world(task).tools,
                           system_prompt=SYSTEM_PROMPT, evidence=hop_documents)

    def close(self) -> None:
        """Stop this suite's sandbox servers (idempotent)."""
        self.sandbox.close()

    def __enter__(self) -> MultiToolSuite:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


SUITES.add("multi-tool", MultiToolSuite)
