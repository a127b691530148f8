"""Latency hiding in the rollout scheduler (`SamplerSettings.waiting_episodes`): an episode waiting on a tool
leaves the decode batch and its slot goes to another episode, under the deterministic schedule too, with the
floats independent of the tools' timing.

Real HFPolicy engine on the untrained tiny model, steered by a logits processor that forces scripted tool calls
(forced tokens have logprob 0, the free last turn is sampled); tools that really sleep on threads. Assertions
count decode steps, never seconds, so they hold on a loaded machine."""

import random
import threading
import time
from contextlib import contextmanager

import pytest
from test_rollout_concurrency import _forcing, one_thread  # noqa: F401 (one_thread: the same autouse fixture)

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy
from agentgrad.envs import ToolEnv
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.tools.base import ToolSet, tool
from agentgrad.types import Task


def _sleep_tools(delay):
    """A `sleep` tool whose latency is `delay(tag, call index)` seconds."""
    counts: dict[int, int] = {}
    lock = threading.Lock()

    @tool
    def sleep(seconds: float, tag: int) -> str:
        """Wait, then say done.

        Args:
            seconds: nominal wait
            tag: the episode
        """
        with lock:
            index = counts[tag] = counts.get(tag, -1) + 1
        time.sleep(delay(tag, index))
        return "done"

    return ToolSet([sleep])


class StepLog:
    """Wraps a policy's decode session and writes down, per decode step, which episodes were generating (from
    `submit` until their turn comes back), and each episode's tool waits as (step its turn came back, step it
    was resubmitted): the scheduler's behaviour in steps, whatever the clock said."""

    def __init__(self, policy) -> None:
        self.policy, self.generate, self.load_weights = policy, policy.generate, policy.load_weights
        self.generating_per_step: list[frozenset] = []
        self.waits: list[tuple[int, int, int]] = []  # (episode, step its turn came back, step it rejoined)
        self._live: set = set()
        self._returned: dict = {}

    @contextmanager
    def session(self, sampling, logits_processor=None, *, max_sequences, max_tokens, **kw):
        with self.policy.session(sampling, logits_processor, max_sequences=max_sequences, max_tokens=max_tokens,
                                 **kw) as inner:
            yield _LoggedSession(inner, self)


class _LoggedSession:
    def __init__(self, inner, log: StepLog) -> None:
        self.inner, self.log = inner, log

    @property
    def has_work(self):
        return self.inner.has_work

    def submit(self, key, new_ids, max_new_tokens):
        if key in self.log._returned:
            self.log.waits.append((key, self.log._returned.pop(key), len(self.log.generating_per_step)))
        self.log._live.add(key)
        self.inner.submit(key, new_ids, max_new_tokens)

    def step(self):
        self.log.generating_per_step.append(frozenset(self.log._live))
        out = self.inner.step()
        for key, _ in out:
            self.log._live.discard(key)
            self.log._returned[key] = len(self.log.generating_per_step)
        return out

    def release(self, key):
        self.log._returned.pop(key, None)
        self.log._live.discard(key)
        self.inner.release(key)


def _run(loaded, codec, delay, *, n=8, in_flight=4, waiting=4, wait_steps=3, seed=3, deterministic=True,
         log=False, generate_only=False):
    policy = HFPolicy(loaded.model, eos_token_ids=loaded.eos_token_ids, pad_token_id=loaded.pad_token_id)
    if generate_only:
        policy = _GenerateOnly(policy)
    if log:
        policy = StepLog(policy)
    tasks = [Task(f"t{i}", f"task {i}", "x") for i in range(n)]
    toolset = _sleep_tools(delay)
    envs = [ToolEnv(toolset, lambda task, answer: True, system_prompt="s") for _ in tasks]
    limits = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=48, max_total_tokens=400, repeated_call_limit=0)
    sampler = SamplerSettings(max_concurrent_episodes=in_flight, waiting_episodes=waiting,
                              tool_wait_steps=wait_steps, deterministic_schedule=deterministic)
    trajs = run_episodes(policy, codec, envs, tasks, sampling=SamplingParams(temperature=1.0, seed=seed),
                         limits=limits, sampler=sampler, logits_processor=_forcing(codec, n, 2))
    return (trajs, policy) if log else trajs


