"""api-catalog: BC then RL (GRPO by default), constrained decoding vs the factored head, same budget.

Each arm is one `agentgrad train` run (the real pipeline: BC on the suite's expert, held-out eval, RL, held-out
eval) from the same tiny base model and seed; the arms differ only in `rollout.action_head`. After training the
final checkpoint is evaluated greedily as in benchmarks/action_space.py (success, right tool, LM tokens sampled
per call, head decisions per call).

    PYTHONPATH=src nice -n 19 python benchmarks/action_space_rl.py --bc-steps 1500 --rl-steps 20 [--seed 0]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from action_space import MODEL, held_out_measures

from agentgrad.config import build_config
from agentgrad.pipelines.components import build_components, build_tiny_model_dir, make_suite
from agentgrad.pipelines.train import train


def arm(head: str, args: argparse.Namespace, model_dir: Path, out: Path) -> dict:
    config = build_config(overrides=[
        "env=api-catalog", *MODEL, f"model.path={model_dir}", f"rollout.action_head={head}",
        f"bc.steps={args.bc_steps}", f"bc.num_demos={args.demos}", "bc.stop_at_success=null", f"bc.lr={args.lr}",
        f"algo.name={args.algo}", f"algo.steps={args.rl_steps}", f"eval.num_tasks={args.eval_tasks}",
        "run.threads=1", "run.progress=false", f"run.seed={args.seed}", f"run.output_dir={out}", f"run.name={head}",
        *args.override])
    summary = train(config)
    final = build_components(config, out / "eval", model_path=Path(summary["run_dir"]) / "checkpoints" / "final")
    return {"head": head, "bc": summary["initial_success_rate"], "rl": summary["final_success_rate"],
            "wall_s": summary["wall_time_s"], **held_out_measures(final, args)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bc-steps", type=int, default=1500)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--algo", default="grpo")
    p.add_argument("--demos", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3, help="bc.lr")
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default="tokens,factored")
    p.add_argument("--override", action="append", default=[], help="more config overrides (both arms)")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_config(overrides=["env=api-catalog", *MODEL, f"run.seed={args.seed}"])
        model_dir = build_tiny_model_dir(base, make_suite(base), Path(tmp) / "base-model")
        rows = [arm(head, args, model_dir, Path(tmp)) for head in args.arms.split(",")]
    threads = next((o.split("=", 1)[1] for o in reversed(args.override) if o.startswith("run.threads=")), "1")
    print(f"api-catalog, tiny model, BC {args.bc_steps} steps then {args.algo} {args.rl_steps} steps, seed "
          f"{args.seed}; greedy on {args.eval_tasks} held-out tasks; threads: {threads}")
    print("| tool name by | after BC | after RL | right tool | LM tokens sampled per call | head decisions per call "
          "| wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['head']} | {r['bc']:.1%} | {r['rl']:.1%} ({r['wins']}/{r['n']} greedy) | {r['tool_accuracy']:.1%} "
              f"| {r['tokens_per_call']:.2f} | {r['head_per_call']:.2f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
