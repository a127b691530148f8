"""Running the code in the (already isolated) child: a fresh `__main__`, an interpreter-like traceback without
our frames, and an exit like `python`'s."""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import types

TYPE_CHECKING = False  # not `typing`'s: the server does not import typing (its pages slow every fork)
if TYPE_CHECKING:
    from typing import Any


def _print_exception(exc: BaseException, code: str, filename: str) -> None:
    """Print a traceback like the interpreter's, without our own frame (imports lazily: rare path)."""
    import linecache
    import traceback

    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is exec_code.__code__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def exec_code(compiled: Any, code: str) -> None:
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
