"""The per-step pieces of `pipelines.rl` that add math on top of `algos` (KL bookkeeping, PPO advantages),
on hand-built batches. Expected numbers worked out in the comments."""

from types import SimpleNamespace

import pytest
import torch

from agentgrad.algos.kl import AdaptiveKLController
from agentgrad.backends.scoring import Scoring
from agentgrad.batch import TokenBatch
from agentgrad.config import build_config
from agentgrad.pipelines import rl


def _batch(**kw) -> TokenBatch:
    base = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 4, dtype=torch.long),
            "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0]]), "old_logprobs": torch.tensor([[0.0, -1.0, -2.0, 0.0]]),
            "token_rewards": torch.tensor([[0.0, 0.0, 1.0, 0.0]]), "group_index": torch.tensor([0]),
            "ref_logprobs": torch.tensor([[0.0, -1.5, -1.0, -9.0]])}
    return TokenBatch(**(base | kw))


def test_rollout_kl_sums_k1_over_policy_tokens():
    # k1 = old - ref on policy tokens: -1 - (-1.5) = 0.5 and -2 - (-1) = -1; position 3 (-9) is not a policy token.
    assert rl.rollout_kl(_batch()).tolist() == pytest.approx([-0.5])


def test_kl_reward_penalty_uses_the_controller_coefficient():
    # r' = r - 0.1 * k1: position 1: 0 - 0.1 * 0.5 = -0.05; position 2: 1 - 0.1 * (-1) = 1.1.
    out = rl.penalise_rewards(_batch(), 0.1)
    assert out.token_rewards.tolist()[0] == pytest.approx([0.0, -0.05, 1.1, 0.0])


def test_adapt_kl_coef_updates_the_adaptive_controller():
    # measured KL -0.5 per episode vs target 1: error clip(-0.5 / 1 - 1, -0.2, 0.2) = -0.2;
    # coef 0.1 * (1 - 0.2 * 1 episode / 10) = 0.1 * 0.98 = 0.098.
    state = rl.RLState(rl.ONLINE_ALGORITHMS.get("ppo"), Scoring(), reference=None,
                       kl_controller=AdaptiveKLController(0.1, 1.0, 10), critic=None)
    assert rl.adapt_kl_coef(state, _batch()) == {"rollout/kl_ref": pytest.approx(-0.5)}
    assert state.kl_controller.value == pytest.approx(0.098)
    assert rl.adapt_kl_coef(state, _batch(ref_logprobs=None)) == {}


def test_adapt_kl_coef_in_verls_unit_feeds_the_per_token_mean():
    # algo.kl_target_unit=token-mean: the episode's k1 sum -0.5 over its 2 policy tokens -> -0.25 per token
    # (verl's current_kl); error clip(-0.25 / 1 - 1, -0.2, 0.2) = -0.2 -> coef 0.1 * 0.98 = 0.098.
    state = rl.RLState(rl.ONLINE_ALGORITHMS.get("ppo"), Scoring(), reference=None,
                       kl_controller=AdaptiveKLController(0.1, 1.0, 10), critic=None)
    assert rl.adapt_kl_coef(state, _batch(), "token-mean") == {"rollout/kl_ref": pytest.approx(-0.25)}
    assert state.kl_controller.value == pytest.approx(0.098)


def test_token_sum_norm_divisor_is_a_run_constant():
    # Dr.GRPO divides by a constant: the configured one, else rollout.max_total_tokens (320 in tiny-cpu).
    c = SimpleNamespace(config=build_config(overrides=["algo.loss_agg=seq-mean-token-sum-norm"]))
    assert rl.agg_norm(c) == c.config.rollout.max_total_tokens == 320
    c = SimpleNamespace(config=build_config(overrides=["algo.loss_agg_norm=1000"]))
    assert rl.agg_norm(c) == 1000


