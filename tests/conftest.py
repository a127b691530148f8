"""Shared fixtures: a tiny tokenizer + model built locally (never downloaded)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def arithmetic_suite():
    from agentgrad.envs import SUITES

    return SUITES.get("arithmetic")()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, arithmetic_suite):
    """The embedded default model (untrained), built exactly as `agentgrad train` builds it."""
    from agentgrad.config import build_config
    from agentgrad.pipelines.components import build_tiny_model_dir

    config = build_config(overrides=["model.tiny.tokenizer_corpus_episodes=100"])
    return build_tiny_model_dir(config, arithmetic_suite, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model_dir):
    from agentgrad.models.hf import load_model

    return load_model(tiny_model_dir)


@pytest.fixture()
def codec(loaded_tiny):
    from agentgrad.rollout.chat import ChatCodec

    return ChatCodec(loaded_tiny.tokenizer, loaded_tiny.eos_token_ids)


@pytest.fixture()
def printed_display():
    """A disabled ProgressDisplay that keeps what a run prints (its `warning:` lines) in `.printed`."""
    from agentgrad.logging import ProgressDisplay

    class PrintedDisplay(ProgressDisplay):
        def __init__(self):
            super().__init__(enabled=False)
            self.printed: list[str] = []

        def print(self, message):
            self.printed.append(message)

    return PrintedDisplay()
