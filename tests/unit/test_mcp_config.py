"""MCP without a server: the typed config, the core without the `mcp` package, and how served tools take their
place in an env's tools (ToolSet.overlaid, ToolEnv.serve_tools). The real servers: tests/integration/test_mcp.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentgrad.config import ConfigError, build_config, load_config, save_config
from agentgrad.envs import SUITES, ToolEnv
from agentgrad.tools.base import ToolSet, tool
from agentgrad.types import FinalAnswer, Task, ToolCall


def test_a_stdio_and_an_http_server_parse_from_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = build_config(overrides=[
        "env.mcp_servers=[{name: calc, command: python, args: [srv.py, --log, x]}, "
        "{name: web, url: 'http://127.0.0.1:8000/mcp', headers: {Authorization: Bearer t}, tools: [fetch], "
        "timeout_s: 5}]"])
    calc, web = config.env.mcp_servers
    assert (calc.command, calc.args, calc.url) == ("python", ["srv.py", "--log", "x"], None)
    assert calc.cwd == str(tmp_path.resolve())  # relative args keep meaning what they meant here
    assert (web.url, web.headers, web.tools, web.timeout_s, web.cwd) == (
        "http://127.0.0.1:8000/mcp", {"Authorization": "Bearer t"}, ["fetch"], 5.0, None)
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").env.mcp_servers == config.env.mcp_servers


@pytest.mark.parametrize("server, problem", [
    ("{name: a}", "exactly one of command"),
    ("{name: a, command: python, url: 'http://x/mcp'}", "exactly one of command"),
    ("{name: a, url: 'ftp://x'}", "mcp_servers.0.url"),
    ("{name: 'a b', command: python}", "mcp_servers.0.name"),
    ("{name: a, command: python, timeout_s: 0}", "mcp_servers.0.timeout_s"),
    ("{name: a, command: python, port: 3}", "unknown key 'env.mcp_servers.0.port'"),
])
def test_a_bad_server_entry_is_a_config_error_naming_the_key(server, problem):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[f"env.mcp_servers=[{server}]"])
    assert problem in str(err.value)


def test_the_core_runs_without_the_mcp_package(monkeypatch):
    from agentgrad.tools.mcp import McpConnection, McpError

    monkeypatch.setitem(sys.modules, "mcp", None)  # what `import mcp` sees when it is not installed
    with pytest.raises(McpError, match=r"pip install 'agentgrad\[mcp\]'"):
        McpConnection("calc", command="python")
    assert SUITES.get("arithmetic")().make_env().tools.names == ["calculator"]  # no server: nothing changes


@tool(name="calculator", category="remote")
def served_calculator(expression: str) -> str:
    """A stand-in for a calculator an MCP server serves.

    Args:
        expression: what to evaluate
    """
    return "served"


@tool(category="remote")
def weather(city: str) -> str:
    """Weather by city.

    Args:
        city: where
    """
    return f"sunny in {city}"


def test_a_served_tool_replaces_its_namesake_in_place_and_others_come_after():
    @tool
    def first(x: int) -> int:
        """First."""
        return x

    @tool
    def calculator(expression: str) -> str:  # the suite's own
        """Local."""
        return "local"

    merged = ToolSet([first, calculator]).overlaid([weather, served_calculator])
    assert merged.names == ["first", "calculator", "weather"]
    assert merged.call(ToolCall("calculator", {"expression": "1"})).text == "served"


def test_a_tool_env_serves_its_tools_after_every_reset():
    # TaskToolEnv-style: the tools change per task; the served ones stay on top of each task's.
    from agentgrad.envs.tasks import TaskToolEnv

    @tool
    def lookup(key: str) -> str:
        """Per-task lookup."""
        return key

    per_task = {"a": ToolSet([lookup]), "b": ToolSet([lookup, weather])}
    env = TaskToolEnv(ToolSet([]), lambda task, answer: answer == task.answer,
                      toolset_for=lambda task: per_task[task.task_id])
    env.serve_tools([served_calculator])
    for task_id, names in (("a", ["lookup", "calculator"]), ("b", ["lookup", "weather", "calculator"])):
        _, info = env.reset(options={"task": Task(task_id, "q", "42")})
        assert [s["function"]["name"] for s in info["tools"]] == names
        assert env.legal_actions().tools == frozenset(names) and "remote" in env.legal_actions().categories
    obs, *_ = env.step(ToolCall("calculator", {"expression": "6*7"}))
    assert obs == "served"
    assert env.step(FinalAnswer("42"))[1] == 1.0


def test_the_arithmetic_env_takes_a_served_calculator():
    env = SUITES.get("arithmetic")().make_env()
    assert isinstance(env, ToolEnv)
    env.serve_tools([served_calculator])
    task = SUITES.get("arithmetic")().sample_tasks(1, split="train", seed=0)[0]
    _, info = env.reset(options={"task": task})
    assert info["tools"] == ToolSet([served_calculator]).schemas()  # the served schema, not the built-in's
    assert env.step(ToolCall("calculator", {"expression": "1+1"}))[0] == "served"


def test_a_suite_whose_envs_are_not_tool_envs_is_refused_in_one_line():
    from agentgrad.envs.mcp import McpSuite
    from agentgrad.registry import import_ref
    from agentgrad.tools.mcp import McpError

    class NoToolbox:
        connections: list = []

        def tools(self):
            return []

        def close(self):
            pass

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo))
    try:
        suite = import_ref("examples.guess_number:GuessNumberSuite", what="suite")()
    finally:
        sys.path.remove(str(repo))
    with pytest.raises(McpError) as err:
        McpSuite(suite, NoToolbox())
    assert "not ToolEnv" in str(err.value) and "\n" not in str(err.value)


def test_schema_checks_follow_additional_properties():
    from agentgrad.tools.base import ToolArgumentError, validate_arguments

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert validate_arguments(schema, {"n": 2.0}) == {"n": 2}
    with pytest.raises(ToolArgumentError, match="unknown argument"):
        validate_arguments(schema, {"n": 1, "m": 2})
    assert validate_arguments(schema, {"n": 1, "m": "x"}, allow_extra=True) == {"n": 1, "m": "x"}
