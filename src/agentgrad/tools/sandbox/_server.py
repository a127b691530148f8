"""The fork server: one per pool slot, a `python -I` process that isolated itself once (`_isolation.py`) and
forks one short-lived process tree per call.

Per call: compile the code (a syntax error returns at once), fork an *init* in a new PID namespace (through
`setns` back, or an intermediate process under a user namespace), which unshares a new IPC namespace (and a mount
namespace with this call's own `/proc`) and forks the *child*: new session, stdio on pipes, a fresh working
directory, rlimits, the uid drop (root) or no capabilities (user namespace), `no_new_privs`, the syscall filter,
then `exec()` of the code in a fresh `__main__`. When the init exits the kernel kills whatever the call left in its
PID namespace, and its IPC namespace (with every SysV object in it) goes with it.

Started by the host as a package loaded from this directory without the host's `__init__` (see `_pool.py`), so it
imports only the standard library and its sibling server modules, all at start-up: after `pivot_root` nothing of
the host's filesystem but the Python installation is reachable.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import resource
import select
import signal
import sys
import time

from . import _linux as L
from ._exec import exec_code
from ._isolation import Isolation

TYPE_CHECKING = False  # not `typing`'s: the server does not import typing (its pages slow every fork)
if TYPE_CHECKING:
    from typing import Any


class _Output:
    """Head of stdout and tail of stderr, byte counts, and the total cap after which the call is killed."""

    def __init__(self, out_cap: int, err_cap: int, total_cap: int) -> None:
        self.out_cap, self.err_cap, self.total_cap = out_cap, err_cap, total_cap
        self.out, self.err = bytearray(), bytearray()
        self.out_bytes = self.err_bytes = 0

    def feed(self, is_stdout: bool, data: bytes) -> bool:
        """Keep what fits; True once the call has written more than the total cap."""
        if is_stdout:
            self.out_bytes += len(data)
            if len(self.out) < self.out_cap:
                self.out += data[: self.out_cap - len(self.out)]
        else:
            self.err_bytes += len(data)
            self.err += data
            if len(self.err) > 2 * self.err_cap:
                del self.err[: len(self.err) - self.err_cap]
        return self.out_bytes + self.err_bytes > self.total_cap

    def fields(self) -> dict[str, Any]:
        err = self.err[-self.err_cap:] if len(self.err) > self.err_cap else self.err
        return {"stdout": self.out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace"),
                "stdout_truncated": self.out_bytes > self.out_cap, "stderr_truncated": self.err_bytes > self.err_cap,
                "stdout_bytes": self.out_bytes, "stderr_bytes": self.err_bytes}


class _Status:
    """What the init reports on the status pipe: `P<child pid>`, then `S<wait status>`."""

    def __init__(self) -> None:
        self.buf = b""
        self.child_pid: int | None = None
        self.wait_status: int | None = None

    def feed(self, data: bytes) -> None:
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line[:1] == b"P":
                self.child_pid = int(line[1:])
            elif line[:1] == b"S":
                self.wait_status = int(line[1:])

    def exit_code(self, killed: bool) -> tuple[int | None, str | None]:
        st = self.wait_status
        if st is not None and st >= 0:
            return (-os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)), None
        if killed:
            return -int(signal.SIGKILL), None
        return None, "the sandbox init died without reporting the exit status"


class _Deadline:
    """The call's clock: the wall-clock deadline, then a short drain while the pipes close (stragglers, possible
    only without a PID namespace, are killed and swept; a second expiry gives up on them)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.drain_until: float | None = None
        self.swept = self.timed_out = False

    def step(self, now: float, finished: bool, killed: bool) -> str | None:
        """None, 'kill' (timed out), 'sweep' or 'stop'."""
        if not finished and not killed and now >= self.deadline:
            self.timed_out, self.drain_until = True, now + 1.0
            return "kill"
        if (finished or killed) and self.drain_until is None:
            self.drain_until = now + 0.5
        if self.drain_until is not None and now >= self.drain_until:
            if self.swept:
                return "stop"
            self.swept, self.drain_until = True, now + 0.2
            return "sweep"
        return None

    def wait_ms(self, now: float) -> float:
        wake = self.drain_until if self.drain_until is not None else self.deadline
        return max(0.0, wake - now) * 1000 + 1


