"""The incremental engine (`HFPolicy.session`): KV caches reused across turns give the logprobs of a fresh full
forward; per-row sampling does not depend on which rows share a step; shared prompts are computed once."""

import pytest
import torch

from agentgrad.algos.sampling import counter_uniform, next_token_logprobs, sample_rows
from agentgrad.backends import hf_engine
from agentgrad.backends.base import SamplingParams, SessionPolicy
from agentgrad.backends.hf import HFPolicy
from agentgrad.backends.scoring import token_logprobs


@pytest.fixture(params=["lean", "lean-torch-attention", "transformers"])
def policy(request, loaded_tiny, monkeypatch):
    if request.param == "transformers":  # the generic path through the model's own modules and SlotCache
        monkeypatch.setattr(hf_engine.LeanDecoder, "supports", staticmethod(lambda model: False))
    # "lean": the compiled attention where this machine can build it (backends/native.py); else torch's ops
    return HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id,
                    native_attention=request.param == "lean")


def _full_forward_logprobs(model, seq, temperature):
    with torch.no_grad():
        ids = torch.tensor([seq])
        return token_logprobs(model, ids, torch.ones_like(ids), temperature)[0]  # (T,)


def _run_turn(session, want):
    done = {}
    while len(done) < want:
        done.update(session.step())
    return done


def test_reused_cache_across_turns_matches_a_fresh_full_forward(policy, loaded_tiny):
    """Three sequences (two with the same prompt, all sharing a prefix), two turns each with an observation in
    between, one of them released and its slot reused by a later prompt: every sampled logprob equals the
    log-softmax of one forward over the whole final sequence."""
    assert isinstance(policy, SessionPolicy)
    prefix = [5, 6, 7, 8, 9, 10, 11]
    prompts = {0: prefix + [12, 13], 1: prefix + [12, 13], 2: prefix + [20, 21, 22, 23]}
    obs = {0: [30, 31, 32], 1: [33], 2: [34, 35, 36, 37, 38]}
    sampling = SamplingParams(max_new_tokens=6, temperature=0.8, seed=4)
    with policy.session(sampling, max_sequences=3, max_tokens=64) as s:
        for k, p in prompts.items():
            s.submit(k, p, 6)
        first = _run_turn(s, 3)
        for k in prompts:
            s.submit(k, obs[k], 5)
        second = _run_turn(s, 3)
        s.release(1)
        s.submit(7, prefix + [40, 41], 6)  # reuses slot 1, with the remembered shared prefix copied in
        late = _run_turn(s, 1)
    seqs = {k: (prompts[k] + list(first[k].token_ids) + obs[k], second[k]) for k in prompts}
    seqs[7] = (prefix + [40, 41], late[7])
    for k, (context, gen) in seqs.items():
        if k in first:
            lp = _full_forward_logprobs(loaded_tiny.model, prompts[k] + list(first[k].token_ids), 0.8)
            assert torch.allclose(lp[len(prompts[k]):], torch.tensor(first[k].logprobs), atol=1e-4)
        full = context + list(gen.token_ids)
        lp = _full_forward_logprobs(loaded_tiny.model, full, 0.8)
        assert torch.allclose(lp[len(context):], torch.tensor(gen.logprobs), atol=1e-4), k
    assert first[0].token_ids != first[1].token_ids or first[0].logprobs == first[1].logprobs


def test_a_rows_sample_does_not_depend_on_its_batch_mates(policy):
    p = [5, 6, 7, 8]
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    alone = policy.generate([p], sampling)[0]
    crowded = policy.generate([p, [9, 10, 11, 12, 13, 14], [15, 16]], sampling)[0]
    assert alone.token_ids == crowded.token_ids
    assert alone.logprobs == pytest.approx(crowded.logprobs, abs=1e-5)


def test_counter_uniform_is_a_pure_function_of_seed_key_and_position():
    keys, pos = torch.tensor([0, 1, 2, 3]), torch.tensor([5, 5, 6, 7])
    u = counter_uniform(9, keys, pos)
    assert torch.equal(u[[2, 0]], counter_uniform(9, keys[[2, 0]], pos[[2, 0]]))  # order and company irrelevant
    assert not torch.equal(u, counter_uniform(10, keys, pos))
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 4


