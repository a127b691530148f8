"""Fixtures shared by more than one integration module."""

from __future__ import annotations

import hashlib

import pytest


def _digests(directory):
    return {p.relative_to(directory): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def bc_start(tmp_path_factory):
    """The BC-warmed start that test_algorithms_tiny.py's algorithms and test_lora_tiny.py's LoRA GRPO lift from:
    BC on the FAST shape with the run's own stop rule (a partial policy). Built once per session (it takes ~18 s)
    and only read: its checkpoint must be bit for bit the same when the session ends."""
    from test_train_tiny import FAST

    from agentgrad.config import build_config
    from agentgrad.pipelines.train import train

    root = tmp_path_factory.mktemp("bc")
    summary = train(build_config(overrides=[*FAST, "algo=bc", f"run.output_dir={root}"]))
    start = summary["final_eval"]
    assert 0.1 <= start["success_rate"] <= 0.7, f"BC's stop rule handed on {start['success_rate']:.0%}"
    checkpoint = root / "fast" / "checkpoints" / "bc"
    before = _digests(checkpoint)
    yield checkpoint, start
    assert _digests(checkpoint) == before, "a test wrote into the shared BC checkpoint"
