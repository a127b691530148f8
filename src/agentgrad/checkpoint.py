"""Checkpoints in Hugging Face format (so `agentgrad eval` and `model.path=` load them like any model),
plus the optimizer state. Written to a temporary directory and renamed, so a crash never leaves half a
checkpoint under the final name."""

from __future__ import annotations

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
