"""The search driver on the arithmetic suite with a scripted stochastic policy (known turn probabilities) and a
scripted value function: trees share one `generate` call per round, nodes are restored by replaying their
actions into fresh envs, every generated token and tool call is counted, pruning keeps at most K children,
budgets stop trees, and search solves tasks the policy alone mostly fails. Env snapshots restore nodes to the
same episodes as replays, with each call run once; the coverage rule stops a node's draws at the stated mass."""

import math
import random
import re

import pytest

from agentgrad.backends.base import Generation, SamplingParams
from agentgrad.envs import SUITES
from agentgrad.envs.base import SnapshotEnv, episode_success
from agentgrad.rollout.loop import EpisodeLimits, run_episodes
from agentgrad.search.driver import SearchBudget, SearchSettings, TreeSearch, search_metrics
from agentgrad.search.tree import iter_nodes, sampled_mass
from agentgrad.types import FinalAnswer, ToolCall

EXPR = re.compile(r"(\d+(?: [-+*] \d+)+) = \?")
WRONG = "7777"


def call(expression):
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


class StochasticScript:
    """First turn: answer wrong (p 0.6), the right calculator call (p 0.3), a wrong call (p 0.1). After a call:
    the right answer (p 0.3) or a wrong one (p 0.7). Alone it succeeds with p 0.3 * 0.3 = 0.09. Randomness is
    keyed by (seed, row, prompt length); logprobs sum to log p of the turn."""

    def __init__(self, codec):
        self.codec = codec
        self.calls, self.rows, self.tokens = 0, [], 0

    def generate(self, prompts, sampling, logits_processor=None):
        self.calls += 1
        self.rows.append(len(prompts))
        out = []
        for row, prompt in enumerate(prompts):
            text = self.codec.decode(prompt)
            expression = EXPR.search(text).group(1)
            answer = str(eval(expression))  # digits and + - * only
            rng = random.Random(f"{sampling.seed}-{row}-{len(prompt)}")
            if "<tool_call>" not in text:
                options = [(WRONG, 0.6), (call(expression), 0.3), (call("1 + 1"), 0.1)]
            else:
                options = [(answer, 0.3), (WRONG, 0.7)]
            turn, p = rng.choices(options, weights=[p for _, p in options])[0]
            ids = self.codec.encode(turn) + [self.codec.eos_token_ids[0]]
            self.tokens += len(ids)
            out.append(Generation(tuple(ids), (math.log(p),) + (0.0,) * (len(ids) - 1), "stop"))
        return out

    def load_weights(self, state):
        pass


def scripted_values(codec):
    """0.9 after a turn that calls the calculator on the task's expression or answers right, 0.1 after any other
    turn, 0.5 for a state (which ends with the generation prompt, not a turn)."""
    def value_fn(sequences):
        out = []
        for seq in sequences:
            text = codec.decode(seq)
            expression = EXPR.search(text).group(1)
            tail = text.rstrip()
            if tail.endswith((call(expression), str(eval(expression)))):
                out.append(0.9)
            elif tail.endswith(("</tool_call>", WRONG)):
                out.append(0.1)
            else:
                out.append(0.5)
        return out
    return value_fn


class CountingSuite:
    """The arithmetic suite, counting envs made and tool calls stepped across all of them."""

    def __init__(self, suite):
        self.suite, self.envs, self.tool_calls = suite, 0, 0

    def __getattr__(self, name):
        return getattr(self.suite, name)

    def make_env(self):
        self.envs += 1
        env, outer = self.suite.make_env(), self

        class Counted:
            def reset(self, **kw):
                return env.reset(**kw)

            def step(self, action):
                outer.tool_calls += isinstance(action, ToolCall)
                return env.step(action)

            def legal_actions(self):
                return env.legal_actions()
        return Counted()


LIMITS = EpisodeLimits(max_turns=3, max_new_tokens_per_turn=48, max_total_tokens=400)


def searcher(codec, suite, **settings):
    """The tests below were worked out for one batch of samples_per_expansion candidates per expansion; the
    coverage rule's own tests set expansion_batch and coverage."""
    settings = {"expansion_batch": 0, "coverage": 1.0, **settings}
    policy = StochasticScript(codec)
    search = TreeSearch(policy, codec, suite, scripted_values(codec), sampling=SamplingParams(seed=3),
                        limits=LIMITS, settings=SearchSettings(**settings))
    return policy, search


