"""api-catalog: constrained decoding of tool names vs the factored (category -> tool) head, same BC budget.

Both arms start from the same tiny base model (same tokenizer, same initial weights), clone the same expert
demonstrations with the same seed, steps, batch and learning rate, and are evaluated greedily on the same
held-out tasks through the same agent loop and engine. The only difference is `rollout.action_head`:
- tokens:   the LM writes the tool name, token by token, under the env's mask (rollout.tool_name_mask=auto);
- factored: two heads on the hidden state at the call position choose category then tool over the legal set;
            the name's tokens are written in (not sampled). BC trains the head on the LM's hidden states, detached
            (bc.head_grad), and the LM still learns the names (bc.lm_learns_names); both switchable.
Reported per arm: held-out greedy success (Wilson 95% CI), tokens the LM sampled per call turn, head decisions
per call, calls per episode, and wall time of BC and of the evaluation.

    PYTHONPATH=src nice -n 19 python benchmarks/action_space.py [--bc-steps 300] [--eval-tasks 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.bc import expert_demos, run_bc
from agentgrad.pipelines.components import build_components, build_tiny_model_dir, make_suite
from agentgrad.pipelines.evaluate import wilson_interval
from agentgrad.rollout.loop import run_episodes
from agentgrad.types import ToolCall

MODEL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
         "model.tiny.intermediate_size=192", "model.tiny.tokenizer_corpus_episodes=200"]


def kinds_override(args: argparse.Namespace) -> list[str]:
    return [f"env.options={{schemas: none, kinds: [{args.kinds}]}}"] if args.kinds else []


def arm(mode: str, args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, float | str]:
    """`mode`: tokens | factored | factored+names (diagnostic: the head, but the LM still trains on the names)."""
    head = "tokens" if mode == "tokens" else "factored"
    config = build_config(overrides=[
        "env=api-catalog", *kinds_override(args), *MODEL, f"model.path={model_dir}", f"rollout.action_head={head}",
        f"bc.steps={args.bc_steps}", f"bc.batch_size_episodes={args.batch}", f"bc.num_demos={args.demos}",
        "bc.stop_at_success=null", f"bc.lr={args.lr}", f"bc.head_loss_coef={args.head_loss_coef}",
        f"bc.head_grad={args.head_grad}", f"bc.lm_learns_names={args.lm_learns_names}", "run.threads=1",
        "run.progress=false", f"run.seed={args.seed}"])
    c = build_components(config, run_dir)
    demos = expert_demos(c, args.demos, seed=args.seed + 1)  # the same tasks in both arms
    if mode == "factored+names":
        plain = expert_demos(dataclasses.replace(c, sampler=dataclasses.replace(c.sampler, action_head="tokens")),
                             args.demos, seed=args.seed + 1)
        demos = [dataclasses.replace(d, loss_mask=p.loss_mask) for d, p in zip(demos, plain)]
    t0 = time.perf_counter()
    run_bc(c, RunLogger([], ProgressDisplay(enabled=False)), demos=demos)
    bc_s = time.perf_counter() - t0
    return {"mode": mode, **held_out_measures(c, args, diagnose=mode == "factored+names"),
            "bc_s": bc_s}


def held_out_measures(c, args: argparse.Namespace, *, diagnose: bool = False) -> dict[str, float]:
    """Greedy held-out success and the per-call measures of the policy `c` (its own rollout.action_head)."""
    tasks = c.suite.sample_tasks(args.eval_tasks, split="heldout", seed=args.seed)

    def rollouts(sampler):
        return run_episodes(c.policy, c.codec, [c.suite.make_env() for _ in tasks], tasks, limits=c.limits,
                            sampler=sampler, sampling=SamplingParams(temperature=0.0, seed=args.seed),
                            seeds=[args.seed] * len(tasks))

    t0 = time.perf_counter()
    trajs = rollouts(c.sampler)
    eval_s = time.perf_counter() - t0
    if diagnose:  # the same LM writing the names itself: is it the head or the LM that fails?
        alone = rollouts(dataclasses.replace(c.sampler, action_head="tokens"))
        print(f"factored+names, names written by the LM instead of the head: held-out success "
              f"{sum(c.suite.verify(t.task, t.final_answer) for t in alone)}/{len(alone)}")
    wins = sum(c.suite.verify(t.task, t.final_answer) for t in trajs)
    low, high = wilson_interval(wins, len(trajs))
    tool_hits = sum(getattr(turn.action, "name", None) == name for t in trajs
                    for turn, (name, _) in zip([u for u in t.turns if isinstance(u.action, ToolCall)],
                                               t.task.metadata["calls"]))
    expert_calls = sum(len(t.task.metadata["calls"]) for t in trajs)
    call_turns = [(t, turn) for t in trajs for turn in t.turns if isinstance(turn.action, ToolCall)
                  and turn.end > turn.start]
    sampled = sum(sum(t.loss_mask[turn.start:turn.end]) for t, turn in call_turns)
    n_calls = max(1, len(call_turns))
    return {"success": wins / len(trajs), "low": low, "high": high, "wins": wins, "n": len(trajs),
            "tokens_per_call": sampled / n_calls, "head_per_call": sum(len(t.head_decisions) for t in trajs) / n_calls,
            "calls_per_episode": len(call_turns) / len(trajs), "tool_accuracy": tool_hits / expert_calls,
            "invalid_per_episode": sum(t.num_invalid_calls for t in trajs) / len(trajs), "eval_s": eval_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bc-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="episodes per BC step")
    p.add_argument("--demos", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-loss-coef", type=float, default=1.0, help="bc.head_loss_coef of the factored arm")
    p.add_argument("--head-grad", default="detached", help="bc.head_grad of the factored arm")
    p.add_argument("--lm-learns-names", default="true", help="bc.lm_learns_names of the factored arm")
    p.add_argument("--arms", default="tokens,factored", help="which arms to run (comma-separated)")
    p.add_argument("--kinds", default="", help="comma-separated api-catalog task kinds (default: all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_config(overrides=["env=api-catalog", *kinds_override(args), *MODEL, f"run.seed={args.seed}"])
        model_dir = build_tiny_model_dir(base, make_suite(base), Path(tmp) / "base-model")
        rows = [arm(mode, args, model_dir, Path(tmp) / mode) for mode in args.arms.split(",")]
    print(f"api-catalog (kinds: {args.kinds or 'all'}), tiny model (64 wide, 2 layers), BC {args.bc_steps} steps x "
          f"{args.batch} of {args.demos} demos, lr {args.lr}, head loss coef {args.head_loss_coef}, head "
          f"{args.head_grad}, LM learns names {args.lm_learns_names}, seed {args.seed}; "
          f"greedy on {args.eval_tasks} held-out tasks; one thread")
    print("| tool name by | held-out success (95% CI) | right tool (k-th call = expert's k-th) | LM tokens sampled "
          "per call | head decisions per call | calls / invalid calls per episode | BC wall s | eval wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['success']:.1%} ({r['low']:.1%}-{r['high']:.1%}, {r['wins']}/{r['n']}) "
              f"| {r['tool_accuracy']:.1%} | {r['tokens_per_call']:.2f} | {r['head_per_call']:.2f} "
              f"| {r['calls_per_episode']:.2f} / {r['invalid_per_episode']:.2f} | {r['bc_s']:.0f} "
              f"| {r['eval_s']:.0f} |")


if __name__ == "__main__":
    main()
