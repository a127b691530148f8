"""CPU time per BC step on api-catalog: the tokens arm and the factored head, with and without the shared prefix.

Each arm clones the same 200 expert demos from the same base model (the tiny shape of action_space_diagnosis.py),
16 per step; 5 warm-up steps, then the mean CPU time (`time.process_time`) of 40 `bc_step`s.

    PYTHONPATH=src nice -n 19 python benchmarks/factored_bc_speed.py
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
from action_space_diagnosis import MODEL

from agentgrad.config import build_config
from agentgrad.pipelines.bc import bc_step
from agentgrad.pipelines.components import build_components, build_tiny_model_dir, make_suite
from agentgrad.pipelines.demos import expert_demos


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_config(overrides=["env=api-catalog", *MODEL, "run.seed=0"])
        model_dir = build_tiny_model_dir(base, make_suite(base), Path(tmp) / "base")
        print("| tool name by | bc.shared_prefix | CPU ms per BC step |\n|---|---|---|")
        for head in ["tokens", "factored"]:
            for shared in ["true", "false"]:
                config = build_config(overrides=[
                    "env=api-catalog", *MODEL, f"model.path={model_dir}", f"rollout.action_head={head}",
                    f"bc.shared_prefix={shared}", "bc.steps=1000", "run.threads=1", "run.progress=false"])
                c = build_components(config, Path(tmp) / f"{head}-{shared}")
                demos = expert_demos(c, 200, seed=1)
                rng = random.Random(0)
                for step in range(5):
                    bc_step(c, demos, rng, step)
                t0 = time.process_time()
                for step in range(5, 45):
                    bc_step(c, demos, rng, step)
                print(f"| {head} | {shared} | {(time.process_time() - t0) / 40 * 1000:.1f} |", flush=True)


if __name__ == "__main__":
    main()
