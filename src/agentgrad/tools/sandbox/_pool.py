"""The host side: a thread-safe pool of warm fork servers, one per slot, and what they report."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import asdict
from typing import Any

from agentgrad.tools.sandbox._config import SandboxConfig, SandboxResult, SandboxUnavailableError
from agentgrad.tools.sandbox._lease import UidLease, lease_uids
from agentgrad.tools.sandbox._linux import ENV_MARKER, recv, send

log = logging.getLogger("agentgrad.tools.sandbox")

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The server loads this directory as a package of its own name, without agentgrad's (or this package's)
# __init__: only the standard library and the server modules end up in the process every call forks.
_BOOT = ("import sys, types; pkg = types.ModuleType('_agentgrad_sandbox'); pkg.__path__ = [sys.argv[1]]; "
         "sys.modules[pkg.__name__] = pkg; from _agentgrad_sandbox._server import serve_main; serve_main()")


def _project_root() -> str | None:
    here = os.path.realpath(__file__)
    for n in range(1, 7):
        parent = here.rsplit("/", n)[0]
        if parent and os.path.isfile(os.path.join(parent, "pyproject.toml")):
            return parent
    return None


def _host_hidden_paths(config: SandboxConfig) -> list[str]:
    """Covered if a visible directory would show them (e.g. a Python installed inside $HOME or the project)."""
    paths = [os.path.expanduser("~"), os.getcwd(), *config.hide_paths]
    root = _project_root()
    if root:
        paths.append(root)
    return [p for p in paths if p and p != "/"]


class _Worker:
    """One fork server process (one pool slot)."""

    def __init__(self, pool: SandboxPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.proc: Any = None
        self.caps: dict[str, Any] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> dict[str, Any]:
        pool = self.pool
        cfg = asdict(pool.config)
        cfg.update(slot=self.slot, token=pool.token, uid=pool.uids[self.slot] if pool.uids else None,
                   hide_paths=pool._hide_paths, readonly_paths=list(pool.config.readonly_paths),
                   host_tmp=tempfile.gettempdir())
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", ENV_MARKER: pool.token}
        lease_fds = pool._lease.fds if pool._lease else ()
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, PACKAGE_DIR],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True, close_fds=True, pass_fds=lease_fds,
                                     bufsize=0)
        try:
            send(self.proc.stdin.fileno(), cfg)
            hello = recv(self.proc.stdout.fileno(), time.monotonic() + 30.0)
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
            send(proc.stdin.fileno(), req)
            resp = recv(proc.stdout.fileno(), time.monotonic() + host_timeout)
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
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


_POOLS: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


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
        self.config = config or SandboxConfig()
        self.size = size or max(1, min(4, os.cpu_count() or 1))
        self.token = uuid.uuid4().hex
        self._hide_paths = _host_hidden_paths(self.config)
        # As root the code runs under uids no other pool on this machine uses (held until close()).
        self._lease: UidLease | None = lease_uids(self.config.uid_base, self.size) if os.geteuid() == 0 else None
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

    @property
    def uids(self) -> tuple[int, ...]:
        """The uid of each slot's code (as root; empty otherwise: the code keeps the user's uid)."""
        return self._lease.uids if self._lease else ()

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
        known = set(SandboxResult.__dataclass_fields__)
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
        """Stop every server; each kills and reaps whatever it still runs; then release the uids. Idempotent;
        also runs at exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._owner_pid:  # a forked copy of the owner: the servers are not ours to stop
            return
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
        if self._lease is not None:
            self._lease.release()  # the servers held it too; they have exited

    def __enter__(self) -> SandboxPool:
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

    Keys: mode ('namespaces' | 'userns' | 'rlimits'), network_isolated, ipc_isolated, filesystem_isolated,
    visible_paths, hidden_paths, pid_namespace, proc, privileges, uid, syscall_filter, no_new_privs, rlimits,
    process_cleanup, warnings."""
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
