"""Every suite's shipped rollout limits fit its expert demonstrations on seeds 0-9: the check `agentgrad train`
runs before BC, alone (no model training). The tokenizer is built once per suite, as a run builds it; the
measured headroom over 20 seeds, each with its own tokenizer, is in docs/demo-limits.md."""

from __future__ import annotations

import pytest

from agentgrad.config import build_config
from agentgrad.models.hf import load_model
from agentgrad.pipelines.components import build_tiny_model_dir, episode_limits, make_suite
from agentgrad.pipelines.demos import MAX_DROPPED_SHARE, DemoLength, check_demos_fit
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import expert_trajectory

SUITE_NAMES = ("arithmetic", "search-qa", "sql-qa", "code", "multi-tool", "api-catalog")
SEEDS = range(10)
DEMOS_PER_SEED = 100  # 1,000 per suite; a run clones bc.num_demos = 2,000 of one seed


@pytest.mark.parametrize("suite_name", SUITE_NAMES)
def test_expert_demos_fit_the_shipped_limits_on_seeds_0_to_9(suite_name, tmp_path):
    config = build_config(overrides=[f"env={suite_name}"])
    suite = make_suite(config)
    try:
        loaded = load_model(build_tiny_model_dir(config, suite, tmp_path / "model"))
        codec, limits, env = ChatCodec(loaded.tokenizer, loaded.eos_token_ids), episode_limits(config), suite.make_env()
        kept: list[DemoLength] = []
        for seed in SEEDS:
            tasks = suite.sample_tasks(DEMOS_PER_SEED, split="train", seed=seed + 1)  # the tasks run_bc clones
            demos = [expert_trajectory(env, t, suite.expert_actions(t), codec, limits) for t in tasks]
            fit = check_demos_fit(demos, limits)  # raises DemoLimitError past MAX_DROPPED_SHARE
            assert fit.dropped <= MAX_DROPPED_SHARE * fit.total, fit.message()
            kept += [DemoLength.of(d) for d in fit.kept]
        # what was kept really fits (the check's own logic, seen from the lengths)
        assert max(k.total_tokens for k in kept) <= limits.max_total_tokens
        assert max(k.turns for k in kept) <= limits.max_turns
        assert max(k.max_turn_tokens for k in kept) <= limits.max_new_tokens_per_turn
    finally:
        getattr(suite, "close", lambda: None)()
