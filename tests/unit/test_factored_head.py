"""The factored (category -> tool) head: log-probabilities by hand, masks, sampling, and BC learning."""

import math

import pytest
import torch

from agentgrad.algos.constrained import factored_tool_logprobs
from agentgrad.envs.tasks.api_catalog import catalog
from agentgrad.models.factored_head import FactoredToolHead
from agentgrad.models.hf import ModelLoadError

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


def _head(width: int = 16) -> FactoredToolHead:
    torch.manual_seed(0)
    specs = catalog()
    return FactoredToolHead(width, [(s.name, s.category) for s in specs])


def test_head_on_the_api_catalog_gives_a_distribution_over_legal_tools_only():
    head = _head()
    specs = catalog()
    assert len(head.categories) == 16 and len(head.tool_names) == len(specs)
    public = frozenset(s.name for s in specs if not s.auth)
    states = torch.randn(5, 16)  # (L, H): one context, the call at its last token
    with torch.no_grad():
        logp = head(states[None], torch.tensor([0]), torch.tensor([4]), head.legal_mask([public]))[0]  # (N,)
    assert abs(float(logp.exp().sum()) - 1) < 1e-5
    assert all((logp[i] > float("-inf")) == (n in public) for i, n in enumerate(head.tool_names))
    picked = {head.decide(states, public, temperature=1.0, uniform=u)[0] for u in torch.rand(200).tolist()}
    assert picked <= public and len(picked) > 10
    name, lp = head.decide(states, public, temperature=1.0, uniform=0.3)
    assert lp == float(logp[head.tool_names.index(name)])
    greedy, _ = head.decide(states, public, temperature=0.0, uniform=0.3)
    assert greedy == head.tool_names[int(logp.argmax())]


def test_a_decision_reads_its_context_up_to_the_call_and_nothing_after():
    """Batch rows are right-padded sequences: decision d reads row[d] up to position[d]. What comes after the
    call (later tokens, padding) changes nothing; an earlier token does; a sequence alone equals its batch row."""
    head = _head()
    states = torch.randn(2, 9, 16)  # (B, T, H)
    row, position = torch.tensor([0, 1, 1]), torch.tensor([4, 2, 8])
    legal = head.legal_mask([frozenset(head.tool_names)] * 3)
    logp = head(states, row, position, legal)  # (D, N)
    later = states.clone()
    later[0, 5:] = torch.randn(4, 16)  # after decision 0's call
    torch.testing.assert_close(head(later, row, position, legal)[0], logp[0])
    earlier = states.clone()
    earlier[0, 1] = torch.randn(16)
    assert (head(earlier, row, position, legal)[0] - logp[0]).abs().max() > 1e-4
    alone = head(states[1:2, :3], torch.tensor([0]), torch.tensor([2]), legal[:1])  # decision 1 on its own
    torch.testing.assert_close(alone[0], logp[1])


def test_bc_fits_tools_that_only_the_context_tells_apart():
    """Eight contexts whose call-position states are identical: the tool is named only by an earlier token
    (position 2). A classifier of the call position alone can fit at most one of them; the head fits all."""
    head = _head()
    specs = catalog()
    states = torch.randn(1, 6, 16).repeat(8, 1, 1)  # (8, 6, H), the same everywhere ...
    states[:, 2] = torch.randn(8, 16)  # ... but at position 2
    row, position = torch.arange(8), torch.full((8,), 5)
    targets = torch.tensor([head.tool_names.index(s.name) for s in specs[3:200:25]])
    legal = head.legal_mask([frozenset(head.tool_names)] * 8)
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    for _ in range(150):
        loss = head.bc_loss(states, row, position, legal, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(head(states, row, position, legal).argmax(-1), targets)


def test_a_head_file_of_another_layout_is_refused_with_a_clear_error(tmp_path):
    head = _head()
    head.save(tmp_path / "tool_head.pt")
    again = FactoredToolHead.load(tmp_path / "tool_head.pt")
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    blob = head.to_blob()
    del blob["layout"]  # as saved before the context read-out
    torch.save(blob, tmp_path / "old.pt")
    with pytest.raises(ModelLoadError, match="another layout.*train the head again"):
        FactoredToolHead.load(tmp_path / "old.pt")


def test_a_category_head_gives_log_p_category_over_the_legal_categories_by_hand():
    """rollout.action_head=category: one decision picks the category only (the LM writes the tool), so the head's
    distribution is the softmax of its category logits over the categories holding a legal tool."""
    torch.manual_seed(0)
    head = FactoredToolHead(8, [("a.x", "a"), ("a.y", "a"), ("b.z", "b"), ("c.w", "c")], decides="category")
    assert head.choices == ("a", "b", "c") and head.tool_head is None
    assert head.legal_choices({"a.y", "c.w", "unknown.tool"}) == {"a", "c"}
    with torch.no_grad():
        head.category_head.weight.zero_()
        head.category_head.bias.copy_(torch.tensor([0.0, 5.0, math.log(3.0)]))  # a: 1, b: e^5 (illegal), c: 3
    states = torch.randn(1, 4, 8)
    legal = head.legal_mask([head.legal_choices({"a.y", "c.w"})])  # (1, 3): b illegal
    with torch.no_grad():
        logp = head(states, torch.tensor([0]), torch.tensor([3]), legal)[0]
        tempered = head(states, torch.tensor([0]), torch.tensor([3]), legal, temperature=0.5)[0]  # p^2, renormalised
    torch.testing.assert_close(logp[[0, 2]], torch.log(torch.tensor([1 / 4, 3 / 4])))
    assert logp[1] == float("-inf")
    torch.testing.assert_close(tempered[[0, 2]], torch.log(torch.tensor([1 / 10, 9 / 10])))
    assert head.decide(states[0], frozenset({"a.y", "c.w"}), temperature=0.0, uniform=0.5) == ("c", float(logp[2]))
    assert head.decide(states[0], frozenset({"a.y", "c.w"}), temperature=1.0, uniform=0.1)[0] == "a"  # cdf 1/4


def test_a_saved_head_keeps_what_it_decides(tmp_path):
    head = FactoredToolHead(8, [("a.x", "a"), ("b.z", "b")], decides="category")
    head.save(tmp_path / "h.pt")
    back = FactoredToolHead.load(tmp_path / "h.pt")
    assert back.decides == "category" and back.choices == ("a", "b")
    torch.testing.assert_close(back.category_head.weight, head.category_head.weight)
    with pytest.raises(ValueError, match="decides"):
        FactoredToolHead(8, [("a.x", "a")], decides="name")
