"""Append-only, crash-safe trajectory store: JSONL segments in a directory, one record per trajectory.

Durability: each `append` writes one batch, flushes and fsyncs it before returning, so a crash loses at most
the batch in flight. A crash mid-write leaves a torn last line; opening the store detects it (no trailing
newline, or a last line that does not parse) and cuts it off, so earlier records are never corrupted.

Offsets: records are numbered 0, 1, 2, ... in append order (`record["index"]`), and `len(store)` is the next
index. A checkpoint saves `len(store)`; a resumed run calls `truncate(offset)` to drop what was appended after
that checkpoint, so the re-run steps append them again exactly once (no duplicates, nothing lost).

Reading: `records()` yields typed `StoreRecord`s (with the `ScoredTrajectory`), `trajectories()` just the
samples, `rows()` flat dicts (a dataset view), `to_pandas()` a DataFrame when pandas is installed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrad.faults import kill_point
from agentgrad.types import (
    FinalAnswer,
    HeadDecision,
    InvalidAction,
    Message,
    RewardBreakdown,
    ScoredTrajectory,
    StopReason,
    Task,
    TokenMask,
    ToolCall,
    Trajectory,
    TrajectoryGroup,
    Turn,
)

_RECORD_TYPES = {cls.__name__: cls for cls in (Task, ToolCall, FinalAnswer, InvalidAction, Message, Turn, TokenMask,
                                               HeadDecision, Trajectory, RewardBreakdown, ScoredTrajectory,
                                               TrajectoryGroup)}
SEGMENT_GLOB = "segment-*.jsonl"


class StoreCorruptError(RuntimeError):
    """A record before the last one does not parse: not a torn write, so it is not repaired silently."""


_PLAIN = (int, float, str, bool, type(None))


def to_json(obj: Any) -> Any:
    """A record (frozen dataclass tree) as JSON-able data; dataclasses carry `__type__` so they decode typed."""
    if type(obj) in _PLAIN:
        return obj
    if isinstance(obj, (list, tuple)) and all(type(x) in _PLAIN for x in obj):
        return list(obj)  # token ids and logprobs: one pass, not a call per element (a step's episodes: ~1 s)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out["__type__"] = type(obj).__name__
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_json(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


def from_json(data: Any) -> Any:
    """Inverse of `to_json` for our record types: list fields become tuples, mappings stay plain JSON."""
    if not (isinstance(data, dict) and "__type__" in data):
        return data
    cls = _RECORD_TYPES[data["__type__"]]
    if cls is HeadDecision and "tool" in data:  # written before heads could choose categories
        data = {**data, "choice": data["tool"]}
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        v = data[f.name]
        if isinstance(v, list):
            v = tuple(from_json(x) for x in v)
        elif isinstance(v, dict):
            v = from_json(v)
        kwargs[f.name] = v
    if cls is Trajectory:
        kwargs["stop_reason"] = StopReason(kwargs["stop_reason"])
    return cls(**kwargs)


@dataclass(frozen=True)
class StoreRecord:
    index: int
    step: int
    stage: str
    group: str
    """Samples with the same `group` were drawn for the same task together (a GRPO group)."""
    source: str
    """"rollout" for the run's own samples, "import:<file>" for offline logs."""
    sample: ScoredTrajectory


