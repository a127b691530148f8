"""The pieces of the Ray rollout backend that run without Ray: how a step's groups are spread over workers, the
session adapter that keys a shard's episodes by their index in the step, and the preflight check."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from agentgrad.backends.base import Generation, SamplingParams
from agentgrad.backends.keyed import KeyedSessionPolicy
from agentgrad.config import build_config
from agentgrad.pipelines.preflight import BadInputError, check_rollout_backend
from agentgrad.pipelines.ray_rollout import spread  # importable without Ray: it imports ray only when it runs


def test_whole_groups_go_round_robin():
    # 10 episodes in groups of 4: [0-3], [4-7], [8-9]; groups 0 and 2 to worker 0, group 1 to worker 1
    assert spread(10, 4, 2) == [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7]]
    # more workers than groups: the third has nothing
    assert spread(8, 4, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], []]
    assert spread(3, 1, 2) == [[0, 2], [1]]


class _RecordingSession:
    def __init__(self, processor, pause):
        self.processor, self.pause, self.submitted, self.released = processor, pause, [], []

    @property
    def has_work(self):
        return bool(self.submitted)

    def submit(self, key, new_ids, max_new_tokens):
        self.submitted.append(key)

    def step(self):
        # the engine calls the processor and the pause hook with its own key (what the sampling draws are keyed by)
        logits = self.processor(self.submitted[-1], [], torch.zeros(3))
        paused = self.pause(self.submitted[-1], [])
        return [(self.submitted[-1], Generation((int(logits.argmax()),), (0.0,), "pause" if paused else "stop"))]

    def release(self, key):
        self.released.append(key)


class _Policy:
    def __init__(self):
        self.sessions = []

    def generate(self, prompts, sampling, logits_processor=None):
        return []

    def load_weights(self, state):
        pass

    @contextlib.contextmanager
    def session(self, sampling, logits_processor=None, *, max_sequences, max_tokens, pause=None):
        self.sessions.append(_RecordingSession(logits_processor, pause))
        yield self.sessions[-1]


def test_keyed_policy_decodes_episode_i_under_key_keys_i():
    inner = _Policy()
    seen = []

    def processor(row, generated, logits):  # the scheduler's processors index their own rows
        seen.append(row)
        return torch.tensor([0.0, 0.0, 1.0]) if row == 1 else logits

    with KeyedSessionPolicy(inner, [8, 9, 12]).session(SamplingParams(), processor, max_sequences=3, max_tokens=9,
                                                       pause=lambda row, ids: row == 1) as s:
        s.submit(1, [5, 6], 4)
        [(key, gen)] = s.step()
        s.release(1)
    engine = inner.sessions[0]
    assert engine.submitted == [9] and engine.released == [9]  # the engine (and its sampler) sees the step index
    assert key == 1 and seen == [1]  # results and processor rows come back as the scheduler's index
    assert gen.token_ids == (2,) and gen.finish_reason == "pause"
    with pytest.raises(ValueError, match="distinct"):
        KeyedSessionPolicy(inner, [1, 1])


def test_ray_backend_without_ray_is_one_clear_error(monkeypatch):
    config = build_config(overrides=["rollout.backend=ray"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(BadInputError, match=r"rollout.backend=ray needs Ray: pip install 'agentgrad\[ray\]'"):
        check_rollout_backend(config)
    check_rollout_backend(build_config())  # the default (local) backend never looks for Ray


def test_ray_backend_refuses_the_factored_head(monkeypatch):
    json_spec = importlib.util.find_spec("json")  # stands in for an installed ray
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: json_spec)
    config = build_config(overrides=["rollout.backend=ray", "rollout.action_head=factored"])
    with pytest.raises(BadInputError, match="action_head=tokens only"):
        check_rollout_backend(config)
