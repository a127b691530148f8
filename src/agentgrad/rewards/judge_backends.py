"""Judge backends: anything with `complete(messages) -> str`. An OpenAI-compatible HTTP endpoint (stdlib urllib),
a local Hugging Face model, or a plain function. No torch at import time (the local model imports it on use).
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class JudgeBackend(Protocol):
    """Anything that answers a chat: `complete([{"role": ..., "content": ...}, ...]) -> reply text`.
    Optional attribute `name` identifies the model (it is part of the judge's id and of cache keys)."""

    def complete(self, messages: Sequence[Mapping[str, str]]) -> str: ...


class JudgeBackendError(RuntimeError):
    """The backend could not produce a reply (HTTP error, timeout, malformed response)."""


_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OpenAIChatBackend:
    """An OpenAI-compatible chat endpoint: POST {base_url}/v1/chat/completions (stdlib urllib, no extra deps).

    `base_url` may or may not end in "/v1". The API key, if any, comes from `api_key` or the environment
    variable named by `api_key_env` (never read implicitly, so a key is not sent to an endpoint by accident).
    Transient failures (connection errors, timeouts, 408/429/5xx) are retried `max_retries` times with
    exponential backoff; then `JudgeBackendError`. Loopback URLs bypass any configured HTTP proxy.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, api_key_env: str | None = None,
                 timeout_s: float = 60.0, temperature: float = 0.0, max_tokens: int | None = 512,
                 max_retries: int = 2, retry_backoff_s: float = 0.5,
                 extra_body: Mapping[str, Any] | None = None) -> None:
        import os

        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self._api_key = api_key if api_key is not None else (os.environ.get(api_key_env) if api_key_env else None)
        self.timeout_s = timeout_s
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.extra_body = dict(extra_body or {})
        self.name = f"openai:{model}" + (f":t={temperature:g}" if temperature else "")
        handlers = [urllib.request.ProxyHandler({})] if _is_loopback(self.url) else []
        self._opener = urllib.request.build_opener(*handlers)

    def complete(self, messages: Sequence[Mapping[str, str]]) -> str:
        body: dict[str, Any] = {"model": self.model, "messages": [dict(m) for m in messages],
                                "temperature": self.temperature, **self.extra_body}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    payload = resp.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                last = f"HTTP {exc.code} from {self.url}: {detail}"
                if exc.code in _RETRY_STATUS:
                    continue
                raise JudgeBackendError(last) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}"
                continue
            try:
                content = json.loads(payload)["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise JudgeBackendError(f"malformed chat completion from {self.url}: {exc!r}") from None
            return content or ""
        raise JudgeBackendError(last + f" (after {self.max_retries + 1} attempts)")

    def __repr__(self) -> str:
        return f"OpenAIChatBackend({self.url!r}, model={self.model!r})"


class CallableBackend:
    """A local callable `fn(messages) -> str` as a judge backend (a local HF model, a test double, ...)."""

    def __init__(self, fn: Callable[[Sequence[Mapping[str, str]]], str], *, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def complete(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.fn(messages)


class HFChatBackend:
    """A local Hugging Face causal LM as the judge: the model's own chat template renders the rubric, greedy
    decoding writes the verdict. `model` is a directory or hub id (loaded on first use, so building a reward
    that is refused by the calibration gate loads nothing) or an already loaded `(model, tokenizer)` pair.

    Decoding is greedy, so a verdict is a function of the messages and the weights: the content-hash cache and
    a stored calibration report stay valid for as long as the weights do.
    """

    def __init__(self, model: str | Path | tuple[Any, Any], *, max_new_tokens: int = 64, device: str = "cpu",
                 name: str | None = None) -> None:
        self._source = model
        self._pair: tuple[Any, Any] | None = model if isinstance(model, tuple) else None
        self.max_new_tokens = max_new_tokens
        self.device = device
        self.name = name or (f"hf:{model}" if not isinstance(model, tuple) else f"hf:{type(model[0]).__name__}")
        self._lock = threading.Lock()  # one generate at a time: judge_many's threads share the model

    def _load(self) -> tuple[Any, Any]:
        if self._pair is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self._source))
            model = AutoModelForCausalLM.from_pretrained(str(self._source)).to(self.device).eval()
            self._pair = (model, tokenizer)
        return self._pair

    def complete(self, messages: Sequence[Mapping[str, str]]) -> str:
        import torch

        with self._lock:
            model, tokenizer = self._load()
            ids = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding whatever return_dict says
                ids = ids["input_ids"]
            input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # (1, T)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            with torch.no_grad():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                     max_new_tokens=self.max_new_tokens, pad_token_id=pad)  # (1, T + new)
            return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFChatBackend({self.name!r})"


def as_backend(obj: Any) -> JudgeBackend:
    """A backend as is, or a plain callable wrapped in `CallableBackend`."""
    if hasattr(obj, "complete"):
        return obj
    if callable(obj):
        return CallableBackend(obj)
    raise TypeError(f"a judge backend needs complete(messages) -> str, got {type(obj).__name__}")
