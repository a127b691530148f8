"""The pure MCTS tree math on hand-built trees, every number worked out by hand in the comments:
PUCT scores and the child they select, backed-up means and visit counts after a few simulations, top-K
pruning, prior normalisation over the kept children, and de-duplication by (tool, normalised arguments)."""

import math

import pytest

from agentgrad.search.tree import (
    DEFAULT_C_PUCT,
    Edge,
    Node,
    Sample,
    action_key,
    backup,
    dedupe,
    expand,
    expanded_per_depth,
    most_visited_path,
    normalised_priors,
    puct_scores,
    select_child,
    select_leaf,
    top_k,
    widen,
)
from agentgrad.types import FinalAnswer, InvalidAction, ToolCall


def child(parent, prior, estimate, visits=0, value_sum=0.0, key=None):
    node = Node(edge=Edge(key or f"k{len(parent.children)}", prior, estimate, Sample("k", 0, 0.0)), parent=parent,
                depth=parent.depth + 1, visits=visits, value_sum=value_sum)
    parent.children.append(node)
    return node


def test_puct_scores_and_selection_by_hand():
    root = Node(expanded=True, visits=4, value_sum=2.0)
    child(root, 0.5, 0.1, visits=2, value_sum=1.0)  # Q = 0.5
    child(root, 0.3, 0.2, visits=1, value_sum=0.9)  # Q = 0.9
    child(root, 0.2, 0.4)  # unvisited: Q = its value estimate 0.4
    # sum_b N = 3, sqrt = 1.7320508; c_puct = 1.25
    # child 0: 0.5 + 1.25 * 0.5 * 1.7320508 / 3 = 0.5 + 0.3608439 = 0.8608439
    # child 1: 0.9 + 1.25 * 0.3 * 1.7320508 / 2 = 0.9 + 0.3247595 = 1.2247595
    # child 2: 0.4 + 1.25 * 0.2 * 1.7320508 / 1 = 0.4 + 0.4330127 = 0.8330127
    assert DEFAULT_C_PUCT == 1.25
    assert puct_scores(root) == pytest.approx([0.8608439, 1.2247595, 0.8330127], abs=1e-7)
    assert select_child(root) == 1
    # With c_puct = 3 exploration wins: child 2: 0.4 + 3 * 0.2 * 1.7320508 = 1.4392305;
    # child 1: 0.9 + 3 * 0.3 * 1.7320508 / 2 = 1.6794229; child 0: 0.5 + 3 * 0.5 * 1.7320508 / 3 = 1.3660254
    assert puct_scores(root, 3.0) == pytest.approx([1.3660254, 1.6794229, 1.4392305], abs=1e-7)
    assert select_child(root, 3.0) == 1
    # c_puct = 10: child 0: 0.5 + 2.8867513 = 3.3867513; child 1: 0.9 + 2.5980762 = 3.4980762;
    # child 2: 0.4 + 3.4641016 = 3.8641016 -> the unvisited child
    assert select_child(root, 10.0) == 2


def test_unvisited_children_are_ranked_by_value_estimate_and_ties_go_to_the_lower_index():
    root = Node(expanded=True)
    child(root, 0.9, 0.3)
    child(root, 0.1, 0.7)
    # sum N = 0 -> U = 0 for all: the estimates decide
    assert puct_scores(root) == [0.3, 0.7] and select_child(root) == 1
    tie = Node(expanded=True)
    child(tie, 0.5, 0.5)
    child(tie, 0.5, 0.5)
    assert select_child(tie) == 0


