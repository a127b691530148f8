"""Bring your own suite, tool, reward, preset and expert data: import paths, env-owned outcomes, layered presets,
evaluation over distinct tasks, check_suite, and BC demos from a logged chat JSONL."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from importlib import metadata
from pathlib import Path

import pytest
from test_agent_loop import ScriptedPolicy

from agentgrad.backends.base import Generation, SamplingParams
from agentgrad.config import ConfigError, build_config
from agentgrad.envs import SUITES, SuiteCheckError, check_suite, episode_success
from agentgrad.registry import ImportRefError, UnknownNameError
from agentgrad.rewards.base import OutcomeReward, load_reward, score
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.tools import TOOLS, make_tool
from agentgrad.types import StopReason, Task, ToolCall

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # examples/ is importable from the repository root, as for a user there

MODULE = '''
from agentgrad.envs.tasks.arithmetic import ArithmeticSuite
from agentgrad.tools import tool


class MySuite(ArithmeticSuite):
    name = "my-suite"
    config_defaults = {"rollout": {"max_turns": 3}}


@tool(category="text")
def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper()
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A module in a directory outside the package, which is the current directory (as for `agentgrad ...`)."""
    name = f"mymod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])  # as a console script starts
    yield name
    sys.modules.pop(name, None)


def test_suite_and_tool_by_import_path_from_the_current_directory(user_module):
    suite_cls = SUITES.get(f"{user_module}:MySuite")
    assert suite_cls.name == "my-suite"
    assert make_tool(f"{user_module}:shout")(text="hi").text == "HI"
    config = build_config(overrides=[f"env={user_module}:MySuite"])
    assert config.rollout.max_turns == 3  # the suite's own limits, under the preset and overrides
    assert build_config(overrides=[f"env={user_module}:MySuite", "rollout.max_turns=5"]).rollout.max_turns == 5


def test_bad_import_paths_are_one_line_errors(user_module):
    for spec, message in [("no_such_mod_xyz:Suite", "cannot import module 'no_such_mod_xyz'"),
                          (f"{user_module}:Missing", "has no attribute 'Missing'"),
                          ("broken:", "must look like 'package.module:attr'")]:
        with pytest.raises(ImportRefError, match=message) as err:
            SUITES.get(spec)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="env.name: cannot import") as err:
        build_config(overrides=["env=no_such_mod_xyz:Suite"])
    assert "\n" not in str(err.value)
    with pytest.raises(UnknownNameError, match="valid names: .*arithmetic.*or an import path"):
        SUITES.get("no-such-suite")


def test_entry_points_resolve_suites_and_tools(monkeypatch):
    eps = [metadata.EntryPoint("ep-arith", "agentgrad.envs.tasks.arithmetic:ArithmeticSuite", "agentgrad.suites"),
           metadata.EntryPoint("ep-calc", "agentgrad.tools.calculator:calculator", "agentgrad.tools")]
    monkeypatch.setattr(metadata, "entry_points", lambda group: [e for e in eps if e.group == group])
    assert SUITES.get("ep-arith").name == "arithmetic" and "ep-arith" in SUITES.names()
    assert make_tool("ep-calc")(expression="2 * 21").text == "42"
    assert build_config(overrides=["env=ep-arith"]).env.name == "ep-arith"


def test_jsonl_tasks_name_user_tools_by_import_path(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # where `examples.custom_tool` imports from
    rec = {"task_id": "t1", "prompt": "Convert 10 EUR to USD.", "answer": "10.80 USD", "verifier": "exact",
           "tools": ["examples.custom_tool:convert"], "split": "train",
           "expert": [{"name": "convert", "arguments": {"amount": 10, "source": "EUR", "target": "USD"}}]}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rec, "tools": ["examples.custom_tool:nope"]}) + "\n")
    suite = SUITES.get("jsonl")(path=str(path))
    env = suite.make_env()
    _, info = env.reset(options={"task": suite.tasks[0]})
    assert [s["function"]["name"] for s in info["tools"]] == ["convert"]
    assert env.step(ToolCall("convert", {"amount": 10, "source": "EUR", "target": "USD"}))[0] == "10.80 USD"
    with pytest.raises(ValueError, match=r"bad.jsonl:1: module 'examples.custom_tool' has no attribute 'nope'"):
        SUITES.get("jsonl")(path=str(bad))
    assert "examples.custom_tool:convert" not in TOOLS  # resolved, not registered


