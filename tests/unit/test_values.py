"""Value-head math: alignment of per-position head outputs with token positions, explained variance, and
which parameters each critic kind trains. Expected numbers worked out by hand in the comments."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from agentgrad.algos.values import explained_variance, values_at_tokens
from agentgrad.models.value import Critic, ValueModel


def test_values_shift_one_position_right_like_logprobs():
    # head_out[b, t] is V of the prefix ending at token t; the value *before* token t is head_out[b, t - 1].
    head_out = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                             [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[0, 1, 1, 0],
                         [0, 0, 1, 1]])
    # shifted:           [[0, 1, 2, 3], [0, 5, 6, 7]]; masked to policy tokens:
    expected = torch.tensor([[0.0, 1.0, 2.0, 0.0],
                             [0.0, 0.0, 6.0, 7.0]])
    assert torch.equal(values_at_tokens(head_out, mask), expected)
    assert torch.equal(values_at_tokens(head_out), torch.tensor([[0.0, 1, 2, 3], [0.0, 5, 6, 7]]))


def test_values_at_tokens_rejects_bad_shapes():
    with pytest.raises(ValueError):
        values_at_tokens(torch.zeros(2, 3, 1))
    with pytest.raises(ValueError):
        values_at_tokens(torch.zeros(2, 3), torch.zeros(2, 4))


def test_explained_variance_by_hand():
    # returns y = [1, 2, 3] on the mask, values v = [1, 1, 3] (the padded 9 is ignored).
    # Var(y) = mean((y - 2)^2) = (1 + 0 + 1)/3 = 2/3. y - v = [0, 1, 0], mean 1/3,
    # Var = ((1/3)^2 + (2/3)^2 + (1/3)^2)/3 = (1/9 + 4/9 + 1/9)/3 = 2/9. EV = 1 - (2/9)/(2/3) = 1 - 1/3 = 2/3.
    y = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    v = torch.tensor([[1.0, 1.0, 3.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(v, y, m).item() == pytest.approx(2 / 3, abs=1e-6)
    assert explained_variance(y, y, m).item() == pytest.approx(1.0)
    assert math.isnan(explained_variance(v, torch.ones_like(y), m).item())  # constant returns: undefined


class _Trunk(nn.Module):
    """Stands in for an HF base model: hidden state h[b, t] = scale * (input_id, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, input_ids, attention_mask, use_cache=False):
        h = torch.stack([input_ids.float(), torch.ones_like(input_ids, dtype=torch.float)], -1) * self.scale
        return SimpleNamespace(last_hidden_state=h)  # (B, T, 2)


def _model(detach: bool) -> ValueModel:
    vm = ValueModel(_Trunk(), 2, detach_trunk=detach)
    with torch.no_grad():
        vm.head.weight.copy_(torch.tensor([[0.5, 1.0]]))  # V = 0.5 * id + 1
        vm.head.bias.zero_()
    return vm


def test_value_model_reads_the_previous_hidden_state():
    vm = _model(detach=True)
    ids = torch.tensor([[2, 4, 6]])
    # per position: 0.5*2+1 = 2, 0.5*4+1 = 3, 0.5*6+1 = 4; shifted -> [0, 2, 3]; mask keeps tokens 1 and 2.
    out = vm(ids, torch.ones_like(ids), torch.tensor([[0, 1, 1]]))
    assert torch.allclose(out, torch.tensor([[0.0, 2.0, 3.0]]))


def test_fresh_head_predicts_zero():
    vm = ValueModel(_Trunk(), 2, detach_trunk=True)
    ids = torch.tensor([[2, 4, 6]])
    assert torch.equal(vm(ids, torch.ones_like(ids)), torch.zeros(1, 3))


@pytest.mark.parametrize("detach", [True, False])
def test_head_critic_never_moves_the_shared_trunk(detach):
    vm = _model(detach)
    critic = Critic(vm, lr=0.1)
    ids = torch.tensor([[2, 4, 6]])
    before = vm.trunk.scale.item()
    critic.step(critic.values(ids, torch.ones_like(ids), torch.tensor([[0, 1, 1]])).sum())
    moved = vm.trunk.scale.item() != before
    assert moved is (not detach)
    assert vm.head.weight.grad is None  # zeroed after the step
