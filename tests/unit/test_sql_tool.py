"""The read-only SQL tool on real SQLite files: every write form is denied, long queries time out, rows are capped."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time

import pytest

from agentgrad.tools.base import ToolErrorKind
from agentgrad.tools.sql import make_sql_tool


@pytest.fixture()
def db(tmp_path):
    path = tmp_path / "shop.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT, price REAL);
        CREATE INDEX items_name ON items(name);
        CREATE VIEW cheap AS SELECT * FROM items WHERE price < 5;
        """
    )
    conn.executemany("INSERT INTO items(name, price) VALUES (?, ?)", [(f"item{i}", i * 1.5) for i in range(200)])
    conn.commit()
    conn.close()
    return path


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def sql(db):
    return make_sql_tool(db, timeout_s=0.5, max_rows=50)


def test_schema_of_the_tool(sql):
    assert sql.name == "sql" and sql.category == "database"
    assert sql.parameters["required"] == ["query"]


def test_select_returns_rows_and_signals(sql):
    r = sql(query="SELECT name, price FROM items WHERE id <= 3 ORDER BY id")
    assert r.ok
    assert r.text.splitlines() == ["name | price", "item0 | 0.0", "item1 | 1.5", "item2 | 3.0"]
    assert r.signals["rows"] == 3 and r.signals["truncated"] is False


def test_reads_views_ctes_and_the_schema(sql):
    assert sql(query="SELECT count(*) FROM cheap").text.splitlines()[1] == "4"
    assert sql(query="WITH t AS (SELECT price FROM items) SELECT max(price) FROM t").ok
    r = sql(query="SELECT name FROM sqlite_master WHERE type = 'table'")
    assert r.ok and "items" in r.text
    assert sql(query="  -- a comment\n/* another */ SELECT 1").ok
    assert sql(query="SELECT 1;").ok  # a trailing semicolon is still one statement


def test_row_cap(sql):
    r = sql(query="SELECT id FROM items ORDER BY id")
    assert r.ok
    assert r.signals == {"rows": 50, "truncated": True, "columns": 1}
    assert len(r.text.splitlines()) == 1 + 50 + 1  # header, rows, note
    r = sql(query="SELECT id FROM items WHERE id > 1000")
    assert r.ok and r.signals["rows"] == 0 and r.signals["truncated"] is False


WRITES = [
    "INSERT INTO items(name, price) VALUES ('x', 1)",
    "UPDATE items SET price = 0",
    "DELETE FROM items",
    "REPLACE INTO items(id, name, price) VALUES (1, 'x', 1)",
    "INSERT OR REPLACE INTO items(id, name, price) VALUES (1, 'x', 1)",
    "CREATE TABLE t(a)",
    "CREATE TEMP TABLE t(a)",
    "CREATE INDEX i2 ON items(price)",
    "CREATE VIEW v AS SELECT 1",
    "CREATE TRIGGER tr AFTER INSERT ON items BEGIN DELETE FROM items; END",
    "CREATE VIRTUAL TABLE v USING fts5(x)",
    "DROP TABLE items",
    "DROP INDEX items_name",
    "DROP VIEW cheap",
    "ALTER TABLE items ADD COLUMN c",
    "ALTER TABLE items RENAME TO stuff",
    "ATTACH DATABASE ':memory:' AS other",
    "DETACH DATABASE main",
    "PRAGMA journal_mode = WAL",
    "PRAGMA table_info(items)",
    "PRAGMA query_only = OFF",
    "VACUUM",
    "BEGIN",
    "SAVEPOINT s",
    "ANALYZE",
    "REINDEX",
    # forms that start like a read but write or escape
    "WITH x AS (SELECT 1) INSERT INTO items(name) SELECT * FROM x",
    "WITH x AS (SELECT 1) DELETE FROM items",
    "EXPLAIN DELETE FROM items",
    "SELECT * FROM pragma_table_info('items')",
    "SELECT * FROM pragma_database_list",
    "SELECT load_extension('/tmp/evil.so')",
    "SELECT 1; DELETE FROM items",
    "SELECT 1; ATTACH DATABASE ':memory:' AS other",
]


