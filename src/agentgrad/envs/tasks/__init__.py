"""Task suites, and the helpers they share: split streams, fictional names, answer matching, per-task envs.

Every suite draws its tasks from a seeded stream per (suite, split, seed) and keeps a task only when a hash of its
prompt falls in that split's buckets (80% train, 10% heldout, 10% test), so the three splits never share a prompt,
whatever the seeds; a suite whose worlds are built per split (sql-qa) keeps every task of a world instead, and
the splits share no world (`world_key`). A task list is a deterministic function of (options, split, seed) (a
longer list extends a shorter one).

Standard library only (plus the env/tool base modules): no torch here.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from agentgrad.answers import MATCHERS
from agentgrad.envs.base import prompt_key
from agentgrad.envs.tool_env import ToolEnv
from agentgrad.tools.base import ToolSet
from agentgrad.types import Action, Task

SPLITS = ("train", "heldout", "test")
_SPLIT_BUCKETS = {"train": range(8), "heldout": range(8, 9), "test": range(9, 10)}


def check_split(split: str) -> str:
    if split not in _SPLIT_BUCKETS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    return split


def stable_int(*parts: Any, bits: int = 64) -> int:
    """A hash of `parts` that is stable across processes and Python versions (unlike `hash`)."""
    data = "\x1f".join(map(str, parts)).encode("utf-8", "surrogatepass")  # model text may hold lone surrogates
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - bits)


def split_of(key: str) -> str:
    """The split a prompt (or any task key) belongs to: 80% train, 10% heldout, 10% test, by a stable hash."""
    bucket = stable_int("split", key) % 10
    return next(s for s, r in _SPLIT_BUCKETS.items() if bucket in r)


def stream_rng(suite: str, split: str, seed: int, *extra: Any) -> random.Random:
    """The generator of one (suite, split, seed) stream. Seeded explicitly: no global random state."""
    return random.Random(stable_int(suite, check_split(split), int(seed), *extra))


def world_key(task: Task) -> str:
    """The split key of a suite whose answers come from a world (a database, a document set) that is built per
    split: the world. A question text may then recur in every split (on other worlds, with other answers), and
    the splits ask the same mix of questions. Keyed by the prompt, a template with few texts lands in a split
    whole (sql-qa's "hired after {year}" has 18: 2 went to heldout, 1 to test, and the held-out split asked
    what training never showed), and a world's few texts of a kind rarely pass a 10% filter, so the held-out
    mix leaned to the kinds with many texts per world."""
    return str(task.metadata["world"])


def sample_in_split(n: int, split: str, make: Callable[[int, int], Task | None], *, per_world: int = 1,
                    tries_per_world: int = 200, split_key: Callable[[Task], str] | None = prompt_key) -> list[Task]:
    """Build `n` tasks whose `split_key` (by default the prompt) hashes into `split`: `make(world, i)`
    proposes task number `i` from world number `world` (drawing from its own seeded generator; it may return
    None to skip). `split_key=None` keeps every proposal: for a caller whose worlds are built per split (their
    keys name the split), so that each is in its split by construction (`world_key`).

    A world gives at most `per_world` tasks; no question comes twice (per `task.metadata["world"]`); after
    `tries_per_world` proposals without enough tasks the next world is used. Deterministic, and a longer list
    extends a shorter one."""
    check_split(split)
    tasks: list[Task] = []
    seen: set[str] = set()
    world = in_world = tries = total = 0
    while len(tasks) < n:
        if in_world >= per_world or tries >= tries_per_world:
            world, in_world, tries = world + 1, 0, 0
        tries += 1
        total += 1
        if total > tries_per_world * (n + 10):
            raise RuntimeError(f"could not generate {n} {split} tasks; the task space is too small for these options")
        task = make(world, len(tasks))
        if task is None or (split_key is not None and split_of(split_key(task)) != split):
            continue
        key = f"{task.metadata.get('world', '')}\x1f{task.prompt}"
        if key in seen:  # no question twice in a list (in the same world, for suites with worlds)
            continue
        seen.add(key)
        in_world += 1
        tasks.append(task)
    return tasks


# ---- fictional names ----------------------------------------------------------------------------------------

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr",
           "st", "th", "sh", "qu", "pl", "vr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia"]
_CODAS = ["", "", "", "n", "r", "l", "s", "k", "th", "m", "x"]


def fictional_word(rng: random.Random, syllables: int | None = None) -> str:
    """A pronounceable, capitalised made-up word ("Zorbla", "Thenik")."""
    k = syllables or rng.choice((2, 2, 2, 3))
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k)) + rng.choice(_CODAS)
    return word.capitalize()


class NameMaker:
    """Fictional words that never repeat within one world (so every name token is unique to its entity)."""

    def __init__(self, rng: random.Random, taken: set[str] | None = None) -> None:
        self.rng = rng
        self.taken: set[str] = set(taken or ())

    def word(self, syllables: int | None = None) -> str:
        for _ in range(1000):
            w = fictional_word(self.rng, syllables)
            if w.lower() not in self.taken and 4 <= len(w) <= 9:
                self.taken.add(w.lower())
                return w
        raise RuntimeError("ran out of fictional names")

    def person(self) -> str:
        return f"{self.word(2)} {self.word()}"


# ---- answers --------------------------------------------------------------------------------------------------

# The rules live in `agentgrad.answers`, shared with the verifier rewards; by name for `metadata["verifier"]`.
VERIFIERS: Mapping[str, Callable[[str | None, str], bool]] = MATCHERS


def verify_by_kind(task: Task, answer: str | None, default: str = "normalized") -> bool:
    """Check `answer` with the rule named by `task.metadata["verifier"]` (exact | normalized | numeric | set)."""
    kind = task.metadata.get("verifier", default)
    fn = VERIFIERS.get(kind)
    if fn is None:
        raise ValueError(f"unknown verifier {kind!r}; valid: {', '.join(VERIFIERS)}")
    return fn(answer, task.answer)


# ---- per-task worlds ------------------------------------------------------------------------------------------

class LRUCache:
    """A small thread-safe cache of worlds (a corpus index, a database path), built on first use."""

    def __init__(self, build: Callable[[Any], Any], capacity: int = 128) -> None:
        self._build = build
        self._capacity = capacity
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = self._build(key)  # outside the lock: building may be slow; a duplicate build is harmless
        with self._lock:
            value = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)
            return value


class TaskToolEnv(ToolEnv):
    """A ToolEnv whose tools depend on the task (its generated world: a corpus, a database).

    `toolset_for(task)` is called at every reset; it must return the same tools (names and schemas) for every task
    of a suite, so the rendered prompt never changes, only what the tools see.

    `evidence(task)`, when given, names the documents the task's answer rests on (its hops' doc ids): a call
    whose result lists or opens one of them (the tool's `doc_ids` / `doc_id` signals) adds the signal
    `evidence`, how many distinct ones the episode has seen so far, which a process reward can pay for
    (rewards/process.py `Fact(signal="evidence", op=">=", value=n)`): a verifiable step of a multi-hop task."""

    def __init__(self, tools: ToolSet, verify: Callable[[Task, str | None], bool], *,
                 toolset_for: Callable[[Task], ToolSet], system_prompt: str = "",
                 evidence: Callable[[Task], frozenset[str]] | None = None) -> None:
        super().__init__(tools, verify, system_prompt=system_prompt)
        self._toolset_for = toolset_for
        self._evidence = evidence
        self._needed: frozenset[str] = frozenset()
        self._seen: set[str] = set()

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        task = (options or {}).get("task")
        if isinstance(task, Task):
            self.tools = self._toolset_for(task)
            self._needed = self._evidence(task) if self._evidence is not None else frozenset()
        self._seen = set()
        return super().reset(seed=seed, options=options)

    def step(self, action: Action) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        signals = info.get("signals")
        if self._needed and signals is not None and info.get("tool_ok"):
            shown = set(signals.get("doc_ids") or ()) | ({signals["doc_id"]} if signals.get("doc_id") else set())
            self._seen |= shown & self._needed
            info["signals"] = {**signals, "evidence": len(self._seen)}
        return obs, reward, terminated, truncated, info
