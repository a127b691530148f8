"""The engine's `pause` (a decision point for a factored action head) and the head's batch and records."""

import pytest
import torch

from agentgrad.backends import hf_engine
from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy
from agentgrad.backends.scoring import token_logprobs_and_hidden
from agentgrad.batch import collate_head
from agentgrad.data.store import from_json, to_json
from agentgrad.types import HeadDecision, StopReason, Task, Trajectory


@pytest.fixture(params=["lean", "transformers"])
def policy(request, loaded_tiny, monkeypatch):
    if request.param == "transformers":
        monkeypatch.setattr(hf_engine.LeanDecoder, "supports", staticmethod(lambda model: False))
    return HFPolicy(loaded_tiny.model, eos_token_ids=(), pad_token_id=loaded_tiny.pad_token_id)


def test_pause_ends_the_turn_before_sampling_and_the_turn_continues_as_if_written(policy, loaded_tiny):
    """Row 0 pauses after 3 sampled ids (row 1 never does). Writing 2 ids in and continuing samples exactly what a
    fresh greedy turn over prompt + 3 ids + the 2 written ids samples; the policy's `context_states` of the
    paused sequence are the learner's forward's (what a factored head reads at the pause)."""
    prompts = {0: [5, 6, 7, 8], 1: [9, 10, 11]}
    paused = []

    def pause(key, generated):  # once: the continuation counts its ids from 0 again
        if key == 0 and len(generated) == 3 and not paused:
            paused.append(key)
            return True
        return False

    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    with policy.session(sampling, max_sequences=2, max_tokens=40, pause=pause) as s:
        for k, p in prompts.items():
            s.submit(k, p, 6)
        done = {}
        while 0 not in done:
            done.update(s.step())
        first = done.pop(0)
        assert first.finish_reason == "pause" and len(first.token_ids) == 3
        s.submit(0, [12, 13], 4)
        while len(done) < 2:
            done.update(s.step())
    assert done[1].finish_reason == "length" and len(done[1].token_ids) == 6
    seq = prompts[0] + list(first.token_ids)
    with torch.no_grad():
        ids = torch.tensor([seq])
        _, hidden = token_logprobs_and_hidden(loaded_tiny.model, ids, torch.ones_like(ids))
    torch.testing.assert_close(policy.context_states(seq), hidden[0], atol=1e-5, rtol=1e-5)
    fresh = policy.generate([seq + [12, 13]], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    assert done[0].token_ids == fresh.token_ids and len(done[0].token_ids) == 4


def _traj(decisions):
    return Trajectory(task=Task("t", "p", "a"), token_ids=tuple(range(10)), loss_mask=(0,) * 10,
                      logprobs=(0.0,) * 10, prompt_length=2, turns=(), stop_reason=StopReason.ANSWERED,
                      head_decisions=tuple(decisions))


def test_head_decisions_collate_over_the_heads_tool_list_and_round_trip():
    d1 = HeadDecision(position=3, end=5, choice="b", logprob=-0.5, legal=("a", "b"))
    d2 = HeadDecision(position=6, end=8, choice="c", logprob=-1.5, legal=("c",))
    trajs = [_traj([d1]), _traj([]), _traj([d2])]
    hb = collate_head(trajs, ["a", "b", "c"])
    assert hb.row.tolist() == [0, 2] and hb.position.tolist() == [3, 6] and hb.choice.tolist() == [1, 2]
    assert hb.legal.tolist() == [[True, True, False], [False, False, True]]
    assert hb.old_logprob.tolist() == [-0.5, -1.5]
    assert from_json(to_json(trajs[0])) == trajs[0]
    stored = to_json(d1)
    stored["tool"] = stored.pop("choice")  # a store written before heads could choose categories
    assert from_json(stored) == d1
    with pytest.raises(ValueError, match="does not have"):
        collate_head(trajs, ["a", "b"])
    with pytest.raises(ValueError, match="legal choice"):
        _traj([HeadDecision(position=3, end=5, choice="z", logprob=0.0, legal=("a",))])
    with pytest.raises(ValueError, match="span"):
        _traj([HeadDecision(position=8, end=12, choice="a", logprob=0.0, legal=("a",))])
