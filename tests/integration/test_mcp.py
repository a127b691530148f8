"""MCP tools against real MCP servers the tests start: `mcp_test_server.py` (beside this file) and the example
calculator (`examples/mcp_calculator.py`), over stdio (a subprocess) and over streamable HTTP on 127.0.0.1.

Every path of a call is met for real: an answer with the server's schema, arguments the schema rejects, a
tool's own error, a call that outlives its timeout, 32 threads at once, a server that dies, servers that never
start; then an env whose calculator the server serves, and a short training run whose tool calls all go
through MCP (counted by the server itself)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the MCP tests need the mcp extra: pip install -e '.[mcp]' (.ci/run installs it)")

from agentgrad.config import McpServerConfig, load_config
from agentgrad.tools.base import ToolErrorKind, tool_schema
from agentgrad.tools.mcp import McpConnection, McpError, McpToolbox

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEST_SERVER = str(HERE / "mcp_test_server.py")
CALCULATOR = str(REPO / "examples" / "mcp_calculator.py")
# The SDK starts stdio servers with a minimal environment; a checkout run with PYTHONPATH=src passes it on.
SERVER_ENV = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
START_S = 180.0  # a server's start on a loaded 2-core machine (importing the SDK) is slow; never a test's point

pytestmark = pytest.mark.timeout(900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    """A server script run with `--http PORT` on loopback, up once its port accepts connections."""

    def __init__(self, script: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        env = {**os.environ, **SERVER_ENV}
        self.proc = subprocess.Popen([sys.executable, script, "--http", str(self.port), *extra], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError as err:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{script} did not start serving on port {self.port}") from err
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def connect(transport: str, http: HttpServer | None = None, **kw) -> McpConnection:
    if transport == "stdio":
        return McpConnection("test", command=sys.executable, args=[TEST_SERVER], env=SERVER_ENV,
                             connect_timeout_s=START_S, **kw)
    return McpConnection("test", url=http.url, headers={"X-Agentgrad-Test": "1"}, connect_timeout_s=START_S, **kw)


@pytest.fixture(scope="module")
def http_server():
    server = HttpServer(TEST_SERVER)
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["stdio", "http"])
def conn(request, http_server):
    c = connect(request.param, http_server, timeout_s=120.0)  # the machine may be busy: only one test times out
    yield c
    c.close()


def tools_of(c: McpConnection) -> dict:
    return {t.name: t for t in c.tools()}


def test_the_tools_and_their_schemas_come_from_the_server(conn):
    tools = tools_of(conn)
    assert list(tools) == ["echo", "add", "fail", "stall", "die"]
    echo = tools["echo"]
    assert echo.description == "Say the text back, `times` times." and echo.category == "test"
    props = echo.parameters["properties"]
    assert echo.parameters["required"] == ["text"]
    assert props["text"]["description"] == "what to say back" and props["text"]["type"] == "string"
    assert props["sep"]["enum"] == ["space", "comma"] and props["times"]["type"] == "integer"
    assert tool_schema(echo)["function"]["parameters"] == echo.parameters  # what the chat template renders


def test_a_call_returns_the_servers_answer_with_its_structured_content(conn):
    tools = tools_of(conn)
    result = tools["echo"](text="hi", times=3, sep="comma")
    assert (result.ok, result.text) == (True, "hi,hi,hi")
    total = tools["add"](a=40, b=2)
    assert total.ok and json.loads(total.text) == {"sum": 42}


def test_content_blocks_become_text_and_structured_content_the_signals():
    from mcp.types import CallToolResult, ImageContent, TextContent

    from agentgrad.tools.mcp import result_of

    mixed = CallToolResult(content=[TextContent(type="text", text="a chart:"),
                                    ImageContent(type="image", data="AAAA", mime_type="image/png")],
                           structured_content={"points": 3})
    assert (result_of(mixed).text, result_of(mixed).signals) == ("a chart:\n[image image/png]", {"points": 3})
    assert result_of(CallToolResult(content=[], structured_content={"n": 1})).text == '{"n": 1}'
    refused = result_of(CallToolResult(content=[TextContent(type="text", text="no\nway")], is_error=True))
    assert (refused.text, refused.error_kind) == ("error (bad_arguments): no way", ToolErrorKind.BAD_ARGUMENTS)


@pytest.mark.parametrize("arguments, message", [
    ({}, "missing required argument(s) ['text']"),
    ({"text": "hi", "times": "3"}, "argument 'times' must be an integer"),
    ({"text": "hi", "sep": "tab"}, "argument 'sep' must be one of ['space', 'comma']"),
    ({"text": "hi", "loud": True}, "unknown argument(s) ['loud']"),
])
def test_arguments_the_schema_rejects_are_bad_arguments(conn, arguments, message):
    result = tools_of(conn)["echo"](**arguments)
    assert not result.ok and result.error_kind is ToolErrorKind.BAD_ARGUMENTS and message in result.text


def test_a_tools_own_error_reaches_the_policy_as_bad_arguments(conn):
    result = tools_of(conn)["fail"](message="no such city: Qwzx")
    assert not result.ok and result.error_kind is ToolErrorKind.BAD_ARGUMENTS  # the call's fault: it still trains
    assert "no such city: Qwzx" in result.text and result.text.startswith("error (bad_arguments): ")


def test_a_call_past_its_timeout_is_a_timeout_and_the_connection_goes_on(conn, monkeypatch):
    tools = tools_of(conn)
    monkeypatch.setattr(conn, "timeout_s", 2.0)
    result = tools["stall"](seconds=60)
    assert not result.ok and result.error_kind is ToolErrorKind.TIMEOUT and "within 2 s" in result.text
    monkeypatch.undo()
    assert tools["echo"](text="still here").text == "still here"


def test_calls_from_many_threads_each_get_their_own_answer(conn):
    add = tools_of(conn)["add"]
    answers: dict[int, str] = {}

    def call(i: int) -> None:
        answers[i] = add(a=i, b=1000).text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: json.loads(text)["sum"] for i, text in answers.items()} == {i: i + 1000 for i in range(32)}


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_server_that_dies_is_one_error_line_and_later_calls_fail_at_once(transport, caplog):
    http = HttpServer(TEST_SERVER) if transport == "http" else None
    c = connect(transport, http, timeout_s=30.0)
    try:
        tools = tools_of(c)
        assert tools["echo"](text="alive").ok
        with caplog.at_level(logging.ERROR, logger="agentgrad.mcp"):
            if http is None:
                first = tools["die"]()
            else:
                http.stop()  # the HTTP server's process goes away between calls
                first = tools["echo"](text="anyone?")
            later = [tools["echo"](text="anyone?") for _ in range(3)]
        for result in (first, *later):
            assert not result.ok and result.error_kind is ToolErrorKind.CRASHED, result
            assert "MCP server 'test' is not running" in result.text
        if http is None:
            assert "dying on request" in first.text  # the server's last words, from its stderr
        lines = [r.getMessage() for r in caplog.records if r.name == "agentgrad.mcp"]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith("error: MCP server 'test'") and " died: " in lines[0]
        assert not c.alive
    finally:
        c.close()
        if http is not None:
            http.stop()


def test_servers_that_never_start_are_one_line_errors(tmp_path):
    with pytest.raises(McpError) as err:
        McpConnection("gone", command=str(tmp_path / "no-such-server"))
    assert "MCP server 'gone'" in str(err.value) and "did not start" in str(err.value)
    with pytest.raises(McpError) as err:
        McpConnection("quits", command=sys.executable, args=["-c", "import sys; sys.exit('bad token file')"],
                      connect_timeout_s=START_S)
    assert "stderr: bad token file" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(McpError) as err:
        McpConnection("nobody", url=f"http://127.0.0.1:{free_port()}/mcp", connect_timeout_s=60)
    assert "MCP server 'nobody' (http: http://127.0.0.1:" in str(err.value)
    with pytest.raises(McpError) as err:  # a server listens but never speaks MCP: bounded by connect_timeout_s
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            McpConnection("mute", url=f"http://127.0.0.1:{silent.getsockname()[1]}/mcp", connect_timeout_s=3)
    assert "no answer within connect_timeout_s=3" in str(err.value)


def test_a_toolbox_keeps_the_listed_tools_and_refuses_missing_ones(http_server):
    only = McpServerConfig(name="a", url=http_server.url, tools=["add", "echo"], connect_timeout_s=START_S)
    with McpToolbox([only]) as box:
        assert [t.name for t in box.tools()] == ["add", "echo"]
    with pytest.raises(McpError, match=r"MCP server 'a' has no tool\(s\) \['weather'\]; it serves: echo, add"):
        McpToolbox([only.model_copy(update={"tools": ["weather"]})])
    twice = [only, only.model_copy(update={"name": "b"})]
    with pytest.raises(McpError, match="MCP servers 'a' and 'b' both serve a tool 'add'"):
        McpToolbox(twice)


def calculator_server(log: Path) -> McpServerConfig:
    return McpServerConfig(name="calc", command=sys.executable, args=[CALCULATOR, "--log", str(log)],
                           env=SERVER_ENV, connect_timeout_s=START_S)


def test_the_arithmetic_suite_with_a_calculator_served_by_mcp(tmp_path):
    from agentgrad.envs import check_suite, close_suite, make_suite

    log = tmp_path / "calls.log"
    suite = make_suite("arithmetic", {}, mcp_servers=[calculator_server(log)])
    try:
        env = suite.make_env()
        task = suite.sample_tasks(1, split="train", seed=0)[0]
        _, info = env.reset(options={"task": task})
        (schema,) = info["tools"]
        assert schema["function"]["name"] == "calculator"
        assert schema["function"]["parameters"]["title"] == "calculatorArguments"  # the server's, not ours
        obs, *_, step_info = env.step(suite.expert_actions(task)[0])
        assert obs == task.answer and step_info["tool_ok"]
        bad, *_, bad_info = env.step(type(suite.expert_actions(task)[0])("calculator", {"expression": "1/0"}))
        assert bad_info["tool_error"] == "bad_arguments" and "division by zero" in bad
        report = check_suite(suite, n=5, seed=0)  # the expert solves tasks through the served calculator
        assert report["expert_tasks"] == 5
    finally:
        close_suite(suite)
    assert len(log.read_text().splitlines()) >= 1 + 1 + 5


TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=64", "model.tiny.tokenizer_corpus_episodes=40"]
# Enough BC steps for its loss to fall (measured: 5.83 -> 1.16, the mean of the first three steps against the
# last three's) and for the policy to write calls (9 in the RL step's 8 episodes, 4 of them valid arithmetic):
# wiring and a first move, not learning to the end (tests/integration/test_train_tiny.py does that).
SHORT = [*TINY, "bc.steps=60", "bc.batch_size_episodes=8", "bc.num_demos=32", "bc.stop_at_success=null",
         "bc.lr=3e-3", "algo.steps=1", "algo.tasks_per_step=4", "algo.group_size=2", "algo.epochs_per_step=1",
         "eval.num_tasks=8", "run.progress=false", "run.name=mcp"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_short_run_whose_only_tool_is_served_by_mcp(transport, tmp_path):
    from agentgrad.data.store import TrajectoryStore
    from agentgrad.tools.calculator import evaluate

    log = tmp_path / "calls.log"
    if transport == "stdio":
        server = {"name": "calc", "command": sys.executable, "args": [CALCULATOR, "--log", str(log)],
                  "env": SERVER_ENV}
    else:
        http = HttpServer(CALCULATOR, "--log", str(log))
        server = {"name": "calc", "url": http.url}
    agentgrad = Path(sys.executable).parent / "agentgrad"
    command = [str(agentgrad)] if agentgrad.exists() else [sys.executable, "-m", "agentgrad.cli"]
    try:
        out = subprocess.run([*command, "train", f"env.mcp_servers=[{json.dumps(server)}]", *SHORT,
                              f"run.output_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=800, env={**os.environ, **SERVER_ENV, "OMP_NUM_THREADS": "1"})
    finally:
        if transport == "http":
            http.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "mcp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == 1 and summary["bc_steps"] == 60
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bc = [r["loss/bc"] for r in rows if "loss/bc" in r]
    assert len(bc) == 60 and sum(bc[-3:]) < 0.5 * sum(bc[:3]), bc  # BC on demos the server answered: it learns

    # The policy's own calls went to the server: each one that passed the schema is in the server's log, a valid
    # one got the server's answer, an invalid one the server's error (ours does not say "Error executing tool").
    served = {json.loads(line) for line in log.read_text().splitlines()}
    rl_calls = [turn for sample in TrajectoryStore(run / "trajectories").trajectories()
                for turn in sample.trajectory.turns if getattr(turn.action, "name", None) == "calculator"
                and set(turn.action.arguments) == {"expression"}
                and isinstance(turn.action.arguments["expression"], str)
                and not (turn.observation or "").startswith("error (bad_arguments): arguments must be JSON text")]
    assert rl_calls, "the policy wrote no calculator call the server could take"
    assert len(served) >= 32  # and the BC demos' calls
    for turn in rl_calls:
        expression = turn.action.arguments["expression"]
        assert expression in served, expression
        if turn.observation is None:  # the episode ended on this turn (a limit)
            continue
        try:
            value = str(evaluate(expression))
        except Exception:
            assert turn.observation.startswith("error (bad_arguments): Error executing tool calculator: ")
        else:
            assert turn.observation == value and turn.tool_ok
    (saved,) = load_config(run / "config.yaml").env.mcp_servers  # `agentgrad eval` reconnects from this
    assert saved.name == "calc" and (saved.url is not None) == (transport == "http")
