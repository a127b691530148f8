"""MCP tools: the tools of any MCP server (stdio or streamable HTTP) as agentgrad `Tool`s (docs/mcp.md).

`McpConnection` holds one session with one server, through the official `mcp` SDK (`pip install
'agentgrad[mcp]'`; imported only when a connection opens, so the core never needs it). The SDK is asyncio; our
tools are called synchronously from rollout worker threads, so each connection runs its own event loop in a
background thread and a call waits on a future that is bounded by the call's timeout. Every failure is a typed
`ToolResult`, as for our own tools: a server-side error is `crashed`, arguments that miss the server's schema
are `bad_arguments` (checked here, before the call), a call that outlives `timeout_s` is `timeout`, and a server
that dies is reported once on stderr (one line) and answers every later call at once with `crashed`.
Nothing waits unbounded: connecting, calling and closing all have deadlines.

No torch here (tools never import it).
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import concurrent.futures
import json
import logging
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

from agentgrad.tools.base import Tool, ToolArgumentError, ToolErrorKind, ToolResult, validate_arguments

logger = logging.getLogger("agentgrad.mcp")

GRACE_S = 5.0  # how long past a call's own timeout the calling thread waits for the loop before it gives up
CLOSE_TIMEOUT_S = 10.0  # the SDK's stdio shutdown: stdin closed, 2 s grace, SIGTERM, 2 s, SIGKILL
MAX_LIST_PAGES = 100  # a tools/list paginator that never ends must not hang the start
_CONNECTION_CLOSED, _REQUEST_TIMEOUT, _INVALID_PARAMS, _METHOD_NOT_FOUND = -32000, -32001, -32602, -32601
_GROUPS = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11+ (3.10: a group reads as itself)
_OPEN: weakref.WeakSet[McpConnection] = weakref.WeakSet()


class McpError(RuntimeError):
    """An MCP server could not be started, reached or listed. The message is one line naming the server."""


def _sdk() -> Any:
    try:
        import mcp
    except ImportError:
        raise McpError("MCP tools need the `mcp` package: pip install 'agentgrad[mcp]'") from None
    return mcp


def _one_line(exc: BaseException) -> str:
    """The innermost cause of `exc` as `Type: message`, one line (task groups wrap errors in groups)."""
    while isinstance(exc, _GROUPS) and exc.exceptions:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class McpConnection:
    """One live session with one MCP server: `command` (+ `args`, `env`, `cwd`) starts it as a subprocess
    speaking stdio; `url` reaches a streamable HTTP server. Opens on construction (raising `McpError` within
    `connect_timeout_s`), lists the server's tools, then serves `call` from any thread until `close()`."""

    def __init__(self, name: str, *, command: str | None = None, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | None = None, url: str | None = None,
                 headers: Mapping[str, str] | None = None, timeout_s: float = 30.0,
                 connect_timeout_s: float = 60.0) -> None:
        if (command is None) == (url is None):
            raise ValueError(f"MCP server {name!r}: give exactly one of command (stdio) or url (streamable HTTP)")
        self.name = name
        self.command, self.args, self.env, self.cwd = command, list(args), dict(env or {}), cwd
        self.url, self.headers = url, dict(headers or {})
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.where = f"stdio: {' '.join([command, *self.args])}" if command else f"http: {url}"
        self._sdk = _sdk()
        self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") if command else None
        self._client: Any = None
        self._dead: str | None = None  # why the connection ended, once it has
        self._closing = False
        self._said = ""  # the stderr tail, kept when the connection closes
        self._stop: asyncio.Event | None = None
        self._serving: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{name}", daemon=True)
        self._thread.start()
        _OPEN.add(self)
        try:
            listed = asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(self.connect_timeout_s)
        except BaseException as exc:
            reason = (f"no answer within connect_timeout_s={self.connect_timeout_s:g}"
                      if isinstance(exc, concurrent.futures.TimeoutError) else _one_line(exc))
            self.close()  # first: a server that is still starting has said nothing yet
            raise McpError(f"MCP server {name!r} ({self.where}) did not start: {reason}{self._said}") from None
        self.tool_specs: list[Any] = listed  # the SDK's Tool records: name, description, input_schema

    # ---- the loop side -----------------------------------------------------------------------------------

    def _transport(self, stack: AsyncExitStack) -> Any:
        if self.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(command=self.command, args=self.args, env=self.env or None, cwd=self.cwd)
            return stdio_client(params, errlog=self._stderr)
        from mcp.client.streamable_http import streamable_http_client

        if not self.headers:
            return streamable_http_client(self.url)
        import httpx2  # the SDK's own HTTP client library

        http = httpx2.AsyncClient(headers=self.headers, timeout=httpx2.Timeout(30.0, read=300.0))
        stack.push_async_callback(http.aclose)
        return streamable_http_client(self.url, http_client=http)

    async def _open(self) -> list[Any]:
        self._stop = asyncio.Event()
        ready: asyncio.Future = self._loop.create_future()
        self._serving = asyncio.create_task(self._serve(ready))
        return await ready

    async def _serve(self, ready: asyncio.Future) -> None:
        """Owns the SDK client for its whole life: anyio's scopes must be entered and left by one task."""
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    self._sdk.Client(self._transport(stack), read_timeout_seconds=self.connect_timeout_s, cache=None))
                tools = await self._list_tools(client)
                self._client = client
                ready.set_result(tools)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else McpError(_one_line(exc)))
            elif self._client is not None:
                self._mark_dead(_one_line(exc))
        finally:
            if self._client is not None:  # it was serving: whatever ended it, later calls must not wait
                self._mark_dead("the connection ended")
            self._client = None

    @staticmethod
    async def _list_tools(client: Any) -> list[Any]:
        tools, cursor = [], None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                return tools
        raise McpError(f"tools/list still had more pages after {MAX_LIST_PAGES}")

    async def _call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        client = self._client
        if client is None or self._dead is not None:
            return self._gone()
        try:
            result = await asyncio.wait_for(  # the SDK's read timeout is the first line, this the backstop
                client.call_tool(tool, arguments, read_timeout_seconds=self.timeout_s), self.timeout_s + 1.0)
        except asyncio.TimeoutError:
            return self._timed_out(tool)
        except self._sdk.MCPError as exc:
            return self._protocol_error(tool, exc)
        except Exception as exc:
            if self._client is None:  # the connection ended while the call was out
                return self._gone()
            return ToolResult.error(ToolErrorKind.CRASHED, f"MCP tool {tool!r} on server {self.name!r}: "
                                                           f"{_one_line(exc)}")
        return result_of(result)

    # ---- what a call sees --------------------------------------------------------------------------------

    def _protocol_error(self, tool: str, exc: Any) -> ToolResult:
        if exc.code == _REQUEST_TIMEOUT:
            return self._timed_out(tool)
        if exc.code == _CONNECTION_CLOSED:
            self._mark_dead("the connection closed")
            return self._gone()
        kind = ToolErrorKind.BAD_ARGUMENTS if exc.code == _INVALID_PARAMS else (
            ToolErrorKind.NOT_FOUND if exc.code == _METHOD_NOT_FOUND else ToolErrorKind.CRASHED)
        return ToolResult.error(kind, f"MCP tool {tool!r} on server {self.name!r}: {' '.join(exc.message.split())}")

    def _timed_out(self, tool: str) -> ToolResult:
        return ToolResult.error(ToolErrorKind.TIMEOUT, f"MCP tool {tool!r} on server {self.name!r} did not answer "
                                                       f"within {self.timeout_s:g} s")

    def _gone(self) -> ToolResult:
        return ToolResult.error(ToolErrorKind.CRASHED, f"MCP server {self.name!r} is not running "
                                                       f"({self._dead or 'closed'})")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None or self._closing:
            return
        self._dead = reason + self._stderr_tail()
        logger.error("error: MCP server %r (%s) died: %s", self.name, self.where, self._dead)

    def _stderr_tail(self) -> str:
        """The server's last stderr line (what a crashing server usually says), as '; stderr: ...'."""
        if self._stderr is None:
            return ""
        try:
            self._stderr.flush()
            self._stderr.seek(0)
            lines = [line.strip() for line in self._stderr.read()[-4000:].splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        return f"; stderr: {lines[-1][:300]}" if lines else ""

    # ---- the caller side ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closing and self._client is not None

    def call(self, tool: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Call `tool` with `arguments` from any thread; never raises, never waits past timeout_s + GRACE_S."""
        if not self.alive:
            return self._gone()
        try:
            future = asyncio.run_coroutine_threadsafe(self._call(tool, dict(arguments)), self._loop)
        except RuntimeError:  # the loop stopped under us (closed meanwhile)
            return self._gone()
        try:
            return future.result(self.timeout_s + GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return self._timed_out(tool)
        except Exception as exc:
            return ToolResult.error(ToolErrorKind.CRASHED, f"MCP tool {tool!r} on server {self.name!r}: "
                                                           f"{_one_line(exc)}")

    def tools(self, only: Sequence[str] | None = None) -> list[McpTool]:
        """The server's tools as agentgrad Tools (in the server's order); `only` keeps those names, in its order."""
        by_name = {spec.name: spec for spec in self.tool_specs}
        if only is not None:
            missing = [n for n in only if n not in by_name]
            if missing:
                raise McpError(f"MCP server {self.name!r} has no tool(s) {missing}; it serves: "
                               f"{', '.join(by_name) or '(none)'}")
        names = list(only) if only is not None else list(by_name)
        return [McpTool(self, by_name[n].name, by_name[n].description or by_name[n].title or "",
                        by_name[n].input_schema) for n in names]

    def close(self) -> None:
        """End the session (stopping a stdio server's process) and the loop thread. Idempotent, bounded."""
        if self._closing:
            return
        self._closing = True
        _OPEN.discard(self)
        if self._loop.is_running():
            if self._stop is not None and self._serving is not None:
                # A session ends when asked; one still connecting (a server that never answered) is cancelled.
                end = self._stop.set if self._client is not None else self._serving.cancel
                self._loop.call_soon_threadsafe(end)
                done = asyncio.run_coroutine_threadsafe(asyncio.wait({self._serving}), self._loop)
                try:
                    done.result(CLOSE_TIMEOUT_S)
                except Exception:
                    pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
        self._said = self._stderr_tail()
        if self._stderr is not None:
            self._stderr.close()

    def __enter__(self) -> McpConnection:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"McpConnection({self.name!r}, {self.where})"


def result_of(result: Any) -> ToolResult:
    """An SDK `CallToolResult` as a ToolResult: its text blocks joined (other blocks named), and a JSON-object
    `structured_content` as the signals process rewards read.

    `is_error` (the server's tool refused or failed this call) is `bad_arguments`, as our own calculator reports
    "division by zero": the policy's call was at fault, so the sample still trains. `crashed` and `timeout` are
    kept for faults of the server or the connection, which `faults.mask_tool_faults` masks."""
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:  # an image, audio, a binary resource, a link: named, since the policy reads text
            what = getattr(block, "mime_type", None) or getattr(block, "uri", None)
            parts.append(f"[{kind} {what}]" if what else f"[{kind}]")
    structured = result.structured_content
    text = "\n".join(parts) if parts or structured is None else json.dumps(structured, ensure_ascii=False)
    if result.is_error:
        return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, " ".join(text.split()) or "the tool reported an error")
    signals = (dict(structured) if isinstance(structured, dict)
               else {} if structured is None else {"structured": structured})
    return ToolResult(text=text, signals=signals)


class McpTool:
    """One tool of an MCP server. Its schema is the server's `inputSchema` (the chat template renders it); the
    arguments are checked against it here (required, known names, JSON types, enums), so a bad call costs no
    round trip and comes back as `bad_arguments` exactly like our own tools'."""

    def __init__(self, connection: McpConnection, name: str, description: str, parameters: Mapping[str, Any],
                 category: str | None = None) -> None:
        self.connection = connection
        self.name = name
        self.description = description
        self.parameters = dict(parameters)
        self.category = category or connection.name  # MCP has no categories: a server is one

    def __call__(self, **arguments: Any) -> ToolResult:
        extra = self.parameters.get("additionalProperties", False) not in (False, None)
        try:
            args = validate_arguments(self.parameters, arguments, allow_extra=extra)
            # A lone surrogate (decoded model text can hold one) would fail in the SDK's writer and end the session.
            json.dumps(args, ensure_ascii=False).encode("utf-8")
        except ToolArgumentError as exc:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
        except (UnicodeEncodeError, TypeError, ValueError) as exc:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, f"arguments must be JSON text: {_one_line(exc)}")
        return self.connection.call(self.name, args)

    def __repr__(self) -> str:
        return f"McpTool({self.connection.name}.{self.name})"


