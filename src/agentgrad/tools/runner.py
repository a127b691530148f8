"""Run one tool call from the command line: `agentgrad tool run NAME --args JSON`.

`run_tool` never raises and never prints a traceback: every failure is a dict with an `error_kind`.

    >>> run_tool("calculator", '{"expression": "6 * 7"}')["text"]
    '42'
    >>> run_tool("calculator", "{not json")["error_kind"]
    'bad_arguments'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from agentgrad.registry import ImportRefError
from agentgrad.tools.base import TOOLS, Tool, ToolErrorKind, ToolResult, make_tool

RESOURCE_KEYS = ("corpus_path", "db_path", "timeout_s")
TOOL_NAMES = ("calculator", "python", "search", "open", "sql")


def _result_dict(name: str, result: ToolResult) -> dict[str, Any]:
    return {"tool": name, "ok": result.ok,
            "error_kind": result.error_kind.value if result.error_kind is not None else None,
            "text": result.text, "signals": json.loads(json.dumps(dict(result.signals), default=str))}


def _error(name: str, kind: ToolErrorKind, message: str) -> dict[str, Any]:
    return _result_dict(name, ToolResult.error(kind, message))


def _build(name: str, resources: dict[str, Any]) -> tuple[Tool | None, Callable[[], None], str | None]:
    """(tool, cleanup, error message). Builds only what `name` needs."""
    nothing = lambda: None  # noqa: E731
    timeout = resources.get("timeout_s")
    if name in ("search", "open"):
        if not resources.get("corpus_path"):
            return None, nothing, f"tool {name!r} needs a corpus: pass corpus_path (JSONL of doc_id, title, text)"
        from agentgrad.tools.search import Corpus, make_search_tools

        try:
            corpus = Corpus.from_jsonl(resources["corpus_path"])
        except FileNotFoundError:
            return None, nothing, f"corpus {resources['corpus_path']!r} does not exist"
        except (ValueError, KeyError) as exc:
            return None, nothing, f"bad corpus: {exc}"
        search, open_ = make_search_tools(corpus)
        return (search if name == "search" else open_), nothing, None
    if name == "sql":
        if not resources.get("db_path"):
            return None, nothing, "tool 'sql' needs a database: pass db_path (an SQLite file)"
        from agentgrad.tools.sql import make_sql_tool

        return make_sql_tool(resources["db_path"], **({"timeout_s": float(timeout)} if timeout else {})), nothing, None
    if name == "python":
        from agentgrad.tools.python_tool import make_python_tool
        from agentgrad.tools.sandbox import SandboxConfig, SandboxPool

        pool = SandboxPool(SandboxConfig(**({"timeout_s": float(timeout)} if timeout else {})), size=1)
        return make_python_tool(pool), pool.close, None
    if TOOLS.resolvable(name):  # registered, an import path (`examples.custom_tool:convert`), or an entry point
        try:
            return make_tool(name), nothing, None
        except ImportRefError as exc:
            return None, nothing, str(exc)
    return None, nothing, None


def run_tool(name: str, args_json: str, **resources: Any) -> dict[str, Any]:
    """Build tool `name`, call it with the JSON object `args_json`, and return
    {"tool", "ok", "error_kind", "text", "signals"} (JSON-able).

    Resources: corpus_path (search, open), db_path (sql), timeout_s (python, sql)."""
    unknown = sorted(set(resources) - set(RESOURCE_KEYS))
    if unknown:
        return _error(name, ToolErrorKind.BAD_ARGUMENTS, f"unknown resource(s) {unknown}; valid: {list(RESOURCE_KEYS)}")
    try:
        args = json.loads(args_json) if args_json and args_json.strip() else {}
    except (json.JSONDecodeError, TypeError) as exc:
        return _error(name, ToolErrorKind.BAD_ARGUMENTS, f"--args is not valid JSON: {exc}")
    if not isinstance(args, dict):
        return _error(name, ToolErrorKind.BAD_ARGUMENTS, f"--args must be a JSON object, got {type(args).__name__}")
    try:
        tool, cleanup, problem = _build(name, {k: v for k, v in resources.items() if v is not None})
    except Exception as exc:  # a factory failing (e.g. no sandbox on this machine) is still a typed result
        return _error(name, ToolErrorKind.CRASHED, f"could not build tool {name!r}: {type(exc).__name__}: {exc}")
    if problem:
        return _error(name, ToolErrorKind.BAD_ARGUMENTS, problem)
    if tool is None:
        names = sorted(set(TOOL_NAMES) | set(TOOLS.names()))
        return _error(name, ToolErrorKind.NOT_FOUND, f"unknown tool {name!r}; available: {', '.join(names)}")
    try:
        result = tool(**args)
    except TypeError as exc:  # a tool that is not a FunctionTool, with a mismatched signature
        result = ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
    except Exception as exc:
        result = ToolResult.error(ToolErrorKind.CRASHED, f"{type(exc).__name__}: {exc}")
    finally:
        cleanup()
    return _result_dict(name, result)


def main(argv: list[str] | None = None) -> int:
    """`python -m agentgrad.tools.runner NAME --args JSON [--corpus-path P] [--db-path P] [--timeout-s S]`:
    prints the result dict as JSON; exit status 0 when the call succeeded, 1 otherwise."""
    import argparse

    ap = argparse.ArgumentParser(prog="agentgrad tool run", description="Run one tool call and print the result.")
    ap.add_argument("name")
    ap.add_argument("--args", default="{}", help="the arguments, a JSON object")
    ap.add_argument("--corpus-path")
    ap.add_argument("--db-path")
    ap.add_argument("--timeout-s", type=float)
    ns = ap.parse_args(argv)
    out = run_tool(ns.name, ns.args, corpus_path=ns.corpus_path, db_path=ns.db_path, timeout_s=ns.timeout_s)
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
