"""LLM-as-judge rewards.

A judge is a backend (anything with `complete(messages) -> str`: an OpenAI-compatible HTTP endpoint, a local
model, a plain function) plus a rubric (jinja2 templates for the chat messages). The reply is parsed into a
score in [0, 1] ("VERDICT: PASS" / "VERDICT: FAIL", or a JSON object {"score": ...}); a reply that cannot be
parsed, or a backend that fails, masks the sample (never a silent 0). Verdicts are cached by a hash of the
judge's identity and the exact messages, in memory and optionally in a JSONL file shared across runs.

A judge must be calibrated against human labels before it may shape training: see
`agentgrad.rewards.calibration` (`calibrate`, `require_calibrated`) and `judge_reward`.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from agentgrad.registry import Registry
from agentgrad.rewards.base import REWARDS, masked
from agentgrad.types import RewardBreakdown, Trajectory

Messages = list[dict[str, str]]


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


# ---- rubrics -----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _template(source: str):
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             autoescape=False, keep_trailing_newline=False)
    return env.from_string(source)


@dataclass(frozen=True)
class Rubric:
    """Jinja2 templates for the judge's system and user messages. Variables: `prompt` (the task), `response`
    (the agent's final answer), `reference` (the expected answer or None), `transcript` (the episode as text,
    or None) and `criteria` (extra instructions, may be empty)."""

    name: str
    user: str
    system: str = ""

    def render(self, **context: Any) -> Messages:
        ctx = {"prompt": "", "response": "", "reference": None, "transcript": None, "criteria": ""} | context
        messages = []
        if self.system:
            messages.append({"role": "system", "content": _template(self.system).render(**ctx).strip()})
        messages.append({"role": "user", "content": _template(self.user).render(**ctx).strip()})
        return messages

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.system}\0{self.user}".encode()).hexdigest()[:12]


_COMMON = """\
## Task
{{ prompt }}
{% if reference %}

## Reference answer
{{ reference }}
{% endif %}
{% if transcript %}

## Agent transcript
{{ transcript }}
{% endif %}

## Agent's final answer
{{ response }}
{% if criteria %}

## Criteria
{{ criteria }}
{% endif %}
"""

PASS_FAIL = Rubric(
    "pass_fail",
    system="You are a strict grader of an AI agent's work. Judge only what is in front of you.",
    user=_COMMON + """
Does the final answer correctly and completely solve the task? Explain in at most three sentences, then end \
with exactly one line: "VERDICT: PASS" or "VERDICT: FAIL".""",
)

SCORE = Rubric(
    "score",
    system="You are a strict grader of an AI agent's work. Judge only what is in front of you.",
    user=_COMMON + """
Rate how well the final answer solves the task, from 0.0 (wrong or missing) to 1.0 (fully correct). Explain in \
at most three sentences, then end with a JSON object on its own line: {"score": <number between 0 and 1>}.""",
)

RUBRICS: Registry[Rubric] = Registry("judge rubric")
RUBRICS.add("pass_fail", PASS_FAIL)
RUBRICS.add("score", SCORE)


# ---- verdicts ----------------------------------------------------------------------------------------------

_VERDICT = re.compile(r"VERDICT\s*[:=]\s*[*_`\"']*\s*(PASS|FAIL)\b", re.IGNORECASE)
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_WORD_SCORES = {"pass": 1.0, "fail": 0.0, "yes": 1.0, "no": 0.0, "true": 1.0, "false": 0.0}


def _json_score(obj: Any, score_max: float) -> float | None:
    if not isinstance(obj, dict):
        return None
    for key in ("score", "verdict"):
        if key not in obj:
            continue
        v = obj[key]
        if isinstance(v, bool):
            return 1.0 if v else 0.0
        if isinstance(v, str):
            word = v.strip().lower()
            if word in _WORD_SCORES:
                return _WORD_SCORES[word]
            try:
                v = float(word)
            except ValueError:
                return None
        if isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= score_max:
            return float(v) / score_max
        return None
    return None


def parse_verdict(text: str | None, *, score_max: float = 1.0) -> float | None:
    """A judge's reply -> score in [0, 1], or None when there is no clear verdict.

    The last "VERDICT: PASS|FAIL" line wins; otherwise the last JSON object with a "score" (a number in
    [0, score_max], divided by score_max) or a "verdict" ("pass"/"fail").

    >>> parse_verdict("Correct arithmetic.\\nVERDICT: PASS")
    1.0
    >>> parse_verdict('reasoning... {"score": 7}', score_max=10)
    0.7
    >>> parse_verdict('{"score": 1.5}') is None  # out of range: not a verdict
    True
    >>> parse_verdict("I am not sure.") is None
    True
    """
    if not text:
        return None
    found = _VERDICT.findall(text)
    if found:
        return 1.0 if found[-1].upper() == "PASS" else 0.0
    try:  # the whole reply may be one (possibly nested) JSON object
        value = _json_score(json.loads(text), score_max)
        if value is not None:
            return value
    except ValueError:
        pass
    for candidate in reversed(_JSON_OBJECT.findall(text)):
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        value = _json_score(obj, score_max)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class JudgeVerdict:
    """`score` in [0, 1], or None when the judge failed (`error` says why). `cached`: served from the cache."""

    score: float | None
    reply: str | None = None
    cached: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.score is not None

    def passed(self, threshold: float = 0.5) -> bool:
        return self.score is not None and self.score >= threshold


class VerdictCache:
    """Parsed verdicts by content hash: in memory, and appended to a JSONL file when `path` is given (loaded
    back on start, so a re-run or another process reuses them). Corrupt lines are skipped and counted.
    Thread-safe. Only parsed verdicts are stored: a failure is retried next time."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._mem: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.bad_lines = 0
        if self.path is not None and self.path.exists():
            with self.path.open(encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        score = float(rec["score"])
                        if not (isinstance(rec["key"], str) and 0.0 <= score <= 1.0):
                            raise ValueError("bad record")
                    except (ValueError, KeyError, TypeError):
                        self.bad_lines += 1
                        continue
                    self._mem[rec["key"]] = {"score": score, "reply": rec.get("reply")}

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._mem.get(key)
            if rec is None:
                self.misses += 1
            else:
                self.hits += 1
            return rec

    def put(self, key: str, score: float, reply: str | None) -> None:
        with self._lock:
            self._mem[key] = {"score": score, "reply": reply}
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"key": key, "score": score, "reply": reply}, ensure_ascii=False) + "\n")

    def __len__(self) -> int:
        return len(self._mem)

    def __contains__(self, key: object) -> bool:
        return key in self._mem


