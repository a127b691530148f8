"""A read-only SQL tool over a SQLite file.

Defence in depth, each layer sufficient against plain writes on its own:

* the file is opened read-only (`file:...?mode=ro` URI) with `PRAGMA query_only`, extensions off, and
  `SQLITE_LIMIT_ATTACHED` = 0;
* an authorizer allows only what a SELECT needs (SELECT, READ, RECURSIVE, and functions other than
  load_extension & co); everything else (INSERT, UPDATE, DELETE, CREATE, DROP, ALTER, ATTACH (so also
  VACUUM INTO), DETACH, PRAGMA (so also the pragma_* table functions), transactions, ANALYZE, REINDEX...)
  is denied while the statement is prepared;
* only statements starting with SELECT, WITH, VALUES or EXPLAIN are accepted, one per call;
* a progress handler interrupts a query after `timeout_s` (typed `timeout`), and at most `max_rows` rows come back.

A fresh connection per call: tools may be called from several threads at once.
"""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

from agentgrad.tools.base import FunctionTool, ToolErrorKind, ToolResult, tool

MAX_QUERY_CHARS = 10_000
MAX_CELL_CHARS = 200
MAX_TEXT_CHARS = 8_000
_ALLOWED_FIRST_WORDS = {"SELECT", "WITH", "VALUES", "EXPLAIN"}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "sqlite_dbpage"}

# sqlite3 authorizer action codes (not all are exported by every Python build)
_ACTION_NAMES = {
    1: "CREATE INDEX", 2: "CREATE TABLE", 3: "CREATE TEMP INDEX", 4: "CREATE TEMP TABLE", 5: "CREATE TEMP TRIGGER",
    6: "CREATE TEMP VIEW", 7: "CREATE TRIGGER", 8: "CREATE VIEW", 9: "DELETE", 10: "DROP INDEX", 11: "DROP TABLE",
    12: "DROP TEMP INDEX", 13: "DROP TEMP TABLE", 14: "DROP TEMP TRIGGER", 15: "DROP TEMP VIEW", 16: "DROP TRIGGER",
    17: "DROP VIEW", 18: "INSERT", 19: "PRAGMA", 20: "READ", 21: "SELECT", 22: "TRANSACTION", 23: "UPDATE",
    24: "ATTACH", 25: "DETACH", 26: "ALTER TABLE", 27: "REINDEX", 28: "ANALYZE", 29: "CREATE VTABLE",
    30: "DROP VTABLE", 31: "FUNCTION", 32: "SAVEPOINT", 33: "RECURSIVE",
}
_SQLITE_READ, _SQLITE_SELECT, _SQLITE_FUNCTION, _SQLITE_RECURSIVE = 20, 21, 31, 33
_COMMENT = re.compile(r"\s*(--[^\n]*(\n|$)|/\*.*?(\*/|$))", re.S)


def _first_word(query: str) -> str:
    pos = 0
    while True:
        m = _COMMENT.match(query, pos)
        if not m or m.end() == pos:
            break
        pos = m.end()
    rest = query[pos:].lstrip().lstrip("(").lstrip()
    m = re.match(r"[A-Za-z]+", rest)
    return m.group(0).upper() if m else ""


def _format_cell(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        text = f"<{len(value)} bytes>"
    else:
        text = str(value)
    text = text.replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."


def format_rows(columns: list[str], rows: list[tuple], truncated: bool, max_rows: int) -> str:
    if not columns:
        return "(statement returned no columns)"
    lines = [" | ".join(columns)]
    lines += [" | ".join(_format_cell(v) for v in row) for row in rows]
    text = "\n".join(lines)
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS].rsplit("\n", 1)[0] + "\n... (output truncated)"
    if not rows:
        text += "\n(0 rows)"
    elif truncated:
        text += f"\n... (more rows; only the first {max_rows} are shown)"
    return text