def test_four_simulations_backed_up_by_hand():
    root = Node()
    candidates = [Sample("A", 1, math.log(0.5)), Sample("B", 2, math.log(0.2)), Sample("C", 3, math.log(0.2))]
    kids = expand(root, candidates, [0.2, 0.6, 0.4], k=2)
    # top-2 by estimate: B (0.6), C (0.4); priors 0.2 / 0.4 = 0.5 each
    assert [c.edge.key for c in kids] == ["B", "C"]
    assert [c.edge.prior for c in kids] == pytest.approx([0.5, 0.5])
    b, c = kids
    leaf_value = {"B": 0.0, "C": 1.0}  # what evaluating each leaf returns (left unexpanded, so it stays a leaf)
    backup(root, 0.3)  # the root's own evaluation: N=1, W=0.3
    picked = []
    for _ in range(4):
        leaf = select_leaf(root)
        picked.append(leaf.edge.key)
        backup(leaf, leaf_value[leaf.edge.key])
    # sim 1: sum N = 0: B 0.6 vs C 0.4 -> B; backs up 0: B N=1 W=0
    # sim 2: sqrt(1) = 1: B 0 + 1.25*0.5*1/2 = 0.3125; C 0.4 + 1.25*0.5*1/1 = 1.025 -> C; C N=1 W=1
    # sim 3: sqrt(2) = 1.4142: B 0 + 0.625*1.4142/2 = 0.4419; C 1 + 0.4419 = 1.4419 -> C; C N=2 W=2
    # sim 4: sqrt(3) = 1.7321: B 0.625*1.7321/2 = 0.5413; C 1 + 0.625*1.7321/3 = 1.3608 -> C; C N=3 W=3
    assert picked == ["B", "C", "C", "C"]
    assert (b.visits, b.value_sum, c.visits, c.value_sum) == (1, 0.0, 3, 3.0)
    # root: N = 1 + 4 = 5, W = 0.3 + 0 + 1 + 1 + 1 = 3.3, Q = 0.66
    assert root.visits == 5 and root.q == pytest.approx(0.66)
    assert [n.edge.key for n in most_visited_path(root)[1:]] == ["C"]
    assert not (root.exhausted or b.exhausted or c.exhausted)  # no terminal was reached


def test_terminal_outcomes_exhaust_nodes_and_are_not_revisited():
    root = Node()
    a, b = expand(root, [Sample("A", 1, math.log(0.9)), Sample("B", 2, math.log(0.1))], [0.0, 0.0], k=None)
    backup(root, 0.0)
    a.terminal_value = 0.0  # A's episode ended in failure
    assert select_leaf(root) is a  # estimates tie at 0: the lower index
    backup(a, 0.0)
    assert a.exhausted and not root.exhausted
    # sqrt(1) = 1: A 0 + 1.25*0.9/2 = 0.5625 would beat B 0 + 1.25*0.1/1 = 0.125, but A is exhausted
    assert puct_scores(root) == pytest.approx([0.5625, 0.125])
    assert select_leaf(root) is b
    b1, = expand(b, [Sample("B1", 3, 0.0)], [0.5], k=None)
    backup(b, 0.5)
    assert select_leaf(root) is b1
    b1.terminal_value = 1.0
    backup(b1, 1.0)
    # B's only child is exhausted, so B is, and with A the root: the tree has nothing left to search
    assert b1.exhausted and b.exhausted and root.exhausted and select_leaf(root) is root
    # root: N = 1 (itself) + A + B + B1 = 4, W = 0 + 0 + 0.5 + 1 = 1.5
    assert (root.visits, root.value_sum, b.visits, b.value_sum) == (4, 1.5, 2, 1.5)
    with pytest.raises(ValueError, match="unexhausted"):
        select_child(root)


def test_backup_reaches_every_ancestor():
    root = Node(expanded=True, visits=1, value_sum=0.5)
    mid = child(root, 1.0, 0.5, visits=1, value_sum=0.5)
    mid.expanded = True
    leaf = child(mid, 1.0, 0.5)
    backup(leaf, 1.0)
    backup(leaf, 0.0)
    # leaf: N=2 W=1 (Q 0.5); mid: N=3 W=1.5 (Q 0.5); root: N=3 W=1.5
    assert (leaf.visits, leaf.q, mid.visits, mid.value_sum, root.visits, root.value_sum) == (2, 0.5, 3, 1.5, 3, 1.5)
    assert select_leaf(root) is leaf and leaf.path() == [root, mid, leaf]


