"""Constrained decoding of tool names: legal sets, masked logprobs by hand, batch masks, when masks apply.
(The acceptance test with the real model and env is tests/integration/test_constrained_decoding.py.)"""

from __future__ import annotations

import pytest
import torch

from agentgrad.algos.constrained import masked_token_logprobs
from agentgrad.batch import LogitMasks, collate
from agentgrad.envs import ActionMask
from agentgrad.rollout.constrained import EpisodeMasks, ToolNameDecoder, call_header, episode_masks
from agentgrad.rollout.parser import OPEN
from agentgrad.types import StopReason, Task, TokenMask, Trajectory

HEADER = '\n{"name": "'


def test_masked_token_logprobs_by_hand():
    # logits ln1, ln2, ln3 (probabilities 1/6, 2/6, 3/6); targets: token 1 at position 0, token 2 at position 1
    logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]]))  # (1, 3, 3)
    targets = torch.tensor([[1, 2, 2]])
    masks = LogitMasks(index=torch.tensor([[0, 1, -1]]), token_ids=torch.tensor([[1, 2], [0, -1]]),
                       allow=torch.tensor([True, False]))
    lp = masked_token_logprobs(logits, targets, masks)
    # position 0: legal {1, 2} -> 2 / (2 + 3); position 1: all but {0} -> 3 / (2 + 3); position 2: free -> 3 / 6
    expected = torch.log(torch.tensor([[2 / 5, 3 / 5, 3 / 6]]))
    torch.testing.assert_close(lp, expected)
    unmasked = torch.log(torch.tensor([[2 / 6, 3 / 6, 3 / 6]]))
    torch.testing.assert_close(masked_token_logprobs(logits, targets, None), unmasked)


def _traj(n: int, masks=()) -> Trajectory:
    return Trajectory(task=Task("t", "p", "a"), token_ids=tuple(range(1, n + 1)), loss_mask=(0,) + (1,) * (n - 1),
                      logprobs=(0.0,) * n, prompt_length=1, turns=(), stop_reason=StopReason.ANSWERED,
                      token_masks=tuple(masks))


def test_collate_dedupes_legal_sets_and_select_keeps_them():
    a = _traj(4, [TokenMask(1, (5, 6)), TokenMask(3, (9,), allow=False)])
    b = _traj(3, [TokenMask(2, (5, 6))])
    batch = collate([a, b, _traj(2)], pad_token_id=0)
    m = batch.logit_masks
    assert m.index.tolist() == [[-1, 0, -1, 1], [-1, -1, 0, -1], [-1, -1, -1, -1]]
    assert m.token_ids.tolist() == [[5, 6], [9, -1]] and m.allow.tolist() == [True, False]
    sub = batch.select(torch.tensor([1]))
    assert sub.logit_masks.index.tolist() == [[-1, -1, 0]] and sub.input_ids.shape == (1, 3)
    assert collate([_traj(3)], pad_token_id=0).logit_masks is None
    with pytest.raises(ValueError):
        _traj(3, [TokenMask(5, (1,))])


@pytest.fixture()
def decoder(codec):
    return ToolNameDecoder(codec, call_header(codec))


def test_header_comes_from_the_template_and_rules_follow_the_names(decoder):
    assert decoder.header == HEADER
    names = frozenset({"weather.get_humidity", "weather.get_wind_speed", "auth.login"})
    mask = ActionMask(frozenset({"weather", "auth"}), names)
    s = decoder.strings
    assert decoder.rule(mask, "I think") is None  # outside a call: free
    assert decoder.rule(mask, OPEN + HEADER + 'auth.login", "arguments": {') is None  # name closed: free
    ids, allow = decoder.rule(mask, OPEN + "\n")  # the header is forced
    assert allow and ids and all(HEADER[1:].startswith(s[i]) for i in ids)
    ids, allow = decoder.rule(mask, OPEN + HEADER + "weather.get_")
    assert allow and {s[i][0] for i in ids} == {"h", "w"}
    assert all(any(n.startswith("weather.get_" + s[i]) for n in names) for i in ids)
    ids, _ = decoder.rule(mask, OPEN + HEADER + "auth.login")
    assert all(s[i].startswith('"') for i in ids) and ids  # a complete name may only close
    eos = decoder.eos_token_ids
    assert decoder.rule(ActionMask(mask.categories, names, final_answer=False), "The answer") == (eos, False)
    assert decoder.rule(ActionMask(mask.categories, names, final_answer=False), OPEN + HEADER + "auth.login\"") is None


def test_deny_rule_blocks_eos_and_keeps_the_rest(decoder):
    logits = torch.zeros(len(decoder.strings))
    out = decoder.apply(logits, (decoder.eos_token_ids, False))
    eos = list(decoder.eos_token_ids)
    assert torch.isinf(out[eos]).all() and torch.isfinite(out).sum() == len(out) - len(eos)


def test_auto_masks_only_where_the_mask_restricts_the_prompt(codec):
    full = ActionMask(frozenset({"math"}), frozenset({"calculator"}))
    offered = [frozenset({"calculator"})]
    no_answer = ActionMask(frozenset(), frozenset(), final_answer=False)
    assert episode_masks(codec, "auto", [full], offered) is None
    assert isinstance(episode_masks(codec, "on", [full], offered), EpisodeMasks)
    assert episode_masks(codec, "off", [no_answer], offered) is None
    masker = episode_masks(codec, "auto", [no_answer], offered)
    assert isinstance(masker, EpisodeMasks)
    # A later state whose mask offers everything again is left free: the turn starts unconstrained.
    masker.start_turn(0, full)
    logits = torch.zeros(len(masker.turn.decoder.strings))
    assert torch.equal(masker(0, [], logits), logits) and masker.token_masks(0) == []
    masker.start_turn(0, no_answer)  # answering illegal: end-of-turn gets -inf from the first token on
    assert torch.isinf(masker(0, [], logits)[list(masker.turn.decoder.eos_token_ids)]).all()
