"""Linux system calls (ctypes), host <-> server message framing, and small process helpers.

Shared by the host and the fork server; standard library only, and lean: every page the server maps makes each
per-call fork slower.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import select
import struct
import time

TYPE_CHECKING = False  # not `typing`'s: the server does not import typing (its pages slow every fork)
if TYPE_CHECKING:
    from typing import Any

ENV_MARKER = "AGENTGRAD_SANDBOX_POOL"  # every server (and so every process it forks) carries the pool's token

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACE_FLAGS = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
                   CLONE_NEWNET)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 38, 47, 4
SECCOMP_MODE_FILTER = 2

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

_libc: Any = None


def lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        for name in ("unshare", "setns", "umount2"):
            getattr(_libc, name).restype = ctypes.c_int
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                                ctypes.c_char_p]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc.syscall.restype = ctypes.c_long
    return _libc


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    check(lib().unshare(flags), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    check(lib().setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(lib().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def umount(target: str) -> None:
    check(lib().umount2(target.encode(), MNT_DETACH), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {os.uname().machine}")
    check(lib().syscall(nr, new_root.encode(), put_old.encode()), "pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    return lib().prctl(option, arg2, arg3, 0, 0)


def drop_all_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets (user-namespace mode)."""
    libc = lib()
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    check(libc.capset(header, data), "capset")


def is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of this mount namespace, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mountpoint = parts[4].encode().decode("unicode_escape") if "\\" in parts[4] else parts[4]
            out.append((mountpoint, set(parts[5].split(","))))
    return out


def remount_flags(opts: set[str]) -> int:
    """The per-mount flags to pass again when remounting (a user namespace may not clear locked ones)."""
    flags = 0
    for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC),
                      ("noatime", MS_NOATIME), ("nodiratime", MS_NODIRATIME), ("relatime", MS_RELATIME)):
        if name in opts:
            flags |= bit
    return flags


# ---- host <-> server framing: 4-byte big-endian length + JSON ---------------------------------------------


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def send(fd: int, obj: Any) -> None:
    payload = json.dumps(obj).encode()
    write_all(fd, struct.pack(">I", len(payload)) + payload)


def read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """Read n bytes; None on EOF; TimeoutError past `deadline` (monotonic)."""
    chunks: list[bytes] = []
    while n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(fd: int, deadline: float | None = None) -> Any:
    head = read_exact(fd, 4, deadline)
    if head is None:
        return None
    body = read_exact(fd, struct.unpack(">I", head)[0], deadline)
    return None if body is None else json.loads(body)


# ---- processes, descriptors, limits --------------------------------------------------------------------------


def clamp_limit(lim: int, soft: int, hard: int) -> tuple[int, int]:
    """(soft, hard) no higher than the current hard limit (lowering is always allowed, raising is not)."""
    cur_hard = resource.getrlimit(lim)[1]
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    return soft, hard


MAX_FD = max(1024, min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20))


def close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, MAX_FD)


def proc_stat(pid: str) -> tuple[int, int] | None:
    """(ppid, pgid) of a process from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[1]), int(fields[2])


def children_of(ppid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(name)
            if st and st[0] == ppid:
                out.append(int(name))
    return out


def count_processes_of(uid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def threading_count() -> int:
    """Threads of this process (from /proc, without importing threading)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def rmtree(path: str) -> bool:
    """Remove a tree without following symlinks (shutil would cost the server ~1 MiB of imports)."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return True
        for _root, dirs, files, rootfd in os.fwalk(path, topdown=False):
            for name in files:
                os.unlink(name, dir_fd=rootfd)
            for name in dirs:
                try:
                    os.rmdir(name, dir_fd=rootfd)
                except NotADirectoryError:  # a symlink to a directory
                    os.unlink(name, dir_fd=rootfd)
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
