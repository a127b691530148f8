import math

import pytest
import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy
from agentgrad.backends.scoring import token_logprobs
from agentgrad.batch import collate
from agentgrad.types import StopReason, Task, Trajectory


@pytest.fixture()
def policy(loaded_tiny):
    return HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id)


def _as_traj(prompt, gen):
    ids = tuple(prompt) + gen.token_ids
    return Trajectory(task=Task("t", "p", "a"), token_ids=ids, loss_mask=(0,) * len(prompt) + (1,) * len(gen.token_ids),
                      logprobs=(0.0,) * len(prompt) + gen.logprobs, prompt_length=len(prompt), turns=(),
                      stop_reason=StopReason.MAX_TOKENS)


def test_sampled_logprobs_match_a_full_forward(policy, loaded_tiny):
    """The ratio pi/pi_old starts at exactly 1 (up to float error): sampling and training see the same numbers,
    including left padding at sampling and right padding at training, and the temperature."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    gens = policy.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.7, seed=0))
    batch = collate([_as_traj(p, g) for p, g in zip(prompts, gens)], pad_token_id=loaded_tiny.pad_token_id)
    with torch.no_grad():
        recomputed = token_logprobs(loaded_tiny.model, batch.input_ids, batch.attention_mask, temperature=0.7)
    diff = ((recomputed - batch.old_logprobs) * batch.loss_mask).abs().max().item()
    assert diff < 1e-4


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(policy):
    prompts = [[5, 6, 7], [8, 9, 10]]
    a = policy.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
    b = policy.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
    assert a == b
    g1 = policy.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    g2 = policy.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert [g.token_ids for g in g1] == [g.token_ids for g in g2]
    assert all(g.finish_reason in ("stop", "length") for g in a)


def test_logits_processor_mask_is_respected_and_logprobs_are_of_the_masked_distribution(policy, loaded_tiny):
    legal = torch.tensor([20, 21, 22])

    def only_legal(row, generated, logits):
        masked = torch.full_like(logits, float("-inf"))
        masked[legal] = logits[legal]
        return masked

    prompts = [[5, 6, 7]] * 16
    gens = policy.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0, seed=1), only_legal)
    with torch.no_grad():
        logits = loaded_tiny.model(torch.tensor([[5, 6, 7]])).logits[0, -1]
    expected = torch.log_softmax(logits[legal], -1)
    for g in gens:
        assert set(g.token_ids) <= set(legal.tolist())
        first = g.token_ids[0]
        assert math.isclose(g.logprobs[0], expected[legal.tolist().index(first)].item(), abs_tol=1e-5)


def test_length_buckets_minimise_padding_plus_a_cost_per_forward():
    """Hand-worked: 16 rows of 10 tokens and 8 of 100. Equal halves (12 + 12 rows) would run 12 x 10 + 12 x 100
    = 1320 slots; the split at the length jump runs 16 x 10 + 8 x 100 = 960 (+ 64 for the second forward),
    one run 24 x 100 = 2400. With lengths 10 and 12 a second forward saves 288 - 256 = 32 slots, less than its
    64: one run."""
    from agentgrad.backends.hf import length_buckets

    lengths = torch.tensor([100] * 8 + [10] * 16)[torch.randperm(24, generator=torch.Generator().manual_seed(0))]
    runs = length_buckets(lengths, 2, min_rows=8, overhead_tokens=64)
    assert [sorted(set(lengths[r].tolist())) for r in runs] == [[10], [100]]
    assert [len(r) for r in runs] == [16, 8]
    assert len(length_buckets(torch.tensor([12] * 8 + [10] * 16), 2, min_rows=8, overhead_tokens=64)) == 1
    assert len(length_buckets(torch.tensor([12] * 8 + [10] * 16), 2, min_rows=8, overhead_tokens=16)) == 2
    assert len(length_buckets(lengths, 4, min_rows=13)) == 1  # two runs of >= 13 rows need 26


def test_length_bucketed_learner_logprobs_equal_one_padded_forward(loaded_tiny):
    """Rows of very different lengths: the bucketed forward gives the same per-token logprobs (and zeros on
    padding) as one right-padded forward, and gradients flow through every bucket."""
    from agentgrad.backends.hf import TorchLearner, length_buckets

    lengths = [3, 40, 5, 38, 4, 41, 6, 39] * 2
    trajs = [Trajectory(task=Task("t", "p", "a"), token_ids=tuple(range(5, 5 + n)), loss_mask=(1,) * n,
                        logprobs=(0.0,) * n, prompt_length=0, turns=(), stop_reason=StopReason.MAX_TOKENS)
             for n in lengths]
    batch = collate(trajs, pad_token_id=loaded_tiny.pad_token_id)
    assert len(length_buckets(batch.attention_mask.sum(1), 4)) == 2  # 16 rows: at least 8 per forward
    learner = TorchLearner(loaded_tiny.model, lr=0.0)
    bucketed = learner.logprobs(batch)
    with torch.no_grad():
        single = token_logprobs(loaded_tiny.model, batch.input_ids, batch.attention_mask)
    assert torch.allclose(bucketed.detach() * batch.attention_mask, single * batch.attention_mask, atol=1e-5)
    (bucketed * batch.loss_mask).sum().backward()
    assert all(p.grad is not None for p in loaded_tiny.model.parameters() if p.requires_grad)
    loaded_tiny.model.zero_grad(set_to_none=True)
    loaded_tiny.model.eval()
