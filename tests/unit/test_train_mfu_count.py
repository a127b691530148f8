"""benchmarks/train_mfu.py counts the FLOPs of the tokens the learner really runs, each at its own context: a
shared prefix skips the early, short-context tokens, so a mean context over all tokens would undercount."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

from agentgrad.batch import TokenBatch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_mfu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(ids: list[list[int]], group_index: list[int]) -> TokenBatch:
    input_ids = torch.tensor(ids)  # (B, T), 0 is padding here
    zeros = torch.zeros(input_ids.shape)
    return TokenBatch(input_ids=input_ids, attention_mask=(input_ids != 0).long(), loss_mask=zeros,
                      old_logprobs=zeros, token_rewards=zeros, group_index=torch.tensor(group_index))


def test_shared_prefix_tokens_are_counted_once_each_at_its_own_position() -> None:
    mfu = load_script()
    # one group of two rows agreeing on 3 tokens: the prefix (positions 0-2) runs once, then row 0's positions 3-4
    # and row 1's position 3; causal keys 1+2+3, then 4+5, then 4
    mb = batch([[5, 6, 7, 8, 9], [5, 6, 7, 3, 0]], [0, 0])
    learner = SimpleNamespace(lean=object(), max_buckets=4, continuation_buckets=lambda plan: [torch.arange(2)])
    trained, ran, _, keys = mfu.computed_tokens(learner, mb)
    assert (trained, ran, keys) == (9, 6, 6 + 9 + 4)


def test_rows_without_a_shared_prefix_count_every_token() -> None:
    mfu = load_script()
    mb = batch([[5, 6, 7, 8], [1, 2, 0, 0]], [0, 1])  # two groups of one row: the plain forward
    learner = SimpleNamespace(lean=object(), max_buckets=4, continuation_buckets=lambda plan: [torch.arange(2)])
    trained, ran, _, keys = mfu.computed_tokens(learner, mb)
    assert (trained, ran, keys) == (6, 6, (1 + 2 + 3 + 4) + (1 + 2))


def test_model_flops_are_six_n_per_token_plus_twelve_layers_width_per_key() -> None:
    mfu = load_script()
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=4, vocab_size=10, num_hidden_layers=2),
                            get_input_embeddings=lambda: SimpleNamespace(weight=torch.zeros(10, 4)),
                            parameters=lambda: [torch.zeros(10, 4), torch.zeros(3, 4)])
    # N = 52 - 40 (embedding) + 40 (the tied head's V x H matmul) = 52
    assert mfu.model_flops(model, tokens=2, keys=5) == 6 * 52 * 2 + 12 * 2 * 4 * 5