# ---- env-owned outcomes -----------------------------------------------------------------------------------


@pytest.fixture()
def game():
    from examples.guess_number import GuessNumberSuite

    return GuessNumberSuite()


def test_a_won_game_scores_1_without_a_final_answer(game, codec):
    task = Task("g", "I picked a number from 1 to 8.", answer="6", suite=game.name, metadata={"high": 8})
    calls = [f'<tool_call>\n{{"name": "guess", "arguments": {{"number": {n}}}}}\n</tool_call>' for n in (4, 6)]
    [won] = run_episodes(ScriptedPolicy(codec, calls), codec, [game.make_env()], [task], sampling=SamplingParams(),
                         limits=EpisodeLimits(max_turns=5, max_total_tokens=400))
    assert won.stop_reason is StopReason.ENV_TERMINATED and won.final_answer is None
    assert won.final_info["success"] is True and won.env_success is True
    [scored] = score([won], OutcomeReward(game), game)
    assert scored.success and scored.reward.outcome == 1.0
    assert load_reward("env", game)(won).outcome == 1.0  # the env's own reward
    # The same game lost (out of guesses) scores 0, and an answer does not win it.
    wrong = '<tool_call>\n{"name": "guess", "arguments": {"number": 1}}\n</tool_call>'
    [lost] = run_episodes(ScriptedPolicy(codec, [wrong]), codec, [game.make_env()], [task], sampling=SamplingParams(),
                          limits=EpisodeLimits(max_turns=8, max_total_tokens=900, repeated_call_limit=0))
    assert lost.stop_reason is StopReason.ENV_TERMINATED and lost.final_info["success"] is False
    assert not episode_success(game, lost)
    [answered] = run_episodes(ScriptedPolicy(codec, ["6"]), codec, [game.make_env()], [task],
                              sampling=SamplingParams(), limits=EpisodeLimits(max_total_tokens=400),
                              sampler=SamplerSettings(tool_name_mask="off"))
    assert answered.final_answer == "6" and not episode_success(game, answered)


def test_success_sources(arithmetic_suite):
    from agentgrad.envs.base import outcome_success

    task = arithmetic_suite.sample_tasks(1, split="train", seed=0)[0]

    class Both(type(arithmetic_suite)):
        success_from = "both"

    both = Both()
    assert outcome_success(arithmetic_suite, task, task.answer, {})
    assert outcome_success(both, task, task.answer, {"success": True})
    assert not outcome_success(both, task, task.answer, {"success": False})
    assert not outcome_success(both, task, "0", {"success": True})


# ---- check_suite ------------------------------------------------------------------------------------------


def test_check_suite_passes_builtins_and_the_game(arithmetic_suite, game):
    assert check_suite(arithmetic_suite, n=10)["success_from"] == "verifier"
    report = check_suite(game, n=10)
    assert report["success_from"] == "env" and report["expert_tasks"] == 10


def test_check_suite_names_what_is_wrong(arithmetic_suite):
    from agentgrad.types import FinalAnswer

    class WrongExpert(type(arithmetic_suite)):
        def expert_actions(self, task):
            return [FinalAnswer("0")]

    class LeakySplits(type(arithmetic_suite)):
        def sample_tasks(self, n, *, split="train", seed=0):
            return super().sample_tasks(n, split="train", seed=seed)

    class Lenient(type(arithmetic_suite)):
        def verify(self, task, answer):
            return not answer or super().verify(task, answer)

    for suite, message in [(WrongExpert(), "the expert fails"), (LeakySplits(), "share"),
                           (Lenient(), "accepts an empty answer")]:
        with pytest.raises(SuiteCheckError, match=message):
            check_suite(suite, n=5)


# ---- presets ----------------------------------------------------------------------------------------------


def test_a_user_preset_naming_only_env_keeps_every_other_default(tmp_path):
    (tmp_path / "mine.yaml").write_text("env:\n  name: search-qa\n")
    assert build_config(str(tmp_path / "mine.yaml")) == build_config("tiny-cpu", ["env=search-qa"])
    default = build_config()
    assert build_config(str(tmp_path / "mine.yaml")).algo.target_kl == default.algo.target_kl == 0.05
    # What a preset extends is its choice: another file (relative to it), or nothing (the field defaults).
    (tmp_path / "child.yaml").write_text("extends: mine.yaml\nalgo:\n  steps: 7\n")
    child = build_config(str(tmp_path / "child.yaml"))
    assert child.env.name == "search-qa" and child.algo.steps == 7 and child.algo.target_kl == 0.05
    (tmp_path / "bare.yaml").write_text("extends: null\nalgo:\n  steps: 7\n")
    assert build_config(str(tmp_path / "bare.yaml")).algo.target_kl is None
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        build_config(str(tmp_path / "loop.yaml"))


