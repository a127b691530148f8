"""A fast sandbox for model-written Python: a pool of warm fork servers.

Design (see docs/sandbox.md for what is and is not isolated):

* Each pool slot is one *fork server*: a fresh `python -I` process running this file. At start-up it isolates
  itself once (the expensive part): a new, empty network namespace (`unshare(CLONE_NEWNET)`; no interface is
  up, not even loopback) and a private mount namespace in which $HOME, /root, /home, /work, the project and the
  host's working directory are covered by empty read-only tmpfs mounts (the Python installation is bound back
  read-only), /tmp and /dev/shm are fresh private tmpfs, and every other mount is remounted read-only.
* Per call the server forks an *init* process in a new PID namespace (so that when it exits the kernel kills
  every process the code left behind), which forks the *child*: new session, stdio on pipes, a fresh working
  directory, rlimits (CPU, address space, file size, process count, open files, no core), an unprivileged uid
  (when the server runs as root) or no capabilities (user namespace), `no_new_privs`, then `exec()` of the code
  in a fresh `__main__`. No interpreter start-up per call: a trivial call costs a few milliseconds.
* The server reads stdout/stderr incrementally (head of stdout and tail of stderr kept, 8 KiB each; the process
  is killed once it has written `max_output_bytes`), enforces the wall-clock timeout by SIGKILLing the init
  (and the process group), and, as a child subreaper, kills and reaps anything that is left before it answers.
* Where namespaces are unavailable (no root and no unprivileged user namespaces) the server degrades to rlimits,
  process-group killing and subreaper sweeps, and says so: `SandboxPool.capabilities()["warnings"]` and a
  logged warning. `sandbox_capabilities()` reports what a pool gets on this machine.

This module uses only the standard library and is also the fork server's script (`python -I sandbox.py
--serve`), so it must never import agentgrad or anything outside the standard library at module level.
"""

from __future__ import annotations

# Only lean standard-library modules up here: this part is also the fork server, and every page the server maps
# makes each per-call fork slower. Host-side imports come after the `__main__` guard below.
import atexit
import builtins
import ctypes
import errno
import gc
import io
import json
import os
import resource
import select
import signal
import struct
import sys
import time
import types

ENV_MARKER = "AGENTGRAD_SANDBOX_POOL"  # every server (and so every process it forks) carries the pool's token

# Paths hidden from sandboxed code by default (those that exist), in addition to $HOME, the host's working
# directory and the project root. /tmp, /var/tmp and /dev/shm are replaced by private tmpfs.
DEFAULT_HIDDEN_PATHS = ("/root", "/home", "/work", "/srv", "/mnt", "/media", "/opt", "/var/tmp",
                        "/run")  # /run: daemon sockets (docker, dbus, databases) and per-user runtime dirs
# Never hidden (hiding them would break the interpreter); descendants of them may be hidden.
_PROTECTED = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/sys",
              "/dev", "/var", "/boot", "/tmp")

ISOLATION_MODES = ("auto", "namespaces", "userns", "rlimits")


# ======================================================================================================
# Low-level Linux helpers (ctypes). Used by the server; harmless to define in the host.
# ======================================================================================================

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 38, 47, 4

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        for name in ("unshare", "setns", "umount2"):
            getattr(_libc, name).restype = ctypes.c_int
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                                ctypes.c_char_p]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_lib().unshare(flags), f"unshare({flags:#x})")


def _setns(fd: int, nstype: int) -> None:
    _check(_lib().setns(fd, nstype), "setns")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_lib().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(option: int, arg2: int = 0) -> int:
    return _lib().prctl(option, arg2, 0, 0, 0)


