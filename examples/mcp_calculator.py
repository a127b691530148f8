"""A calculator served over MCP, for an agent whose tools come from an MCP server (docs/mcp.md).

Written with the official SDK's `MCPServer` (mcp 2's name for FastMCP). It evaluates with agentgrad's own
calculator, so a run through it is comparable to one with the built-in tool; only the path differs. From the
repository root, with `pip install -e '.[mcp]'`:

    agentgrad train 'env.mcp_servers=[{name: calc, command: python, args: [examples/mcp_calculator.py]}]'
    python examples/mcp_calculator.py --http 8765      # streamable HTTP on http://127.0.0.1:8765/mcp
    agentgrad train 'env.mcp_servers=[{name: calc, url: "http://127.0.0.1:8765/mcp"}]'

`--log FILE` appends each expression it evaluates to FILE, as a JSON string (the tests count the calls that came
through MCP).
"""

from __future__ import annotations

import argparse
import json
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from agentgrad.tools.calculator import CalculatorError, evaluate

server = MCPServer("calculator", log_level="WARNING")
LOG: list[str] = []  # the --log path, if any


@server.tool()
def calculator(expression: Annotated[str, Field(description='arithmetic using + - * / and parentheses, '
                                                            'e.g. "12 * (3 + 4)"')]) -> str:
    """Evaluate an arithmetic expression."""
    if LOG:
        with open(LOG[0], "a", encoding="utf-8") as fh:
            fh.write(json.dumps(expression) + "\n")
    try:
        return str(evaluate(expression))
    except CalculatorError as exc:  # a ToolError's message reaches the model (other exceptions' stay here)
        raise ToolError(str(exc)) from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT (default: stdio)")
    ap.add_argument("--log", help="append each evaluated expression to this file")
    ns = ap.parse_args()
    if ns.log:
        LOG.append(ns.log)
    if ns.http:
        server.run("streamable-http", host="127.0.0.1", port=ns.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
