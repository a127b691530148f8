"""The MCP server the MCP tests start (stdio, or streamable HTTP with `--http PORT`): tools that answer, fail,
stall and die, so every path of `agentgrad.tools.mcp` meets a real server."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

server = MCPServer("agentgrad-test", log_level="WARNING")


@server.tool()
def echo(text: Annotated[str, Field(description="what to say back")], times: int = 1,
         sep: Literal["space", "comma"] = "space") -> str:
    """Say the text back, `times` times."""
    return (" " if sep == "space" else ",").join([text] * times)


@server.tool()
def add(a: int, b: int) -> dict:
    """Add two integers; the sum comes back as structured content too."""
    return {"sum": a + b}


@server.tool()
def fail(message: str) -> str:
    """Fail with this message."""
    raise ToolError(message)


@server.tool()
def stall(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def die(code: int = 3) -> str:
    """End the server's process at once."""
    print("test server: dying on request", file=sys.stderr, flush=True)
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