def test_relative_paths_in_env_options_and_bc_demos_become_absolute(tmp_path, monkeypatch):
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "a", "prompt": "p", "answer": "x"}) + "\n")
    (tmp_path / "log.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    config = build_config(overrides=["env=jsonl", "env.options.path=tasks.jsonl", "bc.demos=log.jsonl"])
    assert config.env.options["path"] == str(tmp_path / "tasks.jsonl")
    assert config.bc.demos == str(tmp_path / "log.jsonl")


# ---- evaluation over distinct tasks -----------------------------------------------------------------------


class RepeatingSuite:
    """20 distinct held-out tasks, each handed out again and again (as a game with few secrets does)."""

    name = "repeating"

    def __init__(self) -> None:
        from agentgrad.envs.tasks.arithmetic import ArithmeticSuite

        self.inner = ArithmeticSuite()
        self.pool = self.inner.sample_tasks(20, split="heldout", seed=0)

    def sample_tasks(self, n, *, split="train", seed=0):
        return [Task(f"rep-{i}", t.prompt, t.answer, metadata=t.metadata)
                for i, t in enumerate(self.pool[i % 20] for i in range(n))]

    def expert_actions(self, task):
        return self.inner.expert_actions(task)

    def verify(self, task, answer):
        return self.inner.verify(task, answer)

    def make_env(self):
        return self.inner.make_env()


class SolvesKnown(ScriptedPolicy):
    """Answers the tasks it is given, and a wrong number to the others."""

    def __init__(self, codec, known: list[Task]) -> None:
        super().__init__(codec, [])
        self.known = {t.prompt: t for t in known}

    def generate(self, prompts, sampling, logits_processor=None):
        out = []
        for ids in prompts:
            text = self.codec.tokenizer.decode(ids)
            known = next((t for p, t in self.known.items() if p in text), None)
            reply = self.codec.encode(known.answer if known else "1") + [self.codec.eos_token_ids[0]]
            out.append(Generation(tuple(reply), (0.0,) * len(reply), "stop"))
        return out


def test_eval_counts_distinct_tasks_and_says_when_fewer_than_asked(codec):
    from agentgrad.pipelines.evaluate import evaluate, wilson_interval

    suite = RepeatingSuite()
    seven = suite.pool[:7]
    result = evaluate(SolvesKnown(codec, seven), codec, suite, EpisodeLimits(), SamplerSettings(), num_tasks=200,
                      seed=0)
    assert result.num_tasks == 20 and result.requested_tasks == 200 and result.num_successes == 7
    assert (result.ci_low, result.ci_high) == wilson_interval(7, 20)
    assert result.success_rate == 7 / 20 and "only 20 distinct tasks of the 200 asked" in result.note
    assert evaluate(SolvesKnown(codec, seven), codec, suite, EpisodeLimits(), SamplerSettings(), num_tasks=10,
                    seed=0).note is None
    assert result.by_kind == {} and result.kinds_line() is None  # arithmetic's tasks name no kind


def test_eval_counts_successes_per_task_kind(codec):
    from agentgrad.pipelines.evaluate import evaluate

    suite = RepeatingSuite()
    # kinds by position: the 7 solved tasks are pool[:7]; "a" is pool[0:12], "b" pool[12:20]
    suite.pool = [Task(t.task_id, t.prompt, t.answer, metadata={**t.metadata, "kind": "a" if i < 12 else "b"})
                  for i, t in enumerate(suite.pool)]
    policy = SolvesKnown(codec, suite.pool[:7] + suite.pool[12:13])
    result = evaluate(policy, codec, suite, EpisodeLimits(), SamplerSettings(), num_tasks=20, seed=0)
    assert result.num_successes == 8 and result.by_kind == {"a": (7, 12), "b": (1, 8)}
    assert result.kinds_line() == "per kind: a 7/12, b 1/8"
    assert result.to_dict()["by_kind"] == {"a": {"successes": 7, "tasks": 12}, "b": {"successes": 1, "tasks": 8}}


# ---- BC on logged expert trajectories ---------------------------------------------------------------------


def test_logged_expert_chats_encode_to_the_experts_own_tokens(arithmetic_suite, codec, tmp_path):
    from agentgrad.data.offline import to_chat_line
    from agentgrad.envs.base import expert_episode
    from agentgrad.pipelines.data import DemoLoadError, read_demos, suite_tools
    from agentgrad.rollout.loop import expert_trajectory

    tasks = arithmetic_suite.sample_tasks(6, split="train", seed=4)
    tools, _ = suite_tools(arithmetic_suite)
    lines = [json.dumps(to_chat_line(expert_episode(arithmetic_suite, t), success=True, tools=tools)) for t in tasks]
    lines[2] = "{not json"
    lines.append(json.dumps({**json.loads(lines[0]), "success": False}))
    lines.append(json.dumps({"messages": [{"role": "user", "content": "no assistant"}]}))
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines) + "\n")
    result = read_demos(log, codec, tools)
    assert len(result.demos) == 5 and result.bad_lines == 2 and result.failed == 1 and result.lines == 8
    assert "line 3" in result.errors[0] and "2 bad line(s)" in result.summary(log)
    env = arithmetic_suite.make_env()
    for demo, task in zip(result.demos, [t for i, t in enumerate(tasks) if i != 2]):
        expert = expert_trajectory(env, task, arithmetic_suite.expert_actions(task), codec, EpisodeLimits())
        assert demo.token_ids == expert.token_ids and demo.loss_mask == expert.loss_mask
        assert demo.stop_reason is StopReason.ANSWERED
    (tmp_path / "empty.jsonl").write_text("{bad\n")
    with pytest.raises(DemoLoadError, match="no usable episode"):
        read_demos(tmp_path / "empty.jsonl", codec, tools)
    # A store (a run's trajectories/, an import's --out) is re-encoded through its chat form: same tokens.
    from agentgrad.data.store import TrajectoryStore
    from agentgrad.types import RewardBreakdown, ScoredTrajectory

    store = TrajectoryStore(tmp_path / "store")
    store.append([ScoredTrajectory(d, RewardBreakdown(1.0), True) for d in result.demos], step=0, stage="import")
    assert [d.token_ids for d in read_demos(tmp_path / "store", codec, tools).demos] == \
        [d.token_ids for d in result.demos]


