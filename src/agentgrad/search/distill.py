"""What a searched tree teaches the policy (no torch): successful root-to-leaf paths for behaviour cloning, and
sibling pairs for DPO: at one parent, a child whose subtree reached a successful episode (chosen) against a
sibling whose subtree reached episodes that all failed (rejected). A pair's two trajectories share every token
up to the parent, so the DPO margin comes from where they part.

Episodes played out by a rollout from a leaf count for the leaf's subtree (they pass through it), but only the
search's own terminal episodes become BC paths (a rollout's later turns were not searched).
"""

from __future__ import annotations

from collections.abc import Sequence

from agentgrad.search.driver import SearchEpisode, SearchResult
from agentgrad.search.tree import Node, iter_nodes
from agentgrad.types import Trajectory


def success_paths(results: Sequence[SearchResult]) -> list[Trajectory]:
    """The successful terminal episodes the searches reached, one per distinct action path, in tree order."""
    paths, seen = [], set()
    for r in results:
        for e in r.episodes:
            key = (r.task.task_id, tuple(edge.key for edge in e.node.edges()))
            if e.success and not e.by_rollout and key not in seen:
                seen.add(key)
                paths.append(e.trajectory)
    return paths


def episodes_under(episodes: Sequence[SearchEpisode]) -> dict[int, list[SearchEpisode]]:
    """id(node) -> the episodes that passed through it (reached a terminal node or started a rollout below)."""
    under: dict[int, list[SearchEpisode]] = {}
    for e in episodes:
        for node in e.node.path():
            under.setdefault(id(node), []).append(e)
    return under


def sibling_pairs(result: SearchResult) -> list[tuple[Trajectory, Trajectory]]:
    """(chosen, rejected) trajectories of sibling subtrees: at each expanded node, each child whose episodes all
    failed is paired with a child that reached a success (the winners taken in turn, best-visited first), using
    the first successful and the first failed episode of each. One pair per losing child."""
    under = episodes_under(result.episodes)
    pairs = []
    for parent in iter_nodes(result.root):
        wins, losses = [], []
        for child in parent.children:
            found = under.get(id(child), [])
            won = [e for e in found if e.success]
            if won:
                wins.append((child, won[0]))
            elif found:
                losses.append(found[0])
        wins.sort(key=lambda w: -w[0].visits)
        pairs += [(wins[i % len(wins)][1].trajectory, lost.trajectory) for i, lost in enumerate(losses) if wins]
    return pairs


def nodes_by_depth(root: Node) -> dict[int, int]:
    """How many nodes (expanded or not) the tree holds at each depth."""
    counts: dict[int, int] = {}
    for node in iter_nodes(root):
        counts[node.depth] = counts.get(node.depth, 0) + 1
    return dict(sorted(counts.items()))
