"""Process rewards on hand-built recorded trajectories: verifiable facts, the cap, dedup, dead loops."""

from __future__ import annotations

import itertools
import random
import sqlite3

import pytest

from agentgrad.envs.tool_env import ToolEnv
from agentgrad.rewards import OutcomeReward, VerifierReward, load_reward
from agentgrad.rewards.base import score
from agentgrad.rewards.process import (
    Fact,
    ProcessReward,
    ProcessRewardConfig,
    fact_bonuses,
    process_reward,
    repeated_call_turns,
    shaped_reward,
)
from agentgrad.rewards.testing import answer_turn, invalid_turn, make_trajectory, tool_turn
from agentgrad.tools.base import ToolSet
from agentgrad.tools.search import make_search_tools
from agentgrad.tools.sql import make_sql_tool
from agentgrad.types import FinalAnswer, StopReason, Task, ToolCall, Turn

TASK = Task("t0", "What is the capital of France?", "Paris")


class ExactSuite:
    name = "exact"

    def verify(self, task, answer):
        return answer is not None and answer.strip() == task.answer


def approx(values):
    return pytest.approx(tuple(values), abs=1e-12)


def test_default_facts_per_turn():
    traj = make_trajectory([
        tool_turn("search", {"query": "capital france"}, results=3),      # +0.1
        tool_turn("search", {"query": "zzz"}, results=0),                 # no result: 0
        tool_turn("python", {"code": "print(1)"}, exit_code=0),           # +0.2
        tool_turn("python", {"code": "1/0"}, ok=False, error="crashed", exit_code=1),  # 0
        tool_turn("sql", {"query": "SELEC"}, ok=False, error="bad_arguments"),         # invalid SQL: 0
        tool_turn("sql", {"query": "SELECT 1"}, rows=1),                  # +0.1
        invalid_turn(),                                                    # 0
        answer_turn("Paris"),                                              # 0 (the outcome pays)
    ], task=TASK)
    r = ProcessReward()(traj)
    assert r.outcome == 0.0 and not r.masked
    assert r.process == approx([0.1, 0, 0.2, 0, 0, 0.1, 0, 0])
    assert len(r.process) == len(traj.turns)


def test_each_fact_pays_once_per_episode_by_default():
    traj = make_trajectory([tool_turn("search", {"query": f"q{i}"}, results=2) for i in range(3)]
                           + [tool_turn("python", {"code": f"print({i})"}, exit_code=0) for i in range(2)])
    assert ProcessReward()(traj).process == approx([0.1, 0, 0, 0.2, 0])


def test_dedup_call_pays_distinct_calls_only():
    cfg = ProcessRewardConfig(dedup="call", dead_loop_k=0)
    traj = make_trajectory([tool_turn("search", {"query": "a"}, results=1),
                            tool_turn("search", {"query": "b"}, results=1),
                            tool_turn("search", {"query": "a"}, results=1)])
    assert ProcessReward(cfg)(traj).process == approx([0.1, 0.1, 0])
    assert ProcessReward(ProcessRewardConfig(dedup="none", dead_loop_k=0))(traj).process == approx([0.1] * 3)


def test_fact_checks_are_strict():
    assert not Fact("x", 1.0, signal="exit_code", value=0).holds(
        tool_turn("python", {}, exit_code=False))  # a bool is not exit code 0
    assert not Fact("x", 1.0, signal="results", op=">=", value=1).holds(tool_turn("search", {}, results=None))
    assert not Fact("x", 1.0, signal="results", op=">=", value=1).holds(tool_turn("search", {}))  # no signal
    assert not Fact("x", 1.0, tools=("sql",)).holds(tool_turn("sqlite", {}))
    assert not Fact("x", 1.0, signal="exit_code", value=0).holds(
        tool_turn("python", {}, ok=False, error="timeout", exit_code=0))  # not ok: not verified
    assert Fact("x", 1.0, signal="exit_code", value=0, require_ok=False).holds(
        tool_turn("python", {}, ok=False, error="crashed", exit_code=0))
    assert Fact("x", 1.0, signal="found", op="truthy").holds(tool_turn("open", {}, found=True))
    assert not Fact("x", 1.0).holds(answer_turn("a"))
    with pytest.raises(ValueError, match="unknown op"):
        Fact("x", 1.0, op="~=")
    with pytest.raises(ValueError, match=">= 0"):
        Fact("x", -0.1)


