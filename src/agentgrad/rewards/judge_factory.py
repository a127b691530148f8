"""The registered "judge" reward: a judge built from options, behind the calibration gate.

Its own module because it joins the judge (`rewards.judge`) and its calibration (`rewards.calibration`, which
uses the judge): neither of those imports the other's user.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentgrad.rewards.base import REWARDS
from agentgrad.rewards.calibration import require_calibrated
from agentgrad.rewards.judge import Judge, JudgeReward, Rubric
from agentgrad.rewards.judge_backends import HFChatBackend, OpenAIChatBackend


def judge_reward(*, base_url: str | None = None, model: str | None = None, backend: Any = None,
                 rubric: str | Rubric = "pass_fail", criteria: str = "", cache_path: str | Path | None = None,
                 calibration_report: str | Path | None = None, threshold: float = 0.80,
                 min_kappa: float | None = None, override: bool = False, pass_threshold: float | None = None,
                 api_key_env: str | None = None, timeout_s: float = 60.0, judge_id: str | None = None,
                 score_max: float = 1.0, hf_model: str | None = None, max_workers: int = 4) -> JudgeReward:
    """Build a calibrated judge reward (the registered "judge" factory, `make_judge_reward`, calls this).

    The backend is `backend` (any `JudgeBackend` or callable), a local model (`hf_model`: a directory or hub id,
    `HFChatBackend`) or an `OpenAIChatBackend(base_url, model)`.
    The judge must have a calibration report at `calibration_report` for the same judge id with accuracy
    >= `threshold` (see `require_calibrated`); otherwise `JudgeNotCalibratedError`, unless `override=True`.
    A batch of trajectories is judged with at most `max_workers` requests in flight (`JudgeReward.batch`).
    """
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
    return JudgeReward(judge, pass_threshold=pass_threshold, max_workers=max_workers)


def make_judge_reward(suite: Any, **options: Any) -> JudgeReward:
    """Registered as "judge": `REWARDS.get("judge")(suite, base_url=..., model=..., calibration_report=...,
    threshold=0.8, override=False)`. `suite` is unused; the options are `judge_reward`'s. Building it does not
    contact the endpoint, but it applies the calibration gate (`JudgeNotCalibratedError`)."""
    return judge_reward(**options)


REWARDS.add("judge", make_judge_reward)
