"""Action masks: ActionMask.allows, ToolEnv's typed `denied` errors, and the api-catalog's login-gated mask."""

from __future__ import annotations

import pytest

from agentgrad.envs import ActionMask, ToolEnv, check_env
from agentgrad.envs.tasks.api_catalog import ApiCatalogSuite, catalog
from agentgrad.tools.base import ToolSet, tool
from agentgrad.types import FinalAnswer, InvalidAction, Task, ToolCall


@pytest.fixture(scope="module")
def suite():
    return ApiCatalogSuite()


def _auth_task(suite, kind="auth_single") -> Task:
    return ApiCatalogSuite(kinds=[kind]).sample_tasks(1, split="train", seed=11)[0]


def test_action_mask_allows():
    mask = ActionMask(categories=frozenset({"math"}), tools=frozenset({"calculator"}), final_answer=False)
    assert mask.allows(ToolCall("calculator", {"expression": "1"}))
    assert not mask.allows(ToolCall("python", {"code": "1"}))
    assert not mask.allows(FinalAnswer("3"))
    assert mask.allows(InvalidAction("<tool_call>{", "bad json"))  # always legal: earns an error observation
    assert ActionMask(frozenset(), frozenset()).allows(FinalAnswer("x"))


def test_catalog_is_large_and_hierarchical():
    specs = catalog()
    categories = {s.category for s in specs}
    assert len(specs) >= 200 and len(categories) >= 10
    assert len({s.name for s in specs}) == len(specs)
    assert all(s.name.startswith(s.category + ".") for s in specs)
    auth = {s.category for s in specs if s.auth}
    assert {"bank", "mail"} <= auth and "weather" not in auth
    assert all(s.auth == (s.category in auth) for s in specs)  # login-gated categories are gated whole


def test_masks_before_and_after_login(suite):
    task = _auth_task(suite)
    env = suite.make_env()
    _, info = env.reset(seed=0, options={"task": task})
    every = {s["function"]["name"] for s in info["tools"]}
    gated = {s.name for s in catalog() if s.auth}
    before = env.legal_actions()
    assert "auth.login" in before.tools and "weather.get_humidity" in before.tools
    assert not before.tools & gated and before.tools == every - gated
    assert "bank" not in before.categories and "weather" in before.categories
    assert not before.allows(ToolCall("bank.get_balance", {"account": "1234"}))
    assert before.allows(FinalAnswer("1"))

    obs, _, term, _, info = env.step(ToolCall("auth.login", {"user": task.metadata["user"], "pin": "0000"}))
    assert obs.startswith("error (denied)") and info["tool_error"] == "denied" and not term
    assert env.legal_actions() == before  # a failed login changes nothing

    obs, _, _, _, info = env.step(ToolCall("auth.login", {"user": task.metadata["user"], "pin": task.metadata["pin"]}))
    assert info["tool_ok"] and "logged in" in obs
    after = env.legal_actions()
    assert after.tools == every and "bank" in after.categories
    assert after.allows(ToolCall("bank.get_balance", {"account": "1234"}))
    obs, _, _, _, info = env.step(ToolCall("bank.get_balance", {"account": "1234"}))
    assert info["tool_ok"] and obs.startswith("balance: ")

    env.step(ToolCall("auth.logout", {}))
    assert env.legal_actions() == before
    env.reset(seed=0, options={"task": task})  # reset forgets the login
    assert env.legal_actions() == before


def test_illegal_call_gets_a_typed_denied_observation(suite):
    task = _auth_task(suite)
    env = suite.make_env()
    env.reset(seed=0, options={"task": task})
    call = ToolCall("bank.get_balance", {"account": "1234"})
    obs, reward, term, trunc, info = env.step(call)
    assert obs.startswith("error (denied):") and "auth.login" in obs
    assert (reward, term, trunc) == (0.0, False, False)
    assert info["tool_ok"] is False and info["tool_error"] == "denied"
    # an unknown tool is `not_found`, not `denied`; bad arguments to a legal tool are `bad_arguments`
    assert env.step(ToolCall("bank.get_everything", {}))[0].startswith("error (not_found)")
    assert env.step(ToolCall("weather.get_humidity", {"town": "x"}))[0].startswith("error (bad_arguments)")
    assert env.step(ToolCall("weather.get_humidity", {"city": 3}))[0].startswith("error (bad_arguments)")
    assert env.history[0] == call  # denied calls are part of the history (replay restores them)


def test_expert_actions_are_always_legal_and_replay_restores_state(suite):
    for task in suite.sample_tasks(40, split="train", seed=2):
        env = suite.make_env()
        env.reset(seed=0, options={"task": task})
        masks = []
        for action in suite.expert_actions(task):
            assert env.legal_actions().allows(action)
            masks.append(env.legal_actions())
            env.step(action)
        # replaying the same history from a reset reaches the same masks
        env.reset(seed=0, options={"task": task})
        for action, mask in zip(suite.expert_actions(task), masks):
            assert env.legal_actions() == mask
            env.step(action)
    kinds = {t.metadata["kind"] for t in suite.sample_tasks(40, split="train", seed=2)}
    assert kinds == {"single", "auth_single", "chain", "auth_chain"}


def test_three_call_task(suite):
    task = _auth_task(suite, "auth_chain")
    actions = suite.expert_actions(task)
    assert [a.name for a in actions[:-1]][0] == "auth.login" and len(actions) == 4
    check_env(suite.make_env(), task, actions=actions)


def test_schemas_none_hides_the_catalog_from_the_prompt():
    s = ApiCatalogSuite(schemas="none")
    env = s.make_env()
    _, info = env.reset(options={"task": s.sample_tasks(1, split="test", seed=0)[0]})
    assert info["tools"] == [] and len(env.legal_actions().tools) > 100


def test_tool_env_denies_known_masked_tools_only():
    @tool(category="math")
    def double(x: int) -> int:
        """Double a number.

        Args:
            x: the number
        """
        return 2 * x

    @tool(category="math")
    def triple(x: int) -> int:
        """Triple a number.

        Args:
            x: the number
        """
        return 3 * x

    class OnlyDouble(ToolEnv):
        def legal_actions(self) -> ActionMask:
            return ActionMask(frozenset({"math"}), frozenset({"double"}))

    env = OnlyDouble(ToolSet([double, triple]), lambda t, a: a == t.answer)
    env.reset(options={"task": Task("t", "2*3?", "6")})
    assert env.step(ToolCall("double", {"x": 3}))[0] == "6"
    obs, _, _, _, info = env.step(ToolCall("triple", {"x": 3}))
    assert obs.startswith("error (denied)") and info["tool_error"] == "denied"
    obs, _, _, _, info = env.step(ToolCall("quadruple", {"x": 3}))
    assert obs.startswith("error (not_found)") and info["tool_error"] == "not_found"
