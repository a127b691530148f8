"""`agentgrad train` in a process of its own, started without paying for the interpreter's imports each time.

The kill/resume tests start `agentgrad train` many times only to SIGKILL it a second into its work; a fresh
interpreter spends ~6 s of each start importing torch, transformers and (at the first checkpoint, through
accelerate's `save_pretrained`) deepspeed. Here a fork server (multiprocessing's `forkserver`, started once per
test session) imports those modules once, and each run is a fresh child forked from it: its own process (own pid,
own memory, killed by a real SIGKILL with nothing of it surviving but its files), with the caller's environment
and `agentgrad.cli.main` run on `agentgrad train ARGS` as the console script runs it. The server imports only
modules (it runs nothing), so each child starts from the state a fresh interpreter reaches after the same imports.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What a train run imports (an ImportError, e.g. an extra not installed, is skipped by the server).
PRELOAD = [
    "agentgrad.cli", "agentgrad.pipelines.train", "agentgrad.pipelines.components", "agentgrad.checkpoint",
    "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2", "transformers.tokenization_utils_fast",
    "accelerate", "safetensors.torch", "deepspeed", "peft",
]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["agentgrad", "train", *args]
    from agentgrad.cli import main

    main()  # exits through SystemExit, which multiprocessing turns into the exit code


def agentgrad_train(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `agentgrad train ARGS` under `env` in a forked child; returncode is -9 for a SIGKILL, as subprocess
    reports it."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
        proc = _context().Process(target=_child, args=(list(args), dict(env), out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["agentgrad", "train", *args], timeout)
        return subprocess.CompletedProcess(["agentgrad", "train", *args], proc.exitcode,
                                           Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))
