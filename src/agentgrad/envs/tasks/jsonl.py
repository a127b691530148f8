"""jsonl: your own tasks from a JSON Lines file, as a suite (`env.name: jsonl`, `env.options.path: ...`).

One JSON object per line:

    {"task_id": "q1", "prompt": "What is 17 * 23?", "answer": "391",
     "tools": ["calculator"],              # optional: names in agentgrad.tools.TOOLS, or import paths of
                                           #   your own tools ("my_tools:convert"); default: none
     "verifier": "numeric",                # optional: exact | numeric | normalized (default: the `verifier` option)
     "split": "train",                     # optional: train | heldout | test (default: by a hash of task_id)
     "expert": [{"name": "calculator", "arguments": {"expression": "17 * 23"}}],  # optional demonstration calls
     "metadata": {...}}                    # optional, kept on the Task

Without "split", a task goes to train (80%), heldout (10%) or test (10%) by a stable hash of its id; with the
option `splits: all`, every split is the whole file. `sample_tasks(n)` shuffles its split with the seed; a train
request larger than the split cycles through it again (reshuffled), held-out and test requests return at most
the whole split (no repeats).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrad.envs.base import SUITES
from agentgrad.envs.tasks import SPLITS, VERIFIERS, TaskToolEnv, check_split, split_of, stable_int, verify_by_kind
from agentgrad.registry import ImportRefError
from agentgrad.tools import python_tool as _python_tool  # noqa: F401  (registers the "python" tool)
from agentgrad.tools.base import TOOLS, Tool, ToolSet, make_tool
from agentgrad.types import Action, FinalAnswer, Task, ToolCall

SYSTEM_PROMPT = "Answer the question. Use the tools when they help."


@dataclass(frozen=True)
class JsonlOptions:
    path: str
    verifier: str = "normalized"  # for records without a "verifier"
    splits: str = "hash"  # "hash": by the record's "split" or a hash of its id; "all": every split is the whole file
    system_prompt: str = SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; valid: {', '.join(VERIFIERS)}")
        if self.splits not in ("hash", "all"):
            raise ValueError(f"jsonl splits must be 'hash' or 'all', got {self.splits!r}")


def _fail(path: Path, line: int, message: str) -> ValueError:
    return ValueError(f"{path}:{line}: {message}")


def load_jsonl_tasks(path: str | Path, *, suite: str = "jsonl", verifier: str = "normalized") -> list[Task]:
    """Read and validate the tasks of `path` (errors name the line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jsonl task file {str(path)!r} does not exist")
    tasks: list[Task] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(path, n, f"not JSON ({exc})") from None
            if not isinstance(rec, dict):
                raise _fail(path, n, "each line must be a JSON object")
            missing = [k for k in ("task_id", "prompt", "answer") if k not in rec]
            if missing:
                raise _fail(path, n, f"missing field(s) {missing}")
            task_id, prompt, answer = str(rec["task_id"]), rec["prompt"], rec["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise _fail(path, n, "'prompt' must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise _fail(path, n, "'answer' must be a string or a number")
            if task_id in seen:
                raise _fail(path, n, f"duplicate task_id {task_id!r}")
            seen.add(task_id)
            tools = rec.get("tools", [])
            if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
                raise _fail(path, n, "'tools' must be a list of tool names")
            if len(set(tools)) != len(tools):
                raise _fail(path, n, "'tools' lists a tool twice")
            for t in tools:
                if not TOOLS.resolvable(t):
                    raise _fail(path, n, f"unknown tool {t!r}; registered tools: {', '.join(TOOLS.names())}, or an "
                                         f"import path 'package.module:attr'")
                if t not in TOOLS:  # an import path: fail here, naming the line, rather than at the first reset
                    try:
                        TOOLS.get(t)
                    except ImportRefError as exc:
                        raise _fail(path, n, str(exc)) from None
            kind = rec.get("verifier", verifier)
            if kind not in VERIFIERS:
                raise _fail(path, n, f"unknown verifier {kind!r}; valid: {', '.join(VERIFIERS)}")
            split = rec.get("split")
            if split is not None and split not in SPLITS:
                raise _fail(path, n, f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
            expert = rec.get("expert", [])
            if not isinstance(expert, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
                    for c in expert):
                raise _fail(path, n, "'expert' must be a list of {\"name\": ..., \"arguments\": {...}} objects")
            extra = rec.get("metadata", {})
            if not isinstance(extra, dict):
                raise _fail(path, n, "'metadata' must be an object")
            metadata = {**extra, "tools": list(tools), "verifier": kind, "split": split or split_of(task_id),
                        "expert": [{"name": c["name"], "arguments": c.get("arguments", {})} for c in expert]}
            tasks.append(Task(task_id=task_id, prompt=prompt, answer=str(answer), suite=suite, metadata=metadata))
    return tasks


class JsonlSuite:
    name = "jsonl"

    def __init__(self, **options: Any) -> None:
        if "path" not in options:
            raise ValueError("the jsonl suite needs the option 'path' (a JSON Lines file of tasks)")
        self.options = JsonlOptions(**options)
        self.tasks = load_jsonl_tasks(self.options.path, suite=self.name, verifier=self.options.verifier)
        self._tools: dict[str, Tool] = {}
        self._toolsets: dict[tuple[str, ...], ToolSet] = {}

    def split_tasks(self, split: str) -> list[Task]:
        check_split(split)
        if self.options.splits == "all":
            return list(self.tasks)
        return [t for t in self.tasks if t.metadata["split"] == split]

    def sample_tasks(self, n: int, *, split: str = "train", seed: int = 0) -> list[Task]:
        pool = self.split_tasks(split)
        if not pool or n <= 0:
            if split == "train" and n > 0:
                raise ValueError(f"{self.options.path} has no train tasks")
            return []
        rng = random.Random(stable_int("jsonl", split, seed))
        out: list[Task] = []
        while len(out) < n:
            order = list(pool)
            rng.shuffle(order)
            out += order[: n - len(out)]
            if split != "train":
                break
        return out

    def expert_actions(self, task: Task) -> list[Action]:
        calls = [ToolCall(c["name"], dict(c["arguments"])) for c in task.metadata.get("expert", [])]
        return [*calls, FinalAnswer(task.answer)]

    def verify(self, task: Task, answer: str | None) -> bool:
        return verify_by_kind(task, answer, default=self.options.verifier)

    def toolset(self, names: list[str] | tuple[str, ...]) -> ToolSet:
        key = tuple(names)
        if key not in self._toolsets:
            for name in key:
                if name not in self._tools:
                    self._tools[name] = make_tool(name)
            self._toolsets[key] = ToolSet([self._tools[name] for name in key])
        return self._toolsets[key]

    def make_env(self) -> TaskToolEnv:
        return TaskToolEnv(ToolSet([]), self.verify, system_prompt=self.options.system_prompt,
                           toolset_for=lambda task: self.toolset(task.metadata.get("tools", [])))


SUITES.add("jsonl", JsonlSuite)
