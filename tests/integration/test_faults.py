"""Faults during RL: injected tool timeouts/crashes mask their samples and are counted, the run completes;
non-finite losses skip the update (parameters unchanged) and abort the run after K in a row."""

import copy

import pytest
import torch

from agentgrad.backends.base import Generation
from agentgrad.backends.hf import TorchLearner
from agentgrad.config import build_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import NonFiniteLossError
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.components import Components, episode_limits, sampler_settings
from agentgrad.pipelines.rl import make_batch, policy_update, rollout_groups, run_rl, start_rl
from agentgrad.rewards.base import load_reward
from agentgrad.types import Message, ToolCall


class ExpertPolicy:
    """Plays the suite's expert (calculator call, then the answer) whatever the observations say: a policy that
    calls tools on every episode, so injected tool faults are certain to be hit."""

    def __init__(self, suite, codec, tasks):
        self.suite, self.codec, self.tasks = suite, codec, tasks

    def generate(self, prompts, sampling, logits_processor=None):
        out = []
        for ids in prompts:
            text = self.codec.tokenizer.decode(list(ids))
            task = next(t for t in self.tasks if t.prompt in text)
            actions = self.suite.expert_actions(task)
            a = actions[min(text.count("<tool_response>"), len(actions) - 1)]
            msg = Message("assistant", "", tool_calls=(a,)) if isinstance(a, ToolCall) else Message("assistant", a.text)
            turn = self.codec.assistant_ids(msg)
            out.append(Generation(tuple(turn), (-1.0,) * len(turn), "stop"))
        return out

    def load_weights(self, state):
        pass


class ListSink:
    def __init__(self):
        self.rows = []

    def write(self, step, stage, metrics):
        self.rows.append(dict(metrics))

    def close(self):
        pass


@pytest.fixture()
def components(arithmetic_suite, loaded_tiny, codec):
    def make(*overrides):
        # The scripted expert answers only the tasks it was given: no resampling of zero-signal groups, and no
        # KL guard (its recorded logprobs are not the model's).
        config = build_config(overrides=["algo.tasks_per_step=8", "algo.group_size=4", "algo.epochs_per_step=1",
                                         "algo.minibatch_size_episodes=16", "run.threads=1", "algo.zero_signal=keep",
                                         "algo.target_kl=null", *overrides])
        tasks = [t for s in range(config.algo.steps + 1) for t in arithmetic_suite.sample_tasks(
            config.algo.tasks_per_step, split="train", seed=(config.run.seed + 1) * 1_000_003 + s)]
        loaded = copy.copy(loaded_tiny)
        loaded.model = copy.deepcopy(loaded_tiny.model)
        return Components(config=config, suite=arithmetic_suite, loaded=loaded, codec=codec,
                          policy=ExpertPolicy(arithmetic_suite, codec, tasks),
                          learner=TorchLearner(loaded.model, lr=1e-4), limits=episode_limits(config),
                          sampler=sampler_settings(config),
                          reward_fn=load_reward("outcome", arithmetic_suite))
    return make


def test_ten_percent_tool_faults_are_masked_counted_and_the_run_completes(components, tmp_path):
    c = components("algo.steps=3", "faults.inject_tool_failure_rate=0.1")
    sink = ListSink()
    store = TrajectoryStore(tmp_path)
    steps = run_rl(c, RunLogger([sink], ProgressDisplay(enabled=False)), store)
    assert steps == 3 and len(sink.rows) == 3
    samples = list(store.trajectories())
    assert len(samples) == 3 * 32
    faulty = [s for s in samples if any(t.tool_error in ("timeout", "crashed") for t in s.trajectory.turns)]
    # 96 episodes, one calculator call each, 10% injected: ~10 faults (binomial sd 2.9)
    assert 3 <= len(faulty) <= 20
    assert all(s.reward.masked and s.reward.reason.startswith("tool fault") for s in faulty)
    assert not any(s.reward.masked for s in samples if s not in faulty)
    counted = sum(r["faults/tool_timeouts"] + r["faults/tool_crashes"] for r in sink.rows)
    assert counted == len(faulty) == sum(r["faults/tool_fault_samples"] for r in sink.rows)
    assert all(r["rollout/masked_samples"] == r["faults/tool_fault_samples"] for r in sink.rows)
    assert all(s.success for s in samples)  # the expert still answered correctly: masking, not a 0 reward


def test_nonfinite_loss_skips_the_update_and_aborts_after_k_in_a_row(components):
    c = components("algo.steps=1", "algo.minibatch_size_episodes=16")
    tasks = c.suite.sample_tasks(8, split="train", seed=5)
    c.policy.tasks += tasks
    groups = rollout_groups(c, tasks, step=0)
    batch = make_batch(c, groups)
    bad = batch.replace(advantages=torch.full_like(batch.loss_mask, float("nan")))
    before = {k: v.clone() for k, v in c.loaded.model.state_dict().items()}
    state = start_rl(c)  # faults.max_consecutive_nonfinite = 3 by default
    metrics = policy_update(c, bad, state)  # 32 episodes / 16 per minibatch: two skipped updates
    assert metrics["faults/nonfinite_losses"] == 2 and state.nonfinite.consecutive == 2
    assert all(torch.equal(before[k], v) for k, v in c.loaded.model.state_dict().items())
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        policy_update(c, bad, state)
    state.nonfinite.consecutive = 0
    policy_update(c, batch.replace(advantages=batch.loss_mask.clone()), state)  # finite: goes through
    assert state.nonfinite.consecutive == 0
    assert any(not torch.equal(before[k], v) for k, v in c.loaded.model.state_dict().items())
