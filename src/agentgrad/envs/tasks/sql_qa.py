"""sql-qa: questions over a generated SQLite database, each answered by one query (count, max, sum, join).

Every few tasks share one generated database (departments, employees, projects with fictional names), keyed by
(split, seed, chunk) and written once to a cache directory (a file name that includes the key, the options and a
generator version), atomically, so parallel workers can share it; the `sql` tool opens it read-only. The schema
is in the system prompt. The expert writes the SQL; the gold answer is computed from the generated rows, so a
wrong query shows up as a failed expert.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentgrad.envs.base import SUITES
from agentgrad.envs.tasks import (
    LRUCache,
    NameMaker,
    TaskToolEnv,
    sample_in_split,
    stable_int,
    stream_rng,
    verify_by_kind,
    world_key,
)
from agentgrad.tools.base import ToolSet
from agentgrad.tools.sql import make_sql_tool
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

GENERATOR_VERSION = 2
SCHEMA = ("departments(id, name, city); employees(id, name, dept_id, salary, hire_year); "
          "projects(id, name, dept_id, budget)")
SYSTEM_PROMPT = f"Tables: {SCHEMA}. Use one sql query, then answer."
JOIN = "FROM employees e JOIN departments d ON e.dept_id = d.id"
_write_lock = threading.Lock()


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "agentgrad-cache"


@dataclass(frozen=True)
class SqlQAOptions:
    departments: int = 4
    employees: int = 24
    projects: int = 8
    tasks_per_world: int = 4
    cache_dir: str | None = None  # where the generated databases go (default: <tmp>/agentgrad-cache)
    timeout_s: float = 1.0
    max_rows: int = 20

    def __post_init__(self) -> None:
        if not (1 <= self.departments <= 50 and self.employees >= self.departments
                and self.projects >= self.departments and self.tasks_per_world >= 1):
            raise ValueError(f"sql-qa needs 1 <= departments <= 50, employees >= departments, "
                             f"projects >= departments, tasks_per_world >= 1: {self}")


@dataclass
class SqlWorld:
    key: str
    path: Path
    departments: list[dict[str, Any]]
    employees: list[dict[str, Any]]
    projects: list[dict[str, Any]]
    tools: ToolSet = field(repr=False)

    def dept(self, dept_id: int) -> dict[str, Any]:
        return self.departments[dept_id - 1]

    def staff(self, dept_name: str) -> list[dict[str, Any]]:
        return [e for e in self.employees if self.dept(e["dept_id"])["name"] == dept_name]


def _write_db(path: Path, departments, employees, projects) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        conn.execute("PRAGMA journal_mode = OFF")  # a private temp file, renamed into place when complete
        conn.execute("PRAGMA synchronous = OFF")
        conn.executescript(
            "CREATE TABLE departments(id INTEGER PRIMARY KEY, name TEXT, city TEXT);"
            "CREATE TABLE employees(id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER, salary INTEGER, "
            "hire_year INTEGER);"
            "CREATE TABLE projects(id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER, budget INTEGER);")
        conn.executemany("INSERT INTO departments VALUES (:id, :name, :city)", departments)
        conn.executemany("INSERT INTO employees VALUES (:id, :name, :dept_id, :salary, :hire_year)", employees)
        conn.executemany("INSERT INTO projects VALUES (:id, :name, :dept_id, :budget)", projects)
        conn.commit()
        conn.close()
        os.replace(tmp, path)  # atomic: readers see a whole database or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_sql_world(key: str, opts: SqlQAOptions, *, namespace: str = "sql-world") -> SqlWorld:
    rng = stream_rng(namespace, "train", 0, key)
    names = NameMaker(rng)
    departments = [{"id": i + 1, "name": names.word(), "city": names.word()} for i in range(opts.departments)]
    d = opts.departments
    salaries = [s * 100 for s in rng.sample(range(300, 1500), opts.employees)]  # distinct: one top earner
    employees = [{"id": i + 1, "name": names.person(), "dept_id": (i % d) + 1 if i < d else rng.randint(1, d),
                  "salary": salaries[i], "hire_year": rng.randint(2000, 2023)} for i in range(opts.employees)]
    budgets = [b * 1000 for b in rng.sample(range(10, 500), opts.projects)]
    projects = [{"id": i + 1, "name": names.word(), "dept_id": (i % d) + 1 if i < d else rng.randint(1, d),
                 "budget": budgets[i]} for i in range(opts.projects)]
    config = {k: v for k, v in asdict(opts).items() if k in ("departments", "employees", "projects")}
    digest = f"{stable_int(namespace, key, sorted(config.items())):016x}"
    root = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
    path = root / f"{namespace}-v{GENERATOR_VERSION}-{digest}.sqlite"
    if not path.is_file():
        with _write_lock:
            if not path.is_file():
                _write_db(path, departments, employees, projects)
    tools = ToolSet([make_sql_tool(path, timeout_s=opts.timeout_s, max_rows=opts.max_rows)])
    return SqlWorld(key, path, departments, employees, projects, tools)


KINDS = ("count_dept", "count_hired_after", "max_salary_dept", "top_earner_dept", "employee_city", "total_budget",
         "count_projects", "first_hire_year")


def make_question(world: SqlWorld, kind: str, rng) -> tuple[str, str, str, str]:
    """(prompt, answer, verifier, expert SQL) for one question of `kind`."""
    dept = world.departments[rng.randrange(len(world.departments))]
    dn = dept["name"]
    staff = world.staff(dn)
    where = f"WHERE d.name = '{dn}'"
    if kind == "count_dept":
        return (f"How many employees work in the {dn} department?", str(len(staff)), "numeric",
                f"SELECT COUNT(*) {JOIN} {where}")
    if kind == "count_hired_after":
        year = rng.randint(2003, 2020)
        n = sum(1 for e in world.employees if e["hire_year"] > year)
        return (f"How many employees were hired after {year}?", str(n), "numeric",
                f"SELECT COUNT(*) FROM employees WHERE hire_year > {year}")
    if kind == "max_salary_dept":
        return (f"What is the highest salary in the {dn} department?", str(max(e["salary"] for e in staff)), "numeric",
                f"SELECT MAX(e.salary) {JOIN} {where}")
    if kind == "top_earner_dept":
        top = max(staff, key=lambda e: e["salary"])
        return (f"Who earns the most in the {dn} department?", top["name"], "normalized",
                f"SELECT e.name {JOIN} {where} ORDER BY e.salary DESC LIMIT 1")
    if kind == "employee_city":
        emp = world.employees[rng.randrange(len(world.employees))]
        return (f"In which city does {emp['name']} work?", world.dept(emp["dept_id"])["city"], "normalized",
                f"SELECT d.city {JOIN} WHERE e.name = '{emp['name']}'")
    budgets = [p["budget"] for p in world.projects if p["dept_id"] == dept["id"]]
    pjoin = "FROM projects p JOIN departments d ON p.dept_id = d.id"
    if kind == "total_budget":
        return (f"What is the total project budget of the {dn} department?", str(sum(budgets)), "numeric",
                f"SELECT SUM(p.budget) {pjoin} {where}")
    if kind == "count_projects":
        return (f"How many projects does the {dn} department have?", str(len(budgets)), "numeric",
                f"SELECT COUNT(*) {pjoin} {where}")
    if kind == "first_hire_year":
        return (f"In what year was the first {dn} employee hired?", str(min(e["hire_year"] for e in staff)), "numeric",
                f"SELECT MIN(e.hire_year) {JOIN} {where}")
    raise ValueError(f"unknown sql-qa question kind {kind!r}")


class SqlQASuite:
    name = "sql-qa"
    split_key = staticmethod(world_key)  # few texts per question kind: split by world, not by prompt

    def __init__(self, **options: Any) -> None:
        self.options = SqlQAOptions(**options)
        self._worlds = LRUCache(lambda key: build_sql_world(key, self.options), capacity=256)
        self._template: ToolSet | None = None

    def world(self, task_or_key: Task | str) -> SqlWorld:
        key = task_or_key.metadata["world"] if isinstance(task_or_key, Task) else task_or_key
        return self._worlds.get(key)

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        rng = stream_rng(self.name, split, seed)

        def make(w: int, i: int) -> Task:
            key = f"{split}-{seed}-{w}"
            kind = rng.choice(KINDS)
            prompt, answer, verifier, query = make_question(self.world(key), kind, rng)
            return Task(task_id=f"sql-qa-{split}-{seed}-{i}", prompt=prompt, answer=answer, suite=self.name,
                        metadata={"world": key, "kind": kind, "verifier": verifier, "sql": query})

        return sample_in_split(n, split, make, per_world=self.options.tasks_per_world,
                               split_key=None)  # each world is built for one split (its key names it)

    def expert_actions(self, task: Task) -> list[Action]:
        return [ToolCall("sql", {"query": task.metadata["sql"]}), FinalAnswer(task.answer)]

    def verify(self, task: Task, answer: str | None) -> bool:
        return verify_by_kind(task, answer)

    def make_env(self) -> TaskToolEnv:
        if self._template is None:  # the same tool without a database: what legal_actions shows before reset
            self._template = ToolSet([make_sql_tool(Path(os.devnull), timeout_s=self.options.timeout_s,
                                                    max_rows=self.options.max_rows)])
        return TaskToolEnv(self._template, self.verify, toolset_for=lambda task: self.world(task).tools,
                           system_prompt=SYSTEM_PROMPT)


SUITES.add("sql-qa", SqlQASuite)
