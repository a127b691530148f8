"""The search driver: many MCTS trees at once over agent turns, one simulation per tree per round.

Each round, every live tree selects a leaf by PUCT (`search/tree.py`). A leaf is restored by replaying its
turns into a fresh env (envs are deterministic given task, seed and action history: `envs/base.py`), through
the rollout loop's own episode steps, so its token ids are exactly a rollout's. A leaf whose episode ended is
terminal: its value is the outcome (1 success, 0 failure) by the suite's one success rule. Otherwise it is
expanded: `samples_per_expansion` candidate turns are sampled from the policy at that state, under the env's
action mask (the rollout's tool-name masker), in one decode session shared by every tree's leaf (not one tree
at a time); they are de-duplicated by (tool, normalised arguments), valued by the value model (its estimate
after the candidate turn), and only the top-K are kept. The leaf's own value is the value model's estimate of
its state, optionally mixed with the outcome of one policy rollout from it (`rollout_mix`), and is backed up.
A node whose children have all ended is selected again to be widened (`widenings`): more candidates sampled
at it, the new action keys among them added (top-K). A tree stops at its budget, once solved
(`stop_on_success`), or when nothing is left to search (its root is exhausted: `search/tree.py`).

Budgets per tree, all counted: simulations, generated tokens (every candidate sampled, kept or pruned, and
every rollout turn) and tool calls (every env step with a tool call, the replays that restore nodes included,
since they are real calls; `new_tool_calls` counts the first execution of each only).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agentgrad.backends.base import Generation, Policy, SamplingParams
from agentgrad.backends.generate_session import open_session
from agentgrad.envs.base import SnapshotEnv, close_env, episode_success
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.constrained import MaskMode, episode_masks
from agentgrad.rollout.copying import CopySpec
from agentgrad.rollout.loop import (
    EpisodeLimits,
    _Episode,
    _turn_budget,
    begin_turn,
    end_turn,
    finish_episode,
    run_actions,
    start_episode,
)
from agentgrad.search.tree import (
    DEFAULT_C_PUCT,
    Node,
    Sample,
    action_key,
    backup,
    dedupe,
    expand,
    expanded_per_depth,
    iter_nodes,
    sampled_mass,
    select_leaf,
    stop_widening,
    widen,
)
from agentgrad.types import StopReason, Task, ToolCall, Trajectory

# Token-id sequences (a state, or a state followed by a candidate turn) -> estimated return of each, in [0, 1].
ValueFn = Callable[[Sequence[Sequence[int]]], list[float]]
_ROUND_SEED_STRIDE = 1_000_003  # each round's sampling seed: sampling.seed + round * stride (rows reuse keys)
_DRAW_SEED_STRIDE = 7_919  # and + draw * this for a round's later batches of candidates


@dataclass(frozen=True)
class SearchBudget:
    """Per tree; 0 means no limit on that count. A tree stops before the simulation that would start over one."""

    simulations: int = 16
    generated_tokens: int = 0
    tool_calls: int = 0


@dataclass(frozen=True)
class SearchSettings:
    top_k: int | None = 5  # children kept per expansion, by the value model's estimate; None / 0: all
    samples_per_expansion: int = 8  # most candidate turns sampled per expansion or widening (before de-duplication)
    expansion_batch: int = 2  # candidates drawn per batch up to samples_per_expansion; 0: all in one batch
    coverage: float = 0.9  # draw no more at a node once its distinct turns hold this share of the sampling mass
    snapshots: bool = True  # restore nodes from env snapshots where the env offers them (envs/base.py)
    c_puct: float = DEFAULT_C_PUCT
    rollout_mix: float = 0.0  # leaf value = (1 - mix) * V(leaf) + mix * (outcome of a policy rollout from it)
    widenings: int = 2  # times a node whose children all ended may sample more candidates (search/tree.py)
    stop_on_success: bool = True  # a tree stops once it reached a successful episode (the search solved it)
    budget: SearchBudget = SearchBudget()
    tool_workers: int = 8  # threads stepping envs (restoring nodes, rollouts) across trees
    tool_name_mask: MaskMode = "auto"
    copy_args: CopySpec = CopySpec()  # rollout.copy_args (rollout/copying.py)

    def __post_init__(self) -> None:
        if (self.samples_per_expansion < 1 or not (0.0 <= self.rollout_mix <= 1.0) or self.c_puct < 0
                or self.widenings < 0 or self.expansion_batch < 0 or not (0.0 < self.coverage <= 1.0)):
            raise ValueError(f"invalid search settings: {self}")


@dataclass(frozen=True)
class SearchEpisode:
    """An episode the search played to its end: at a terminal node, or by a rollout from a leaf."""

    trajectory: Trajectory
    success: bool
    node: Node = field(compare=False, repr=False)  # the terminal node, or the leaf a rollout started from
    by_rollout: bool = False


@dataclass
class _Tree:
    task: Task
    seed: int
    root: Node = field(default_factory=Node)
    simulations: int = 0
    generated_tokens: int = 0
    tool_calls: int = 0
    new_tool_calls: int = 0
    episodes: list[SearchEpisode] = field(default_factory=list)
    saved: dict[int, tuple[_Episode, Any]] = field(default_factory=dict)  # id(node) -> its episode, env snapshot
    reached: set[int] = field(default_factory=set)  # id(node) of every node whose turn has run once

    @property
    def solved(self) -> bool:
        return any(e.success and not e.by_rollout for e in self.episodes)

    def live(self, settings: SearchSettings) -> bool:
        b = settings.budget
        return not ((settings.stop_on_success and self.solved) or self.simulations >= b.simulations
                    or (b.generated_tokens and self.generated_tokens >= b.generated_tokens)
                    or (b.tool_calls and self.tool_calls >= b.tool_calls)
                    or self.root.terminal_value is not None or self.root.exhausted)


@dataclass(frozen=True)
class SearchResult:
    """One tree after its search. `success`: the search reached a successful episode (not counting rollouts)."""

    task: Task
    root: Node = field(repr=False)
    success: bool
    episodes: tuple[SearchEpisode, ...]
    simulations: int
    generated_tokens: int
    tool_calls: int
    new_tool_calls: int


@dataclass
class _Leaf:
    tree: _Tree
    node: Node
    episode: _Episode | None = None


class TreeSearch:
    """Searches a batch of tasks, one tree each (see the module docstring)."""

    def __init__(self, policy: Policy, codec: ChatCodec, suite: Any, value_fn: ValueFn, *, sampling: SamplingParams,
                 limits: EpisodeLimits, settings: SearchSettings = SearchSettings()) -> None:
        self.policy, self.codec, self.suite, self.value_fn = policy, codec, suite, value_fn
        self.sampling, self.limits, self.settings = sampling, limits, settings
        self.rounds = 0
        self.expansion_rounds = 0  # rounds that sampled candidates (the others only met terminal leaves)

    def run(self, tasks: Sequence[Task], seeds: Sequence[int] | None = None) -> list[SearchResult]:
        trees = [_Tree(task, seed) for task, seed in zip(tasks, seeds or [0] * len(tasks))]
        with ThreadPoolExecutor(max_workers=max(1, self.settings.tool_workers),
                                thread_name_prefix="agentgrad-search") as pool:
            self.pool = pool
            while live := [t for t in trees if t.live(self.settings)]:
                self._round(live)
        return [SearchResult(t.task, t.root, t.solved, tuple(t.episodes), t.simulations, t.generated_tokens,
                             t.tool_calls, t.new_tool_calls) for t in trees]

    def _round(self, trees: list[_Tree]) -> None:
        """One simulation in every tree: select, restore, evaluate or expand, back up."""
        leaves = []
        for tree in trees:
            tree.simulations += 1
            leaves.append(_Leaf(tree, select_leaf(tree.root, self.settings.c_puct)))
        self._restore(leaves)
        to_expand = []
        for leaf in leaves:
            ep = leaf.episode
            assert ep is not None
            if ep.done:
                trajectory = finish_episode(ep)
                success = episode_success(self.suite, trajectory)
                leaf.node.terminal_value = float(success)
                leaf.tree.episodes.append(SearchEpisode(trajectory, success, leaf.node))
                backup(leaf.node, leaf.node.terminal_value)
                close_env(ep.env)
            else:
                to_expand.append(leaf)
        if to_expand:
            self._expand(to_expand)
            self.expansion_rounds += 1
        self.rounds += 1

    def _restore(self, leaves: list[_Leaf]) -> None:
        """Bring each leaf's episode back: from the nearest node on its path with a saved env snapshot (none on
        the first visit below it, or when the env offers none), then replaying the turns after it into the env,
        depth by depth, the tool calls of all trees on the pool. Tokenizer work (parsing, observation ids)
        stays on this thread: the tokenizer is not thread-safe."""
        paths = []  # per leaf: the nodes to step into, in order
        for leaf in leaves:
            path, resumed = leaf.node.path()[1:], None
            for node in reversed(leaf.node.path()):
                if id(node) in leaf.tree.saved:
                    resumed, path = leaf.tree.saved[id(node)], path[node.depth:]
                    break
            env = self.suite.make_env()
            if resumed is not None:
                env.reset(seed=leaf.tree.seed, options={"task": leaf.tree.task})
                env.restore(resumed[1])
                leaf.episode = _copy_episode(resumed[0], env)
            else:
                leaf.episode = start_episode(env, leaf.tree.task, self.codec, seed=leaf.tree.seed)
                if leaf.episode.prompt_length >= self.limits.max_total_tokens:
                    leaf.episode.stop_reason = StopReason.MAX_TOKENS
            paths.append(path)
        for depth in range(max(map(len, paths), default=0)):
            stepping = []
            for leaf, path in zip(leaves, paths):
                ep = leaf.episode
                if depth < len(path) and not ep.done:
                    node = path[depth]
                    actions = begin_turn(ep, node.edge.sample.payload, self.codec, self.limits)
                    if not ep.done:
                        stepping.append((leaf, ep, actions, id(node) not in leaf.tree.reached))
                        leaf.tree.reached.add(id(node))
            list(self.pool.map(lambda s: run_actions(s[1], s[2]), stepping))
            for leaf, ep, actions, first in stepping:
                calls = sum(isinstance(a, ToolCall) for a in actions)
                leaf.tree.tool_calls += calls
                leaf.tree.new_tool_calls += calls if first else 0
                end_turn(ep, self.codec, self.limits)
        for leaf in leaves:
            ep = leaf.episode
            if (self.settings.snapshots and not ep.done and isinstance(ep.env, SnapshotEnv)
                    and id(leaf.node) not in leaf.tree.saved):
                leaf.tree.saved[id(leaf.node)] = (_copy_episode(ep, None), ep.env.snapshot())

    def _expand(self, leaves: list[_Leaf]) -> None:
        """Sample candidates at every leaf in one session, de-duplicate, value, prune to top-K, back up."""
        samples = self._draw(leaves)
        candidates = [dedupe(ss) for ss in samples]
        queries = [leaf.episode.token_ids for leaf in leaves]
        queries += [leaf.episode.token_ids + list(c.payload.token_ids) for leaf, cs in zip(leaves, candidates)
                    for c in cs]
        values = self.value_fn(queries)
        state_values, offset = values[:len(leaves)], len(leaves)
        for leaf, cs in zip(leaves, candidates):
            if leaf.node.expanded:  # all its children ended: widen it with the fresh candidates
                if leaf.node.widenings_left:  # (none left: its draws covered it, `_draw` stopped it)
                    widen(leaf.node, cs, values[offset:offset + len(cs)], self.settings.top_k)
            else:
                expand(leaf.node, cs, values[offset:offset + len(cs)], self.settings.top_k, self.settings.widenings)
            offset += len(cs)
        mix = self.settings.rollout_mix
        outcomes = self._rollouts(leaves) if mix > 0 else [0.0] * len(leaves)
        for leaf, v, z in zip(leaves, state_values, outcomes):
            backup(leaf.node, (1 - mix) * float(v) + mix * z)
            close_env(leaf.episode.env)

    def _draw(self, leaves: list[_Leaf]) -> list[list[Sample]]:
        """Candidate turns at each leaf: batches of `expansion_batch` drawn for every leaf still drawing, up to
        `samples_per_expansion` in all, a leaf stopping once the distinct turns drawn at its node cover
        `coverage` of the sampling distribution (a concentrated policy repeats its likeliest turn: more draws
        would cost tokens and find nothing new). A node to widen whose draws already cover it is not widened."""
        settings = self.settings
        n, batch = settings.samples_per_expansion, settings.expansion_batch or settings.samples_per_expansion
        samples: list[list[Sample]] = [[] for _ in leaves]

        def covered(node: Node) -> bool:  # coverage 1.0 never stops early (sums of probabilities may round to 1)
            return settings.coverage < 1.0 and sampled_mass(node) >= settings.coverage
        drawing = []
        for i, leaf in enumerate(leaves):
            if leaf.node.expanded and covered(leaf.node):
                stop_widening(leaf.node)
            else:
                drawing.append(i)
        drawn = 0
        while drawing:
            size = min(batch, n - drawn)
            for i, gens in zip(drawing, self._sample([leaves[i].episode for i in drawing], size, drawn // batch)):
                leaves[i].tree.generated_tokens += sum(len(g.token_ids) for g in gens)
                samples[i] += [self._candidate(g) for g in gens]
            drawn += size
            for i in drawing:
                leaves[i].node.record_samples(samples[i])
            drawing = [i for i in drawing if drawn < n and not covered(leaves[i].node)]
        return samples

    def _candidate(self, gen: Generation) -> Sample:
        text = self.codec.decode(gen.token_ids)
        if gen.finish_reason == "stop":
            key = action_key(self.codec.parse(text))
        else:  # cut by the token limit: the episode would end there, a failure whatever the text says
            key = "cut:" + " ".join(text.split())
        return Sample(key, tuple(gen.token_ids), float(sum(gen.logprobs)), Generation(gen.token_ids, gen.logprobs,
                                                                                      gen.finish_reason))

    def _sample(self, episodes: Sequence[_Episode], n: int, draw: int = 0) -> list[list[Generation]]:
        """`n` turns sampled at each episode's state, every row of every episode in one decode session; `draw`
        numbers the batches of one round (each draws fresh numbers)."""
        rows = [(e, j) for e in range(len(episodes)) for j in range(n)]
        masker = episode_masks(self.codec, self.settings.tool_name_mask,
                               [episodes[e].env.legal_actions() for e, _ in rows],
                               [episodes[e].offered_tools for e, _ in rows], self.settings.copy_args)
        seed = (None if self.sampling.seed is None
                else self.sampling.seed + self.rounds * _ROUND_SEED_STRIDE + draw * _DRAW_SEED_STRIDE)
        turn = dataclasses.replace(self.sampling, max_new_tokens=self.limits.max_new_tokens_per_turn, seed=seed)
        out: list[list[Generation | None]] = [[None] * n for _ in episodes]
        with open_session(self.policy, turn, masker, max_sequences=max(1, len(rows)),
                          max_tokens=self.limits.max_total_tokens) as session:
            for key, (e, _) in enumerate(rows):
                ep = episodes[e]
                if masker is not None:
                    masker.start_turn(key, ep.env.legal_actions(), ep.messages)
                session.submit(key, ep.token_ids, _turn_budget(ep, self.limits))
            while session.has_work:
                for key, gen in session.step():
                    e, j = rows[key]
                    out[e][j] = gen
                    session.release(key)
        return [[g for g in gens if g is not None] for gens in out]

    def _rollouts(self, leaves: list[_Leaf]) -> list[float]:
        """Play each leaf's episode to its end with the policy (one turn per row per session, all leaves at
        once); returns the outcomes (1 / 0) and records the episodes."""
        live = list(range(len(leaves)))
        while live:
            gens = self._sample([leaves[i].episode for i in live], 1)
            stepping = []
            for i, [gen] in zip(live, gens):
                leaves[i].tree.generated_tokens += len(gen.token_ids)
                ep = leaves[i].episode
                actions = begin_turn(ep, gen, self.codec, self.limits)
                if not ep.done:
                    stepping.append((i, ep, actions))
            list(self.pool.map(lambda s: run_actions(s[1], s[2]), stepping))
            for i, ep, actions in stepping:
                calls = sum(isinstance(a, ToolCall) for a in actions)
                leaves[i].tree.tool_calls += calls
                leaves[i].tree.new_tool_calls += calls
                end_turn(ep, self.codec, self.limits)
            live = [i for i in live if not leaves[i].episode.done]
        outcomes = []
        for leaf in leaves:
            trajectory = finish_episode(leaf.episode)
            success = episode_success(self.suite, trajectory)
            leaf.tree.episodes.append(SearchEpisode(trajectory, success, leaf.node, by_rollout=True))
            outcomes.append(float(success))
        return outcomes


def _copy_episode(ep: _Episode, env: Any) -> _Episode:
    """An episode's record with its own containers (the turns after it must not write into the saved one)."""
    return dataclasses.replace(ep, env=env, token_ids=list(ep.token_ids), loss_mask=list(ep.loss_mask),
                               logprobs=list(ep.logprobs), messages=list(ep.messages), turns=list(ep.turns),
                               call_counts=Counter(ep.call_counts), observations=list(ep.observations),
                               token_masks=list(ep.token_masks), head_decisions=list(ep.head_decisions),
                               final_info=dict(ep.final_info))


def search_metrics(results: Sequence[SearchResult], top_k: int | None) -> dict[str, float]:
    """A round's report: trees, success, mean costs, nodes expanded per depth, the widest expansion."""
    n = max(1, len(results))
    metrics: dict[str, float] = {
        "search/trees": float(len(results)),
        "search/success": sum(r.success for r in results) / n,
        "search/simulations": sum(r.simulations for r in results) / n,
        "search/generated_tokens": sum(r.generated_tokens for r in results) / n,
        "search/tool_calls": sum(r.tool_calls for r in results) / n,
        "search/new_tool_calls": sum(r.new_tool_calls for r in results) / n,
    }
    per_depth: dict[int, int] = {}
    widest = 0
    for r in results:
        for depth, count in expanded_per_depth(r.root).items():
            per_depth[depth] = per_depth.get(depth, 0) + count
        widest = max([widest, *(len(node.children) for node in iter_nodes(r.root))])
    for depth, count in sorted(per_depth.items()):
        metrics[f"search/expanded_depth_{depth}"] = count / n
    metrics["search/max_children"] = float(widest)
    if top_k:
        metrics["search/top_k"] = float(top_k)
    return metrics