def test_pruning_keeps_exactly_the_top_k_and_renormalises_priors():
    values = [0.1, 0.9, 0.5, 0.5, 0.3, 0.8, 0.0, 0.7]
    assert top_k(values, 5) == [1, 5, 7, 2, 3]  # 0.9, 0.8, 0.7, then the tied 0.5s in index order
    assert top_k(values, None) == top_k(values, 0) == [1, 5, 7, 2, 3, 4, 0, 6]
    probs = [0.30, 0.05, 0.10, 0.05, 0.20, 0.10, 0.15, 0.05]
    samples = [Sample(f"a{i}", i, math.log(p)) for i, p in enumerate(probs)]
    root = Node()
    kept = expand(root, samples, values, k=5)
    assert len(kept) == 5 and root.candidates == 8
    assert [c.edge.key for c in kept] == ["a1", "a5", "a7", "a2", "a3"]
    # kept probabilities 0.05, 0.10, 0.05, 0.10, 0.05 sum to 0.35: priors 1/7, 2/7, 1/7, 2/7, 1/7
    assert [c.edge.prior for c in kept] == pytest.approx([1 / 7, 2 / 7, 1 / 7, 2 / 7, 1 / 7])
    assert [c.q for c in kept] == [0.9, 0.8, 0.7, 0.5, 0.5]
    assert expanded_per_depth(root) == {0: 1}
    kept[0].expanded = True
    assert expanded_per_depth(root) == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="already expanded"):
        expand(root, samples, values, k=5)
    with pytest.raises(ValueError, match="de-duplicated"):
        expand(Node(), [samples[0], samples[0]], [0.1, 0.2], k=5)
    assert normalised_priors([math.log(1.0), math.log(3.0)]) == pytest.approx([0.25, 0.75])


def test_action_keys_normalise_arguments():
    a = action_key([ToolCall("calculator", {"expression": "  2 +   3 "})])
    b = action_key([ToolCall("calculator", {"expression": "2 + 3"})])
    assert a == b == 'call:calculator:{"expression": "2 + 3"}'
    assert action_key([ToolCall("get", {"id": 2.0, "opts": {"b": 1, "a": [1.0, "x  y"]}})]) == \
        action_key([ToolCall("get", {"opts": {"a": [1, "x y"], "b": 1}, "id": 2})])
    assert action_key([ToolCall("get", {"flag": True})]) != action_key([ToolCall("get", {"flag": 1})])
    assert action_key([ToolCall("calculator", {"expression": "2+3"})]) != b  # spacing inside tokens is kept
    assert action_key([FinalAnswer(" 5 ")]) == "answer:5" != action_key([ToolCall("answer", {})])
    assert action_key([InvalidAction("<tool_call>{", "bad")]) == "invalid:<tool_call>{"
    assert action_key([]) == "empty"


def test_dedupe_sums_distinct_sequences_once():
    samples = [Sample("x", (1, 2), math.log(0.2), "first"), Sample("y", (3,), math.log(0.1)),
               Sample("x", (1, 2), math.log(0.2), "again"),  # the same sequence drawn twice counts once
               Sample("x", (1, 5), math.log(0.3), "best")]  # another spelling of the same action
    merged = dedupe(samples)
    assert [m.key for m in merged] == ["x", "y"]
    # x: 0.2 + 0.3 = 0.5, represented by its most probable sequence
    assert math.exp(merged[0].logprob) == pytest.approx(0.5) and merged[0].payload == "best"
    assert math.exp(merged[1].logprob) == pytest.approx(0.1)


def test_widening_adds_new_keys_and_renormalises_priors():
    root = Node()
    a, = expand(root, [Sample("A", 1, math.log(0.6))], [0.2], k=2, widenings=1)
    backup(root, 0.2)
    a.terminal_value = 0.0
    backup(a, 0.0)
    # A ended and the root may widen once: it is not exhausted, and it is the leaf to widen
    assert not root.exhausted and select_leaf(root) is root
    fresh = [Sample("A", 9, math.log(0.6)), Sample("B", 2, math.log(0.2)), Sample("C", 3, math.log(0.2)),
             Sample("D", 4, math.log(0.4))]
    added = widen(root, fresh, [0.9, 0.1, 0.5, 0.3], k=2)
    # "A" is known; of B (0.1), C (0.5), D (0.3) the top-2 by value are C, D
    assert [n.edge.key for n in added] == ["C", "D"] and root.widenings_left == 0 and root.candidates == 4
    # priors over all children: 0.6, 0.2, 0.4 -> 0.5, 1/6, 1/3
    assert [n.edge.prior for n in root.children] == pytest.approx([0.5, 1 / 6, 1 / 3])
    # A is exhausted; sum N = 1: C 0.5 + 1.25 * (1/6) * 1 / 1 = 0.7083, D 0.3 + 1.25 * (1/3) = 0.7167 -> D
    assert puct_scores(root)[1:] == pytest.approx([0.5 + 1.25 / 6, 0.3 + 1.25 / 3])
    assert select_leaf(root) is added[1]
    for child in added:
        child.terminal_value = 0.0
        backup(child, 0.0)
    assert root.exhausted  # all children ended and no widening left
    with pytest.raises(ValueError, match="widenings left"):
        widen(root, fresh, [0.0] * 4, k=2)