def test_search_solves_tasks_the_policy_mostly_fails(arithmetic_suite, codec):
    tasks = arithmetic_suite.sample_tasks(6, split="train", seed=0)
    suite = CountingSuite(arithmetic_suite)
    policy, search = searcher(codec, suite, top_k=2, samples_per_expansion=4,
                              budget=SearchBudget(simulations=8))
    results = search.run(tasks, seeds=list(range(6)))
    assert [r.success for r in results] == [True] * 6
    for r in results:
        [won] = [e for e in r.episodes if e.success]
        # the winning episode is a real one: the verifier accepts it, and it called the calculator right first
        assert episode_success(arithmetic_suite, won.trajectory)
        actions = [t.action for t in won.trajectory.turns]
        assert actions == [ToolCall("calculator", {"expression": r.task.metadata["expression"]}),
                           FinalAnswer(r.task.answer)]
        assert won.trajectory.loss_mask.count(1) == sum(len(e.sample.sequence) for e in won.node.edges())
    # Trees share the sampler: one generate call per round, over every expanding tree's rows.
    assert policy.calls == search.expansion_rounds < search.rounds and max(policy.rows) == 6 * 4
    # Every generated token and every tool call was counted (replays that restore a node included).
    assert sum(r.generated_tokens for r in results) == policy.tokens
    assert sum(r.tool_calls for r in results) == suite.tool_calls
    assert all(r.new_tool_calls <= r.tool_calls for r in results)
    for r in results:
        for node in iter_nodes(r.root):
            assert len(node.children) <= 2 and node.candidates >= len(node.children)
    metrics = search_metrics(results, 2)
    assert metrics["search/success"] == 1.0 and metrics["search/max_children"] <= 2
    assert metrics["search/expanded_depth_0"] == 1.0  # each root expanded once

    # The same policy alone, sampled on the same tasks: p = 0.09 per episode.
    alone = run_episodes(policy, codec, [arithmetic_suite.make_env() for _ in range(60)],
                         [t for t in tasks for _ in range(10)], sampling=SamplingParams(seed=5), limits=LIMITS)
    rate = sum(episode_success(arithmetic_suite, t) for t in alone) / len(alone)
    assert rate < 0.3


def test_search_is_deterministic_and_budgets_stop_trees(arithmetic_suite, codec):
    tasks = arithmetic_suite.sample_tasks(3, split="train", seed=1)

    def shape(results):
        return [[(n.depth, n.edge.key if n.edge else None, n.visits, round(n.value_sum, 9))
                 for n in iter_nodes(r.root)] for r in results]

    runs = [searcher(codec, arithmetic_suite, top_k=3, samples_per_expansion=3, stop_on_success=False,
                     budget=SearchBudget(simulations=5))[1].run(tasks) for _ in range(2)]
    assert shape(runs[0]) == shape(runs[1])
    # a tree stops at its 5 simulations, or earlier once every path in it has ended (its root is exhausted)
    assert all(r.simulations == 5 or r.root.exhausted for r in runs[0])
    assert all(r.root.visits == r.simulations for r in runs[0])  # every simulation backs up through the root
    # A tool-call budget of 1: a tree stops before the round after its first call.
    _, search = searcher(codec, arithmetic_suite, top_k=3, samples_per_expansion=3, stop_on_success=False,
                         budget=SearchBudget(simulations=50, tool_calls=1))
    for r in search.run(tasks):
        assert 1 <= r.tool_calls <= 2 and r.simulations < 50
    # A token budget below one expansion's worth: one simulation (the root's expansion) only.
    _, search = searcher(codec, arithmetic_suite, samples_per_expansion=3,
                         budget=SearchBudget(simulations=50, generated_tokens=1))
    assert [r.simulations for r in search.run(tasks)] == [1, 1, 1]


def test_rollout_mix_backs_up_a_rollout_outcome(arithmetic_suite, codec):
    tasks = arithmetic_suite.sample_tasks(2, split="train", seed=2)
    policy, search = searcher(codec, arithmetic_suite, samples_per_expansion=2, rollout_mix=1.0,
                              stop_on_success=False, budget=SearchBudget(simulations=1))
    results = search.run(tasks)
    for r in results:
        [rollout] = [e for e in r.episodes if e.by_rollout]
        assert rollout.node is r.root
        # mix = 1: the root's value is exactly the rollout's outcome
        assert r.root.visits == 1 and r.root.value_sum == float(rollout.success)
    assert sum(r.generated_tokens for r in results) == policy.tokens


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="invalid search settings"):
        SearchSettings(rollout_mix=1.5)


def test_widening_samples_again_where_every_child_ended(arithmetic_suite, codec):
    # One sample per expansion, K = 1: without widening a tree tries one first turn and one answer, so it
    # succeeds with p = 0.3 * 0.3 = 0.09; with 4 widenings a node whose child ended samples again (up to 4 times).
    tasks = arithmetic_suite.sample_tasks(12, split="train", seed=4)
    outcomes = {}
    for widenings in (0, 4):
        policy, search = searcher(codec, arithmetic_suite, top_k=1, samples_per_expansion=1, widenings=widenings,
                                  budget=SearchBudget(simulations=20))
        results = search.run(tasks)
        outcomes[widenings] = results
        # one sampled turn per expansion or widening, each adding at most top_k = 1 child
        assert all(len(n.children) <= 1 + widenings for r in results for n in iter_nodes(r.root))
        assert sum(r.generated_tokens for r in results) == policy.tokens
    # without widening a tree whose one root child fails has nothing left: its root is exhausted
    assert all(r.success or r.root.exhausted for r in outcomes[0])
    assert any(len(r.root.children) > 1 for r in outcomes[4])  # some root was widened
    # measured 2/12 vs 9/12 (expected ~1/12 without widening)
    assert sum(r.success for r in outcomes[4]) >= sum(r.success for r in outcomes[0]) + 4


