"""Distillation data from a hand-built searched tree: successful paths for BC, sibling pairs for DPO."""

from agentgrad.search.distill import episodes_under, nodes_by_depth, sibling_pairs, success_paths
from agentgrad.search.driver import SearchEpisode, SearchResult
from agentgrad.search.tree import Edge, Node, Sample
from agentgrad.types import StopReason, Task, Trajectory

TASK = Task("t0", "p", "a")


def node(parent, key, visits=1):
    n = Node(edge=Edge(key, 0.5, 0.5, Sample(key, key, 0.0)), parent=parent, depth=parent.depth + 1, visits=visits)
    parent.children.append(n)
    parent.expanded = True
    return n


def trajectory(name):
    return Trajectory(Task(name, "p", "a"), (), (), (), 0, (), StopReason.ANSWERED)


def test_paths_and_sibling_pairs_by_hand():
    root = Node()
    a, b, c = node(root, "A", visits=3), node(root, "B"), node(root, "C", visits=0)
    a1, a2 = node(a, "A1"), node(a, "A2")
    wins, fail_a2, fail_b = trajectory("win"), trajectory("a2"), trajectory("b")
    episodes = (SearchEpisode(wins, True, a1), SearchEpisode(fail_a2, False, a2), SearchEpisode(fail_b, False, b),
                SearchEpisode(trajectory("rollout"), True, a1, by_rollout=True))
    result = SearchResult(TASK, root, True, episodes, 5, 0, 0, 0)
    # root: A reached a success, B only a failure, C nothing -> (win, b); at A: A1 won, A2 failed -> (win, a2)
    assert sibling_pairs(result) == [(wins, fail_b), (wins, fail_a2)]
    # BC: the search's own successful terminal episode, once (the rollout from A1 is not a searched path)
    assert success_paths([result, result]) == [wins]
    under = episodes_under(episodes)
    assert len(under[id(root)]) == 4 and len(under[id(a)]) == 3 and id(c) not in under
    assert nodes_by_depth(root) == {0: 1, 1: 3, 2: 2}
