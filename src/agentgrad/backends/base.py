"""Policy (inference) and Learner (training) protocols. Backends: hf today; vllm, fsdp, deepspeed, ray later."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from agentgrad.batch import TokenBatch

# (row index in the batch, generated-so-far ids of that row, logits (V,)) -> logits with illegal ids at -inf.
LogitsProcessor = Callable[[int, Sequence[int], torch.Tensor], torch.Tensor]
# (sequence key, ids generated so far this turn) -> True to end the turn there, before sampling the next token
# (finish_reason "pause"): a decision point for an action head (rollout.action_head=factored).
# `submit(key, ids, n)` then continues the turn.
PauseFn = Callable[[Hashable, Sequence[int]], bool]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not (0 < self.top_p <= 1) or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params: {self}")


@dataclass(frozen=True)
class Generation:
    """Sampled ids (including the stop token when one was produced) and their logprobs under the sampling
    distribution (temperature- and mask-adjusted), so PPO ratios are exact."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length" | "pause" (a session's `pause` ended the turn at a decision point)


@runtime_checkable
class Policy(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> list[Generation]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...


class DecodeSession(Protocol):
    """Incremental generation over keyed sequences that live across turns (continuous batching).

    `submit` appends ids to sequence `key`'s context (its prompt the first time, later the observation after the
    turn it generated) and queues one more turn of at most `max_new_tokens`; `step` advances every queued or
    generating sequence by one token and returns the turns that finished; `release` frees the sequence.
    A sequence's context is never re-encoded: the backend keeps its KV cache between turns.
    Sampling randomness is keyed by (seed, key, position), so results do not depend on which sequences share
    a step; the logits processor is called with `key` as its row index and the ids of the current turn.
    """

    @property
    def has_work(self) -> bool: ...

    def submit(self, key: Hashable, new_ids: Sequence[int], max_new_tokens: int) -> None: ...

    def step(self) -> list[tuple[Hashable, Generation]]: ...

    def release(self, key: Hashable) -> None: ...


@runtime_checkable
class SessionPolicy(Policy, Protocol):
    """A Policy that can also decode incrementally. Backends without it run through the same rollout scheduler,
    `generate` seen as a session by `backends/generate_session.py: GenerateSession`. `max_batch` (optional: passed
    only when set) is the most sequences that generate at once, when fewer than `max_sequences` (the others wait
    on tools, their caches kept)."""

    def session(self, sampling: SamplingParams, logits_processor: LogitsProcessor | None = None, *,
                max_sequences: int, max_tokens: int, pause: PauseFn | None = None,
                max_batch: int | None = None) -> AbstractContextManager[DecodeSession]:
        ...


@runtime_checkable
class Learner(Protocol):
    def logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor: ...  # (B, T)

    def step(self, loss: torch.Tensor) -> Mapping[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
