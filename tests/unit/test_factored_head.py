"""The factored (category -> tool) head: log-probabilities by hand, masks, sampling, and BC learning."""

import math

import torch

from agentgrad.algos.constrained import factored_tool_logprobs
from agentgrad.envs.tasks.api_catalog import catalog
from agentgrad.models.factored_head import FactoredToolHead

# tools 0, 1 in category 0; tool 2 in category 1
TOOL_CATEGORY = torch.tensor([0, 0, 1])


def test_factored_logprobs_by_hand():
    category_logits = torch.tensor([[0.0, 0.0]])  # p(c0) = p(c1) = 1/2
    tool_logits = torch.tensor([[0.0, math.log(3.0), 5.0]])  # within c0: 1/4, 3/4; c1 holds only tool 2: 1
    every = torch.tensor([[True, True, True]])
    lp = factored_tool_logprobs(category_logits, tool_logits, TOOL_CATEGORY, every)
    torch.testing.assert_close(lp, torch.log(torch.tensor([[1 / 8, 3 / 8, 1 / 2]])))
    # tool 2 illegal: category 1 has no legal tool left, so p(c0) = 1
    lp = factored_tool_logprobs(category_logits, tool_logits, TOOL_CATEGORY, torch.tensor([[True, True, False]]))
    torch.testing.assert_close(lp[:, :2], torch.log(torch.tensor([[1 / 4, 3 / 4]])))
    assert lp[0, 2] == float("-inf")
    # tool 1 illegal: within c0 only tool 0 remains -> 1/2 * 1
    lp = factored_tool_logprobs(category_logits, tool_logits, TOOL_CATEGORY, torch.tensor([[True, False, True]]))
    torch.testing.assert_close(lp[0, [0, 2]], torch.log(torch.tensor([1 / 2, 1 / 2])))


def test_gradients_stay_finite_under_masks():
    category_logits = torch.zeros(1, 2, requires_grad=True)
    tool_logits = torch.zeros(1, 3, requires_grad=True)
    lp = factored_tool_logprobs(category_logits, tool_logits, TOOL_CATEGORY, torch.tensor([[True, True, False]]))
    lp[0, 0].backward()
    assert torch.isfinite(category_logits.grad).all() and torch.isfinite(tool_logits.grad).all()


def test_head_on_the_api_catalog_samples_only_legal_tools_and_learns_by_bc():
    torch.manual_seed(0)
    specs = catalog()
    head = FactoredToolHead(16, [(s.name, s.category) for s in specs])
    assert len(head.categories) == 16 and len(head.tool_names) == len(specs)
    public = frozenset(s.name for s in specs if not s.auth)
    legal = head.legal_mask([public] * 64)
    hidden = torch.randn(64, 16)
    choice = head.choose(hidden, legal, generator=torch.Generator().manual_seed(0))
    assert all(head.tool_names[i] in public for i in choice.tool_index.tolist())
    torch.testing.assert_close(choice.logprob, head(hidden, legal).gather(-1, choice.tool_index[:, None]).squeeze(-1))
    assert torch.exp(head(hidden, legal)).sum(-1).sub(1).abs().max() < 1e-5  # a distribution over legal tools

    # BC: 8 fixed states, each with its expert tool; the head fits them
    states, targets = torch.randn(8, 16), torch.tensor([head.tool_names.index(s.name) for s in specs[3:200:25]])
    legal8 = head.legal_mask([frozenset(head.tool_names)] * 8)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(60):
        loss = head.bc_loss(states, legal8, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(head.choose(states, legal8, temperature=0).tool_index, targets)