def _connect(db_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db_path.as_uri() + "?mode=ro", uri=True, timeout=1.0, check_same_thread=False,
                           isolation_level=None)
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    conn.execute("PRAGMA query_only = ON")
    conn.execute("PRAGMA trusted_schema = OFF")
    if hasattr(conn, "setlimit"):  # Python 3.11+
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 10_000_000)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_QUERY_CHARS * 4)
    return conn


def run_query(db_path: str | Path, query: str, *, timeout_s: float = 1.0, max_rows: int = 50) -> ToolResult:
    """Run one read-only statement against `db_path` (see the module docstring)."""
    if not query.strip():
        return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, "query is empty")
    if len(query) > MAX_QUERY_CHARS:
        return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"query longer than {MAX_QUERY_CHARS} characters")
    word = _first_word(query)
    if word not in _ALLOWED_FIRST_WORDS:
        return ToolResult.error(ToolErrorKind.DENIED,
                                "only read-only queries (SELECT, WITH, VALUES, EXPLAIN) are allowed, "
                                f"got {word or query[:20]!r}")
    path = Path(db_path).resolve()
    if not path.is_file():
        return ToolResult.error(ToolErrorKind.NOT_FOUND, f"database {str(db_path)!r} does not exist")
    try:
        conn = _connect(path)
    except sqlite3.Error as exc:
        return ToolResult.error(ToolErrorKind.NOT_FOUND, f"cannot open database: {exc}")

    denied: list[str] = []

    def authorizer(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
        if action in (_SQLITE_SELECT, _SQLITE_READ, _SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == _SQLITE_FUNCTION and (arg2 or "").lower() not in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        what = _ACTION_NAMES.get(action, f"action {action}")
        detail = arg2 if action == _SQLITE_FUNCTION else arg1
        denied.append(f"{what} {detail}" if detail else what)
        return sqlite3.SQLITE_DENY

    deadline = time.monotonic() + timeout_s
    timed_out = False

    def progress() -> int:
        nonlocal timed_out
        if time.monotonic() > deadline:
            timed_out = True
            return 1  # interrupt
        return 0

    try:
        conn.set_authorizer(authorizer)
        conn.set_progress_handler(progress, 1000)
        cur = conn.execute(query)
        columns = [d[0] for d in cur.description or []]
        rows = cur.fetchmany(max_rows + 1)
        truncated = len(rows) > max_rows
        rows = rows[:max_rows]
    except sqlite3.ProgrammingError as exc:
        if "one statement" in str(exc):
            return ToolResult.error(ToolErrorKind.DENIED, "only one statement per call")
        return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
    except sqlite3.Error as exc:
        if timed_out:
            return ToolResult.error(ToolErrorKind.TIMEOUT, f"query interrupted after {timeout_s:g} s", rows=0,
                                    truncated=False)
        if denied:
            return ToolResult.error(ToolErrorKind.DENIED, f"not allowed: {denied[0]} (the database is read-only)")
        msg = str(exc)
        if "readonly" in msg or "read-only" in msg or "not authorized" in msg:
            return ToolResult.error(ToolErrorKind.DENIED, msg)
        if isinstance(exc, sqlite3.OperationalError):  # syntax errors, unknown tables and columns, ...
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, msg)
        return ToolResult.error(ToolErrorKind.CRASHED, f"{type(exc).__name__}: {msg}")
    finally:
        conn.close()
    return ToolResult(text=format_rows(columns, rows, truncated, max_rows),
                      signals={"rows": len(rows), "truncated": truncated, "columns": len(columns)})


def make_sql_tool(db_path: str | Path, *, timeout_s: float = 1.0, max_rows: int = 50) -> FunctionTool:
    """A `sql(query)` tool (category "database") over the SQLite file `db_path`, read-only. Each call opens its
    own connection, so the tool may be called from several threads at once."""
    path = Path(db_path)

    def sql(query: str) -> ToolResult:
        """Run one read-only SQL query (SQLite dialect) and return the rows.

        Args:
            query: a single SELECT statement, e.g. "SELECT name FROM sqlite_master WHERE type = 'table'"
        """
        return run_query(path, query, timeout_s=timeout_s, max_rows=max_rows)

    return tool(sql, name="sql", category="database")