class _GenerateOnly:
    def __init__(self, policy) -> None:
        self.generate, self.load_weights = policy.generate, policy.load_weights


def _same(a, b) -> bool:
    return [t.token_ids for t in a] == [t.token_ids for t in b] and [t.logprobs for t in a] == [t.logprobs for t in b]


@pytest.mark.slow
def test_queued_deterministic_schedule_repeats_the_floats_whatever_the_tool_latency(loaded_tiny, codec):
    """Instant tools, jittered ones (0-50 ms) and one episode whose every call takes 200 ms: the same episodes
    share every decode step, and tokens and logprobs are bit-identical, without the batch-invariant engine.
    The eager schedule (no deterministic_schedule) shows that the step log does see timing: there an episode
    whose first call takes 1 s (longer than the other wave's turn) rejoins later than with instant tools."""
    jitter = random.Random()  # unseeded on purpose: tools return in another order each run
    slow_one = lambda tag, i: 0.2 if tag == 1 else jitter.random() * 0.01  # noqa: E731
    instant, log = _run(loaded_tiny, codec, lambda tag, i: 0.0, log=True)
    assert all(len(t.turns) >= 3 for t in instant)  # two forced calls, then a sampled turn
    for delay in (lambda tag, i: jitter.random() * 0.05, slow_one):
        trajs, other = _run(loaded_tiny, codec, delay, log=True)
        assert other.generating_per_step == log.generating_per_step
        assert _same(instant, trajs)
    assert not _same(instant, _run(loaded_tiny, codec, lambda tag, i: 0.0, seed=4))  # the free turn is sampled
    _, eager_instant = _run(loaded_tiny, codec, lambda tag, i: 0.0, deterministic=False, log=True)
    _, eager_slow = _run(loaded_tiny, codec, lambda tag, i: float(tag == 1 and i == 0), deterministic=False,
                         log=True)
    assert eager_slow.generating_per_step != eager_instant.generating_per_step


@pytest.mark.slow
def test_generate_only_policy_under_the_queued_schedule_repeats_whatever_the_tool_latency(loaded_tiny, codec):
    """A `generate`-only policy seeds each call by its step index: the queued schedule's steps are a function of
    the data, so its rows repeat too."""
    jitter = random.Random()
    a = _run(loaded_tiny, codec, lambda tag, i: 0.0, generate_only=True)
    b = _run(loaded_tiny, codec, lambda tag, i: jitter.random() * 0.05, generate_only=True)
    assert _same(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("latency_s", [0.05, 0.2])
def test_a_waiting_episode_gives_its_decode_slot_away(loaded_tiny, codec, latency_s):
    """Every tool call takes `latency_s`. 8 episodes, 4 decode slots, 4 more may wait on tools: while an episode
    waits, others decode (queued ones join when the first four call their tools), and no answer is taken back
    before 3 decode steps have run. The old deterministic schedule (drain after each step) gives 0 such steps:
    every tool round was a full stall."""
    trajs, log = _run(loaded_tiny, codec, lambda tag, i: latency_s, log=True)
    assert all(len(t.turns) >= 3 for t in trajs)
    assert len(log.waits) == 8 * 2  # two forced calls each
    progressed = [sum(1 for s in range(came_back, rejoined) if log.generating_per_step[s] - {ep})
                  for ep, came_back, rejoined in log.waits]
    # Each wait spans at least tool_wait_steps=3 steps in which some other episode was generating, unless the
    # batch ran dry (the last episodes' calls): count both.
    assert sum(p >= 3 for p in progressed) >= 12, progressed
    # Queued episodes took the slots of the first four while they waited: more than 4 generated in one step.
    first_wave_waiting = [s for ep, c, r in log.waits if ep < 4 for s in range(c, r)]
    assert any(log.generating_per_step[s] & set(range(4, 8)) for s in first_wave_waiting)
    assert max(len(g) for g in log.generating_per_step) <= 4  # never more than the decode slots

    _, old = _run(loaded_tiny, codec, lambda tag, i: latency_s, waiting=0, log=True)
    assert len(old.waits) == 8 * 2 and all(rejoined == came_back for _, came_back, rejoined in old.waits)
