"""The tree math of Monte-Carlo tree search over agent turns, kept pure: records, PUCT selection, backup,
expansion with top-K pruning, and de-duplication of candidate actions. No torch, no env, no tokenizer: the
driver (`search/driver.py`) samples candidates and evaluates them; this module only decides.

A node is the state after a sequence of turns; an edge is one candidate turn (its parsed actions, keyed by
`action_key`). Selection is PUCT as in AlphaGo Zero (Silver et al. 2017, "Mastering the game of Go without
human knowledge", Methods) and AlphaZero (Silver et al. 2018):

    a* = argmax_a  Q(s, a) + U(s, a),    U(s, a) = c_puct * P(s, a) * sqrt(sum_b N(s, b)) / (1 + N(s, a))

- `c_puct` defaults to 1.25, the `c_init` of AlphaZero's published pseudocode (whose visit-dependent growth
  term, log((1 + N + c_base) / c_base) with c_base = 19652, stays ~0 at the few hundred simulations searched
  here, so it is left out).
- P(s, a): the policy's probability of the candidate turn (exp of the summed token logprobs, summed over the
  distinct token sequences that parse to the same action key), renormalised over the children kept after
  pruning, so the kept priors sum to 1.
- Q(s, a): the mean of the values backed up through the child (W / N); an unvisited child's Q is the value
  model's estimate of it (the number pruning ranked it by), not 0, since values here are success
  probabilities in [0, 1] and an unvisited child is not worth nothing.
- Ties go to the lower child index (children are stored best estimate first), so selection is deterministic.
- Exhausted children are never selected (the "proven" nodes of MCTS-Solver, Winands et al. 2008, reduced to
  what a deterministic env gives): a terminal node, once its outcome is backed up, and an expanded node whose
  children are all exhausted and that may not widen again. Revisiting one would re-add a value already known
  and learn nothing; without the rule an untrained value model (every estimate 0) lets a likely failed answer
  soak up every simulation.
- Widening: children are *sampled* candidates, not every legal action, so a node whose children are all
  exhausted may still hold an unsampled good turn. Such a node is selected as a leaf again and widened
  (`widen`: more candidates sampled, new action keys only, top-K of them added) up to `widenings_left` times
  (a bounded form of progressive widening, Coulom 2007; Couëtoux et al. 2011).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentgrad.types import Action, FinalAnswer, InvalidAction, ToolCall

DEFAULT_C_PUCT = 1.25


def normalise_argument(value: Any) -> Any:
    """An argument value in canonical form, so calls that differ only in layout count as one action: strings
    with runs of whitespace collapsed and ends stripped, integral floats as ints (2.0 == 2), mappings by sorted
    key, sequences element-wise. Case is kept (a SQL literal or a path may depend on it)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): normalise_argument(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [normalise_argument(v) for v in value]
    return value


def action_key(actions: Sequence[Action]) -> str:
    """The identity of one turn's actions: (tool, normalised arguments) per call, the normalised text of a final
    answer or an unparsable call; a turn with several actions joins them in order."""
    parts = []
    for action in actions:
        if isinstance(action, ToolCall):
            args = json.dumps(normalise_argument(dict(action.arguments)), sort_keys=True, default=str)
            parts.append(f"call:{action.name}:{args}")
        elif isinstance(action, FinalAnswer):
            parts.append("answer:" + normalise_argument(action.text))
        elif isinstance(action, InvalidAction):
            parts.append("invalid:" + normalise_argument(action.text))
    return "|".join(parts) or "empty"


@dataclass(frozen=True)
class Sample:
    """One sampled candidate turn. `sequence` identifies the exact sample (its token ids), so the same sequence
    drawn twice counts once in the prior; `logprob` is log p(turn) under the policy; `payload` is the driver's."""

    key: str
    sequence: Hashable
    logprob: float
    payload: Any = field(default=None, compare=False, repr=False)


def dedupe(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per action key, in first-seen order. Its logprob is log of the summed probability of the
    key's distinct sequences (logsumexp), its payload that of the most probable of them."""
    by_key: dict[str, dict[Hashable, Sample]] = {}
    for s in samples:
        by_key.setdefault(s.key, {}).setdefault(s.sequence, s)
    merged = []
    for key, seqs in by_key.items():
        best = max(seqs.values(), key=lambda s: s.logprob)  # max keeps the first of equals
        merged.append(Sample(key, best.sequence, _logsumexp([s.logprob for s in seqs.values()]), best.payload))
    return merged


def top_k(values: Sequence[float], k: int | None) -> list[int]:
    """Indices of the `k` largest values, largest first, ties to the lower index; `k` None or 0 keeps all."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return order if not k else order[:k]


def normalised_priors(logprobs: Sequence[float]) -> list[float]:
    """Softmax of the kept children's logprobs: their policy probabilities renormalised to sum to 1."""
    if not logprobs:
        return []
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class Edge:
    """The turn that leads from a parent to a child: its action key, its prior P(s, a) (normalised over the
    parent's kept children), the value model's estimate of it (its Q before any visit, and pruning's rank)."""

    key: str
    prior: float
    value_estimate: float
    sample: Sample = field(compare=False, repr=False)


@dataclass(eq=False)
class Node:
    """A state of the search tree. `visits` (N) and `value_sum` (W) count the simulations backed up through
    it; `terminal_value` is the episode's outcome when the state ends it (then it is never expanded);
    `candidates` counts the distinct candidate turns its expansion saw before pruning."""

    edge: Edge | None = None
    parent: Node | None = field(default=None, repr=False)
    depth: int = 0
    children: list[Node] = field(default_factory=list, repr=False)
    visits: int = 0
    value_sum: float = 0.0
    expanded: bool = False
    terminal_value: float | None = None
    candidates: int = 0
    exhausted: bool = False  # nothing left to learn below: see the module docstring
    widenings_left: int = 0  # times it may still be widened once its children are all exhausted
    sampled: dict[Hashable, float] = field(default_factory=dict, repr=False)  # distinct turns drawn here: logprob

    def record_samples(self, samples: Sequence[Sample]) -> None:
        """Note the turns sampled at this node (`sampled_mass` sums their probabilities)."""
        for s in samples:
            self.sampled.setdefault(s.sequence, s.logprob)

    @property
    def q(self) -> float:
        if self.visits:
            return self.value_sum / self.visits
        return self.edge.value_estimate if self.edge is not None else 0.0

    def path(self) -> list[Node]:
        """Root to this node, root first."""
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def edges(self) -> list[Edge]:
        """The turns from the root to this node."""
        return [n.edge for n in self.path()[1:] if n.edge is not None]


def puct_scores(node: Node, c_puct: float = DEFAULT_C_PUCT) -> list[float]:
    """Q + U of each child of `node` (the formula in the module docstring); the sum of visits counts exhausted
    children too (their visits are part of the parent's)."""
    sqrt_total = math.sqrt(sum(c.visits for c in node.children))
    return [c.q + c_puct * c.edge.prior * sqrt_total / (1 + c.visits) for c in node.children if c.edge is not None]


def select_child(node: Node, c_puct: float = DEFAULT_C_PUCT) -> int:
    """Index of the child PUCT picks among the unexhausted ones; ties to the lower index."""
    open_children = [i for i, c in enumerate(node.children) if not c.exhausted]
    if not open_children:
        raise ValueError("select_child on a node without unexhausted children")
    scores = puct_scores(node, c_puct)
    return max(open_children, key=lambda i: (scores[i], -i))


def select_leaf(root: Node, c_puct: float = DEFAULT_C_PUCT) -> Node:
    """Descend by PUCT from `root` to a node that is unexpanded, terminal, or to be widened (expanded, its
    children all exhausted). An exhausted root is returned as it is: the tree has nothing left to search."""
    node = root
    while node.expanded and node.terminal_value is None and not node.exhausted and not needs_widening(node):
        node = node.children[select_child(node, c_puct)]
    return node


def needs_widening(node: Node) -> bool:
    """An expanded node whose children are all exhausted but that may still sample more."""
    return node.expanded and node.widenings_left > 0 and all(c.exhausted for c in node.children)


def backup(leaf: Node, value: float) -> None:
    """Add one visit and `value` to every node from `leaf` up to the root (Q becomes the mean backed-up value).
    A terminal leaf becomes exhausted, and so does every ancestor whose children all are."""
    node: Node | None = leaf
    while node is not None:
        node.visits += 1
        node.value_sum += value
        node = node.parent
    if leaf.terminal_value is not None:
        _exhaust(leaf)


def _exhaust(node: Node) -> None:
    """Mark `node` exhausted, then every ancestor whose children all are and that may not widen."""
    node.exhausted = True
    parent = node.parent
    while (parent is not None and parent.expanded and parent.widenings_left == 0
           and all(c.exhausted for c in parent.children)):
        parent.exhausted = True
        parent = parent.parent


def expand(node: Node, candidates: Sequence[Sample], values: Sequence[float], k: int | None,
           widenings: int = 0) -> list[Node]:
    """Attach the top-`k` of `candidates` (already de-duplicated) by value estimate as children of `node`,
    best first, with priors renormalised over the kept ones; the node may be widened `widenings` times later.
    Returns the new children."""
    if node.expanded:
        raise ValueError("node is already expanded")
    if len(candidates) != len(values):
        raise ValueError(f"{len(candidates)} candidates for {len(values)} value estimates")
    if len({c.key for c in candidates}) != len(candidates):
        raise ValueError("candidates must be de-duplicated by action key first (dedupe)")
    kept = top_k(values, k)
    priors = normalised_priors([candidates[i].logprob for i in kept])
    node.children = [Node(edge=Edge(candidates[i].key, p, float(values[i]), candidates[i]), parent=node,
                          depth=node.depth + 1) for i, p in zip(kept, priors)]
    node.expanded, node.candidates, node.widenings_left = True, len(candidates), widenings
    return node.children


def widen(node: Node, candidates: Sequence[Sample], values: Sequence[float], k: int | None) -> list[Node]:
    """Add the top-`k` by value of the `candidates` (de-duplicated) whose action keys are not children yet to an
    expanded node, using one of its `widenings_left`; every child's prior is renormalised over all of them.
    Returns the new children (none when every key was already there: the node may then become exhausted)."""
    if not node.expanded or node.widenings_left < 1:
        raise ValueError("widen needs an expanded node with widenings left")
    if len(candidates) != len(values):
        raise ValueError(f"{len(candidates)} candidates for {len(values)} value estimates")
    known = {c.edge.key for c in node.children if c.edge is not None}
    fresh = [i for i, c in enumerate(candidates) if c.key not in known]
    kept = [fresh[j] for j in top_k([values[i] for i in fresh], k)]
    added = [Node(edge=Edge(candidates[i].key, 0.0, float(values[i]), candidates[i]), parent=node,
                  depth=node.depth + 1) for i in kept]
    node.children += added
    node.widenings_left -= 1
    node.candidates += len(fresh)
    priors = normalised_priors([c.edge.sample.logprob for c in node.children if c.edge is not None])
    for child, prior in zip(node.children, priors):
        child.edge = dataclasses.replace(child.edge, prior=prior)
    if not added and node.widenings_left == 0:
        _exhaust(node)  # nothing new and no widening left
    return added


def sampled_mass(node: Node) -> float:
    """Probability mass of the distinct token sequences sampled at `node` (at most 1, up to rounding): the share
    of the sampling distribution already seen, so 1 minus it is the chance that one more draw is new."""
    return min(1.0, sum(math.exp(lp) for lp in node.sampled.values()))


def stop_widening(node: Node) -> None:
    """Take away a node's remaining widenings (its sampled turns already cover what the policy proposes); it
    becomes exhausted if its children all are."""
    node.widenings_left = 0
    if node.expanded and all(c.exhausted for c in node.children):
        _exhaust(node)


def iter_nodes(root: Node) -> list[Node]:
    """Every node of the tree, depth-first, children in order."""
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(node.children))
    return out


def expanded_per_depth(root: Node) -> dict[int, int]:
    """How many nodes were expanded at each depth (root = 0)."""
    counts: dict[int, int] = {}
    for node in iter_nodes(root):
        if node.expanded:
            counts[node.depth] = counts.get(node.depth, 0) + 1
    return dict(sorted(counts.items()))


def most_visited_path(root: Node) -> list[Node]:
    """The path that follows the most-visited child from the root (ties to the better Q, then the lower index)."""
    path, node = [root], root
    while node.children:
        node = max(node.children, key=lambda c: (c.visits, c.q))
        if not node.visits:
            break
        path.append(node)
    return path


def _logsumexp(xs: Sequence[float]) -> float:
    top = max(xs)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(x - top) for x in xs))