def test_inverse_cdf_sampling_picks_the_id_whose_cdf_step_holds_u():
    # p = [0.5, 0, 0.25, 0.25] -> CDF [0.5, 0.5, 0.75, 1.0]; u=0.49 -> id 0, 0.51 -> id 2 (id 1 has an empty
    # step, being masked), 0.8 -> id 3.
    logp = torch.log(torch.tensor([[0.5, 0.0, 0.25, 0.25]] * 3))
    assert sample_rows(logp, torch.tensor([0.49, 0.51, 0.8], dtype=torch.float64)).tolist() == [0, 2, 3]


def test_sampled_logprobs_are_of_the_masked_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    keep_two = lambda lg: lg.masked_fill(torch.tensor([[False, True, False, True]]), float("-inf"))  # noqa: E731
    lp = next_token_logprobs(logits, 0.5, 1.0, keep_two)
    # tempered logits 4 and 0 on the legal ids: log(e^4 / (e^4 + 1)) = -0.01815, log(1 / (e^4 + 1)) = -4.01815
    assert lp[0, 0].item() == pytest.approx(-0.018150, abs=1e-5)
    assert lp[0, 2].item() == pytest.approx(-4.018150, abs=1e-5)
    assert lp[0, 1].item() == float("-inf") and lp[0, 3].item() == float("-inf")


def test_windowed_dense_decode_over_slots_past_the_first_matches_a_full_forward(policy, loaded_tiny, monkeypatch):
    """With `max_batch` < `max_sequences` (episodes waiting on tools keep their slots), a dense decode runs the
    window of slots from the first generating one: slots 0-2 wait (their turn done, no new ids) while 3-5
    generate, then 0-2 take their next turn. Every logprob equals a full forward's, and the window really
    started past slot 0 (the decode read the cache through slots 3..5, not 0..5)."""
    firsts = []
    hidden = hf_engine.HFSession._hidden

    def spy(self, input_ids, write_pos, rows, first=0):
        if input_ids.shape[1] == 1 and rows is None:
            firsts.append((first, input_ids.shape[0]))
        return hidden(self, input_ids, write_pos, rows, first)

    monkeypatch.setattr(hf_engine.HFSession, "_hidden", spy)
    prompts = {k: [5, 6, 7, 8, 9 + k, 20 + k] for k in range(6)}
    sampling = SamplingParams(max_new_tokens=5, temperature=0.8, seed=2)
    with policy.session(sampling, max_sequences=6, max_tokens=64, max_batch=3) as s:
        for k in range(3):
            s.submit(k, prompts[k], 5)
        first = _run_turn(s, 3)
        for k in range(3, 6):
            s.submit(k, prompts[k], 5)
        first.update(_run_turn(s, 3))
        for k in range(3):
            s.submit(k, [30 + k, 31], 4)
        second = _run_turn(s, 3)
    assert (3, 3) in firsts
    for k, gen in first.items():
        lp = _full_forward_logprobs(loaded_tiny.model, prompts[k] + list(gen.token_ids), 0.8)
        assert torch.allclose(lp[len(prompts[k]):], torch.tensor(gen.logprobs), atol=1e-4), k
    for k, gen in second.items():
        context = prompts[k] + list(first[k].token_ids) + [30 + k, 31]
        lp = _full_forward_logprobs(loaded_tiny.model, context + list(gen.token_ids), 0.8)
        assert torch.allclose(lp[len(context):], torch.tensor(gen.logprobs), atol=1e-4), k


def test_a_session_takes_over_the_last_sessions_cache_and_samples_as_a_fresh_one(policy, loaded_tiny):
    """The second session runs in the first one's cache memory, zeroed first (NaN left there would poison every
    row); its samples equal a fresh policy's."""
    long_prompts = [[5 + j % 12 for j in range(260)] + [i] for i in range(4)]  # past 256: the cache grows in a step
    short_prompts = [[5, 6, 7][: i + 1] + [20 + i] for i in range(4)]  # ragged: rows read past their own length
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    policy.generate(long_prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=2))
    first = policy._spare_cache
    assert first is not None and any(bool(k.any()) for k in first.k)  # keys of the first session are in it
    with torch.inference_mode():  # the grown buffers are inference tensors, like the engine's
        for buf in (*first.k, *first.v):  # a stale non-finite value would reach every row through the masked keys
            buf.fill_(float("nan"))
    reused = policy.generate(short_prompts, sampling)
    assert policy._spare_cache is first  # the same memory, reset in between
    fresh = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id,
                     native_attention=policy.native_attention).generate(short_prompts, sampling)
    assert [g.token_ids for g in reused] == [g.token_ids for g in fresh]
    assert [g.logprobs for g in reused] == [g.logprobs for g in fresh]