def test_task_complete_is_the_outcome():
    shaped = shaped_reward(ExactSuite())
    solved = make_trajectory([tool_turn("search", {"query": "france"}, results=4), answer_turn("Paris")], task=TASK)
    wrong = make_trajectory([tool_turn("search", {"query": "france"}, results=4), answer_turn("Lyon")], task=TASK)
    r = shaped(solved)
    assert r.outcome == 1.0 and r.process == approx([0.1, 0.0]) and r.total == pytest.approx(1.1)
    assert shaped(wrong).outcome == 0.0 and shaped(wrong).total == pytest.approx(0.1)
    big = shaped_reward(ExactSuite(), task_complete=2.0, cap=1.0)
    assert big(solved).outcome == 2.0


@pytest.mark.parametrize("dedup", ["fact", "call", "none"])
def test_fifty_searches_cannot_outscore_a_completed_task(dedup):
    suite = ExactSuite()
    shaped = shaped_reward(suite, dedup=dedup, dead_loop_k=0)
    busy = make_trajectory([tool_turn("search", {"query": f"q{i}"}, results=5) for i in range(50)], task=TASK)
    solved = make_trajectory([answer_turn("Paris")], task=TASK)  # no process reward at all
    busy_s, solved_s = score([busy, solved], shaped, suite)
    assert sum(busy_s.reward.process) <= shaped.components[1][0].config.cap + 1e-12
    assert busy_s.total_reward < solved_s.total_reward
    assert solved_s.total_reward == 1.0
    if dedup == "none":
        assert sum(busy_s.reward.process) == pytest.approx(0.5)  # 50 x 0.1 = 5.0, capped at 0.5
        assert busy_s.reward.process[:6] == approx([0.1] * 5 + [0.0])  # the cap is reached on the 5th search


def test_cap_holds_for_any_mix_of_facts():
    rng = random.Random(0)
    kinds = [lambda i: tool_turn("search", {"q": i}, results=rng.randint(0, 3)),
             lambda i: tool_turn("python", {"c": i}, exit_code=rng.choice([0, 0, 1])),
             lambda i: tool_turn("sql", {"s": i}, ok=rng.random() < 0.7),
             lambda i: invalid_turn()]
    for dedup, cap in itertools.product(["fact", "call", "none"], [0.0, 0.15, 0.5, 0.99]):
        cfg = ProcessRewardConfig(cap=cap, dedup=dedup, dead_loop_k=0)
        for _ in range(20):
            traj = make_trajectory([rng.choice(kinds)(i) for i in range(rng.randint(0, 30))])
            bonus = fact_bonuses(traj, cfg)
            assert all(b >= 0 for b in bonus)
            assert sum(bonus) <= cap + 1e-12


def test_dead_loop_penalty_on_the_repeating_turns():
    same = {"query": "paris"}
    traj = make_trajectory([tool_turn("search", same, results=1),
                            tool_turn("search", {"query": "other"}, results=1),
                            tool_turn("search", dict(same), results=1),   # 2nd identical call: penalised
                            tool_turn("search", same, results=1)],        # 3rd: penalised
                           stop_reason=StopReason.REPEATED_CALL)
    assert repeated_call_turns(traj, 2) == (2, 3)
    r = ProcessReward()(traj)  # default: k=2, penalty 0.1, no stop penalty
    assert r.process == approx([0.1, 0.0, -0.1, -0.1])
    k3 = ProcessReward(ProcessRewardConfig(dead_loop_k=3, dead_loop_penalty=0.25, repeated_call_stop_penalty=0.5))
    assert k3(traj).process == approx([0.1, 0.0, 0.0, -0.25 - 0.5])
    off = ProcessReward(ProcessRewardConfig(dead_loop_k=0))
    assert off(traj).process == approx([0.1, 0.0, 0.0, 0.0])


def test_argument_order_does_not_hide_a_loop():
    traj = make_trajectory([tool_turn("sql", {"query": "SELECT 1", "limit": 5}),
                            tool_turn("sql", {"limit": 5, "query": "SELECT 1"})])
    assert repeated_call_turns(traj, 2) == (1,)


def test_credit_of_a_tokenless_turn_moves_to_the_span_that_produced_it():
    traj = make_trajectory([tool_turn("search", {"query": "a"}, results=1),
                            tool_turn("python", {"code": "print(1)"}, exit_code=0),  # same generated text
                            answer_turn("x")], same_span=[1])
    assert traj.turns[1].start == traj.turns[1].end
    assert ProcessReward()(traj).process == approx([0.3, 0.0, 0.0])


