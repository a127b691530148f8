"""Acceptance for constrained decoding with the real tiny model, the real api-catalog env and the real loop."""

from __future__ import annotations

import math
import random
import re
from types import SimpleNamespace

import pytest
import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy, TorchLearner
from agentgrad.backends.scoring import token_logprobs
from agentgrad.batch import collate
from agentgrad.envs.tasks.api_catalog import ApiCatalogSuite, catalog
from agentgrad.rollout.loop import EpisodeLimits, run_episodes
from agentgrad.rollout.parser import OPEN

HEADER = '\n{"name": "'
PUBLIC = frozenset(s.name for s in catalog() if not s.auth)


class ForceCall:
    """Wraps a policy so every turn starts with <tool_call> (an untrained model rarely writes one); after that,
    the loop's own mask processor decides. The forced first token is not a masked position."""

    def __init__(self, policy, open_id):
        self.policy, self.open_id = policy, open_id

    def generate(self, prompts, sampling, logits_processor=None):
        def force(row, generated, logits):
            if not generated:
                return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([self.open_id]), 0.0)
            return logits_processor(row, generated, logits) if logits_processor else logits
        return self.policy.generate(prompts, sampling, force)

    def load_weights(self, state):
        pass


def _legal_by_brute_force(tokenizer, generated: list[int], names: frozenset[str]) -> set[int]:
    """Every token whose decoded text keeps the call a prefix of header + legal name + '"' + anything.
    (Byte-level BPE on ASCII text decodes piecewise, so prefix text + token text is the decoded sequence.)"""
    legal = set()
    prefixes = {n[:k] for n in names for k in range(len(n) + 1)}
    prefix = tokenizer.decode(generated, skip_special_tokens=False)
    singles = tokenizer.batch_decode([[v] for v in range(len(tokenizer))], skip_special_tokens=False)
    for v, single in enumerate(singles):
        text = prefix + single
        tail = text[text.find(OPEN) + len(OPEN):]  # the call this turn opened
        if len(tail) <= len(HEADER):
            ok = HEADER.startswith(tail)
        else:
            rest = tail[len(HEADER):]
            ok = tail.startswith(HEADER) and (rest in prefixes if '"' not in rest
                                               else rest.split('"', 1)[0] in names)
        if ok:
            legal.add(v)
    return legal


def _force_first(open_id):
    def force(row, generated, logits):
        if not generated:
            return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([open_id]), 0.0)
        return logits
    return force


def _masked_rollout(loaded_tiny, codec, engine: str = "session", n: int = 8):
    """Single-call episodes of api-catalog before login: the tool-name mask hides the tools that need auth."""
    suite = ApiCatalogSuite(kinds=["auth_single"], schemas="none")
    tasks = suite.sample_tasks(n, split="train", seed=0)
    policy = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id)
    open_id = loaded_tiny.tokenizer.convert_tokens_to_ids(OPEN)
    # "rounds": a plain Policy through `generate`, seen as a session by GenerateSession (every episode in flight
    # advances one turn per `generate` call); "session": HFPolicy's continuous-batching engine, where the loop's own
    # processor is chained after a caller's (here the one forcing <tool_call>).
    sampler, caller = (ForceCall(policy, open_id), None) if engine == "rounds" else (policy, _force_first(open_id))
    return run_episodes(sampler, codec, [suite.make_env() for _ in tasks], tasks,
                        sampling=SamplingParams(temperature=1.0, seed=0), logits_processor=caller,
                        limits=EpisodeLimits(max_turns=1, max_new_tokens_per_turn=40, max_total_tokens=400))


