"""The code base passes `ruff check` with the committed config ([tool.ruff] in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATHS = ("src", "tests", "benchmarks", "examples")


def _ruff() -> str | None:
    """The ruff of this interpreter's environment (the dev extra pins it), else the one on PATH."""
    beside = Path(sys.executable).with_name("ruff")
    if beside.is_file():
        return str(beside)
    return shutil.which("ruff")


def test_ruff_check_is_clean():
    ruff = _ruff()
    if ruff is None:  # fail, not skip: CI installs the dev extra, which pins ruff
        pytest.fail("ruff is not installed: install the dev extra (pip install -e '.[dev]') to get the pinned ruff")
    proc = subprocess.run([ruff, "check", "--no-cache", *PATHS], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"ruff check failed ({ruff}):\n{proc.stdout}{proc.stderr}"