def test_config_validation_and_from_dict():
    with pytest.raises(ValueError, match="strictly less than task_complete"):
        ProcessRewardConfig(cap=1.0)
    with pytest.raises(ValueError, match="strictly less than task_complete"):
        ProcessRewardConfig(cap=0.6, task_complete=0.5)
    with pytest.raises(ValueError, match="magnitudes"):
        ProcessRewardConfig(dead_loop_penalty=-0.1)
    with pytest.raises(ValueError, match="dead_loop_k"):
        ProcessRewardConfig(dead_loop_k=1)
    with pytest.raises(ValueError, match="unique"):
        ProcessRewardConfig(facts=(Fact("a", 0.1), Fact("a", 0.2)))
    with pytest.raises(ValueError, match="dedup"):
        ProcessRewardConfig(dedup="episode")
    cfg = ProcessRewardConfig.from_dict({"facts": {"search_results": 0.05, "sql_valid": 0}, "cap": 0.3})
    assert [(f.name, f.reward) for f in cfg.facts] == [("search_results", 0.05), ("code_exit_zero", 0.2),
                                                       ("known_entity", 0.1), ("logged_in", 0.1)]
    custom = ProcessRewardConfig.from_dict(
        {"facts": [{"name": "opened", "reward": 0.05, "signal": "found", "op": "truthy", "tools": ["open"]}]})
    assert custom.facts == (Fact("opened", 0.05, signal="found", op="truthy", tools=("open",)),)
    assert ProcessRewardConfig.from_dict(custom.to_dict()) == custom
    with pytest.raises(ValueError, match="unknown process reward option"):
        ProcessRewardConfig.from_dict({"capp": 0.3})
    with pytest.raises(ValueError, match="unknown fact"):
        ProcessRewardConfig.from_dict({"facts": {"searched": 0.1}})


def test_registered_factories():
    suite = ExactSuite()
    assert isinstance(load_reward("process", suite, cap=0.2), ProcessReward)
    assert load_reward("process", suite, cap=0.2).config.cap == 0.2
    assert process_reward(ProcessRewardConfig(), cap=0.1).config.cap == 0.1
    assert process_reward(cap=0.1, dedup="call").config.dedup == "call"  # the function itself is unchanged
    shaped = load_reward("shaped", suite, dedup="none")
    assert shaped.components[0][1] == 1.0 and shaped.components[1][0].config.dedup == "none"
    assert isinstance(shaped.components[0][0], OutcomeReward) and shaped.components[0][0].suite is suite
    # YAML-style options: facts as a mapping, the outcome as another reward spec
    shaped = load_reward("shaped", suite, cap=0.3, dedup="call", facts={"search_results": 0.05, "sql_valid": 0},
                         outcome={"name": "verifier", "verifier": "numeric", "abs_tol": 1e-6})
    outcome_fn, proc = shaped.components[0][0], shaped.components[1][0]
    assert isinstance(outcome_fn, VerifierReward) and proc.config.cap == 0.3
    assert [(f.name, f.reward) for f in proc.config.facts] == [("search_results", 0.05), ("code_exit_zero", 0.2),
                                                               ("known_entity", 0.1), ("logged_in", 0.1)]
    assert isinstance(load_reward("shaped", suite, outcome="verifier").components[0][0], VerifierReward)
    with pytest.raises(ValueError, match="needs a `name`"):
        load_reward("shaped", suite, outcome={"verifier": "numeric"})
    with pytest.raises(ValueError, match="unknown process reward option"):
        load_reward("process", suite, capp=0.3)


def _record(env: ToolEnv, action) -> Turn:
    """A Turn as rollout/loop.py records it from env.step's info."""
    obs, reward, terminated, _, info = env.step(action)
    return Turn(0, 0, "", action, obs if not terminated else None, tool_ok=info.get("tool_ok"),
                tool_error=info.get("tool_error"), signals=info.get("signals", {}), env_reward=float(reward))


def test_facts_read_real_tool_signals(tmp_path):
    db = tmp_path / "t.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE city(name TEXT)")
    conn.execute("INSERT INTO city VALUES ('Paris')")
    conn.commit()
    conn.close()
    search, open_ = make_search_tools([("paris", "Paris", "Paris is the capital of France.")], k=2)
    env = ToolEnv(ToolSet([search, open_, make_sql_tool(db)]), lambda task, a: a == task.answer)
    env.reset(seed=0, options={"task": TASK})
    turns = [_record(env, a) for a in [ToolCall("search", {"query": "zebra"}),
                                       ToolCall("search", {"query": "capital of France"}),
                                       ToolCall("sql", {"query": "DELETE FROM city"}),
                                       ToolCall("sql", {"query": "SELECT name FROM city"}),
                                       FinalAnswer("Paris")]]
    traj = make_trajectory(turns, task=TASK)
    assert ProcessReward()(traj).process == approx([0.0, 0.1, 0.0, 0.1, 0.0])
