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
    # PPO as in Ziegler et al. 2019: KL to the BC policy as a reward penalty, adaptive coefficient.
    "ppo": ["algo.steps=4", "algo.epochs_per_step=2", "algo.kl_coef=0.05", "algo.kl_mode=reward",
            "algo.kl_controller=adaptive", "algo.kl_target=0.5", "algo.kl_horizon_episodes=500"],
    # ReST's Grow step needs diverse samples: at temperature 0.3 it fine-tuned on near-greedy successes and lost
    # ground (33% -> 31%); at 0.7 it gained (33% -> 44%). Pinned here so the test does not follow the preset.
    "rest": ["rest.iterations=4", "rest.tasks_per_iteration=8", "rest.samples_per_task=8", "rest.sft_steps=4",
             "rest.threshold_start=1.0", "rollout.temperature=0.7"],
    "dpo": ["dpo.iterations=4", "dpo.tasks_per_iteration=8", "dpo.samples_per_task=8", "dpo.epochs=1"],
}


class _Sink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, step, stage, metrics) -> None:
        self.records.append(dict(metrics))

    def close(self) -> None:
        pass


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
    sink = _Sink()
    STAGES.get(algo)(c, RunLogger([sink], ProgressDisplay(enabled=False)), None, None, 0)
    final = held_out(c).success_rate
    print(f"{algo}: held-out success {start:.0%} -> {final:.0%}")
    assert final > start, f"{algo}: held-out success {start:.0%} -> {final:.0%}"
    if algo == "ppo":  # the adaptive coefficient is logged every step and moves
        coefs = [m["train/kl_coef"] for m in sink.records]
        assert len(coefs) == 4 and coefs[0] == 0.05 and coefs[-1] != coefs[0], coefs
        assert all("critic/explained_variance" in m and "rollout/kl_ref" in m for m in sink.records)
