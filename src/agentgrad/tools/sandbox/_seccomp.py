"""The syscall filter: what namespaces do not cover, built with libseccomp, installed per call.

Namespaces cannot scope the kernel keyring (keys of a uid outlive its processes) and cannot tell a unix socket
from a file (a socket bound to a path is reached through the filesystem). The filter makes these fail with EPERM:

* `add_key`, `request_key`, `keyctl` (the keyring);
* `socket(AF_UNIX, ...)` (a seccomp filter cannot read the path a `connect`/`bind` names, so unix sockets are
  refused at creation; `socketpair` still works, and abstract sockets are per network namespace anyway);
* `unshare`, `setns`, `mount`, `umount2`, `pivot_root`, `chroot`, and `clone` with a namespace flag (nested
  namespaces are kernel attack surface the code never needs); `clone3` fails with ENOSYS, so libc falls back to
  `clone`, whose flags the filter can read (as Docker's default profile does).

System calls of another architecture (32-bit ones from a 64-bit process) kill the thread.

libseccomp (`libseccomp.so.2`, on nearly every distribution: systemd needs it) is used through ctypes: the
filter is compiled once per server (`build_filter()`), exported as raw BPF, and each call only loads it with one
`prctl` (`install()`). Without libseccomp `build_filter()` returns None and the caller warns.
"""

from __future__ import annotations

import ctypes
import errno
import os

from ._linux import NAMESPACE_FLAGS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prctl

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7
AF_UNIX = 1  # not from `socket`: the server stays lean

BLOCKED_EPERM = ("add_key", "request_key", "keyctl", "unshare", "setns", "mount", "umount2", "pivot_root",
                 "chroot", "fsopen", "fsmount", "open_tree", "move_mount")
BLOCKED_ENOSYS = ("clone3",)


def _errno_action(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)  # SCMP_ACT_ERRNO(err)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Filter:
    """A compiled BPF program, ready to load in a process that has set no_new_privs."""

    def __init__(self, bpf: bytes) -> None:
        self._buf = ctypes.create_string_buffer(bpf, len(bpf))
        self._prog = _SockFprog(len(bpf) // 8, ctypes.addressof(self._buf))  # 8 bytes per sock_filter
        self.instructions = len(bpf) // 8

    def install(self) -> None:
        if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._prog)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp: {os.strerror(err)}")


def _load_libseccomp() -> ctypes.CDLL | None:
    for name in ("libseccomp.so.2", "libseccomp.so"):  # no ctypes.util: it imports subprocess & co
        if name:
            try:
                so = ctypes.CDLL(name, use_errno=True)
            except OSError:
                continue
            so.seccomp_init.restype = ctypes.c_void_p
            so.seccomp_init.argtypes = [ctypes.c_uint32]
            so.seccomp_release.argtypes = [ctypes.c_void_p]
            so.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
            so.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                                  ctypes.POINTER(_ArgCmp)]
            so.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
            return so
    return None


def build_filter() -> tuple[Filter | None, str | None]:
    """(the filter, None), or (None, why not)."""
    so = _load_libseccomp()
    if so is None:
        return None, "libseccomp.so.2 not found (apt-get install libseccomp2)"
    ctx = so.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return None, "seccomp_init failed"
    try:
        def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
            nr = so.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return  # not a syscall of this architecture (e.g. an old kernel's headers): nothing to block
            args = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
            ret = so.seccomp_rule_add_array(ctx, action, nr, len(cmps), args)
            if ret != 0:
                raise OSError(-ret, f"seccomp_rule_add({name}): {os.strerror(-ret)}")

        for name in BLOCKED_EPERM:
            rule(_errno_action(errno.EPERM), name)
        for name in BLOCKED_ENOSYS:
            rule(_errno_action(errno.ENOSYS), name)
        rule(_errno_action(errno.EPERM), "socket", (0, SCMP_CMP_EQ, AF_UNIX, 0))
        for flag in NAMESPACE_FLAGS:
            rule(_errno_action(errno.EPERM), "clone", (0, SCMP_CMP_MASKED_EQ, flag, flag))
        r, w = os.pipe()
        try:
            ret = so.seccomp_export_bpf(ctx, w)
            os.close(w)
            w = -1
            if ret != 0:
                return None, f"seccomp_export_bpf failed: {os.strerror(-ret)}"
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        return Filter(b"".join(chunks)), None
    except OSError as exc:
        return None, str(exc)
    finally:
        so.seccomp_release(ctx)
