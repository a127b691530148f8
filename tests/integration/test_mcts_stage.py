"""Stage `mcts` end to end on the tiny model (untrained: the wiring, not learning): rounds of baseline rollouts,
value fit, batched search and distillation log their metrics; expansions keep at most top_k children; the
stage's state resumes from its state_dict; the schedule knows the stage."""

import torch
from test_train_tiny import FAST

from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.run_state import run_alone
from agentgrad.pipelines.schedule import STAGES, stage_config, stages_of
from agentgrad.sinks import MemorySink

SMALL = ["bc.steps=0", "algo=mcts", "mcts.iterations=2", "mcts.trees_per_iteration=3", "mcts.simulations=4",
         "mcts.samples_per_expansion=4", "mcts.top_k=2", "mcts.value_fit_steps=3", "mcts.sft_steps=2",
         "mcts.stop_on_success=false", "mcts.widenings=1", "eval.num_tasks=8"]


def test_mcts_stage_runs_rounds_and_resumes(tmp_path):
    config = build_config(overrides=[*FAST, *SMALL])
    assert [s.algo for s in stages_of(config)] == ["bc", "mcts"] and stages_of(config)[1].steps == 2
    c = build_components(config, tmp_path)
    sink = MemorySink()
    stage = STAGES.get("mcts")
    state = stage.start(c, RunLogger([sink], ProgressDisplay(enabled=False)), 0, None)
    taken = run_alone("mcts", stage, c, RunLogger([sink], ProgressDisplay(enabled=False)), state=state)
    assert taken == 2 and len(sink.metrics) == 2
    for m in sink.metrics:
        # top_k=2 per expansion, and one widening may add 2 more
        assert m["search/trees"] == 3.0 and m["search/max_children"] <= 2 * (1 + 1)
        assert m["search/simulations"] <= 4 and m["search/expanded_depth_0"] == 1.0
        assert {"policy/success_rate", "search/success", "value/ece", "value/rollouts_loss_last",
                "mcts/bc_paths", "mcts/dpo_pairs", "search/generated_tokens", "search/tool_calls"} <= set(m)
    resumed = stage.start(c, RunLogger([sink], ProgressDisplay(enabled=False)), 0, state.state_dict())
    for a, b in zip(state.critic.model.head.parameters(), resumed.critic.model.head.parameters()):
        assert torch.equal(a, b)
    assert resumed.rng.getstate() == state.rng.getstate()
    assert stage_config(config, stages_of(config)[1]).mcts.iterations == 2