class _Server:
    def __init__(self, cfg: dict[str, Any], ctl_in: int, ctl_out: int) -> None:
        self.cfg = cfg
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.pid = os.getpid()
        self.iso = Isolation(cfg)
        self.nproc_base = 0
        self.counter = 0
        self.tmp_base: str | None = "/tmp"
        self.fixed_workdir: str | None = None
        self.in_call = self.shutting_down = False
        self.running: list[int] = []  # the current call's init (and intermediate) processes
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
            self.rlimits.append((lim,) + L.clamp_limit(lim, value, value))

    def setup(self) -> dict[str, Any]:
        L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        self.iso.setup()
        if self.iso.drop != "uid":  # RLIMIT_NPROC counts all processes of the real uid: leave room for the user's
            self.nproc_base = L.count_processes_of(os.getuid())
        nproc = int(self.cfg["max_procs"]) + self.nproc_base
        self.rlimits.append((resource.RLIMIT_NPROC,) + L.clamp_limit(resource.RLIMIT_NPROC, nproc, nproc))
        if self.iso.fs_isolated:
            # One call at a time per server, in its private /tmp: the same path every call (reproducible output),
            # so the code's environment can be set once, here.
            self.fixed_workdir = "/tmp/work"
            os.environ.clear()
            os.environ.update(self._code_env(self.fixed_workdir))
            sys.path.insert(0, self.fixed_workdir)
        else:
            self.tmp_base = None  # working directories go to the host's temp dir
            os.environ.update({k: v for k, v in self._code_env("/").items() if k.endswith("_THREADS")})
        for name in self.cfg.get("preload") or ():  # after the *_NUM_THREADS variables: no thread pools before fork
            try:
                __import__(name)
            except Exception as exc:
                self.iso.warnings.append(f"preload of {name!r} failed: {type(exc).__name__}: {exc}")
        if L.threading_count() > 1:
            self.iso.warnings.append("a preloaded module started threads in the server: forking it is unsafe")
        return self.iso.capabilities(self.pid)

    def _code_env(self, workdir: str) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PWD": workdir,
                "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", L.ENV_MARKER: str(self.cfg["token"])}

    # ---- the request loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        while not self.shutting_down:
            req = L.recv(self.ctl_in)
            if req is None:
                break
            self.in_call = True
            try:
                resp = self.run(req)
            except Exception as exc:  # the server must answer, whatever happened
                resp = {"error": f"sandbox server error: {type(exc).__name__}: {exc}"}
                self.sweep()
            finally:
                self.in_call = False
            try:
                L.send(self.ctl_out, resp)
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
        if self.iso.uid is not None:
            os.chown(path, self.iso.uid, self.iso.uid)
        return path

    def _remove_workdir(self, path: str) -> None:
        if not L.rmtree(path):  # e.g. a directory the code chmod-ed to 000 (only matters without root)
            for root, dirs, _files, _fd in os.fwalk(path):
                for d in dirs:
                    try:
                        os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
                    except OSError:
                        pass
            L.rmtree(path)
        if self.iso.fs_isolated:  # our private /dev/shm
            for name in os.listdir("/dev/shm"):
                L.rmtree(os.path.join("/dev/shm", name))

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        code = req["code"]
        timeout = float(req.get("timeout_s") or self.cfg["timeout_s"])
        cpu = self.cfg.get("cpu_s") or timeout + 1.0
        t0 = time.monotonic()
        try:  # compiled here, before forking: much cheaper than in the child (no copy-on-write faults)
            compiled = compile(code, "<sandbox>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
            import traceback  # lazily: every module the server imports makes each fork slower

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
                result = self._collect((out_r, err_r, st_r), t0 + timeout)
            finally:
                self.running = []
                for fd in (out_r, err_r, st_r):
                    os.close(fd)
                self._reap(direct)
                self.sweep()
            result["duration_s"] = time.monotonic() - t0
            return result
        finally:
            self._remove_workdir(workdir)

    # ---- per call: init and child ----------------------------------------------------------------------

    def _spawn(self, child_args: tuple) -> tuple[int, int | None]:
        """Fork the per-call init. Returns (pid of our direct child, pid of the init to kill on timeout)."""
        if self.iso.pidns == "setns":
            L.unshare(L.CLONE_NEWPID)
            try:
                pid = os.fork()
                if pid == 0:
                    self._init_main(child_args, in_pidns=True)
            finally:
                try:
                    L.setns(self.iso.self_pidns_fd, L.CLONE_NEWPID)
                except OSError:  # cannot fork normally any more: give up this server, the host restarts one
                    os._exit(3)
            return pid, pid
        if self.iso.pidns == "intermediate":
            return self._spawn_intermediate(child_args)
        pid = os.fork()
        if pid == 0:
            self._init_main(child_args, in_pidns=False)
        return pid, pid

    def _spawn_intermediate(self, child_args: tuple) -> tuple[int, int | None]:
        """Under a user namespace: a process that unshares the PID namespace, forks the init, reports its pid."""
        pid_r, pid_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(pid_r)
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
                L.unshare(L.CLONE_NEWPID)
                init = os.fork()
                if init == 0:
                    os.close(pid_w)
                    self._init_main(child_args, in_pidns=True)
                L.close_fds_except({pid_w})
                L.write_all(pid_w, b"%d\n" % init)
                os.close(pid_w)
                os.waitpid(init, 0)
                os._exit(0)
            except BaseException:
                os._exit(70)
        os.close(pid_w)
        buf = b""
        try:
            while not buf.endswith(b"\n"):
                data = L.read_exact(pid_r, 1, time.monotonic() + 5.0)
                if not data:
                    break
                buf += data
            init_pid = int(buf) if buf.strip() else None
        except (TimeoutError, ValueError):
            init_pid = None
        finally:
            os.close(pid_r)
        return pid, init_pid

    def _init_namespaces(self) -> None:
        """The call's own IPC namespace (its SysV objects die with it) and, in a mount namespace of its own, a
        /proc of its PID namespace (so the code sees the call's processes only)."""
        flags = (L.CLONE_NEWIPC if self.iso.ipcns else 0) | (L.CLONE_NEWNS if self.iso.per_call_proc else 0)
        if flags:
            L.unshare(flags)
        if self.iso.per_call_proc:
            opts = "hidepid=2" if self.iso.mode == "namespaces" else None  # root's init is hidden from the code
            L.mount("proc", "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC, opts)

    def _init_main(self, child_args: tuple, *, in_pidns: bool) -> None:
        """The per-call init: PID 1 of the call's namespace (or a plain parent without one). Forks the child,
        reaps, reports the child's wait status on the status pipe, and exits (taking the namespaces with it)."""
        out_w, err_w, st_w = child_args[3:6]
        try:
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            L.close_fds_except({self.devnull, out_w, err_w, st_w})
            if not in_pidns and os.getppid() != self.pid:  # the server died before the death signal was set
                os._exit(0)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if in_pidns:
                self._init_namespaces()
            child = os.fork()
            if child == 0:
                self._child_main(*child_args)
            os.close(out_w)
            os.close(err_w)
            L.write_all(st_w, b"P%d\n" % child)
            while True:
                try:
                    pid, status = os.waitpid(-1 if in_pidns else child, 0)
                except ChildProcessError:
                    status = -1
                    break
                if pid == child:
                    break
            L.write_all(st_w, b"S%d\n" % status)
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
            resource.setrlimit(resource.RLIMIT_CPU, L.clamp_limit(resource.RLIMIT_CPU, cpu_i, cpu_i + 1))
            for lim, soft, hard in self.rlimits:
                resource.setrlimit(lim, (soft, hard))
            if self.iso.drop == "uid":
                os.setgroups([])
                os.setresgid(self.iso.uid, self.iso.uid, self.iso.uid)
                os.setresuid(self.iso.uid, self.iso.uid, self.iso.uid)
            elif self.iso.drop == "caps":
                L.drop_all_capabilities()
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
            L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
            L.close_fds_except(set())
            if self.iso.seccomp is not None:
                self.iso.seccomp.install()  # last: it forbids nothing the set-up above still needs
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
        exec_code(compiled, code)

    # ---- per call: output, deadline, cleanup ------------------------------------------------------------

    def _kill_call(self, child_pid: int | None) -> None:
        for pid in self.running:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if child_pid and self.iso.pidns == "none":  # without a PID namespace: the child's process group too
            try:
                os.killpg(child_pid, signal.SIGKILL)
            except OSError:
                pass

    def _collect(self, pipes: tuple[int, int, int], deadline: float) -> dict[str, Any]:
        """Read output and status until the code is done (or killed) and the output pipes are closed."""
        out_r, _err_r, st_r = pipes
        output = _Output(int(self.cfg["max_stdout_bytes"]), int(self.cfg["max_stderr_bytes"]),
                         int(self.cfg["max_output_bytes"]))
        status, clock = _Status(), _Deadline(deadline)
        killed = output_limit = host_gone = False
        open_fds = set(pipes)
        poller = select.poll()
        for fd in (*pipes, self.ctl_in):
            if fd != self.ctl_in:
                os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        while open_fds:
            now = time.monotonic()
            action = clock.step(now, status.wait_status is not None or st_r not in open_fds, killed)
            if action or (self.shutting_down and not killed):
                killed = True
                self._kill_call(status.child_pid)
                if action in ("sweep", "stop"):
                    self.sweep()
                if action == "stop":
                    break
            for fd, _ev in poller.poll(clock.wait_ms(now)):
                data = b"" if fd == self.ctl_in else _read_some(fd)
                if fd == self.ctl_in:  # the host went away (or broke protocol): stop everything
                    host_gone = killed = True
                    self._kill_call(status.child_pid)
                elif data is None:
                    continue
                elif fd == st_r and data:
                    status.feed(data)
                elif data and output.feed(fd == out_r, data) and not killed:
                    output_limit = killed = True
                    self._kill_call(status.child_pid)
                if not data:
                    poller.unregister(fd)
                    open_fds.discard(fd)
        return self._result(output, status, clock, killed, output_limit, host_gone)

    @staticmethod
    def _result(output: _Output, status: _Status, clock: _Deadline, killed: bool, output_limit: bool,
                host_gone: bool) -> dict[str, Any]:
        exit_code, error = status.exit_code(killed)
        timed_out, reason = clock.timed_out, "wall" if clock.timed_out else None
        if exit_code == -int(signal.SIGXCPU) and not output_limit:
            timed_out, reason = True, "cpu"
        fields = output.fields()
        if exit_code == 71 and "sandbox setup failed" in fields["stderr"]:
            error = fields["stderr"].strip()
        return {**fields, "exit_code": exit_code, "timed_out": timed_out, "timeout_reason": reason,
                "output_limit_exceeded": output_limit, "error": error, "_host_gone": host_gone}

    def _reap(self, pid: int | None) -> None:
        """Wait for our direct child: by now it has exited (its status pipe closed) or has been SIGKILLed."""
        if pid:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # already reaped by a sweep

    def sweep(self) -> None:
        """Kill and reap every remaining child (orphans are re-parented to us: we are a child subreaper)."""
        for attempt in range(400):
            try:
                while True:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
            except ChildProcessError:
                return  # no children at all: the common, cheap case
            for pid in L.children_of(self.pid):
                for killer in (os.killpg, os.kill):
                    try:
                        killer(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.001 * min(attempt + 1, 20))


def _read_some(fd: int) -> bytes | None:
    """Up to 64 KiB; b"" at EOF; None if nothing was there after all."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def serve_main() -> None:
    # Move the control pipe off stdin/stdout, so nothing forked from here can inherit it by accident.
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host owns Ctrl-C; we exit when our stdin closes
    cfg = L.recv(ctl_in)
    if cfg is None:
        return
    server = _Server(cfg, ctl_in, ctl_out)
    try:
        caps = server.setup()
    except Exception as exc:
        L.send(ctl_out, {"error": f"sandbox server setup failed: {type(exc).__name__}: {exc}"})
        return
    L.send(ctl_out, {"hello": caps})
    gc.collect()
    gc.freeze()  # the children's garbage collector then leaves the server's objects (and their pages) alone
    try:
        server.serve()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.sweep()