@pytest.mark.parametrize("query", WRITES)
def test_every_write_form_is_denied(sql, db, query):
    before = digest(db)
    r = sql(query=query)
    assert not r.ok
    assert r.error_kind is ToolErrorKind.DENIED, r.text
    assert digest(db) == before
    assert sql(query="SELECT count(*) FROM items").text.splitlines()[1] == "200"


def test_vacuum_into_cannot_write_a_file(sql, db, tmp_path):
    target = tmp_path / "copy.db"
    r = sql(query=f"VACUUM INTO '{target}'")
    assert r.error_kind is ToolErrorKind.DENIED
    assert not target.exists()


def test_authorizer_alone_denies_writes(db):
    """The first-word filter is one layer; the authorizer must hold even without it."""
    import agentgrad.tools.sql as sqlmod

    original = sqlmod._ALLOWED_FIRST_WORDS
    sqlmod._ALLOWED_FIRST_WORDS = {"SELECT", "WITH", "VALUES", "EXPLAIN", "INSERT", "PRAGMA", "ATTACH", "VACUUM",
                                   "CREATE", "DROP", "DELETE", "UPDATE", "BEGIN"}
    try:
        tool = make_sql_tool(db)
        for q in ("INSERT INTO items(name) VALUES ('x')", "PRAGMA table_info(items)", "DROP TABLE items",
                  "ATTACH DATABASE ':memory:' AS o", "CREATE TEMP TABLE t(a)", "DELETE FROM items",
                  "UPDATE items SET price = 1", "BEGIN", f"VACUUM INTO '{db.parent / 'x.db'}'"):
            r = tool(query=q)
            assert r.error_kind is ToolErrorKind.DENIED, (q, r.text)
        assert not (db.parent / "x.db").exists()
    finally:
        sqlmod._ALLOWED_FIRST_WORDS = original


def test_long_query_times_out(sql):
    t0 = time.monotonic()
    r = sql(query="WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c")
    elapsed = time.monotonic() - t0
    assert r.error_kind is ToolErrorKind.TIMEOUT, r.text
    assert elapsed < 2.0
    assert sql(query="SELECT 1").ok  # the next call is unaffected


def test_syntax_errors_and_unknown_names_are_bad_arguments(sql):
    assert sql(query="SELECT FROM WHERE").error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert sql(query="SELECT * FROM nope").error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert sql(query="SELECT nope FROM items").error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert sql(query="   ").error_kind is ToolErrorKind.BAD_ARGUMENTS


def test_missing_database_is_not_found(tmp_path):
    r = make_sql_tool(tmp_path / "absent.db")(query="SELECT 1")
    assert r.error_kind is ToolErrorKind.NOT_FOUND
    assert not (tmp_path / "absent.db").exists()  # read-only open never creates the file


def test_concurrent_calls_from_threads(sql):
    out: dict[int, str] = {}

    def work(i: int) -> None:
        out[i] = sql(query=f"SELECT name FROM items WHERE id = {i + 1}").text.splitlines()[1]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {i: f"item{i}" for i in range(8)}


def test_runner_sql(db):
    from agentgrad.tools.runner import run_tool

    out = run_tool("sql", '{"query": "SELECT count(*) FROM items"}', db_path=str(db))
    assert out == {"tool": "sql", "ok": True, "error_kind": None, "text": "count(*)\n200",
                   "signals": {"rows": 1, "truncated": False, "columns": 1}}
    assert run_tool("sql", '{"query": "DELETE FROM items"}', db_path=str(db))["error_kind"] == "denied"
    assert run_tool("sql", '{"query": 1}', db_path=str(db))["error_kind"] == "bad_arguments"