# ---- what the judge sees -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeInput:
    prompt: str
    response: str
    reference: str | None = None
    transcript: str | None = None


def _call_text(name: Any, arguments: Any) -> str:
    args = arguments
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if isinstance(args, dict):
        args = {k: v for k, v in args.items() if k != "__type__"}
    return f"[call {name} {json.dumps(args, ensure_ascii=False, sort_keys=True, default=str)}]"


def render_transcript(messages: Iterable[Any], *, max_chars: int = 6000) -> str:
    """Messages (`Message` records or their dict form) as "role: text" lines, system messages skipped, tool
    calls shown as `[call name {args}]`. Longer than `max_chars`: the beginning is cut."""
    lines = []
    for m in messages:
        if isinstance(m, Mapping):
            role, content, calls = m.get("role", "?"), m.get("content") or "", m.get("tool_calls") or []
        else:
            role, content, calls = m.role, m.content, m.tool_calls
        if role == "system":
            continue
        parts = [content.strip()] if content and content.strip() else []
        for c in calls:
            if isinstance(c, Mapping):
                fn = c.get("function", c)
                parts.append(_call_text(fn.get("name"), fn.get("arguments")))
            else:
                parts.append(_call_text(c.name, dict(c.arguments)))
        lines.append(f"{role}: {' '.join(parts)}")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else "[...]\n" + text[-max_chars:]


def _final_answer_of_record(traj: Mapping[str, Any]) -> str | None:
    for turn in reversed(traj.get("turns") or []):
        action = turn.get("action") if isinstance(turn, Mapping) else None
        if isinstance(action, Mapping) and action.get("__type__") == "FinalAnswer":
            return action.get("text")
    for m in reversed(traj.get("messages") or []):
        if isinstance(m, Mapping) and m.get("role") == "assistant" and m.get("content") and not m.get("tool_calls"):
            return m["content"]
    return traj.get("final_answer") or traj.get("response")


