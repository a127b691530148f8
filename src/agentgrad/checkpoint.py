"""Checkpoints in Hugging Face format (so `agentgrad eval` and `model.path=` load them like any model),
plus the optimizer state. Written to a temporary directory and renamed, so a crash never leaves half a
checkpoint under the final name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def save_checkpoint(directory: str | Path, model, tokenizer, optimizer: torch.optim.Optimizer | None = None) -> Path:
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
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
# checkpoints/step-000004/   HF model + tokenizer, optimizer.pt, rng.pt, state.json, replay.json
# checkpoints/LATEST         "step-000004": written last (tmp file + fsync + rename), so it only ever names a
#                            checkpoint whose every file is on disk. A crash at any point leaves the previous
#                            LATEST in force; `.tmp` leftovers are removed on the next save.

LATEST = "LATEST"


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


def save_run_state(run_dir: str | Path, step: int, model, tokenizer, optimizer: torch.optim.Optimizer,
                   state: dict, *, replay: dict | None = None, keep: int = 2) -> Path:
    """Write the whole run state for resuming before `step` (model, optimizer, RNGs, the JSON-able `state`:
    stage, LR, KL controller, store and metrics offsets, ...), then point LATEST at it."""
    from agentgrad.faults import kill_point

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final, tmp = root / name, root / (name + ".tmp")
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale)
    tmp.mkdir()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
    if replay is not None:
        (tmp / "replay.json").write_text(json.dumps(replay))
    for f in tmp.iterdir():
        _fsync_path(f)
    kill_point("checkpoint", step)
    if final.exists():  # a crash after the rename but before LATEST moved: LATEST still names an older one
        shutil.rmtree(final)
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
    for old in sorted(root.glob("step-*"))[:-keep]:
        if old.is_dir() and not old.name.endswith(".tmp") and old != final:
            shutil.rmtree(old)
    return final


def latest_run_state(run_dir: str | Path) -> tuple[Path, dict]:
    """(checkpoint dir, state.json) of the checkpoint LATEST names; FileNotFoundError if there is none."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if not pointer.exists():
        raise FileNotFoundError(f"{run_dir} has no resumable checkpoint ({pointer} is missing); "
                                "set run.checkpoint_every > 0 to write them")
    directory = root / pointer.read_text().strip()
    return directory, json.loads((directory / "state.json").read_text())


def load_run_state(directory: Path, optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore optimizer and RNG states from a run-state checkpoint; returns the replay buffer state (or None).
    The model itself is loaded from `directory` like any HF checkpoint."""
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=False))
    restore_rng(torch.load(directory / "rng.pt", weights_only=False))
    replay = directory / "replay.json"
    return json.loads(replay.read_text()) if replay.exists() else None
