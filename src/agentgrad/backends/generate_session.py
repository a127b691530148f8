"""A `generate`-only Policy as a `DecodeSession`, so the rollout scheduler has one shape for every backend.

A backend that only offers `Policy.generate` (a third party's, or a wrapper around one) still runs through the
same scheduler as `HFPolicy`'s engine: `GenerateSession` keeps each sequence's whole context (nothing is cached,
so every turn re-reads its prefix) and each `step` is one `generate` call over every queued sequence, which
finishes them all. It cannot `pause` (no hidden state comes back from `generate`), so a factored action head
needs a real session.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Sequence

from agentgrad.backends.base import (
    DecodeSession,
    Generation,
    LogitsProcessor,
    PauseFn,
    Policy,
    SamplingParams,
    SessionPolicy,
)


class GenerateSession:
    """`DecodeSession` over `policy.generate`. Rows are the queued sequences in submission order; the logits
    processor sees each row's key, as a session's does. Step n is seeded `sampling.seed + n`: a seeded rollout
    repeats when its steps hold the same sequences (the scheduler drains tool calls after every step of this
    session, so they do), since a `generate` backend keys its randomness by row, not by sequence."""

    def __init__(self, policy: Policy, sampling: SamplingParams, logits_processor: LogitsProcessor | None) -> None:
        self.policy, self.sampling, self.logits_processor = policy, sampling, logits_processor
        self.context: dict[Hashable, list[int]] = {}  # key -> prompt, turns and observations so far
        self.queued: dict[Hashable, int] = {}  # key -> max_new_tokens of its next turn, in submission order
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.queued)

    def submit(self, key: Hashable, new_ids: Sequence[int], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if key in self.queued:
            raise RuntimeError(f"sequence {key!r} is still generating")
        if not self.context.get(key) and not new_ids:
            raise ValueError("cannot generate from an empty prompt")
        self.context.setdefault(key, []).extend(new_ids)
        self.queued[key] = max_new_tokens

    def step(self) -> list[tuple[Hashable, Generation]]:
        keys = list(self.queued)
        seed = None if self.sampling.seed is None else self.sampling.seed + self.steps
        processor = None if self.logits_processor is None else (
            lambda row, generated, logits: self.logits_processor(keys[row], generated, logits))
        generations = self.policy.generate([self.context[k] for k in keys],
                                           dataclasses.replace(self.sampling, seed=seed), processor)
        self.steps += 1
        finished = []
        for key, gen in zip(keys, generations):
            gen = _cut(gen, self.queued.pop(key))
            self.context[key].extend(gen.token_ids)
            finished.append((key, gen))
        return finished

    def release(self, key: Hashable) -> None:
        self.context.pop(key, None)
        self.queued.pop(key, None)


def _cut(gen: Generation, max_new_tokens: int) -> Generation:
    """A row's own turn budget: one `generate` call asks every row for the session's `max_new_tokens`."""
    if len(gen.token_ids) <= max_new_tokens:
        return gen
    return Generation(gen.token_ids[:max_new_tokens], gen.logprobs[:max_new_tokens], "length")


def open_session(policy: Policy, sampling: SamplingParams, logits_processor: LogitsProcessor | None = None, *,
                 max_sequences: int, max_tokens: int, pause: PauseFn | None = None,
                 max_batch: int | None = None) -> contextlib.AbstractContextManager[DecodeSession]:
    """The policy's own session when it has one (`SessionPolicy`), else a `GenerateSession` over `generate`."""
    if isinstance(policy, SessionPolicy):
        # A third party's session may take neither `pause` nor `max_batch`: passed only when set.
        extra = {k: v for k, v in (("pause", pause), ("max_batch", max_batch)) if v is not None}
        return policy.session(sampling, logits_processor, max_sequences=max_sequences, max_tokens=max_tokens,
                              **extra)
    if pause is not None:
        raise ValueError("pausing a turn needs a policy with incremental sessions (e.g. HFPolicy), not `generate`")
    return contextlib.nullcontext(GenerateSession(policy, sampling, logits_processor))
