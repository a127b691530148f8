"""What a fork server does once, at start-up, to isolate itself (and so every call it forks).

* namespaces (root): new network and IPC namespaces, a new mount namespace whose root is an **allow-list**: a fresh
  tmpfs holding read-only binds of the system directories the interpreter needs (`/usr`, `/bin`, `/lib*`), a few
  files of `/etc`, the Python installation and `readonly_paths`, a minimal `/dev`, a private `/tmp` and
  `/dev/shm`, and `/proc`; `pivot_root` into it and detach the host's root. Nothing else of the host is reachable
  by path. The code later runs as a uid leased to this pool alone.
* userns (no root, or forced): the same inside a user namespace; the code keeps the user's uid, without
  capabilities.
* rlimits: none of this (a documented, warned degradation).

Per call (in `_server.py`) each call also gets a new PID and IPC namespace, its own `/proc`, rlimits, the uid
drop and the syscall filter (`_seccomp.py`).
"""

from __future__ import annotations

import os
import stat
import sys

from . import _linux as L
from ._seccomp import Filter, build_filter

TYPE_CHECKING = False  # not `typing`'s: the server does not import typing (its pages slow every fork)
if TYPE_CHECKING:
    from typing import Any

# Visible (read-only) in the allow-list root, when they exist. Symlinks (merged /usr) are recreated as symlinks.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Of /etc only what the loader, libc and the standard library read; the rest (credentials, service configs) is
# not there at all.
ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group",
             "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf", "/etc/localtime", "/etc/timezone",
             "/etc/os-release", "/etc/mime.types", "/etc/protocols", "/etc/services", "/etc/alternatives",
             "/etc/ssl/certs", "/etc/ca-certificates")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
NEW_ROOT_AT = ("/tmp", "/mnt", "/var/tmp")  # where the new root is built (covered only in our mount namespace)


