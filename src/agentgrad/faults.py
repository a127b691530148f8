"""Fault handling shared by the pipelines: typed errors, and a deterministic crash hook for tests.

`kill_point(name, step)` lets tests SIGKILL a real training process at a named place (mid-rollout, mid-update,
mid-checkpoint-write, ...) so crash recovery is tested against real kills, not simulated exceptions. It is a
no-op unless the environment variable `AGENTGRAD_KILL_AT` names that point, e.g. `AGENTGRAD_KILL_AT=update:3`
(kill at the first `update` point of step 3) or `AGENTGRAD_KILL_AT=store` (at the first `store` point).
No torch here.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "AGENTGRAD_KILL_AT"

KILL_POINTS = ("rollout", "update", "store", "checkpoint", "checkpoint_pointer", "after_checkpoint")
"""Where `kill_point` is called: after a step's rollouts; after the first optimizer step of an update; halfway
through writing a store batch (a torn last record); after a checkpoint's files are written but before its
directory is renamed into place; after the rename but before `checkpoints/LATEST` points at it; after the
pointer (the step is fully durable)."""


class NonFiniteLossError(RuntimeError):
    """Too many consecutive updates had a non-finite loss; the run stops rather than train on garbage."""


def kill_point(name: str, step: int | None = None) -> None:
    """SIGKILL this process if `AGENTGRAD_KILL_AT` is `name` or `name:step`. Nothing runs after a SIGKILL
    (no finally blocks, no flushes), which is exactly the crash the store and checkpoints must survive."""
    target = os.environ.get(KILL_ENV)
    if not target:
        return
    point, _, at = target.partition(":")
    if point != name:
        return
    if at and (step is None or int(at) != step):
        return
    os.kill(os.getpid(), signal.SIGKILL)
