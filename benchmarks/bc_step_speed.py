"""BC step time by compute dtype and prefix sharing, on the default run's model and demos, interleaved.

    python benchmarks/bc_step_speed.py --repeats 20          # fp32 / bf16 x plain / shared prefix
    python benchmarks/bc_step_speed.py --validation 6        # also time full and probe validation checks

Every variant takes the same minibatches (the same demos in the same order) from one copy of the model, one
step each in turn, so machine load hits all alike. Reported: median wall and CPU time per step (with their
range), speed-up against fp32 plain, and the loss each variant computes on one fixed batch (the same weights),
so a faster variant is seen to compute the same loss. The model is the default one after `--bc-steps` of BC
(mid-training weights, not the random init).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_config, median

from agentgrad.algos.losses import sft_loss
from agentgrad.backends.precision import resolve_compute_dtype
from agentgrad.batch import collate
from agentgrad.pipelines.bc import bc_step, expert_demos, one_group, validation_success
from agentgrad.pipelines.components import build_components

VARIANTS = {"fp32 plain": ("fp32", False), "fp32 shared prefix": ("fp32", True),
            "bf16 plain": ("bf16", False), "bf16 shared prefix": ("bf16", True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--bc-steps", type=int, default=30, help="BC steps before timing (mid-training weights)")
    ap.add_argument("--validation", type=int, default=0, help="also time this many full and probe validation checks")
    ap.add_argument("--probe-tasks", type=int, default=16, help="the probe's size (bc.probe_tasks)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(bench_config(), Path(tmp))
        demos = expert_demos(c, 512, seed=1)
        rng = random.Random(0)
        for step in range(args.bc_steps):
            bc_step(c, demos, rng, step)
        state = {k: v.clone() for k, v in c.loaded.model.state_dict().items()}
        fixed = collate(demos[:32], pad_token_id=c.pad_token_id)
        mean_len = float(fixed.attention_mask.sum(1).float().mean())
        print(f"prefix shared by a batch: {shared_prefix_tokens(fixed)} of {mean_len:.0f} tokens per demo on average")
        losses = {}
        for name, (dtype, shared) in VARIANTS.items():
            c.learner.compute = resolve_compute_dtype(dtype, "cpu")
            with torch.no_grad():
                lp = c.learner.logprobs(one_group(fixed) if shared else fixed)
            losses[name] = float(sft_loss(lp, fixed.loss_mask))
        configs = {shared: c.config.model_copy(update={"bc": c.config.bc.model_copy(update={"shared_prefix": shared})})
                   for shared in (False, True)}
        wall = {k: [] for k in VARIANTS}
        cpu = {k: [] for k in VARIANTS}
        for r in range(args.repeats):
            for name, (dtype, shared) in VARIANTS.items():
                c.loaded.model.load_state_dict(state)
                c.learner.compute = resolve_compute_dtype(dtype, "cpu")
                c.config = configs[shared]
                t0, p0 = time.perf_counter(), time.process_time()
                bc_step(c, demos, random.Random(r), args.bc_steps)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - p0)
        base = median(cpu["fp32 plain"])
        print(f"{'variant':<20} {'wall ms':>8} {'(range)':>15} {'cpu ms':>8} {'speed-up (cpu)':>14} {'loss':>10}")
        for name in VARIANTS:
            lo, hi = 1e3 * min(wall[name]), 1e3 * max(wall[name])
            print(f"{name:<20} {1e3 * median(wall[name]):8.1f} {lo:7.1f}-{hi:<7.1f}"
                  f" {1e3 * median(cpu[name]):8.1f} {base / median(cpu[name]):13.2f}x {losses[name]:10.6f}")
        if args.validation:
            c.loaded.model.load_state_dict(state)
            sizes = {"full": c.config.bc.eval_tasks, "probe": args.probe_tasks}
            times = {k: [] for k in sizes}
            seen = {}
            for _ in range(args.validation):
                for k, n in sizes.items():
                    p0 = time.process_time()
                    seen[k] = validation_success(c, n)
                    times[k].append(time.process_time() - p0)
            for k, n in sizes.items():
                print(f"validation check, {k} ({n} tasks, greedy): {median(times[k]):.3f} s CPU "
                      f"({min(times[k]):.3f}-{max(times[k]):.3f}), success {seen[k]:.0%}")


def shared_prefix_tokens(batch) -> int:
    from agentgrad.backends.shared_prefix import plan_shared_prefixes

    plan = plan_shared_prefixes(dataclasses.replace(batch, group_index=torch.zeros_like(batch.group_index)))
    return int(plan.prefix_len[0]) if plan is not None else 0


if __name__ == "__main__":
    main()