# ---- env snapshots and the coverage rule ----------------------------------------------------------------------


def test_api_catalog_env_state_survives_a_snapshot_and_later_steps_do_not_touch_it():
    suite = SUITES.get("api-catalog")(kinds=["auth_single"])
    [task] = suite.sample_tasks(1, split="train", seed=0)
    login, lookup = suite.expert_actions(task)[:2]
    env = suite.make_env()
    env.reset(seed=0, options={"task": task})
    assert isinstance(env, SnapshotEnv)
    public = env.legal_actions()
    assert env.step(login)[4]["tool_ok"] and lookup.name not in public.tools
    state = env.snapshot()
    expected = env.step(lookup)
    env.step(ToolCall("auth.logout", {}))  # after the snapshot: must not reach it

    other = suite.make_env()
    other.reset(seed=0, options={"task": task})
    assert lookup.name not in other.legal_actions().tools
    other.restore(state)
    assert lookup.name in other.legal_actions().tools  # logged in, as at the snapshot
    assert other.step(lookup) == expected
    assert other.step(FinalAnswer(task.answer))[4]["success"]


class SnapshotSuite(CountingSuite):
    """The counting arithmetic suite whose envs offer snapshots (the calculator keeps no state of its own, so the
    ToolEnv's history is all there is)."""

    def make_env(self):
        counted = super().make_env()
        inner = counted.reset.__closure__[0].cell_contents  # the ToolEnv the counting wrapper steps

        class Snapshotting(type(counted)):
            def snapshot(self):
                return tuple(inner.history), inner._done

            def restore(self, state):
                inner.history, inner._done = list(state[0]), state[1]
        counted.__class__ = Snapshotting
        return counted


def test_snapshots_play_the_replayed_search_with_each_call_run_once(arithmetic_suite, codec):
    tasks = arithmetic_suite.sample_tasks(6, split="train", seed=1)
    runs = {}
    for snapshots in (False, True):
        suite = (SnapshotSuite if snapshots else CountingSuite)(arithmetic_suite)
        _, search = searcher(codec, suite, top_k=3, samples_per_expansion=4, budget=SearchBudget(simulations=10),
                             snapshots=snapshots, expansion_batch=2, coverage=0.9)
        runs[snapshots] = (search.run(tasks, seeds=list(range(6))), suite.tool_calls)
    (replayed, replay_calls), (restored, snapshot_calls) = runs[False], runs[True]
    for a, b in zip(replayed, restored):
        assert (a.success, a.simulations, a.generated_tokens, a.new_tool_calls) == (
            b.success, b.simulations, b.generated_tokens, b.new_tool_calls)
        assert [e.trajectory for e in a.episodes] == [e.trajectory for e in b.episodes]
        assert b.tool_calls == b.new_tool_calls  # every call ran once: no replays
    assert snapshot_calls == sum(r.tool_calls for r in restored) < replay_calls == sum(r.tool_calls for r in replayed)


def test_coverage_stops_drawing_once_the_distinct_turns_hold_enough_mass(arithmetic_suite, codec):
    """The script's first turn is one of three with probabilities 0.6, 0.3 and 0.1. With coverage 0.85 and one
    draw per batch, a root keeps drawing until it has seen the 0.6 and the 0.3 turns (mass 0.9) or drew 8."""
    tasks = arithmetic_suite.sample_tasks(8, split="train", seed=2)
    settings = {"top_k": 0, "samples_per_expansion": 8, "expansion_batch": 1, "widenings": 0,
                    "budget": SearchBudget(simulations=1)}
    policy, search = searcher(codec, arithmetic_suite, coverage=0.85, **settings)
    results = search.run(tasks, seeds=list(range(8)))
    # One batch per draw, each over the roots still drawing: 8 at first, then fewer as roots cross 0.85.
    rows = policy.rows
    assert rows[0] == 8 and all(a >= b for a, b in zip(rows, rows[1:])) and len(rows) <= 8
    below = 0
    for r in results:
        probabilities = sorted(round(math.exp(lp), 6) for lp in r.root.sampled.values())
        assert sampled_mass(r.root) == pytest.approx(sum(probabilities))
        if sampled_mass(r.root) < 0.85:  # it never saw both the 0.6 and the 0.3 turns: it drew all 8
            assert probabilities in ([0.1], [0.3], [0.6], [0.1, 0.3], [0.1, 0.6])
            below += 1
        else:
            assert {0.3, 0.6} <= set(probabilities)
    assert below == 0 or (len(rows) == 8 and rows[-1] >= below)
    assert sum(rows) < 8 * 8  # drawing stopped early somewhere

    policy_all, search_all = searcher(codec, arithmetic_suite, coverage=1.0, **settings)
    search_all.run(tasks, seeds=list(range(8)))
    assert policy_all.rows == [8] * 8  # coverage 1.0: every root draws all 8, whatever it has seen

