"""The sandbox's typed records: a pool's limits and isolation, and one call's result."""

from __future__ import annotations

from dataclasses import dataclass

ISOLATION_MODES = ("auto", "namespaces", "userns", "rlimits")


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
    hide_paths: tuple[str, ...] = ()  # paths to cover inside what is visible (the root is an allow-list already)
    readonly_paths: tuple[str, ...] = ()  # extra host paths to show, read-only (datasets the code may read)
    private_proc: bool = True  # the code's /proc shows only its own call's processes
    uid_base: int = 2_000_000_000  # as root, pools lease blocks of uids from here (see _lease.py), one per slot
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