def judge_input(item: Trajectory | Mapping[str, Any] | JudgeInput, *, include_reference: bool = True,
                include_transcript: bool = True, max_transcript_chars: int = 6000) -> JudgeInput:
    """What the judge sees, from a `Trajectory`, a labelled record ({"prompt", "response", "reference"?} or
    {"trajectory": <Trajectory | store record dict | transcript string>}) or a `JudgeInput`."""
    if isinstance(item, JudgeInput):
        return item
    if isinstance(item, Trajectory):
        answer = item.final_answer
        return JudgeInput(
            prompt=item.task.prompt,
            response=answer if answer is not None else "(no final answer)",
            reference=item.task.answer if include_reference else None,
            transcript=render_transcript(item.messages, max_chars=max_transcript_chars)
            if include_transcript and item.messages else None)
    if not isinstance(item, Mapping):
        raise TypeError(f"cannot build a judge input from {type(item).__name__}")
    traj = item.get("trajectory")
    if isinstance(traj, Trajectory):
        return judge_input(traj, include_reference=include_reference, include_transcript=include_transcript,
                           max_transcript_chars=max_transcript_chars)
    if isinstance(traj, Mapping):
        if isinstance(traj.get("trajectory"), Mapping):  # a ScoredTrajectory record from the store
            traj = traj["trajectory"]
        task = traj.get("task") if isinstance(traj.get("task"), Mapping) else {}
        prompt = item.get("prompt") or task.get("prompt") or traj.get("prompt") or ""
        response = item.get("response") or _final_answer_of_record(traj)
        reference = item.get("reference", task.get("answer"))
        messages = traj.get("messages") or []
        transcript = (render_transcript(messages, max_chars=max_transcript_chars)
                      if include_transcript and messages else None)
    elif isinstance(traj, str):
        prompt, response = item.get("prompt") or "", item.get("response")
        reference, transcript = item.get("reference"), traj if include_transcript else None
    elif traj is None:
        if "prompt" not in item or "response" not in item:
            raise ValueError("a judge record needs 'trajectory', or 'prompt' and 'response'")
        prompt, response = item["prompt"], item["response"]
        reference, transcript = item.get("reference"), item.get("transcript") if include_transcript else None
    else:
        raise TypeError(f"'trajectory' must be an object or a string, got {type(traj).__name__}")
    return JudgeInput(prompt=str(prompt), response=str(response) if response is not None else "(no final answer)",
                      reference=None if not include_reference or reference is None else str(reference),
                      transcript=transcript)


# ---- the judge ---------------------------------------------------------------------------------------------


class Judge:
    """A backend plus a rubric: renders the messages, asks (or reuses a cached verdict), parses the reply.

    `cache`: True (in memory, the default), False (none), a path (in memory + JSONL file) or a `VerdictCache`.
    `judge_id` names the (model, rubric) pair for calibration reports and cache keys; by default
    "<backend name>|<rubric name>@<digest of rubric, criteria, score_max and what the judge is shown>", so a
    changed prompt needs a new calibration.
    """

    def __init__(self, backend: JudgeBackend | Callable[[Sequence[Mapping[str, str]]], str],
                 rubric: str | Rubric = "pass_fail", *, cache: bool | str | Path | VerdictCache = True,
                 judge_id: str | None = None, criteria: str = "", score_max: float = 1.0,
                 include_reference: bool = True, include_transcript: bool = True,
                 max_transcript_chars: int = 6000) -> None:
        self.backend = as_backend(backend)
        self.rubric = RUBRICS.get(rubric) if isinstance(rubric, str) else rubric
        if isinstance(cache, VerdictCache):
            self.cache: VerdictCache | None = cache
        elif cache is True:
            self.cache = VerdictCache()
        elif cache is False or cache is None:
            self.cache = None
        else:
            self.cache = VerdictCache(cache)
        if not (score_max > 0 and math.isfinite(score_max)):
            raise ValueError(f"score_max must be positive, got {score_max}")
        self.criteria = criteria
        self.score_max = float(score_max)
        self.include_reference = include_reference
        self.include_transcript = include_transcript
        self.max_transcript_chars = max_transcript_chars
        what = f"{self.rubric.digest}\0{criteria}\0{score_max:g}\0{int(include_reference)}{int(include_transcript)}"
        digest = hashlib.sha256(what.encode()).hexdigest()[:8]
        backend_name = getattr(self.backend, "name", None) or type(self.backend).__name__
        self.judge_id = judge_id or f"{backend_name}|{self.rubric.name}@{digest}"
        self.requests = 0  # calls that reached the backend
        self._count_lock = threading.Lock()

    def messages(self, inp: JudgeInput) -> Messages:
        return self.rubric.render(prompt=inp.prompt, response=inp.response, reference=inp.reference,
                                  transcript=inp.transcript, criteria=self.criteria)

    def cache_key(self, messages: Messages) -> str:
        blob = json.dumps({"judge": self.judge_id, "messages": messages}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def judge(self, item: Trajectory | Mapping[str, Any] | JudgeInput) -> JudgeVerdict:
        """Judge one trajectory / labelled record / JudgeInput. Never raises for backend or parse failures:
        they come back as a verdict with `score=None` and an `error`."""
        inp = judge_input(item, include_reference=self.include_reference,
                          include_transcript=self.include_transcript, max_transcript_chars=self.max_transcript_chars)
        messages = self.messages(inp)
        key = self.cache_key(messages)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return JudgeVerdict(score=hit["score"], reply=hit.get("reply"), cached=True)
        with self._count_lock:
            self.requests += 1
        try:
            reply = self.backend.complete(messages)
        except Exception as exc:
            return JudgeVerdict(score=None, error=f"backend failed: {type(exc).__name__}: {exc}"[:300])
        if not isinstance(reply, str):
            return JudgeVerdict(score=None, error=f"backend returned {type(reply).__name__}, not str")
        score = parse_verdict(reply, score_max=self.score_max)
        if score is None:
            snippet = " ".join(reply.split())[-120:]
            return JudgeVerdict(score=None, reply=reply, error=f"unparseable verdict: {snippet!r}")
        if self.cache is not None:
            self.cache.put(key, score, reply)
        return JudgeVerdict(score=score, reply=reply)

    def judge_many(self, items: Sequence[Trajectory | Mapping[str, Any] | JudgeInput], *,
                   max_workers: int = 4) -> list[JudgeVerdict]:
        """Judge several items, up to `max_workers` requests in flight (I/O-bound: threads suffice)."""
        if max_workers <= 1 or len(items) <= 1:
            return [self.judge(i) for i in items]
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="judge") as pool:
            return list(pool.map(self.judge, items))

    def __repr__(self) -> str:
        return f"Judge({self.judge_id!r})"


