"""Append-only trajectory store: one JSON object per line, flushed per batch."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

from agentgrad.types import ScoredTrajectory


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out["__type__"] = type(obj).__name__
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    return obj


class TrajectoryStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, samples: Sequence[ScoredTrajectory], *, step: int, stage: str) -> None:
        with self.path.open("a") as fh:
            for s in samples:
                fh.write(json.dumps({"step": step, "stage": stage, **_jsonable(s)}) + "\n")

    def records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open() as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)
