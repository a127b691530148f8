"""Processes of a sharded run (`learner.backend=fsdp|deepspeed`; docs/scale-out.md, "Training"): `agentgrad
train learner.world_size=N` re-runs itself under `torch.distributed.run` (N processes, gloo or nccl on
127.0.0.1); under a launcher (torchrun, deepspeed: RANK and WORLD_SIZE set) each process joins the process
group, rank 0 runs the pipeline and the others follow its learner (`backends/distributed.py`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import NoReturn

from agentgrad.config import Config


def launched() -> bool:
    """Whether a launcher started this process as one rank of several (torchrun, deepspeed, our re-run)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_relaunch(config: Config) -> bool:
    return config.learner.world_size > 1 and not launched()


def relaunch(world_size: int, argv: Sequence[str]) -> int:
    """Run this command again as `world_size` processes under torch.distributed.run; its exit status (a rank
    that fails or is killed takes the others down with it)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "agentgrad.cli", *argv]
    return subprocess.run(command, check=False).returncode


def uses_cuda(config: Config) -> bool:
    return config.model.device.startswith("cuda")


def init_processes(config: Config) -> int:
    """Join (or, for one process without a launcher, create) the default process group; this process's rank."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank()
    if launched():
        # a rank that dies of a native fault (SIGSEGV, SIGABRT from glibc's heap checks, ...) prints every
        # thread's Python stack before the launcher tears the run down: without it the only trace is the signal.
        # An embedding whose stderr has no file descriptor goes without (io.UnsupportedOperation is both).
        with contextlib.suppress(ValueError, OSError):
            faulthandler.enable(file=sys.stderr, all_threads=True)
    # one process, no launcher: a group of one on loopback, its variables set only while the group forms (child
    # processes, e.g. a later `agentgrad train` started from this one, must not look launched)
    alone = {} if launched() else {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(free_port())}
    os.environ.update(alone)
    try:
        cuda = uses_cuda(config)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if config.learner.backend == "deepspeed":
            if not cuda:
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            from agentgrad.backends.deepspeed import init_distributed

            init_distributed("nccl" if cuda else "gloo")
        else:
            dist.init_process_group("nccl" if cuda else "gloo")
    finally:
        for key in alone:
            os.environ.pop(key, None)
    return dist.get_rank()


def follow_rank_zero(config: Config) -> None:
    """A rank > 0: serve rank 0's learner until it says stop."""
    import torch

    from agentgrad.backends.distributed import follow
    from agentgrad.models.hf import load_model
    from agentgrad.models.lora import merge_saved_adapter

    torch.set_num_threads(config.run.threads)

    def load(path: str, dtype: str, device: str):
        loaded = load_model(path, dtype=dtype, device=device)
        return merge_saved_adapter(loaded.model, path)  # as build_components does for rank 0

    try:
        follow(load)
    finally:
        leave_processes()
    end_rank_process()


def leave_processes() -> None:
    """Tear the default process group down, if this process joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_rank_process() -> NoReturn:
    """End a rank of a sharded run that finished cleanly (its files written and closed) without the
    interpreter's finalization. gloo completes a collective on its worker thread, which drops the finished work
    (and its tensors) a moment later; after the last broadcast ("stop") that moment can fall inside finalization,
    the drop needs the GIL, and the process aborts (SIGABRT, "terminate called without an active exception";
    core dump: ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> take_gil -> pthread_exit). Seen on rank 0 in
    CI, about 1 run in 10 on a loaded 2-core machine. destroy_process_group does not prevent it: FSDP's device
    mesh keeps the group, and so its worker threads, alive until finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def world_size_error(config: Config) -> str | None:
    """Under a launcher: a config that disagrees with it, as one line (None when they agree)."""
    if not launched():
        return None
    world = int(os.environ["WORLD_SIZE"])
    if config.learner.world_size not in (1, world):
        return (f"learner.world_size={config.learner.world_size} but the launcher started {world} processes "
                "(leave learner.world_size at 1 under torchrun/deepspeed, or make them match)")
    if world > 1 and config.learner.backend == "torch":
        return (f"{world} processes with learner.backend=torch (one process): set learner.backend=fsdp or "
                "learner.backend=deepspeed")
    return None