def _segment_lines(path: Path) -> list[int]:
    """Byte offset of the start of every complete line of a segment."""
    starts, pos = [], 0
    with path.open("rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break
            starts.append(pos)
            pos += len(line)
    return starts


class TrajectoryStore:
    def __init__(self, directory: str | Path, *, segment_max_records: int = 50_000, fsync: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_max_records = segment_max_records
        self.fsync = fsync
        self.repaired_bytes = self._repair_tail()
        self._segments = self._scan()

    # ---- opening ------------------------------------------------------------------------------------------

    def _segment_paths(self) -> list[Path]:
        return sorted(self.directory.glob(SEGMENT_GLOB))

    def _repair_tail(self) -> int:
        """Cut a torn last record (crash mid-write) off the last segment; returns the bytes removed."""
        paths = self._segment_paths()
        if not paths:
            return 0
        last = paths[-1]
        data = last.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep > 0:  # also drop a complete-looking last line that does not parse (torn inside a page)
            prev = data.rfind(b"\n", 0, keep - 1) + 1
            try:
                json.loads(data[prev:keep])
            except json.JSONDecodeError:
                keep = prev
        if keep < len(data):
            with last.open("r+b") as fh:
                fh.truncate(keep)
                fh.flush()
                os.fsync(fh.fileno())
        return len(data) - keep

    def _scan(self) -> list[tuple[Path, int, int]]:
        """(path, first index, record count) per segment."""
        out, expected = [], 0
        for path in self._segment_paths():
            first = int(path.stem.split("-")[1])
            if first != expected:
                raise StoreCorruptError(f"{path} starts at record {first}, expected {expected}")
            n = len(_segment_lines(path))
            out.append((path, first, n))
            expected = first + n
        return out

    def __len__(self) -> int:
        if not self._segments:
            return 0
        _, first, n = self._segments[-1]
        return first + n

    # ---- writing ------------------------------------------------------------------------------------------

    def append(self, samples: Sequence[ScoredTrajectory], *, step: int, stage: str,
               groups: Sequence[str] | None = None, source: str = "rollout") -> tuple[int, int]:
        """Append one batch durably; returns the (start, end) record indices it occupies."""
        if groups is not None and len(groups) != len(samples):
            raise ValueError(f"{len(groups)} group keys for {len(samples)} samples")
        start = len(self)
        if not samples:
            return start, start
        lines = []
        for i, s in enumerate(samples):
            record = {"index": start + i, "step": step, "stage": stage,
                      "group": groups[i] if groups is not None else f"{step}:{i}", "source": source,
                      "sample": to_json(s)}
            lines.append(json.dumps(record, separators=(",", ":")) + "\n")
        path = self._writable_segment(start)
        payload = "".join(lines).encode()
        with path.open("ab") as fh:
            half = len(payload) // 2
            fh.write(payload[:half])
            fh.flush()
            kill_point("store", step)  # tests: a crash here leaves a torn record for the next open to cut
            fh.write(payload[half:])
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        p, first, n = self._segments[-1]
        self._segments[-1] = (p, first, n + len(samples))
        return start, start + len(samples)

    def _writable_segment(self, start: int) -> Path:
        if self._segments and self._segments[-1][2] < self.segment_max_records:
            return self._segments[-1][0]
        path = self.directory / f"segment-{start:012d}.jsonl"
        path.touch()
        self._fsync_dir()
        self._segments.append((path, start, 0))
        return path

    def _fsync_dir(self) -> None:
        if self.fsync:
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def truncate(self, offset: int) -> int:
        """Drop every record with index >= offset (a resumed run rolling back to its checkpoint); returns
        how many were dropped."""
        total = len(self)
        if offset > total:
            raise ValueError(f"cannot truncate a store of {total} records to {offset}: records were lost "
                             "(the store is older than the checkpoint that points into it)")
        if offset < 0:
            raise ValueError("offset must be >= 0")
        kept = []
        for path, first, n in self._segments:
            if first >= offset and first > 0:
                path.unlink()
                continue
            if first + n > offset:
                cut = _segment_lines(path)[offset - first] if offset - first < n else path.stat().st_size
                with path.open("r+b") as fh:
                    fh.truncate(cut)
                    fh.flush()
                    os.fsync(fh.fileno())
                n = offset - first
            kept.append((path, first, n))
        self._segments = kept
        self._fsync_dir()
        return total - offset

    # ---- reading ------------------------------------------------------------------------------------------

    def raw_records(self, start: int = 0) -> Iterator[dict[str, Any]]:
        for path, first, n in self._segments:
            if first + n <= start:
                continue
            with path.open() as fh:
                for i, line in enumerate(fh):
                    if i >= n:
                        break
                    if first + i >= start:
                        yield json.loads(line)

    def records(self, start: int = 0) -> Iterator[StoreRecord]:
        for r in self.raw_records(start):
            yield StoreRecord(index=r["index"], step=r["step"], stage=r["stage"], group=r["group"],
                              source=r["source"], sample=from_json(r["sample"]))

    def trajectories(self, start: int = 0) -> Iterator[ScoredTrajectory]:
        for r in self.records(start):
            yield r.sample

    def rows(self) -> Iterator[dict[str, Any]]:
        """Flat rows for analysis: one per trajectory, scalar columns plus the token lists."""
        for r in self.records():
            s, t = r.sample, r.sample.trajectory
            yield {"index": r.index, "step": r.step, "stage": r.stage, "group": r.group, "source": r.source,
                   "task_id": t.task.task_id, "policy_version": t.policy_version, "stop_reason": t.stop_reason.value,
                   "reward": s.total_reward, "masked": s.reward.masked, "success": s.success,
                   "num_tokens": len(t.token_ids), "num_generated_tokens": t.num_generated_tokens,
                   "token_ids": list(t.token_ids), "loss_mask": list(t.loss_mask), "logprobs": list(t.logprobs)}

    def to_pandas(self):
        """The `rows()` as a pandas DataFrame (pandas is optional: `pip install pandas`)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError("TrajectoryStore.to_pandas needs pandas; iterate rows() instead") from exc
        return pd.DataFrame(list(self.rows()))