def test_ppo_advantages_are_gae_then_whitened():
    # Policy tokens 1, 2; reward 1 on token 2; values V1 = 0.5, V2 = 0.8; gamma = lambda = 1.
    # delta2 = 1 - 0.8 = 0.2 -> A2 = 0.2; delta1 = 0 + 0.8 - 0.5 = 0.3 -> A1 = 0.3 + 0.2 = 0.5.
    # returns = A + V = 1.0, 1.0. Whitened over {0.5, 0.2}: mean 0.35, population std 0.15 -> +1, -1.
    c = SimpleNamespace(config=build_config(overrides=["algo.gae_lambda=1.0", "algo.gamma=1.0"]))
    batch = _batch(values=torch.tensor([[0.0, 0.5, 0.8, 0.0]]))
    out = rl.compute_advantages(c, batch, rl.ONLINE_ALGORITHMS.get("ppo"))
    assert out.returns.tolist()[0] == pytest.approx([0.0, 1.0, 1.0, 0.0])
    assert out.advantages.tolist()[0] == pytest.approx([0.0, 1.0, -1.0, 0.0], abs=1e-4)
    raw = SimpleNamespace(config=build_config(overrides=["algo.gae_lambda=1.0", "critic.whiten_advantages=false"]))
    assert rl.compute_advantages(raw, batch, rl.ONLINE_ALGORITHMS.get("ppo")).advantages.tolist()[0] == \
        pytest.approx([0.0, 0.5, 0.2, 0.0])


class _DriftingLearner:
    """Each optimizer step moves every policy token's logprob down by 0.1 nat (a stand-in for a policy that
    drifts away from the sampling policy as it trains on one batch)."""

    def __init__(self):
        self.shift = torch.zeros(())
        self.steps = 0

    def logprobs(self, batch, *, temperature=1.0):
        return (batch.old_logprobs - self.shift).requires_grad_(True)  # (B, T)

    def step(self, loss=None):
        self.steps += 1
        self.shift = self.shift + 0.1
        return {"train/grad_norm": 1.0, "train/skipped_steps": 0.0}


@pytest.mark.parametrize("target_kl,expected_updates", [(None, 4), (0.01, 2), (0.03, 3)])
def test_target_kl_stops_the_remaining_updates_of_a_step(target_kl, expected_updates):
    # After k updates, log r = logprobs - old_logprobs = -0.1 k, and the reported approx KL is the k3 estimate
    # (r - 1) - log r = exp(-0.1 k) - 1 + 0.1 k:  k=0: 0,  k=1: 0.00484,  k=2: 0.01873,  k=3: 0.04082.
    # The check runs before each of the 4 updates (4 epochs of one minibatch): target 0.01 lets k=0 and k=1
    # through and stops at k=2 (2 updates); target 0.03 stops at k=3 (3 updates); None never stops.
    overrides = ["algo.epochs_per_step=4", "algo.minibatch_size_episodes=64"]
    if target_kl is not None:
        overrides.append(f"algo.target_kl={target_kl}")
    c = SimpleNamespace(config=build_config(overrides=overrides), learner=_DriftingLearner())
    state = rl.RLState(algorithm=rl.ONLINE_ALGORITHMS.get("grpo"), scoring=Scoring(), reference=None,
                       kl_controller=AdaptiveKLController(0.0, target=1.0, horizon=1.0), critic=None)
    batch = _batch(ref_logprobs=None, advantages=torch.tensor([[0.0, 1.0, -1.0, 0.0]]))
    metrics = rl.policy_update(c, batch, state)
    assert c.learner.steps == expected_updates
    assert metrics["train/updates"] == expected_updates
    assert metrics["train/kl_early_stops"] == float(expected_updates < 4)


def test_minibatch_order_keeps_groups_together_when_the_group_size_divides_the_minibatch():
    group_index = torch.tensor([2, 0, 1, 3, 0, 2, 1, 3, 2, 0, 1, 3])  # 4 groups of 3 rows, interleaved
    order = rl.shuffled_rows(group_index, 6, torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(12))
    runs = group_index[order].view(4, 3)  # consecutive triples are whole groups: minibatches of 6 hold two
    assert all(len(set(r.tolist())) == 1 for r in runs) and sorted(runs[:, 0].tolist()) == [0, 1, 2, 3]
    assert torch.equal(order, rl.shuffled_rows(group_index, 6, torch.Generator().manual_seed(0)))  # seeded
    # 3 does not divide 4, and groups of one row: the plain row shuffle, as before
    for groups, size in ((group_index, 4), (torch.arange(12), 6)):
        assert torch.equal(rl.shuffled_rows(groups, size, torch.Generator().manual_seed(0)),
                           torch.randperm(12, generator=torch.Generator().manual_seed(0)))
