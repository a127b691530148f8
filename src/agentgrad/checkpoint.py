"""Checkpoints in Hugging Face format (so `agentgrad eval` and `model.path=` load them like any model),
plus the optimizer state. Written to a temporary directory and renamed, so a crash never leaves half a
checkpoint under the final name."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch


def save_checkpoint(directory: str | Path, model, tokenizer, optimizer: torch.optim.Optimizer | None = None,
                    extra_files: Mapping[str, Callable[[Path], None]] | None = None) -> Path:
    """`extra_files`: file name -> writer (e.g. a factored tool head's weights), written before the rename."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    for name, write in (extra_files or {}).items():
        write(tmp / name)
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)
    return directory


def latest_checkpoint(run_dir: str | Path) -> Path:
    """`checkpoints/final` if the run finished, else the most recently written checkpoint."""
    root = Path(run_dir) / "checkpoints"
    if (root / "final").is_dir():
        return root / "final"
    candidates = [p for p in root.glob("*") if p.is_dir() and not p.name.endswith((".tmp", ".old"))]
    if not candidates:
        raise FileNotFoundError(f"no checkpoint under {root}")
    return max(candidates, key=lambda p: p.stat().st_mtime)


# ---- whole run state ----------------------------------------------------------------------------------------
#
# checkpoints/run-000007/   HF model + tokenizer, optimizer.pt, rng.pt, state.json, and named blobs (*.pt)
# checkpoints/LATEST        "run-000007": written last (tmp file + fsync + rename), so it only ever names a
#                           checkpoint whose every file is on disk. A crash at any point leaves the previous
#                           LATEST in force; `.tmp` leftovers are removed by the next save. Names never repeat,
#                           so a save never touches the directory LATEST names.

LATEST = "LATEST"
RUN_PREFIX = "run-"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    import random

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict) -> None:
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _next_name(root: Path) -> str:
    used = [int(p.name[len(RUN_PREFIX):].split(".")[0]) for p in root.glob(RUN_PREFIX + "*")
            if p.name[len(RUN_PREFIX):].split(".")[0].isdigit()]
    return f"{RUN_PREFIX}{max(used, default=0) + 1:06d}"


def save_run_state(run_dir: str | Path, step: int, model, tokenizer, optimizer: torch.optim.Optimizer,
                   state: dict, blobs: dict | None = None, *, keep: int = 2) -> Path:
    """Write the whole run state (model, optimizer, RNGs, the JSON-able `state`, `blobs` saved with torch.save
    as `<name>.pt`), then point LATEST at it. `step` (global steps done) only feeds the test kill points."""
    from agentgrad.faults import kill_point

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(RUN_PREFIX + "*.tmp"):
        shutil.rmtree(stale)
    name = _next_name(root)
    final, tmp = root / name, root / (name + ".tmp")
    tmp.mkdir()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    for key, blob in (blobs or {}).items():
        torch.save(blob, tmp / f"{key}.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    for f in tmp.iterdir():
        _fsync_path(f)
    kill_point("checkpoint", step)
    os.replace(tmp, final)
    _fsync_path(root)
    kill_point("checkpoint_pointer", step)
    pointer_tmp = root / (LATEST + ".tmp")
    with pointer_tmp.open("w") as fh:
        fh.write(name)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(pointer_tmp, root / LATEST)
    _fsync_path(root)
    kill_point("after_checkpoint", step)
    done = sorted(p for p in root.glob(RUN_PREFIX + "*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old)
    return final


def latest_run_state(run_dir: str | Path) -> tuple[Path, dict]:
    """(checkpoint dir, its state.json) for the checkpoint LATEST names; FileNotFoundError if there is none."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if not pointer.exists():
        raise FileNotFoundError(f"{run_dir} has no resumable checkpoint ({pointer} is missing)")
    directory = root / pointer.read_text().strip()
    return directory, json.loads((directory / "state.json").read_text())


def load_run_state(directory: Path, optimizer: torch.optim.Optimizer) -> dict:
    """Restore optimizer and RNG states from a run-state checkpoint and return its blobs by name. The model
    itself is loaded from `directory` like any HF checkpoint."""
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=False))
    restore_rng(torch.load(directory / "rng.pt", weights_only=False))
    return {p.stem: torch.load(p, weights_only=False) for p in directory.glob("*.pt")
            if p.stem not in ("optimizer", "rng")}
