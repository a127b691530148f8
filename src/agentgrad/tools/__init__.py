from agentgrad.tools import calculator as _calculator  # noqa: F401  (registers the builtin)
from agentgrad.tools.base import (
                                  TOOLS,
                                  FunctionTool,
                                  Tool,
                                  ToolErrorKind,
                                  ToolResult,
                                  ToolSet,
                                  make_tool,
                                  tool,
                                  tool_schema,
)

__all__ = ["TOOLS", "FunctionTool", "Tool", "ToolErrorKind", "ToolResult", "ToolSet", "make_tool", "tool",
           "tool_schema"]
from agentgrad.tools import python_tool as _python_tool  # noqa: F401  (registers "python")