@pytest.mark.parametrize("engine", ["rounds", "session"])
def test_under_a_mask_sampled_names_are_legal_and_logprobs_are_the_masked_softmax(loaded_tiny, codec, engine):
    """Acceptance: api-catalog before login, the real tiny model, the real loop. Every sampled name is a legal
    (public) API; every constrained token's logprob is the log-softmax over the legal set (found here by brute
    force over the vocabulary); the learner, given the recorded masks, reproduces every sampled logprob."""
    trajs = _masked_rollout(loaded_tiny, codec, engine)
    names = [re.match(re.escape(OPEN + HEADER) + r'([^"]*)"', t.turns[0].text) for t in trajs]
    assert all(names), [t.turns[0].text for t in trajs]
    assert {n.group(1) for n in names} <= PUBLIC
    assert len({n.group(1) for n in names}) > 4  # an untrained model samples many different legal names

    batch = collate(trajs, pad_token_id=loaded_tiny.pad_token_id)
    with torch.no_grad():
        logits = loaded_tiny.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        rescored = TorchLearner(loaded_tiny.model, lr=0.0).logprobs(batch, temperature=1.0)  # what PPO's ratio uses
    for b, traj in enumerate(trajs[:2]):
        assert traj.token_masks and all(m.allow for m in traj.token_masks)
        for m in traj.token_masks:
            generated = list(traj.token_ids[traj.prompt_length:m.position])
            legal = _legal_by_brute_force(loaded_tiny.tokenizer, generated, PUBLIC)
            assert set(m.token_ids) == legal
            ids = sorted(legal)
            expected = torch.log_softmax(logits[b, m.position - 1, ids], -1)[ids.index(traj.token_ids[m.position])]
            assert math.isclose(traj.logprobs[m.position], expected.item(), abs_tol=1e-5)
    forced = torch.zeros_like(batch.loss_mask)
    forced[torch.arange(len(trajs)), [t.prompt_length for t in trajs]] = 1  # the forced <tool_call> token
    diff = ((rescored - batch.old_logprobs) * batch.loss_mask * (1 - forced)).abs().max().item()
    assert diff < 1e-4
    plain = token_logprobs(loaded_tiny.model, batch.input_ids, batch.attention_mask, 1.0)
    assert ((plain - batch.old_logprobs) * batch.loss_mask * (1 - forced)).abs().max().item() > 0.1  # masks matter


def test_dpo_scores_policy_and_reference_on_the_same_masked_distribution(loaded_tiny, codec):
    """At the start of a DPO stage the reference is a copy of the policy, so every pair's implicit reward
    margin beta * ((pi_w - ref_w) - (pi_l - ref_l)) is 0 and the loss is -log sigmoid(0) = log 2 = 0.6931, with
    constrained decoding or without. Scoring the reference without the logit masks and the policy with them
    gives a margin of beta times the difference of the pairs' masked-vs-full log-normaliser sums instead."""
    import copy

    from agentgrad.algos.losses import sequence_logprobs
    from agentgrad.pipelines.dpo import dpo_update, frozen_sequence_logprobs

    trajs = _masked_rollout(loaded_tiny, codec)
    chosen = collate(trajs[0::2], pad_token_id=loaded_tiny.pad_token_id)  # (4, T) rows 0, 2, 4, 6
    rejected = collate(trajs[1::2], pad_token_id=loaded_tiny.pad_token_id)
    assert chosen.logit_masks is not None and rejected.logit_masks is not None
    reference = copy.deepcopy(loaded_tiny.model).eval().requires_grad_(False)
    ref_chosen = frozen_sequence_logprobs(reference, chosen)
    ref_rejected = frozen_sequence_logprobs(reference, rejected)
    full = sequence_logprobs(token_logprobs(reference, chosen.input_ids, chosen.attention_mask), chosen.loss_mask)
    assert (ref_chosen - full).abs().min().item() > 0.1  # the masks matter: a legal set holds less than all mass

    config = SimpleNamespace(dpo=SimpleNamespace(epochs=1, batch_size_pairs=4, beta=0.1, label_smoothing=0.0,
                                                 nll_coef=1.0))
    c = SimpleNamespace(config=config, learner=TorchLearner(loaded_tiny.model, lr=0.0))  # lr 0: one update, no move
    metrics = dpo_update(c, chosen, rejected, ref_chosen, ref_rejected, random.Random(0))
    assert metrics["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