def _drop_all_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets (user-namespace mode)."""
    lib = _lib()
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    _check(lib.capset(header, data), "capset")


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


# ======================================================================================================
# Message framing (host <-> server): 4-byte big-endian length + JSON
# ======================================================================================================


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _send(fd: int, obj: Any) -> None:
    payload = json.dumps(obj).encode()
    _write_all(fd, struct.pack(">I", len(payload)) + payload)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
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


def _recv(fd: int, deadline: float | None = None) -> Any:
    head = _read_exact(fd, 4, deadline)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack(">I", head)[0], deadline)
    return None if body is None else json.loads(body)


# ======================================================================================================
# The fork server (runs in its own `python -I sandbox.py --serve` process)
# ======================================================================================================


class _Server:
    def __init__(self, cfg: dict[str, Any], ctl_in: int, ctl_out: int) -> None:
        self.cfg = cfg
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.pid = os.getpid()
        self.warnings: list[str] = []
        self.mode = "rlimits"
        self.netns = False
        self.fs_hidden = False
        self.hidden: list[str] = []
        self.pidns = "none"  # "setns" | "intermediate" | "none"
        self.drop = "none"  # "uid" | "caps" | "none"
        self.uid: int | None = None
        self.nproc_base = 0
        self.self_pidns_fd = -1
        self.counter = 0
        self.tmp_base: str | None = "/tmp"
        self.fixed_workdir: str | None = None
        self.in_call = False
        self.shutting_down = False
        self.running: list[int] = []  # the current call's init (and intermediate) processes
        self.proc = "all processes (host /proc)"
        self.devnull = os.open(os.devnull, os.O_RDWR)
        # Built once here rather than in every child: each object a child creates or touches costs it page
        # faults on memory shared copy-on-write with this server.
        self.stdio = (
            io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"),
            io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                             errors="backslashreplace", line_buffering=True),
            io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                             errors="backslashreplace", line_buffering=True),
        )
        mib = 1024 * 1024
        self.rlimits: list[tuple[int, int, int]] = []
        for lim, value in ((resource.RLIMIT_AS, int(cfg["memory_mb"]) * mib),
                           (resource.RLIMIT_FSIZE, int(cfg["max_file_mb"]) * mib),
                           (resource.RLIMIT_NOFILE, int(cfg["max_open_files"])),
                           (resource.RLIMIT_CORE, 0)):
            self.rlimits.append((lim,) + _clamp_limit(lim, value, value))

    # ---- start-up isolation -----------------------------------------------------------------------

    def setup(self) -> dict[str, Any]:
        cfg = self.cfg
        want = cfg["isolation"]
        euid = os.geteuid()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        if want == "rlimits":
            self.warnings.append("isolation='rlimits' requested: no network, filesystem or PID isolation")
        elif euid == 0 and want in ("auto", "namespaces"):
            self.mode = "namespaces"
            self._try_netns()
            self._try_fs()
        else:
            pre_fs = False
            if euid == 0:
                # 'userns' forced as root (used by tests): hide files as root first (an unprivileged user could
                # not reach a Python installed under /root), then become an ordinary user and continue as one.
                self._try_fs()
                pre_fs = self.fs_hidden
                uid = gid = int(cfg["uid_base"]) + int(cfg["slot"])
                if pre_fs:
                    os.chown("/tmp", uid, gid)  # our private /tmp: the server creates the working directories
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                _prctl(PR_SET_DUMPABLE, 1)  # setuid made us non-dumpable: /proc/self/uid_map would be root's
            uid, gid = os.getuid(), os.getgid()
            try:
                _unshare(CLONE_NEWUSER)
                for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                                   ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                self.mode = "userns"
            except OSError as exc:
                self.warnings.append(f"user namespaces unavailable ({exc}); falling back to rlimits only: "
                                     "no network, filesystem or PID isolation")
            if self.mode == "userns":
                self._try_netns()
                if pre_fs:
                    _unshare(CLONE_NEWNS)  # a mount namespace owned by our user namespace (mounts stay locked)
                else:
                    self._try_fs()
            elif pre_fs:
                self.warnings.append("filesystem hidden, but no user namespace")
        if self.mode != "rlimits":
            self._probe_pidns()
            if self.pidns != "none" and self.fs_hidden and cfg["private_proc"] and self.mode == "userns":
                self.proc = "this call's PID namespace only (mounted per call)"
            if self.pidns == "none":
                self.warnings.append("PID namespaces unavailable: stray processes are killed by process group "
                                     "and subreaper sweeps instead")
        if os.geteuid() == 0 and self.mode != "userns":
            self.drop = "uid"
            self.uid = int(cfg["uid_base"]) + int(cfg["slot"])
        elif self.mode == "userns":
            self.drop = "caps"
        if self.drop != "uid":  # RLIMIT_NPROC counts all processes of the real uid: leave room for the user's
            self.nproc_base = _count_processes_of(os.getuid())
        nproc = int(cfg["max_procs"]) + self.nproc_base
        self.rlimits.append((resource.RLIMIT_NPROC,) + _clamp_limit(resource.RLIMIT_NPROC, nproc, nproc))
        if self.fs_hidden:
            # One call at a time per server, in its private /tmp: the same path every call (reproducible output),
            # so the code's environment can be set once, here.
            self.fixed_workdir = "/tmp/work"
            os.environ.clear()
            os.environ.update(self._code_env(self.fixed_workdir))
            sys.path.insert(0, self.fixed_workdir)
        else:
            self.tmp_base = None  # working directories go to the host's temp dir
            os.environ.update({k: v for k, v in self._code_env("/").items() if k.endswith("_THREADS")})
        for name in cfg.get("preload") or ():  # after the *_NUM_THREADS variables: no thread pools before fork
            try:
                __import__(name)
            except Exception as exc:
                self.warnings.append(f"preload of {name!r} failed: {type(exc).__name__}: {exc}")
        if threading_count() > 1:
            self.warnings.append("a preloaded module started threads in the server: forking it is unsafe")
        return self.capabilities()

    def _code_env(self, workdir: str) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PWD": workdir,
                "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", ENV_MARKER: str(self.cfg["token"])}

    def capabilities(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "network_isolated": self.netns,
            "filesystem_isolated": self.fs_hidden,
            "hidden_paths": list(self.hidden),
            "pid_namespace": self.pidns != "none",
            "proc": self.proc,  # what the code's /proc shows
            "privileges": {"uid": "dropped to uid %s" % self.uid, "caps": "user namespace, no capabilities",
                           "none": "unchanged (not root)"}[self.drop],
            "no_new_privs": True,
            "rlimits": ["cpu", "as", "fsize", "nproc", "nofile", "core"],
            "process_cleanup": "pid namespace + subreaper" if self.pidns != "none" else "process group + subreaper",
            "server_pid": self.pid,
            "warnings": list(self.warnings),
        }

    def _try_netns(self) -> None:
        try:
            _unshare(CLONE_NEWNET)
            self.netns = True
        except OSError as exc:
            self.warnings.append(f"network namespace unavailable ({exc}): sandboxed code HAS NETWORK ACCESS")

    def _open_keeps(self) -> dict[str, int]:
        """O_PATH handles on what must stay visible (the Python installation), opened in the new mount namespace
        before anything is covered; bound back later through /proc/self/fd/N."""
        keeps = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                                *self.cfg.get("readonly_paths", ()))}
        fds: dict[str, int] = {}
        for path in sorted(keeps):
            try:
                fds[path] = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                pass
        return fds

    def _try_fs(self) -> None:
        try:
            _unshare(CLONE_NEWNS)
        except OSError as exc:
            self.warnings.append(f"mount namespace unavailable ({exc}): sandboxed code can READ every file its "
                                 "uid can (and write where its uid may)")
            return
        keep_fds = self._open_keeps()
        try:
            self._setup_mounts(keep_fds)
            self.fs_hidden = True
        except OSError as exc:
            self.warnings.append(f"filesystem isolation failed ({exc}): sandboxed code can READ every file its "
                                 "uid can")
        finally:
            for fd in keep_fds.values():
                os.close(fd)

    def _setup_mounts(self, keep_fds: dict[str, int]) -> None:
        cfg = self.cfg
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        keeps = sorted(keep_fds)
        hidden: list[str] = []
        for raw in list(DEFAULT_HIDDEN_PATHS) + list(cfg.get("hide_paths", ())):
            path = os.path.realpath(raw)
            if not os.path.isdir(path) or path in _PROTECTED or any(_is_under(p, path) for p in _PROTECTED if p != "/"):
                continue
            if path in keeps:
                continue  # the Python installation itself
            if _is_under(path, "/tmp") or _is_under(path, "/dev/shm"):
                continue  # replaced wholesale by private tmpfs below (e.g. a checkout that lives under /tmp)
            hidden.append(path)
        hidden = sorted(set(hidden), key=lambda p: (p.count("/"), p))
        top = [h for h in hidden if not any(_is_under(h, k) for k in keeps)]
        inner = [h for h in hidden if h not in top]
        covered: list[str] = []
        for h in top:
            if any(_is_under(h, c) for c in covered):
                continue
            _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            covered.append(h)
        # fresh private /tmp (holds the working directories) and /dev/shm
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0711,size={int(cfg['tmp_mb'])}m")
        covered.append("/tmp")
        if os.path.isdir("/dev/shm"):
            _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=16m")
        # bind the kept paths back, read-only
        bound: list[str] = []
        for k in keeps:
            if not any(_is_under(k, c) for c in covered) or any(_is_under(k, b) for b in bound):
                continue
            os.makedirs(k, exist_ok=True)
            _mount(f"/proc/self/fd/{keep_fds[k]}", k, None, MS_BIND | MS_REC)
            bound.append(k)
        for h in inner:
            _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for h in [c for c in covered if c != "/tmp"] + inner:
            _mount(None, h, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        # everything else read-only (per-mount flag in this namespace only: MS_BIND is essential here)
        for mountpoint, opts in _mounts():
            if mountpoint in ("/tmp", "/dev/shm") or any(_is_under(mountpoint, p) for p in ("/proc", "/sys", "/dev")):
                continue
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY
            for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC),
                              ("noatime", MS_NOATIME), ("nodiratime", MS_NODIRATIME), ("relatime", MS_RELATIME)):
                if name in opts:
                    flags |= bit
            try:
                _mount(None, mountpoint, None, flags)
            except OSError:
                pass  # shadowed by one of our mounts, or not ours to change
        self.hidden = [h for h in covered if h != "/tmp"] + inner
        if self.cfg["private_proc"] and os.geteuid() == 0 and self.mode == "namespaces":
            # The code runs under a uid of its own: a proc instance with hidepid=2 shows it only its own
            # processes (once, here; a per-call /proc mount costs milliseconds).
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
                self.proc = "own processes only (hidepid=2)"
            except OSError as exc:
                self.warnings.append(f"could not remount /proc with hidepid ({exc}): the code sees all processes")

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
                try:
                    _unshare(CLONE_NEWPID)
                    q = os.fork()
                    if q == 0:
                        os._exit(0 if os.getpid() == 1 else 1)
                    _, st = os.waitpid(q, 0)
                    if st != 0:
                        os._exit(1)
                    if strategy == "setns":
                        _setns(self.self_pidns_fd, CLONE_NEWPID)
                        q = os.fork()
                        if q == 0:
                            os._exit(0)
                        os.waitpid(q, 0)
                    os._exit(0)
                except BaseException:
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            if status == 0:
                self.pidns = strategy
                return

    # ---- the request loop -------------------------------------------------------------------------

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        while not self.shutting_down:
            req = _recv(self.ctl_in)
            if req is None:
                break
            self.in_call = True
            try:
                resp = self.run(req)
            except Exception as exc:  # the server must answer, whatever happened
                resp = {"error": f"sandbox server error: {type(exc).__name__}: {exc}"}
                self._sweep()
            finally:
                self.in_call = False
            try:
                _send(self.ctl_out, resp)
            except OSError:
                break
            if resp.get("_host_gone"):
                break

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The host is closing the pool: stop the running call (if any), answer it, and exit."""
        self.shutting_down = True
        if not self.in_call:
            raise SystemExit(0)
        for pid in self.running:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _make_workdir(self) -> str:
        self.counter += 1
        path = self.fixed_workdir
        try:
            if path is None:
                raise FileExistsError
            os.mkdir(path, 0o700)
        except FileExistsError:  # no private /tmp (or the last one could not be removed): a unique name
            base = self.tmp_base or self.cfg.get("host_tmp") or "/tmp"
            path = os.path.join(base, f"agentgrad-sandbox-{self.pid}-{self.counter}-{os.urandom(6).hex()}")
            os.mkdir(path, 0o700)
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)
        return path

    def _remove_workdir(self, path: str) -> None:
        if not _rmtree(path):  # e.g. a directory the code chmod-ed to 000 (only matters without root)
            for root, dirs, _files, _fd in os.fwalk(path):
                for d in dirs:
                    try:
                        os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
                    except OSError:
                        pass
            _rmtree(path)
        if self.fs_hidden:  # our private /dev/shm
            for name in os.listdir("/dev/shm"):
                _rmtree(os.path.join("/dev/shm", name))

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        code = req["code"]
        timeout = float(req.get("timeout_s") or cfg["timeout_s"])
        cpu = cfg.get("cpu_s") or timeout + 1.0
        t0 = time.monotonic()
        try:  # compiled here, before forking: much cheaper than in the child (no copy-on-write faults)
            compiled = compile(code, "<sandbox>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
            import traceback

            msg = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
            return {"stdout": "", "stderr": msg + "\n", "stderr_bytes": len(msg) + 1, "exit_code": 1,
                    "syntax_error": msg, "duration_s": time.monotonic() - t0}
        workdir = self._make_workdir()
        try:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            st_r, st_w = os.pipe()
            try:
                direct, init_pid = self._spawn((compiled, code, workdir, out_w, err_w, st_w, cpu))
            except BaseException:
                for fd in (out_r, out_w, err_r, err_w, st_r, st_w):
                    os.close(fd)
                raise
            for fd in (out_w, err_w, st_w):
                os.close(fd)
            self.running = [p for p in (direct, init_pid) if p]
            try:
                result = self._collect(out_r, err_r, st_r, t0, timeout, self.running)
            finally:
                self.running = []
                for fd in (out_r, err_r, st_r):
                    os.close(fd)
                self._reap(direct)
                self._sweep()
            result["duration_s"] = time.monotonic() - t0
            return result
        finally:
            self._remove_workdir(workdir)

    def _spawn(self, child_args: tuple) -> tuple[int, int | None]:
        """Fork the per-call init. Returns (pid of our direct child, pid of the init to kill on timeout)."""
        if self.pidns == "setns":
            _unshare(CLONE_NEWPID)
            try:
                pid = os.fork()
                if pid == 0:
                    self._init_main(child_args, in_pidns=True)
            finally:
                try:
                    _setns(self.self_pidns_fd, CLONE_NEWPID)
                except OSError:  # cannot fork normally any more: give up this server, the host restarts one
                    os._exit(3)
            return pid, pid
        if self.pidns == "intermediate":
            pid_r, pid_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(pid_r)
                    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                    _unshare(CLONE_NEWPID)
                    init = os.fork()
                    if init == 0:
                        os.close(pid_w)
                        self._init_main(child_args, in_pidns=True)
                    _close_fds_except({pid_w})
                    _write_all(pid_w, b"%d\n" % init)
                    os.close(pid_w)
                    os.waitpid(init, 0)
                    os._exit(0)
                except BaseException:
                    os._exit(70)
            os.close(pid_w)
            try:
                data = _read_exact(pid_r, 1, time.monotonic() + 5.0)
                buf = data or b""
                while data and not buf.endswith(b"\n"):
                    data = _read_exact(pid_r, 1, time.monotonic() + 5.0)
                    buf += data or b""
                init_pid = int(buf) if buf.strip() else None
            except (TimeoutError, ValueError):
                init_pid = None
            finally:
                os.close(pid_r)
            return pid, init_pid
        pid = os.fork()
        if pid == 0:
            self._init_main(child_args, in_pidns=False)
        return pid, pid

    def _init_main(self, child_args: tuple, *, in_pidns: bool) -> None:
        """The per-call init: PID 1 of the call's namespace (or a plain parent without one). Forks the child,
        reaps, reports the child's wait status on the status pipe, and exits (taking the namespace with it)."""
        out_w, err_w, st_w = child_args[3:6]
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _close_fds_except({self.devnull, out_w, err_w, st_w})
            if not in_pidns and os.getppid() != self.pid:  # the server died before the death signal was set
                os._exit(0)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if in_pidns and self.fs_hidden and self.cfg["private_proc"] and self.mode == "userns":
                try:  # a /proc showing only this namespace's processes
                    _unshare(CLONE_NEWNS)
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                except OSError:
                    pass
            child = os.fork()
            if child == 0:
                self._child_main(*child_args)
            os.close(out_w)
            os.close(err_w)
            _write_all(st_w, b"P%d\n" % child)
            while True:
                try:
                    pid, status = os.waitpid(-1 if in_pidns else child, 0)
                except ChildProcessError:
                    status = -1
                    break
                if pid == child:
                    break
            _write_all(st_w, b"S%d\n" % status)
            if not in_pidns:
                try:
                    os.killpg(child, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(0)
        except BaseException:
            os._exit(70)

    def _child_main(self, compiled: Any, code: str, workdir: str, out_w: int, err_w: int, st_w: int,
                    cpu: float) -> None:
        """The process that runs the code. Never returns."""
        try:
            os.setsid()
            os.dup2(self.devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.chdir(workdir)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the rest are at their defaults already
            cpu_i = max(1, int(cpu + 0.999))
            resource.setrlimit(resource.RLIMIT_CPU, _clamp_limit(resource.RLIMIT_CPU, cpu_i, cpu_i + 1))
            for lim, soft, hard in self.rlimits:
                resource.setrlimit(lim, (soft, hard))
            if self.drop == "uid":
                os.setgroups([])
                os.setresgid(self.uid, self.uid, self.uid)
                os.setresuid(self.uid, self.uid, self.uid)
            elif self.drop == "caps":
                _drop_all_capabilities()
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _close_fds_except(set())
            if workdir != self.fixed_workdir:
                os.environ.clear()
                os.environ.update(self._code_env(workdir))
                sys.path.insert(0, workdir)
            sys.stdin, sys.stdout, sys.stderr = self.stdio
            sys.__stdin__, sys.__stdout__, sys.__stderr__ = self.stdio
            sys.argv = [""]
            atexit._clear()
        except BaseException as exc:
            try:
                os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(71)
        _exec_code(compiled, code)

    def _collect(self, out_r: int, err_r: int, st_r: int, t0: float, timeout: float,
                 to_kill: list[int]) -> dict[str, Any]:
        """Read output and status until the code is done (or killed) and the output pipes are closed."""
        cfg = self.cfg
        out_cap, err_cap = int(cfg["max_stdout_bytes"]), int(cfg["max_stderr_bytes"])
        total_cap = int(cfg["max_output_bytes"])
        out, err = bytearray(), bytearray()
        counts = {out_r: 0, err_r: 0}
        status_buf = b""
        child_pid: int | None = None
        wait_status: int | None = None
        timed_out = output_limit = host_gone = killed = swept = False
        open_fds = {out_r, err_r, st_r}
        poller = select.poll()
        for fd in open_fds:
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        poller.register(self.ctl_in, select.POLLIN)
        deadline = t0 + timeout
        drain_until: float | None = None  # once done or killed: how long to wait for the pipes to close

        def kill() -> None:
            nonlocal killed
            killed = True
            for pid in to_kill:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if child_pid and self.pidns == "none":  # without a PID namespace: the child's process group too
                try:
                    os.killpg(child_pid, signal.SIGKILL)
                except OSError:
                    pass

        while open_fds:
            now = time.monotonic()
            finished = wait_status is not None or st_r not in open_fds
            if self.shutting_down and not killed:
                kill()
            if not finished and not killed and now >= deadline:
                timed_out = True
                kill()
                drain_until = now + 1.0
            if (finished or killed) and drain_until is None:
                drain_until = now + 0.5
            if drain_until is not None and now >= drain_until:
                # stragglers (possible only without a PID namespace) still hold the pipes: kill everything
                if not killed:
                    kill()
                self._sweep()
                if swept:
                    break
                swept = True
                drain_until = now + 0.2
            wake = drain_until if drain_until is not None else deadline
            for fd, _ev in poller.poll(max(0.0, wake - now) * 1000 + 1):
                if fd == self.ctl_in:  # the host went away (or broke protocol): stop everything
                    host_gone = True
                    poller.unregister(fd)
                    kill()
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif fd == st_r:
                    status_buf += data
                    while b"\n" in status_buf:
                        line, status_buf = status_buf.split(b"\n", 1)
                        tag, body = line[:1], line[1:]
                        if tag == b"P":
                            child_pid = int(body)
                        elif tag == b"S":
                            wait_status = int(body)
                else:
                    counts[fd] += len(data)
                    if fd == out_r:
                        if len(out) < out_cap:
                            out += data[: out_cap - len(out)]
                    else:
                        err += data
                        if len(err) > 2 * err_cap:
                            del err[: len(err) - err_cap]
                    if counts[out_r] + counts[err_r] > total_cap and not killed:
                        output_limit = True
                        kill()
        if len(err) > err_cap:
            del err[: len(err) - err_cap]
        error = None
        if wait_status is not None and wait_status >= 0:
            exit_code: int | None = (-os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status)
                                     else os.WEXITSTATUS(wait_status))
        elif killed:
            exit_code = -int(signal.SIGKILL)
        else:
            exit_code = None
            error = "the sandbox init died without reporting the exit status"
        timeout_reason = "wall" if timed_out else None
        if exit_code == -int(signal.SIGXCPU) and not output_limit:
            timed_out, timeout_reason = True, "cpu"
        if exit_code == 71 and b"sandbox setup failed" in err:
            error = bytes(err).decode("utf-8", "replace").strip()
        return {
            "stdout": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace"),
            "exit_code": exit_code,
            "timed_out": timed_out,
            "timeout_reason": timeout_reason,
            "stdout_truncated": counts[out_r] > out_cap,
            "stderr_truncated": counts[err_r] > err_cap,
            "stdout_bytes": counts[out_r],
            "stderr_bytes": counts[err_r],
            "output_limit_exceeded": output_limit,
            "error": error,
            "_host_gone": host_gone,
        }

    def _reap(self, pid: int | None) -> None:
        """Wait for our direct child: by now it has exited (its status pipe closed) or has been SIGKILLed."""
        if pid:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # already reaped by a sweep

    def _sweep(self) -> None:
        """Kill and reap every remaining child (orphans are re-parented to us: we are a child subreaper)."""
        for attempt in range(400):
            try:
                while True:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
            except ChildProcessError:
                return  # no children at all: the common, cheap case
            for pid in _children_of(self.pid):
                for killer in (os.killpg, os.kill):
                    try:
                        killer(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.001 * min(attempt + 1, 20))


def _print_exception(exc: BaseException, code: str, filename: str) -> None:
    """Print a traceback like the interpreter's, without our own frame (imports lazily: rare path)."""
    import linecache
    import traceback

    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _exec_code.__code__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _exec_code(compiled: Any, code: str) -> None:
    """Run compiled `code` as __main__ in this (already sandboxed) process, then exit like `python` would."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    exit_code = 0
    try:
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        exit_code = _system_exit_code(exc)
    except BaseException as exc:
        try:
            _print_exception(exc, code, "<sandbox>")
        except BaseException:
            pass
        exit_code = 1
    try:
        threading_mod = sys.modules.get("threading")
        if threading_mod is not None:
            threading_mod._shutdown()  # like the interpreter: wait for non-daemon threads
        atexit._run_exitfuncs()
    except SystemExit as exc:
        exit_code = _system_exit_code(exc)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(exit_code)


def _system_exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except BaseException:
        pass
    return 1


def _rmtree(path: str) -> bool:
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


def threading_count() -> int:
    """Threads of this process (from /proc, without importing threading)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _clamp_limit(lim: int, soft: int, hard: int) -> tuple[int, int]:
    """(soft, hard) no higher than the current hard limit (lowering is always allowed, raising is not)."""
    cur_hard = resource.getrlimit(lim)[1]
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    return soft, hard


def _close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _MAX_FD)


_MAX_FD = max(1024, min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20))


