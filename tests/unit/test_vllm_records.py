"""The vLLM backends' pure pieces (no vllm needed): per-row seeds and reading a server's completion choice."""

from __future__ import annotations

import pytest

from agentgrad.backends.vllm_policy import row_seed
from agentgrad.backends.vllm_server import _generation


def test_rows_get_distinct_seeds_and_unseeded_stays_unseeded():
    assert row_seed(None, 3) is None
    # seed 7: 7 * 1_000_003 + row
    assert [row_seed(7, b) for b in range(3)] == [7_000_021, 7_000_022, 7_000_023]
    assert row_seed(8, 0) != row_seed(7, 1)


def test_a_server_choice_becomes_a_generation():
    choice = {"token_ids": [5, 9, 2], "finish_reason": "stop",
              "logprobs": {"tokens": ["token_id:5", "token_id:9", "token_id:2"], "token_logprobs": [-0.5, -1.25, 0.0]}}
    gen = _generation(choice)
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ((5, 9, 2), (-0.5, -1.25, 0.0), "stop")
    assert _generation({**choice, "finish_reason": "length"}).finish_reason == "length"
    with pytest.raises(RuntimeError, match="3 ids with 2 logprobs"):
        _generation({**choice, "logprobs": {"token_logprobs": [-0.5, -1.25]}})
