"""The rollout loop's per-token logits processor (the tool-name mask of `rollout/constrained.py`) inside vLLM's V1
sampler, for the in-process engine (`VLLMPolicy`). Imported only once vLLM is: it subclasses vLLM's class.

vLLM 0.32 takes custom logits processors as classes when the engine is built (`LLM(logits_processors=[...])`,
vllm/v1/sample/logits_processor/__init__.py: `build_logitsprocs`), one instance over the persistent batch, told of
every request that joins it (`update_state`). `AdapterLogitsProcessor` turns that into a callable per request on
(its output ids so far, its logits row). A request names its processor in `SamplingParams.extra_args`: the key of
one `generate` call in `_ACTIVE` (this process's table of the calls in flight) and its row. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the callable is ours and the rules it applies are recorded
where the loop reads them (`EpisodeMasks.token_masks`), as with the HF engine.

Which distribution comes back: the processor is not argmax-invariant, so the sampler applies it to the float32
logits before the greedy argmax, the temperature and top-p (vllm/v1/sample/sampler.py: `forward` calls
`apply_logits_processors`, then `sample`), and `logprobs_mode="processed_logprobs"` reports the log-softmax of
the masked logits: the renormalised distribution over the legal set, the one the HF engine reports and the learner
scores (`algos.masked_token_logprobs`). Masking by -inf before the temperature (vLLM) or after it (HF,
`algos.sampling.next_token_logprobs`) gives the same distribution.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from vllm import SamplingParams as VSampling
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from agentgrad.backends.base import LogitsProcessor

EXTRA_ARG = "agentgrad_logits_processor"  # SamplingParams.extra_args key: [call key, row]
_ACTIVE: dict[int, LogitsProcessor] = {}  # call key -> the processor of a `generate` call in flight
_CALLS = itertools.count()


@contextmanager
def registered(processor: LogitsProcessor) -> Iterator[int]:
    """`processor` reachable from the engine under the returned key for the duration of one `generate` call."""
    key = next(_CALLS)
    _ACTIVE[key] = processor
    try:
        yield key
    finally:
        del _ACTIVE[key]


class RowLogitsProcessor(AdapterLogitsProcessor):
    """vLLM's side: each request that carries `EXTRA_ARG` gets its call's processor, bound to its row."""

    def is_argmax_invariant(self) -> bool:
        return False  # a mask changes the greedy choice: vLLM must apply it before argmax

    def new_req_logits_processor(self, params: VSampling) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        named = (params.extra_args or {}).get(EXTRA_ARG)
        if named is None:
            return None
        key, row = named
        processor = _ACTIVE[key]  # registered by `generate` before the request was added

        def request(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:  # logits (V,)
            return processor(row, output_ids, logits)

        return request
