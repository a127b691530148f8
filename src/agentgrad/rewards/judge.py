"""LLM-as-judge rewards.

A judge is a backend (anything with `complete(messages) -> str`: an OpenAI-compatible HTTP endpoint, a local
model, a plain function) plus a rubric (jinja2 templates for the chat messages). The reply is parsed into a
score in [0, 1] ("VERDICT: PASS" / "VERDICT: FAIL", or a JSON object {"score": ...}); a reply that cannot be
parsed, or a backend that fails, masks the sample (never a silent 0). Verdicts are cached by a hash of the
judge's identity and the exact messages, in memory and optionally in a JSONL file shared across runs.

A judge reads a `Trajectory` (`judge_input` says what of it). Backends are in `rewards.judge_backends`; a judge
must be calibrated against human labels before it may shape training: `rewards.calibration` (`calibrate`,
`require_calibrated`), and the registered "judge" reward that applies that gate is `rewards.judge_factory`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrad.registry import Registry
from agentgrad.rewards.base import masked
from agentgrad.rewards.judge_backends import JudgeBackend, as_backend
from agentgrad.types import Message, RewardBreakdown, ToolCall, Trajectory

Messages = list[dict[str, str]]


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


def _call_text(call: ToolCall) -> str:
    args = {k: v for k, v in call.arguments.items() if k != "__type__"}
    return f"[call {call.name} {json.dumps(args, ensure_ascii=False, sort_keys=True, default=str)}]"


def render_transcript(messages: Iterable[Message], *, max_chars: int = 6000) -> str:
    """Messages as "role: text" lines, system messages skipped, tool calls shown as `[call name {args}]`.
    Longer than `max_chars`: the beginning is cut."""
    lines = []
    for m in messages:
        if m.role == "system":
            continue
        parts = [m.content.strip()] if m.content and m.content.strip() else []
        parts += [_call_text(c) for c in m.tool_calls]
        lines.append(f"{m.role}: {' '.join(parts)}")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else "[...]\n" + text[-max_chars:]


def judge_input(trajectory: Trajectory, *, include_reference: bool = True, include_transcript: bool = True,
                max_transcript_chars: int = 6000) -> JudgeInput:
    """What the judge sees of a trajectory: the task, its final answer, the reference answer (the task's, if
    any) and the transcript (its messages, if any). Labelled records become trajectories in
    `rewards.calibration.labelled_trajectory`."""
    answer = trajectory.final_answer
    transcript = None
    if include_transcript and trajectory.messages:
        transcript = render_transcript(trajectory.messages, max_chars=max_transcript_chars)
    return JudgeInput(prompt=trajectory.task.prompt,
                      response=answer if answer is not None else "(no final answer)",
                      reference=(trajectory.task.answer or None) if include_reference else None,
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

    def judge(self, trajectory: Trajectory) -> JudgeVerdict:
        """Judge one trajectory. Never raises for backend or parse failures: they come back as a verdict with
        `score=None` and an `error`."""
        inp = judge_input(trajectory, include_reference=self.include_reference,
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

    def judge_many(self, trajectories: Sequence[Trajectory], *, max_workers: int = 4,
                   on_verdict: Callable[[int], None] | None = None) -> list[JudgeVerdict]:
        """Judge several trajectories, at most `max_workers` requests in flight (I/O-bound: threads suffice);
        verdicts in the order of `trajectories`. `on_verdict(count)` after each verdict (from this thread)."""
        counted = on_verdict or (lambda count: None)
        if max_workers <= 1 or len(trajectories) <= 1:
            verdicts = []
            for t in trajectories:
                verdicts.append(self.judge(t))
                counted(len(verdicts))
            return verdicts
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="judge") as pool:
            futures = [pool.submit(self.judge, t) for t in trajectories]
            for count, _ in enumerate(as_completed(futures), start=1):
                counted(count)
            return [f.result() for f in futures]

    def __repr__(self) -> str:
        return f"Judge({self.judge_id!r})"


class JudgeReward:
    """A judge as a reward function: outcome = the judge's score (or, with `pass_threshold`, 1.0 if the score
    reaches it else 0.0); zeros for process rewards. A judge failure masks the sample.

    Judging is I/O-bound: `batch` (which `rewards.base.score` prefers) judges a whole batch with at most
    `max_workers` requests in flight, instead of one request after another.
    """

    name = "judge"

    def __init__(self, judge: Judge, *, pass_threshold: float | None = None, max_workers: int = 4) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.judge = judge
        self.pass_threshold = pass_threshold
        self.max_workers = max_workers

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        return self._breakdown(self.judge.judge(trajectory), trajectory)

    def batch(self, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
        verdicts = self.judge.judge_many(trajectories, max_workers=self.max_workers)
        return [self._breakdown(v, t) for v, t in zip(verdicts, trajectories)]

    def _breakdown(self, verdict: JudgeVerdict, trajectory: Trajectory) -> RewardBreakdown:
        if verdict.score is None:
            return masked(f"judge: {verdict.error}")
        outcome = verdict.score if self.pass_threshold is None else float(verdict.score >= self.pass_threshold)
        return RewardBreakdown(outcome=outcome, process=(0.0,) * len(trajectory.turns))

    def __repr__(self) -> str:
        return f"JudgeReward({self.judge.judge_id!r})"


