"""The env `Wrapper` base forwards everything it does not override, and the fault-injecting env hides nothing."""

import pickle

import pytest

from agentgrad.envs.base import ActionMask, Env
from agentgrad.envs.faults import FaultInjectingEnv
from agentgrad.envs.wrappers import Wrapper
from agentgrad.types import FinalAnswer, Task, ToolCall


class _Counter:
    """A minimal env: counts steps, one tool, answers terminate."""

    def __init__(self) -> None:
        self.tools = ("add",)
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return f"task {options['task'].task_id} seed {seed}", {"tools": [], "system": ""}

    def step(self, action):
        self.steps += 1
        return f"obs {self.steps}", 0.0, isinstance(action, FinalAnswer), False, {}

    def legal_actions(self):
        return ActionMask(frozenset({"math"}), frozenset(self.tools))

    def describe(self) -> str:
        return f"counter at {self.steps}"


class _Shout(Wrapper):
    """Changes one thing (observations upper-cased) and nothing else."""

    def step(self, action):
        obs, *rest = self.env.step(action)
        return (obs.upper(), *rest)


TASK = Task("t1", "p", "a")


def test_wrapper_forwards_attributes_methods_and_protocol_calls():
    inner = _Counter()
    env = _Shout(inner)
    assert isinstance(env, Env)
    assert env.reset(seed=3, options={"task": TASK}) == ("task t1 seed 3", {"tools": [], "system": ""})
    assert env.step(ToolCall("add", {})) == ("OBS 1", 0.0, False, False, {})
    # attributes and methods the wrapper does not define are the wrapped env's, live (not copied at wrap time)
    assert env.tools == ("add",) and env.steps == 1 and env.describe() == "counter at 1"
    assert env.legal_actions() == inner.legal_actions()
    with pytest.raises(AttributeError, match="nope"):
        env.nope  # noqa: B018
    # attributes the wrapper sets stay its own
    env.steps = 99
    assert inner.steps == 1


def test_unwrapped_is_the_innermost_env_through_a_stack():
    inner = _Counter()
    stacked = FaultInjectingEnv(_Shout(inner), rate=0.0, seed=0)
    assert stacked.unwrapped is inner and stacked.env.unwrapped is inner
    assert stacked.describe() == "counter at 0" and stacked.tools == ("add",)
    assert "FaultInjectingEnv" in repr(stacked) and "_Shout" in repr(stacked)


def test_fault_injecting_env_forwards_everything_but_the_faults():
    inner = _Counter()
    env = FaultInjectingEnv(inner, rate=1.0, seed=0)
    env.reset(seed=0, options={"task": TASK})
    obs, reward, terminated, truncated, info = env.step(ToolCall("add", {}))
    # every tool call fails (rate 1) without reaching the wrapped env; an answer still goes through
    assert info["tool_error"] in ("timeout", "crashed") and not terminated and inner.steps == 0
    assert env.injected == 1
    assert env.step(FinalAnswer("a"))[2] is True and inner.steps == 1
    # what the old hand-forwarding hid: the wrapped env's own attributes
    assert env.tools == ("add",) and env.describe() == "counter at 1"


def test_wrapper_pickles_without_recursing():
    # pickle looks attributes up on an instance whose __init__ has not run: __getattr__ must not loop on self.env
    env = pickle.loads(pickle.dumps(FaultInjectingEnv(_Counter(), rate=0.5, seed=1)))
    assert env.rate == 0.5 and env.tools == ("add",)
