"""Stage `mcts`: tree search over tool calls, distilled into the policy (docs/search.md).

Each round: (1) the policy alone plays `baseline_samples` episodes per task (its own success, and Monte-Carlo
returns); (2) the value model's calibration is measured on them (its predictions before it saw them), then it
is fitted to them; (3) one tree per task is searched (`search/driver.py`), pruned to `top_k` children by the
value model; (4) successful root-to-leaf paths are cloned (BC) and sibling pairs (same parent, one child led to
success, one to failure) train DPO against the policy frozen at stage start, as `mcts.distill` says; (5) the
value model is fitted again on the search's episodes, for the next round.

The stage state (value model and its optimizer, DPO reference, the minibatch RNG) is saved after every round,
so a killed run resumes at the next one.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentgrad.algos.losses import sft_loss
from agentgrad.backends.base import SamplingParams
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.models.value import Critic, build_critic
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.dpo import dpo_update, frozen_sequence_logprobs, pair_batches
from agentgrad.pipelines.rl import rl_tasks, rollout_groups, rollout_metrics
from agentgrad.pipelines.run_state import Stage
from agentgrad.rewards.base import score
from agentgrad.search.distill import sibling_pairs, success_paths
from agentgrad.search.driver import SearchBudget, SearchResult, SearchSettings, TreeSearch, search_metrics
from agentgrad.search.value import CriticValues, ValueExample, calibration_metrics, fit_values, value_example
from agentgrad.types import Trajectory


@dataclass
class MctsState:
    critic: Critic
    """The value model (config critic.model: a head on the policy's trunk, or a separate copy)."""
    reference: torch.nn.Module | None
    """The policy frozen as the stage started (DPO's reference); None when mcts.distill=bc."""
    rng: random.Random
    """Draws BC minibatches and shuffles DPO pairs."""

    def state_dict(self) -> dict[str, Any]:
        out = {"critic": self.critic.state_dict(), "rng": self.rng.getstate()}
        if self.reference is not None:
            out["reference"] = self.reference.state_dict()
        return out

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.critic.load_state_dict(saved["critic"])
        self.rng.setstate(saved["rng"])
        if self.reference is not None:
            self.reference.load_state_dict(saved["reference"])


def start_mcts(c: Components, logger: RunLogger, first_step: int, saved: Mapping[str, Any] | None) -> MctsState:
    if c.config.rollout.action_head != "tokens":
        raise ValueError("mcts samples candidate turns as tokens: set rollout.action_head=tokens")
    critic = build_critic(c.loaded.model, c.config.critic.model, lr=c.config.critic.lr,
                          grad_clip=c.config.algo.grad_clip)
    reference = (copy.deepcopy(c.loaded.model).eval().requires_grad_(False)
                 if c.config.mcts.distill != "bc" else None)
    state = MctsState(critic, reference, random.Random(c.config.run.seed + first_step))
    if saved is not None:
        state.load_state_dict(saved)
    return state


def search_settings(c: Components) -> SearchSettings:
    cfg = c.config.mcts
    return SearchSettings(top_k=cfg.top_k or None, samples_per_expansion=cfg.samples_per_expansion,
                          expansion_batch=cfg.expansion_batch, coverage=cfg.coverage, snapshots=cfg.snapshots,
                          c_puct=cfg.c_puct, widenings=cfg.widenings, rollout_mix=cfg.rollout_mix,
                          stop_on_success=cfg.stop_on_success,
                          budget=SearchBudget(cfg.simulations, cfg.max_generated_tokens, cfg.max_tool_calls),
                          tool_workers=c.config.rollout.tool_workers or 8,
                          tool_name_mask=c.config.rollout.tool_name_mask,
                          copy_args=c.sampler.copy_args)


def run_search(c: Components, critic: Critic, tasks: Sequence[Any], step: int) -> list[SearchResult]:
    temperature = c.config.mcts.temperature
    sampling = SamplingParams(temperature=c.config.rollout.temperature if temperature is None else temperature,
                              top_p=c.config.rollout.top_p,
                              seed=c.config.run.seed * 7_919 + step + 3_571)
    search = TreeSearch(c.policy, c.codec, c.suite, CriticValues(critic, c.pad_token_id), sampling=sampling,
                        limits=c.limits, settings=search_settings(c))
    seeds = [c.config.run.seed * 1_009 + step * 101 + i for i in range(len(tasks))]
    return search.run(tasks, seeds)


def examples_of(pairs: Sequence[tuple[Trajectory, bool]]) -> list[ValueExample]:
    return [e for e in (value_example(t, float(ok)) for t, ok in pairs) if e is not None]


def fit(c: Components, state: MctsState, examples: Sequence[ValueExample], step: int, tag: str) -> dict[str, float]:
    cfg = c.config.mcts
    fitted = fit_values(state.critic, examples, c.pad_token_id, steps=cfg.value_fit_steps,
                        batch_size=cfg.value_batch_size, seed=c.config.run.seed + step)
    return {k.replace("value/", f"value/{tag}_"): v for k, v in fitted.items()}


def clone(c: Components, paths: Sequence[Trajectory], rng: random.Random, step: int) -> dict[str, float]:
    """`mcts.sft_steps` SFT steps on minibatches of the successful paths."""
    cfg = c.config.mcts
    if not paths or cfg.sft_steps == 0:
        return {}
    c.learner.set_lr(cfg.lr)
    losses = []
    for _ in range(cfg.sft_steps):
        batch = c.collate(rng.sample(list(paths), min(cfg.batch_size_episodes, len(paths))))
        loss = sft_loss(c.learner.logprobs(batch), batch.loss_mask)
        c.learner.step(loss)
        kill_point("update", step)
        losses.append(loss.item())
    return {"loss/sft": sum(losses) / len(losses)}


def prefer(c: Components, state: MctsState, pairs: Sequence[tuple[Trajectory, Trajectory]], step: int
           ) -> dict[str, float]:
    if not pairs or state.reference is None:
        return {}
    chosen, rejected = pair_batches(c, pairs)
    ref_chosen = frozen_sequence_logprobs(state.reference, chosen)  # (N,)
    ref_rejected = frozen_sequence_logprobs(state.reference, rejected)  # (N,)
    c.learner.set_lr(c.config.dpo.lr)
    return dpo_update(c, chosen, rejected, ref_chosen, ref_rejected, state.rng, step)


def mcts_step(c: Components, logger: RunLogger, store: TrajectoryStore | None, state: MctsState,
              step: int) -> dict[str, float]:
    cfg = c.config.mcts
    t0 = time.perf_counter()
    tasks = rl_tasks(c, step, n=cfg.trees_per_iteration)
    groups = rollout_groups(c, tasks, step, group_size=cfg.baseline_samples)
    alone = [(s.trajectory, s.success) for g in groups for s in g.samples]
    examples = examples_of(alone)
    metrics = {f"policy/{k.split('/', 1)[1]}": v for k, v in rollout_metrics(groups).items()}
    metrics |= calibration_metrics(CriticValues(state.critic, c.pad_token_id).predict(examples))
    metrics |= fit(c, state, examples, step, "rollouts")
    results = run_search(c, state.critic, tasks, step)
    kill_point("rollout", step)
    metrics |= search_metrics(results, cfg.top_k or None)
    searched = [(e.trajectory, e.success) for r in results for e in r.episodes]
    if store is not None:
        store.append(score([t for t, _ in searched], c.reward_fn, c.suite), step=step, stage="mcts")
    paths = success_paths(results)
    pairs = [p for r in results for p in sibling_pairs(r)]
    metrics |= {"mcts/bc_paths": float(len(paths)), "mcts/dpo_pairs": float(len(pairs)),
                "mcts/search_minus_policy": metrics["search/success"] - metrics["policy/success_rate"]}
    if cfg.distill in ("bc", "both"):
        metrics |= clone(c, paths, state.rng, step)
    if cfg.distill in ("dpo", "both"):
        metrics |= prefer(c, state, pairs, step)
    metrics |= fit(c, state, examples_of(searched), step, "search")
    return metrics | {"perf/step_s": time.perf_counter() - t0}


MCTS_STAGE: Stage[MctsState] = Stage(budget=lambda config: config.mcts.iterations, start=start_mcts,
                                     step=mcts_step, log_every_step=True)
"""`mcts.iterations` search/distil rounds."""
