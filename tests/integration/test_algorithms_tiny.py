"""Each of ppo, grpo, rest and dpo raises held-out success from the same BC-warmed start (fixed seeds).

BC runs once per module (a fixed number of steps, so the start does not depend on validation noise); each
algorithm then loads that checkpoint, runs a few steps, and is evaluated on the same held-out tasks.
"""

import pytest

from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.schedule import STAGES
from agentgrad.pipelines.train import held_out, train

from test_train_tiny import FAST  # noqa: E402  (rootdir-relative: tests are not a package)

BC = ["bc.steps=190", "bc.stop_at_success=null", "algo=bc", "run.threads=1"]
# Small per-algorithm budgets: a few rollout batches of 8 tasks x 8 samples each.
ALGOS = {
    "grpo": ["algo.steps=4", "algo.epochs_per_step=2"],
    "ppo": ["algo.steps=4", "algo.epochs_per_step=2"],
    "rest": ["rest.iterations=4", "rest.tasks_per_iteration=8", "rest.samples_per_task=8", "rest.sft_steps=4",
             "rest.threshold_start=1.0"],
    "dpo": ["dpo.iterations=4", "dpo.tasks_per_iteration=8", "dpo.samples_per_task=8", "dpo.epochs=1"],
}


@pytest.fixture(scope="module")
def bc_start(tmp_path_factory):
    root = tmp_path_factory.mktemp("bc")
    summary = train(build_config(overrides=[*FAST, *BC, f"run.output_dir={root}"]))
    start = summary["final_success_rate"]
    assert 0.05 <= start <= 0.8, f"BC start {start:.0%} leaves RL nothing to show; retune BC's steps"
    return root / "fast" / "checkpoints" / "bc", start


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(ALGOS))
def test_algorithm_raises_heldout_success_from_bc(bc_start, algo, tmp_path):
    checkpoint, start = bc_start
    config = build_config(overrides=[*FAST, "bc.steps=0", "run.threads=1", f"model.path={checkpoint}",
                                     f"algo={algo}", *ALGOS[algo]])
    c = build_components(config, tmp_path)
    logger = RunLogger([], ProgressDisplay(enabled=False))
    STAGES.get(algo)(c, logger, None, None, 0)
    final = held_out(c).success_rate
    print(f"{algo}: held-out success {start:.0%} -> {final:.0%}")
    assert final > start, f"{algo}: held-out success {start:.0%} -> {final:.0%}"