class JudgeReward:
    """A judge as a reward function: outcome = the judge's score (or, with `pass_threshold`, 1.0 if the score
    reaches it else 0.0); zeros for process rewards. A judge failure masks the sample.

    Judging is I/O-bound: call `warm(trajectories)` first to judge a whole batch concurrently into the cache,
    then `score` reads the cached verdicts.
    """

    name = "judge"

    def __init__(self, judge: Judge, *, pass_threshold: float | None = None) -> None:
        self.judge = judge
        self.pass_threshold = pass_threshold

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        verdict = self.judge.judge(trajectory)
        if verdict.score is None:
            return masked(f"judge: {verdict.error}")
        outcome = verdict.score if self.pass_threshold is None else float(verdict.score >= self.pass_threshold)
        return RewardBreakdown(outcome=outcome, process=(0.0,) * len(trajectory.turns))

    def warm(self, trajectories: Sequence[Trajectory], *, max_workers: int = 4) -> list[JudgeVerdict]:
        return self.judge.judge_many(trajectories, max_workers=max_workers)

    def __repr__(self) -> str:
        return f"JudgeReward({self.judge.judge_id!r})"


def judge_reward(*, base_url: str | None = None, model: str | None = None, backend: Any = None,
                 rubric: str | Rubric = "pass_fail", criteria: str = "", cache_path: str | Path | None = None,
                 calibration_report: str | Path | None = None, threshold: float = 0.80,
                 min_kappa: float | None = None, override: bool = False, pass_threshold: float | None = None,
                 api_key_env: str | None = None, timeout_s: float = 60.0, judge_id: str | None = None,
                 score_max: float = 1.0, hf_model: str | None = None) -> JudgeReward:
    """Build a calibrated judge reward (the registered "judge" factory, `make_judge_reward`, calls this).

    The backend is `backend` (any `JudgeBackend` or callable), a local model (`hf_model`: a directory or hub id,
    `HFChatBackend`) or an `OpenAIChatBackend(base_url, model)`.
    The judge must have a calibration report at `calibration_report` for the same judge id with accuracy
    >= `threshold` (see `require_calibrated`); otherwise `JudgeNotCalibratedError`, unless `override=True`.
    """
    from agentgrad.rewards.calibration import require_calibrated

    if backend is None and hf_model is not None:
        backend = HFChatBackend(hf_model)
    if backend is None:
        if not base_url or not model:
            raise ValueError("judge reward needs `backend`, `hf_model` (a local HF model directory), or `base_url` "
                             "and `model` of an OpenAI-compatible API")
        backend = OpenAIChatBackend(base_url, model, api_key_env=api_key_env, timeout_s=timeout_s)
    judge = Judge(backend, rubric, cache=cache_path if cache_path is not None else True, judge_id=judge_id,
                  criteria=criteria, score_max=score_max)
    require_calibrated(judge.judge_id, calibration_report, threshold=threshold, min_kappa=min_kappa,
                       override=override)
    return JudgeReward(judge, pass_threshold=pass_threshold)


def make_judge_reward(suite: Any, **options: Any) -> JudgeReward:
    """Registered as "judge": `REWARDS.get("judge")(suite, base_url=..., model=..., calibration_report=...,
    threshold=0.8, override=False)`. `suite` is unused; the options are `judge_reward`'s. Building it does not
    contact the endpoint, but it applies the calibration gate (`JudgeNotCalibratedError`)."""
    return judge_reward(**options)


REWARDS.add("judge", make_judge_reward)
