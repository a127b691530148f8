"""ReST-EM's Improve step starts from the stage's first weights with a fresh optimizer; 'current' does not; the
start weights survive a state_dict round trip (a resumed run re-fits the same start)."""

import random

import torch
from test_train_tiny import FAST

from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.rest import RestState, improve, start_rest


def _components(tmp_path, improve_from: str):
    config = build_config(overrides=[*FAST, "bc.steps=0", "algo=rest", f"rest.improve_from={improve_from}"])
    return build_components(config, tmp_path)


def _drift(c) -> None:
    """One optimizer step on a made-up loss: the weights move and AdamW holds moments for every parameter."""
    loss = sum((p.float() ** 2).sum() for p in c.loaded.model.parameters())
    c.learner.step(loss)


def _weights(c) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in c.loaded.model.state_dict().items()}


def test_improve_from_start_restores_the_first_weights_and_a_fresh_optimizer(tmp_path):
    c = _components(tmp_path, "start")
    logger = RunLogger([], ProgressDisplay(enabled=False))
    first = _weights(c)
    state = start_rest(c, logger, 0, None)
    _drift(c)
    assert any(not torch.equal(first[k], v) for k, v in c.loaded.model.state_dict().items())
    assert c.learner.optimizer.state  # moments from the drift step
    # No kept samples: Improve is only the reset, so the policy is exactly the stage's first one.
    assert improve(c, [], random.Random(0), 0, state.start) == {"train/updates": 0.0}
    assert all(torch.equal(first[k], v) for k, v in c.loaded.model.state_dict().items())
    assert not c.learner.optimizer.state

    # A resumed run gets the same start back from the checkpointed state (saved with torch.save, as blobs are).
    path = tmp_path / "stage.pt"
    torch.save(state.state_dict(), path)
    resumed = start_rest(c, logger, 0, torch.load(path, weights_only=False))
    assert isinstance(resumed, RestState) and resumed.start is not None
    assert all(torch.equal(first[k], resumed.start[k]) for k in first)


def test_improve_from_current_keeps_fine_tuning_the_policy(tmp_path):
    c = _components(tmp_path, "current")
    state = start_rest(c, RunLogger([], ProgressDisplay(enabled=False)), 0, None)
    assert state.start is None and state.state_dict()["start"] is None
    _drift(c)
    drifted = _weights(c)
    improve(c, [], random.Random(0), 0, state.start)
    assert all(torch.equal(drifted[k], v) for k, v in c.loaded.model.state_dict().items())
    assert c.learner.optimizer.state