class Isolation:
    """The server's isolation state, filled in by `setup()`; `capabilities()` reports it to the host."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.warnings: list[str] = []
        self.mode = "rlimits"
        self.netns = self.ipcns = self.fs_isolated = False
        self.visible: list[str] = []
        self.hidden: list[str] = []
        self.pidns = "none"  # "setns" | "intermediate" | "none"
        self.self_pidns_fd = -1
        self.per_call_proc = False  # the init mounts a /proc of the call's PID namespace
        self.drop = "none"  # "uid" | "caps" | "none"
        self.uid: int | None = None
        self.seccomp: Filter | None = None

    # ---- start-up ------------------------------------------------------------------------------------------

    def setup(self) -> None:
        want, euid = self.cfg["isolation"], os.geteuid()
        if want == "rlimits":
            self.warnings.append("isolation='rlimits' requested: no network, filesystem, IPC or PID isolation")
        elif euid == 0 and want in ("auto", "namespaces"):
            self.mode = "namespaces"
            self._try_net_ipc()
            self._try_fs()
        else:
            self._setup_userns(as_root=euid == 0)
        if self.mode != "rlimits":
            self._probe_pidns()
            if self.pidns == "none":
                self.warnings.append("PID namespaces unavailable: stray processes are killed by process group "
                                     "and subreaper sweeps instead")
            self.per_call_proc = self.pidns != "none" and self.fs_isolated and bool(self.cfg["private_proc"])
        if euid == 0 and self.mode != "userns":
            self.drop, self.uid = "uid", int(self.cfg["uid"])
        elif self.mode == "userns":
            self.drop = "caps"
        self.seccomp, why = build_filter()
        if self.seccomp is None:
            self.warnings.append(f"no syscall filter ({why}): the code can use the kernel keyring (kept per uid "
                                 "across calls) and unix sockets inside visible directories")

    def _setup_userns(self, *, as_root: bool) -> None:
        if as_root:
            # 'userns' forced as root (used by tests): build the root as root first (an unprivileged user could
            # not reach a Python installed under /root), then become the pool's uid and continue as that user.
            self._try_fs()
            uid = gid = int(self.cfg["uid"])
            if self.fs_isolated:
                os.chown("/tmp", uid, gid)  # our private /tmp: the server creates the working directories
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            L.prctl(L.PR_SET_DUMPABLE, 1)  # setuid made us non-dumpable: /proc/self/uid_map would be root's
        uid, gid = os.getuid(), os.getgid()
        try:
            L.unshare(L.CLONE_NEWUSER)
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            self.mode = "userns"
        except OSError as exc:
            self.warnings.append(f"user namespaces unavailable ({exc}); falling back to rlimits only: "
                                 "no network, filesystem, IPC or PID isolation")
            if self.fs_isolated:
                self.warnings.append("filesystem isolated, but no user namespace")
            return
        self._try_net_ipc()
        if as_root and self.fs_isolated:
            L.unshare(L.CLONE_NEWNS)  # a mount namespace owned by our user namespace: the mounts stay locked
        else:
            self._try_fs()

    def _try_net_ipc(self) -> None:
        try:
            L.unshare(L.CLONE_NEWNET)
            self.netns = True
        except OSError as exc:
            self.warnings.append(f"network namespace unavailable ({exc}): sandboxed code HAS NETWORK ACCESS")
        try:
            L.unshare(L.CLONE_NEWIPC)
            self.ipcns = True
        except OSError as exc:
            self.warnings.append(f"IPC namespace unavailable ({exc}): the code sees the host's SysV IPC objects "
                                 "and may leave its own behind")

    def _try_fs(self) -> None:
        try:
            L.unshare(L.CLONE_NEWNS)
        except OSError as exc:
            self.warnings.append(f"mount namespace unavailable ({exc}): sandboxed code can READ every file its "
                                 "uid can (and write where its uid may)")
            return
        try:
            self.visible, self.hidden = build_root(self.cfg)
            self.fs_isolated = True
        except OSError as exc:
            self.warnings.append(f"filesystem isolation failed ({exc}): sandboxed code can READ every file its "
                                 "uid can")

    def _probe_pidns(self) -> None:
        """Per call we need a fresh PID namespace. Cheapest: unshare(CLONE_NEWPID) + fork + setns back (needs
        privilege over the original namespace); else an intermediate process. Probed in a throwaway child."""
        try:
            self.self_pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.self_pidns_fd = -1
        for strategy in ("setns", "intermediate"):
            if strategy == "setns" and self.self_pidns_fd < 0:
                continue
            pid = os.fork()
            if pid == 0:
                os._exit(_probe_child(strategy, self.self_pidns_fd))
            _, status = os.waitpid(pid, 0)
            if status == 0:
                self.pidns = strategy
                return

    # ---- report --------------------------------------------------------------------------------------------

    def capabilities(self, server_pid: int) -> dict[str, Any]:
        proc = ("this call's PID namespace only (mounted per call)" if self.per_call_proc
                else "the server's (host PID namespace)" if self.fs_isolated else "all processes (host /proc)")
        return {
            "mode": self.mode,
            "network_isolated": self.netns,
            "ipc_isolated": self.ipcns,  # and a fresh IPC namespace per call
            "filesystem_isolated": self.fs_isolated,
            "visible_paths": list(self.visible),  # everything else of the host is absent
            "hidden_paths": list(self.hidden),
            "pid_namespace": self.pidns != "none",
            "proc": proc,
            "privileges": {"uid": f"dropped to uid {self.uid}", "caps": "user namespace, no capabilities",
                           "none": "unchanged (not root)"}[self.drop],
            "uid": self.uid,
            "syscall_filter": self.seccomp is not None,
            "no_new_privs": True,
            "rlimits": ["cpu", "as", "fsize", "nproc", "nofile", "core"],
            "process_cleanup": "pid namespace + subreaper" if self.pidns != "none" else "process group + subreaper",
            "server_pid": server_pid,
            "warnings": list(self.warnings),
        }


def _probe_child(strategy: str, pidns_fd: int) -> int:
    try:
        L.unshare(L.CLONE_NEWPID)
        q = os.fork()
        if q == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        _, st = os.waitpid(q, 0)
        if st != 0:
            return 1
        if strategy == "setns":
            L.setns(pidns_fd, L.CLONE_NEWPID)
            q = os.fork()
            if q == 0:
                os._exit(0)
            os.waitpid(q, 0)
        return 0
    except BaseException:
        return 1


# ---- the allow-list root ---------------------------------------------------------------------------------------


def allowed_paths(cfg: dict[str, Any]) -> list[str]:
    """Host paths visible in the sandbox: system directories, a few of /etc, the Python installation, extras."""
    python = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    extra = {os.path.realpath(p) for p in cfg.get("readonly_paths", ())}
    etc = list(ETC_PATHS) + sorted(f"/etc/{n}" for n in os.listdir("/etc") if n.startswith("python3"))
    # (Debian's python reads /etc/python3.X)
    paths = [p for p in (*SYSTEM_PATHS, *etc) if os.path.lexists(p)]
    paths += sorted(p for p in python | extra if os.path.exists(p))
    out: list[str] = []
    for p in paths:  # drop what an earlier (real) directory already shows; symlinks are kept as links
        where = p if os.path.islink(p) else os.path.realpath(p)
        if not any(L.is_under(where, q) for q in out if not os.path.islink(q)):
            out.append(p)
    return out


def hidden_inside(visible: list[str], hide: Any) -> list[str]:
    """The `hide` directories that a visible directory would show (the rest are absent anyway); never one that
    holds a visible path (the project root holding the venv)."""
    dirs = [v for v in visible if not os.path.islink(v) and os.path.isdir(v)]
    out = []
    for p in sorted({os.path.realpath(h) for h in hide if h}):
        if (os.path.isdir(p) and any(L.is_under(p, v) for v in dirs) and not any(L.is_under(v, p) for v in dirs)
                and not any(L.is_under(p, o) for o in out)):
            out.append(p)
    return out


def build_root(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Build the allow-list root in this (new, private) mount namespace and pivot into it. Returns (what is
    visible, what of it is covered). Sources are opened first (O_PATH) and bound through /proc/self/fd, so a source
    that lives where the new root is built (a checkout under /tmp) still works."""
    L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)
    paths = allowed_paths(cfg)
    fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in paths if not os.path.islink(p)}
    fds.update({f"/dev/{n}": os.open(f"/dev/{n}", os.O_PATH | os.O_CLOEXEC) for n in DEV_NODES
                if os.path.exists(f"/dev/{n}")})
    proc_fd = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    root = next(p for p in NEW_ROOT_AT if os.path.isdir(p) and not os.path.islink(p))
    try:
        L.mount("tmpfs", root, "tmpfs", L.MS_NOSUID | L.MS_NODEV, "mode=0755,size=1m")
        # The private /tmp first: a visible path under the host's /tmp (a checkout and its venv cloned there) is
        # then bound on top of it, where mounting /tmp afterwards would cover it.
        os.mkdir(root + "/tmp", 0o711)
        L.mount("tmpfs", root + "/tmp", "tmpfs", L.MS_NOSUID | L.MS_NODEV, f"mode=0711,size={int(cfg['tmp_mb'])}m")
        for p in paths:
            _bind_into(root, p, fds.get(p))
        _make_dev(root, fds)
        _make_proc(root, proc_fd)
        hidden = hidden_inside(paths, cfg.get("hide_paths", ()))
        for p in hidden:
            L.mount("tmpfs", root + p, "tmpfs", L.MS_NOSUID | L.MS_NODEV, "mode=0755,size=64k")
        os.mkdir(root + "/.oldroot")
        L.pivot_root(root, root + "/.oldroot")
    finally:
        for fd in (*fds.values(), proc_fd):
            os.close(fd)
    os.chdir("/")
    L.umount("/.oldroot")
    os.rmdir("/.oldroot")
    _remount_read_only()
    return paths, hidden


