"""Uids leased to one pool, unique across every process on the machine.

As root each pool slot runs its code under a uid of its own. Two pools sharing uids (two runs on one machine,
`eval` during training, two suites in one process) could read each other's processes through `/proc/PID/mem`
and exhaust each other's per-uid process limit, so uids come in blocks of `BLOCK` and a pool holds each of its
blocks by an exclusive `flock` on a lock file named after the block. The lock lives as long as the open file
description: the pool and its servers (which inherit the descriptor) hold it, and the kernel drops it when the
last of them exits, however it exits, so a crash never leaks a lease. A block is also skipped while any process
runs under one of its uids (a stale or foreign user).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass

BLOCK = 64  # uids per lock file
MAX_BLOCKS = 4096  # blocks tried from the base: 262,144 uids
LOCK_DIRS = ("/run/lock", "/dev/shm")  # the first that exists, then the temp dir: one place for every process


class UidLeaseError(RuntimeError):
    """No free block of uids (or no place for the lock files)."""


@dataclass(frozen=True)
class UidLease:
    uids: tuple[int, ...]  # slot i runs as uids[i]
    fds: tuple[int, ...]  # the locked files' descriptors: pass them to the servers, close them to release

    def release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


def lock_dir() -> str:
    base = next((d for d in LOCK_DIRS if os.path.isdir(d) and os.access(d, os.W_OK)), tempfile.gettempdir())
    path = os.path.join(base, "agentgrad-sandbox-uids")
    os.makedirs(path, mode=0o755, exist_ok=True)
    return path


def _uids_in_use() -> set[int]:
    used = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                used.add(os.stat(f"/proc/{name}").st_uid)
            except OSError:
                pass
    return used


def lease_uids(base: int, count: int) -> UidLease:
    """Lock ceil(count / BLOCK) free blocks of uids at or above `base`; the first `count` uids are the lease."""
    need = -(-count // BLOCK)
    directory = lock_dir()
    used = _uids_in_use()
    fds: list[int] = []
    uids: list[int] = []
    for k in range(MAX_BLOCKS):
        if len(fds) == need:
            break
        start = base + k * BLOCK
        if any(start <= u < start + BLOCK for u in used):
            continue
        fd = os.open(os.path.join(directory, f"{start}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        fds.append(fd)
        uids.extend(range(start, start + BLOCK))
    if len(fds) < need:
        UidLease((), tuple(fds)).release()
        raise UidLeaseError(f"no free block of {BLOCK} sandbox uids from {base} (lock files in {directory})")
    return UidLease(tuple(uids[:count]), tuple(fds))