def _mounts() -> list[tuple[str, set[str]]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mountpoint = parts[4].encode().decode("unicode_escape") if "\\" in parts[4] else parts[4]
            out.append((mountpoint, set(parts[5].split(","))))
    return out


def _proc_stat(pid: str) -> tuple[int, int] | None:
    """(ppid, pgid) of a process from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[1]), int(fields[2])


def _children_of(ppid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(name)
            if st and st[0] == ppid:
                out.append(int(name))
    return out


def _count_processes_of(uid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _serve_main() -> None:
    # Move the control pipe off stdin/stdout, so nothing forked from here can inherit it by accident.
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host owns Ctrl-C; we exit when our stdin closes
    cfg = _recv(ctl_in)
    if cfg is None:
        return
    server = _Server(cfg, ctl_in, ctl_out)
    try:
        caps = server.setup()
    except Exception as exc:
        _send(ctl_out, {"error": f"sandbox server setup failed: {type(exc).__name__}: {exc}"})
        return
    _send(ctl_out, {"hello": caps})
    gc.collect()
    gc.freeze()  # the children's garbage collector then leaves the server's objects (and their pages) alone
    try:
        server.serve()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server._sweep()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve_main()
    sys.exit(0)

# ======================================================================================================
# Host side
# ======================================================================================================

import logging  # noqa: E402  (host-only imports, kept out of the fork server)
import tempfile  # noqa: E402
import threading  # noqa: E402
import uuid  # noqa: E402
import weakref  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

log = logging.getLogger("agentgrad.tools.sandbox")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation of a sandbox pool. Sizes in MiB unless named `_bytes`."""

    timeout_s: float = 10.0  # wall clock, per call (a call may pass a smaller or larger one)
    cpu_s: float | None = None  # RLIMIT_CPU; None: timeout + 1 s (the wall clock normally fires first)
    memory_mb: int = 1024  # RLIMIT_AS
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_procs: int = 32  # RLIMIT_NPROC (per sandbox uid; counted on top of the user's processes without root)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_stdout_bytes: int = 8192  # head of stdout kept
    max_stderr_bytes: int = 8192  # tail of stderr kept
    max_output_bytes: int = 1 << 20  # stdout + stderr written before the process is killed
    tmp_mb: int = 64  # size of the private /tmp (holds the working directories)
    isolation: str = "auto"  # auto | namespaces (root) | userns (unprivileged) | rlimits (no namespaces)
    strict: bool = False  # raise SandboxUnavailableError instead of degrading
    hide_paths: tuple[str, ...] = ()  # extra paths to hide
    readonly_paths: tuple[str, ...] = ()  # extra paths to keep visible (read-only) inside hidden ones
    private_proc: bool = True  # the code's /proc shows only its own processes
    uid_base: int = 61000  # as root, slot i runs code as uid/gid uid_base + i
    preload: tuple[str, ...] = ()  # fork-safe modules the servers import up front (e.g. "numpy"): then free to
    #                                import per call, at the price of a slightly slower fork for every call

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None  # negative: killed by that signal (as in subprocess)
    timed_out: bool = False  # wall clock or CPU limit
    timeout_reason: str | None = None  # "wall" | "cpu"
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0  # bytes written in total
    stderr_bytes: int = 0
    output_limit_exceeded: bool = False  # killed after writing max_output_bytes
    syntax_error: str | None = None  # the code did not compile (it never ran)
    error: str | None = None  # the sandbox itself failed (server died, ...)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.error is None and self.syntax_error is None and not self.timed_out
                and not self.output_limit_exceeded and self.exit_code == 0)


