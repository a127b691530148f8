"""A session policy whose sequences are keyed by ids the caller chooses: a shard of a rollout samples exactly as
the whole rollout would.

The rollout scheduler keys each episode by its index in the batch it runs, and a session draws each token from
(seed, key, position). A Ray rollout worker runs a shard of the step's episodes; wrapped here, its episode i
decodes under key `keys[i]` (its index in the whole step), so its random draws are those the in-process runner
makes for that episode. Logits processors and the pause hook still see the scheduler's own indices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence

import torch

from agentgrad.backends.base import (
    DecodeSession,
    Generation,
    LogitsProcessor,
    PauseFn,
    SamplingParams,
    SessionPolicy,
)


class KeyedSession:
    """`inner` with local key i sent as `keys[i]`, and results mapped back."""

    def __init__(self, inner: DecodeSession, keys: Sequence[int]) -> None:
        self.inner, self.keys = inner, list(keys)
        self.local = {k: i for i, k in enumerate(self.keys)}

    @property
    def has_work(self) -> bool:
        return self.inner.has_work

    def submit(self, key: Hashable, new_ids: Sequence[int], max_new_tokens: int) -> None:
        self.inner.submit(self.keys[key], new_ids, max_new_tokens)

    def step(self) -> list[tuple[Hashable, Generation]]:
        return [(self.local[k], gen) for k, gen in self.inner.step()]

    def release(self, key: Hashable) -> None:
        self.inner.release(self.keys[key])


class KeyedSessionPolicy:
    """A `SessionPolicy` over `inner` whose session keys episode i as `keys[i]` (distinct ints)."""

    def __init__(self, inner: SessionPolicy, keys: Sequence[int]) -> None:
        if len(set(keys)) != len(keys):
            raise ValueError("session keys must be distinct")
        self.inner, self.keys = inner, list(keys)
        self.local = {k: i for i, k in enumerate(self.keys)}

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> list[Generation]:
        return self.inner.generate(prompts, sampling, logits_processor)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        self.inner.load_weights(state)

    @contextlib.contextmanager
    def session(self, sampling: SamplingParams, logits_processor: LogitsProcessor | None = None, *,
                max_sequences: int, max_tokens: int, pause: PauseFn | None = None) -> Iterator[DecodeSession]:
        local = self.local
        processor = None if logits_processor is None else (
            lambda row, generated, logits: logits_processor(local[row], generated, logits))
        pause_kw = {} if pause is None else {"pause": lambda key, ids: pause(local[key], ids)}
        with self.inner.session(sampling, processor, max_sequences=max_sequences, max_tokens=max_tokens,
                                **pause_kw) as session:
            yield KeyedSession(session, self.keys)
