"""Rewards: plain callables Trajectory -> RewardBreakdown.

- `base`: the RewardFn protocol, the REWARDS registry (every entry is `factory(suite, **options) -> RewardFn`),
  `score` (failure = masked sample), `CombinedReward`, `with_timeout`, `load_reward(spec, suite, **options)`.
- `verifiers`: outcome verifiers (exact, normalised, numeric, set, custom) and `VerifierReward`.
- `process`: verifiable per-turn bonuses (capped, deduplicated) and dead-loop penalties; `shaped_reward`.
- `judge`: LLM-as-judge (OpenAI-compatible HTTP or local callable backends, rubrics, verdict cache).
- `calibration`: judge calibration against human labels and the `require_calibrated` gate.
- `metrics`: `reward_metrics` for a scored batch.

No torch anywhere in this package.
"""

from agentgrad.rewards.base import (REWARDS, CombinedReward, OutcomeReward, RewardFactory, RewardFn,
                                    RewardSpecError, RewardTimeoutError, TimedReward, apply_reward, as_breakdown,
                                    load_reward, make_outcome_reward, masked, score, with_timeout)
from agentgrad.rewards.verifiers import (VERIFIERS, VerifierReward, exact_match, get_verifier, make_verifier_reward,
                                         normalize_text, normalized_match, numeric_match, parse_number, set_match,
                                         split_items)
from agentgrad.rewards.process import (CODE_EXIT_ZERO, DEFAULT_FACTS, SEARCH_RESULTS, SQL_VALID, Fact, ProcessReward,
                                       ProcessRewardConfig, dead_loop_penalties, fact_bonuses, make_process_reward,
                                       make_shaped_reward, process_reward, repeated_call_turns, shaped_reward)
from agentgrad.rewards.judge import (PASS_FAIL, RUBRICS, SCORE, CallableBackend, Judge, JudgeBackend,
                                     JudgeBackendError, JudgeInput, JudgeReward, JudgeVerdict, OpenAIChatBackend,
                                     Rubric, VerdictCache, judge_input, judge_reward, make_judge_reward,
                                     parse_verdict, render_transcript)
from agentgrad.rewards.calibration import (CalibrationError, CalibrationReport, JudgeNotCalibratedError,
                                           agreement_report, calibrate, calibrate_cli, load_labels, read_report,
                                           require_calibrated, write_report)
from agentgrad.rewards.metrics import reward_metrics

__all__ = [
    "REWARDS", "RewardFactory", "RewardFn", "OutcomeReward", "make_outcome_reward", "make_verifier_reward",
    "make_process_reward", "make_shaped_reward", "make_judge_reward", "score", "CombinedReward", "with_timeout",
    "TimedReward", "RewardTimeoutError", "RewardSpecError", "load_reward", "apply_reward", "as_breakdown", "masked",
    "VERIFIERS", "VerifierReward", "exact_match", "normalized_match", "numeric_match", "set_match",
    "normalize_text", "parse_number", "split_items", "get_verifier",
    "Fact", "ProcessRewardConfig", "ProcessReward", "process_reward", "shaped_reward", "fact_bonuses",
    "dead_loop_penalties", "repeated_call_turns", "DEFAULT_FACTS", "SEARCH_RESULTS", "CODE_EXIT_ZERO", "SQL_VALID",
    "JudgeBackend", "OpenAIChatBackend", "CallableBackend", "JudgeBackendError", "Rubric", "RUBRICS", "PASS_FAIL",
    "SCORE", "Judge", "JudgeInput", "JudgeVerdict", "JudgeReward", "VerdictCache", "judge_reward", "judge_input",
    "parse_verdict", "render_transcript",
    "CalibrationReport", "CalibrationError", "JudgeNotCalibratedError", "calibrate", "calibrate_cli",
    "agreement_report", "load_labels", "write_report", "read_report", "require_calibrated",
    "reward_metrics",
]
