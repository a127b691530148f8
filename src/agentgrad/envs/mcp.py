"""`McpSuite`: any task suite whose envs also get the tools of MCP servers (`env.mcp_servers`, docs/mcp.md).

A tool a server serves under a name the suite already uses takes that tool's place, schema and all (the
arithmetic suite's `calculator` served by MCP: then every call of the run goes to the server); the others are
added. The suite's envs must be `ToolEnv`s (every built-in suite's are, and `jsonl`'s, which is how your own
tasks meet your own MCP server); an env with its own `step` talks to `agentgrad.tools.mcp` itself. No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentgrad.envs.base import TaskSuite, close_env, close_suite
from agentgrad.envs.tool_env import ToolEnv
from agentgrad.envs.wrappers import Wrapper
from agentgrad.tools.mcp import McpError, McpToolbox


def _tool_env(env: Any) -> ToolEnv | None:
    inner = env.unwrapped if isinstance(env, Wrapper) else env
    return inner if isinstance(inner, ToolEnv) else None


class McpSuite:
    """The wrapped suite in every respect (its name, tasks, expert, verifier, options ...) except that its envs
    serve the toolbox's tools, and `close()` also ends the server connections."""

    def __init__(self, suite: TaskSuite, toolbox: McpToolbox) -> None:
        self.suite = suite
        self.toolbox = toolbox
        probe = suite.make_env()
        try:
            if _tool_env(probe) is None:
                raise McpError(f"env.mcp_servers: the envs of suite {suite.name!r} are {type(probe).__name__}, not "
                               f"ToolEnv, so they cannot take MCP tools; use the jsonl suite, a ToolEnv, or call "
                               f"agentgrad.tools.mcp from your env (docs/mcp.md)")
        finally:
            close_env(probe)

    def make_env(self) -> Any:
        env = self.suite.make_env()
        _tool_env(env).serve_tools(self.toolbox.tools())
        return env

    def close(self) -> None:
        try:
            close_suite(self.suite)
        finally:
            self.toolbox.close()

    def __getattr__(self, name: str) -> Any:
        if name in ("suite", "toolbox") or name.startswith("__"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.suite, name)

    def __repr__(self) -> str:
        return f"<McpSuite {self.suite!r} + {[c.name for c in self.toolbox.connections]}>"


def with_mcp_tools(suite: TaskSuite, servers: Sequence[Any]) -> McpSuite:
    """`suite` with the tools of `servers` (McpServerConfig records) in its envs. Raises McpError (one line)
    when a server does not start or the suite's envs cannot take tools; the connections opened are closed."""
    toolbox = McpToolbox(servers)
    try:
        return McpSuite(suite, toolbox)
    except BaseException:
        toolbox.close()
        raise