def _bind_into(root: str, path: str, fd: int | None) -> None:
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if fd is None:  # a symlink (merged /usr: /bin -> usr/bin): the same link, resolved inside the new root
        os.symlink(os.readlink(path), target)
        return
    if stat.S_ISDIR(os.fstat(fd).st_mode):  # from the fd: the host path may lie where the new root now stands
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        open(target, "w").close()
    L.mount(f"/proc/self/fd/{fd}", target, None, L.MS_BIND | L.MS_REC)


def _make_dev(root: str, fds: dict[str, int]) -> None:
    dev = root + "/dev"
    os.mkdir(dev, 0o755)
    L.mount("tmpfs", dev, "tmpfs", L.MS_NOSUID | L.MS_NOEXEC, "mode=0755,size=64k")
    for name in DEV_NODES:
        if f"/dev/{name}" in fds:
            open(f"{dev}/{name}", "w").close()
            L.mount(f"/proc/self/fd/{fds[f'/dev/{name}']}", f"{dev}/{name}", None, L.MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(dev + "/shm")
    L.mount("tmpfs", dev + "/shm", "tmpfs", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC, "mode=1777,size=16m")


def _make_proc(root: str, proc_fd: int) -> None:
    os.mkdir(root + "/proc", 0o555)
    try:
        L.mount("proc", root + "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
    except OSError:  # a user namespace that does not own our PID namespace: the host's /proc, as it is
        L.mount(f"/proc/self/fd/{proc_fd}", root + "/proc", None, L.MS_BIND | L.MS_REC)


def _remount_read_only() -> None:
    """Every mount but /tmp, /dev/shm and /proc read-only (per-mount flag: MS_BIND is essential here)."""
    for mountpoint, opts in L.mounts():
        if mountpoint in ("/tmp", "/dev/shm") or L.is_under(mountpoint, "/proc"):
            continue
        try:
            L.mount(None, mountpoint, None, L.MS_REMOUNT | L.MS_BIND | L.MS_RDONLY | L.remount_flags(opts))
        except OSError:
            if mountpoint == "/":
                raise  # the new root itself must not be writable
