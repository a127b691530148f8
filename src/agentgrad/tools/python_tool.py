"""The `python` tool: runs model-written code in the sandbox (see `tools/sandbox/` and docs/sandbox.md).

Results are typed: a syntax error is `bad_arguments`, a timeout (wall clock or CPU) is `timeout`, a non-zero exit
or a kill (memory, output flood, process limit) is `crashed` and still carries the output. `signals` always hold
`exit_code`, `timed_out`, `stdout_truncated` (plus `stderr_truncated`, `output_limit_exceeded`).
"""

from __future__ import annotations

import signal
import threading

from agentgrad.tools.base import TOOLS, FunctionTool, ToolErrorKind, ToolResult, tool
from agentgrad.tools.sandbox import SandboxConfig, SandboxPool, SandboxResult

MAX_CODE_CHARS = 100_000

_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    """The process-wide pool behind `make_python_tool()` without a pool (started lazily, closed at exit)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            _default_pool = SandboxPool(SandboxConfig())
        return _default_pool


def _signal_name(exit_code: int) -> str:
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def format_output(r: SandboxResult) -> str:
    """stdout, then the tail of stderr, with truncation notes: what the policy sees."""
    parts = [r.stdout]
    if r.stdout_truncated:
        if parts[0] and not parts[0].endswith("\n"):
            parts.append("\n")
        parts.append(f"[stdout truncated: first {len(r.stdout.encode())} of {r.stdout_bytes} bytes shown]\n")
    if r.stderr.strip():
        if parts[-1] and not parts[-1].endswith("\n"):
            parts.append("\n")
        parts.append("[stderr]\n")
        if r.stderr_truncated:
            parts.append(f"[... last {len(r.stderr.encode())} of {r.stderr_bytes} bytes]\n")
        parts.append(r.stderr)
    return "".join(parts).rstrip("\n")


def sandbox_result_to_tool_result(r: SandboxResult, *, timeout_s: float | None = None) -> ToolResult:
    signals = {"exit_code": r.exit_code, "timed_out": r.timed_out, "stdout_truncated": r.stdout_truncated,
               "stderr_truncated": r.stderr_truncated, "output_limit_exceeded": r.output_limit_exceeded}
    output = format_output(r)
    if r.error is not None:
        return ToolResult.error(ToolErrorKind.CRASHED, f"sandbox failure: {r.error}", **signals)
    if r.syntax_error is not None:
        return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"the code does not compile\n{r.syntax_error}",
                                **signals)
    if r.timed_out:
        what = ("CPU time limit exceeded" if r.timeout_reason == "cpu"
                else f"timed out after {timeout_s:g} s" if timeout_s else "timed out")
        return ToolResult.error(ToolErrorKind.TIMEOUT, f"{what} (process killed)" + (f"\n{output}" if output else ""),
                                **signals)
    if r.output_limit_exceeded:
        return ToolResult.error(ToolErrorKind.CRASHED,
                                f"output limit exceeded ({r.stdout_bytes + r.stderr_bytes}+ bytes); process killed"
                                + (f"\n{output}" if output else ""), **signals)
    if r.exit_code != 0:
        how = (f"killed by {_signal_name(r.exit_code)}" if r.exit_code is not None and r.exit_code < 0
               else f"exit code {r.exit_code}")
        return ToolResult.error(ToolErrorKind.CRASHED, how + (f"\n{output}" if output else ""), **signals)
    return ToolResult(text=output if output else "(no output)", signals=signals)


def make_python_tool(pool: SandboxPool | None = None, *, timeout_s: float | None = None,
                     name: str = "python") -> FunctionTool:
    """A `python(code)` tool (category "code") running in `pool` (default: the shared `default_pool()`)."""

    def python(code: str) -> ToolResult:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: a complete Python program; use print() to show results
        """
        if not code.strip():
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, "code is empty")
        if len(code) > MAX_CODE_CHARS:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"code longer than {MAX_CODE_CHARS} characters")
        p = pool if pool is not None else default_pool()
        t = timeout_s if timeout_s is not None else p.config.timeout_s
        return sandbox_result_to_tool_result(p.run(code, timeout_s=t), timeout_s=t)

    return tool(python, name=name, category="code")


TOOLS.add("python", lambda: make_python_tool())