class SandboxUnavailableError(RuntimeError):
    """`strict=True` and the machine cannot provide the requested isolation."""


def _project_root() -> str | None:
    here = os.path.realpath(__file__)
    for parent in (os.path.dirname(here), *[here.rsplit("/", n)[0] for n in range(2, 6)]):
        if parent and os.path.isfile(os.path.join(parent, "pyproject.toml")):
            return parent
    return None


def _host_hidden_paths(config: SandboxConfig) -> list[str]:
    paths = [os.path.expanduser("~"), os.getcwd(), *config.hide_paths]
    root = _project_root()
    if root:
        paths.append(root)
    return [p for p in paths if p and p != "/"]


class _Worker:
    """One fork server process (one pool slot)."""

    def __init__(self, pool: "SandboxPool", slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.proc: Any = None
        self.caps: dict[str, Any] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> dict[str, Any]:
        import subprocess

        pool = self.pool
        cfg = asdict(pool.config)
        cfg.update(slot=self.slot, token=pool.token, hide_paths=pool._hide_paths,
                   readonly_paths=list(pool.config.readonly_paths), host_tmp=tempfile.gettempdir())
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", ENV_MARKER: pool.token}
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True, close_fds=True, bufsize=0)
        try:
            _send(self.proc.stdin.fileno(), cfg)
            hello = _recv(self.proc.stdout.fileno(), time.monotonic() + 30.0)
        except (OSError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"sandbox server failed to start: {exc}") from None
        if not hello or "hello" not in hello:
            self.stop()
            raise RuntimeError((hello or {}).get("error", "sandbox server failed to start"))
        self.caps = hello["hello"]
        return self.caps

    def request(self, req: dict[str, Any], host_timeout: float) -> dict[str, Any]:
        proc = self.proc
        try:
            _send(proc.stdin.fileno(), req)
            resp = _recv(proc.stdout.fileno(), time.monotonic() + host_timeout)
        except TimeoutError:
            self.stop()
            return {"error": "sandbox server did not answer in time (killed and restarted)"}
        except OSError as exc:
            self.stop()
            return {"error": f"sandbox server failed: {exc}"}
        if resp is None:
            self.stop()
            return {"error": "sandbox server died"}
        return resp

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the server (only by the thread that holds this worker: no request in flight)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # EOF: the server exits (killing whatever still runs)
        except OSError:
            pass
        _wait_or_kill(proc, grace_s)
        try:
            proc.stdout.close()
        except OSError:
            pass

    def terminate(self) -> Any:
        """Ask a busy server to kill its call, answer, and exit (from any thread); returns its process."""
        proc = self.proc
        if proc is not None:
            try:
                proc.send_signal(signal.SIGTERM)
            except OSError:
                pass
        return proc