def test_a_game_log_ends_with_the_envs_own_termination(game, codec, tmp_path):
    from agentgrad.data.offline import to_chat_line
    from agentgrad.envs.base import expert_episode
    from agentgrad.pipelines.data import read_demos, suite_tools
    from agentgrad.rollout.loop import expert_trajectory

    task = game.sample_tasks(1, split="train", seed=0)[0]
    tools, _ = suite_tools(game)
    (tmp_path / "g.jsonl").write_text(json.dumps(to_chat_line(expert_episode(game, task), success=True,
                                                              tools=tools)) + "\n")
    [demo] = read_demos(tmp_path / "g.jsonl", codec, tools).demos
    expert = expert_trajectory(game.make_env(), task, game.expert_actions(task), codec,
                               EpisodeLimits(max_turns=7, max_total_tokens=448))
    assert demo.stop_reason is expert.stop_reason is StopReason.ENV_TERMINATED
    assert demo.token_ids == expert.token_ids


# ---- a step far slower than the defaults expect -----------------------------------------------------------


def test_a_slow_rl_step_warns_once_per_stage(printed_display):
    import dataclasses
    from types import SimpleNamespace

    from agentgrad.logging import RunLogger
    from agentgrad.pipelines.rl import ONLINE_STAGE
    from agentgrad.pipelines.run_state import run_alone

    display = printed_display
    steps = iter([5.0, 80.0, 90.0])
    stage = dataclasses.replace(ONLINE_STAGE, step=lambda c, logger, store, state, step: {"perf/step_s": next(steps)})
    c = SimpleNamespace(config=build_config(overrides=["algo.steps=3"]))
    run_alone("grpo", stage, c, RunLogger([], display), state=object())
    assert len(display.printed) == 1 and "grpo step 2 took 80 s" in display.printed[0]
    assert "algo.tasks_per_step" in display.printed[0]
    assert build_config().run.slow_step_warn_s == 60.0