class McpToolbox:
    """The connections to several servers and their tools, opened together and closed together.

    `servers` are objects with the fields of `agentgrad.config.McpServerConfig` (name, command, args, env, cwd,
    url, headers, tools, timeout_s, connect_timeout_s). Tool names must be unique across the servers."""

    def __init__(self, servers: Sequence[Any]) -> None:
        self.connections: list[McpConnection] = []
        try:
            for s in servers:
                self.connections.append(McpConnection(
                    s.name, command=s.command, args=s.args, env=s.env, cwd=s.cwd, url=s.url, headers=s.headers,
                    timeout_s=s.timeout_s, connect_timeout_s=s.connect_timeout_s))
            self._tools: list[Tool] = []
            owner: dict[str, str] = {}
            for conn, s in zip(self.connections, servers):
                for t in conn.tools(s.tools):
                    if t.name in owner:
                        raise McpError(f"MCP servers {owner[t.name]!r} and {conn.name!r} both serve a tool "
                                       f"{t.name!r}; keep one with the servers' `tools` lists")
                    owner[t.name] = conn.name
                    self._tools.append(t)
        except BaseException:
            self.close()
            raise

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()

    def __enter__(self) -> McpToolbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    """Stop every stdio server still open when the interpreter exits (before daemon threads are dropped)."""
    for conn in list(_OPEN):
        conn.close()