def _wait_or_kill(proc: Any, grace_s: float) -> None:
    import subprocess

    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


_POOLS: "weakref.WeakSet[SandboxPool]" = weakref.WeakSet()


def _close_all_pools() -> None:
    for pool in list(_POOLS):
        try:
            pool.close()
        except Exception:
            pass


atexit.register(_close_all_pools)


class SandboxPool:
    """Thread-safe pool of warm fork servers. `run(code)` blocks until a slot is free.

    >>> with SandboxPool(SandboxConfig(timeout_s=5)) as pool:   # doctest: +SKIP
    ...     pool.run("print(6 * 7)").stdout
    '42\\n'
    """

    def __init__(self, config: SandboxConfig | None = None, *, size: int | None = None) -> None:
        import queue

        self.config = config or SandboxConfig()
        self.size = size or max(1, min(4, os.cpu_count() or 1))
        self.token = uuid.uuid4().hex
        self._hide_paths = _host_hidden_paths(self.config)
        self._workers = [_Worker(self, i) for i in range(self.size)]
        self._idle: Any = queue.LifoQueue()
        for w in reversed(self._workers):
            self._idle.put(w)
        self._closed = False
        self._owner_pid = os.getpid()
        self._caps: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._warned = False
        _POOLS.add(self)

    # ---- public ---------------------------------------------------------------------------------------

    def run(self, code: str, *, timeout_s: float | None = None) -> SandboxResult:
        """Run `code` in a fresh sandboxed process. Never raises for anything the code does; raises
        RuntimeError only if the pool is closed."""
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        timeout = float(timeout_s if timeout_s is not None else self.config.timeout_s)
        if not timeout > 0:
            return SandboxResult(error=f"timeout must be positive, got {timeout}")
        worker = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("SandboxPool is closed")
            try:
                if not worker.alive:
                    self._note_caps(worker.start())
            except RuntimeError as exc:
                return SandboxResult(error=str(exc))
            resp = worker.request({"code": code, "timeout_s": timeout}, host_timeout=timeout + 15.0)
        finally:
            if self._closed:  # closed while we ran: this thread owns the worker, so it stops it
                worker.stop()
            self._idle.put(worker)
        resp.pop("_host_gone", None)
        known = {f for f in SandboxResult.__dataclass_fields__}
        return SandboxResult(**{k: v for k, v in resp.items() if k in known})

    def capabilities(self) -> dict[str, Any]:
        """What isolation this pool's servers achieved (starts one server if none is running)."""
        if self._caps is None:
            worker = self._idle.get()
            try:
                if self._caps is None:
                    self._note_caps(worker.caps if worker.alive and worker.caps else worker.start())
            finally:
                self._idle.put(worker)
        return dict(self._caps or {})

    def warmup(self) -> None:
        """Start every server now (otherwise they start on first use)."""
        taken = [self._idle.get() for _ in range(self.size)]
        try:
            for w in taken:
                if not w.alive:
                    self._note_caps(w.start())
        finally:
            for w in taken:
                self._idle.put(w)

    def server_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    def close(self) -> None:
        """Stop every server; each kills and reaps whatever it still runs. Idempotent; also runs at exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._owner_pid:  # a forked copy of the owner: the servers are not ours to stop
            return
        import queue

        idle = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        busy = [w.terminate() for w in self._workers if w not in idle]  # their threads stop them afterwards
        for w in idle:
            w.stop()
            self._idle.put(w)  # wake threads waiting for a worker: they find the pool closed
        for proc in busy:
            if proc is not None:
                _wait_or_kill(proc, 3.0)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- internal -------------------------------------------------------------------------------------

    def _note_caps(self, caps: dict[str, Any]) -> None:
        self._caps = caps
        if caps.get("warnings") and not self._warned:
            self._warned = True
            for w in caps["warnings"]:
                log.warning("python sandbox degraded: %s", w)
        if self.config.strict and caps.get("warnings"):
            raise SandboxUnavailableError("; ".join(caps["warnings"]))


_CAPS_CACHE: dict[tuple, dict[str, Any]] = {}


def sandbox_capabilities(config: SandboxConfig | None = None) -> dict[str, Any]:
    """Which isolation a sandbox gets on this machine (cached): starts one server, reads its report, stops it.

    Keys: mode ('namespaces' | 'userns' | 'rlimits'), network_isolated, filesystem_isolated, hidden_paths,
    pid_namespace, proc, privileges, no_new_privs, rlimits, process_cleanup, warnings."""
    config = config or SandboxConfig()
    key = (config.isolation, config.private_proc, config.hide_paths, config.readonly_paths)
    if key not in _CAPS_CACHE:
        with SandboxPool(SandboxConfig(isolation=config.isolation, private_proc=config.private_proc,
                                       hide_paths=config.hide_paths, readonly_paths=config.readonly_paths),
                         size=1) as pool:
            caps = pool.capabilities()
        caps.pop("server_pid", None)
        _CAPS_CACHE[key] = caps
    return dict(_CAPS_CACHE[key])
