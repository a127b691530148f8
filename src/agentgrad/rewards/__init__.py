"""Rewards: plain callables Trajectory -> RewardBreakdown.

- `base`: the RewardFn protocol, the REWARDS registry (every entry is `factory(suite, **options) -> RewardFn`),
  `score` (failure = masked sample), `CombinedReward`, `with_timeout`, `load_reward(spec, suite, **options)`.
- `verifiers`: outcome verifiers (the rules of `agentgrad.answers`, or custom ones) and `VerifierReward`.
- `process`: verifiable per-turn bonuses (capped, deduplicated) and dead-loop penalties; `shaped_reward`.
- `judge`: LLM-as-judge of a Trajectory (rubrics, verdict cache, `JudgeReward` with a concurrent `batch`);
  `judge_backends`: OpenAI-compatible HTTP, local HF model or callable backends.
- `labels`: human-labelled records as trajectories; `calibration`: judge calibration against them and the
  `require_calibrated` gate; `judge_factory`: the registered "judge" reward, behind that gate.
- `metrics`: `reward_metrics` for a scored batch.

No torch anywhere in this package.
"""

from agentgrad.rewards.base import (
                                    REWARDS,
                                    BatchRewardFn,
                                    CombinedReward,
                                    OutcomeReward,
                                    RewardFactory,
                                    RewardFn,
                                    RewardSpecError,
                                    RewardTimeoutError,
                                    TimedReward,
                                    apply_reward,
                                    apply_rewards,
                                    as_breakdown,
                                    load_reward,
                                    make_outcome_reward,
                                    masked,
                                    score,
                                    with_timeout,
)
from agentgrad.rewards.calibration import (
                                    CalibrationReport,
                                    JudgeNotCalibratedError,
                                    agreement_report,
                                    calibrate,
                                    calibrate_cli,
                                    read_report,
                                    require_calibrated,
                                    write_report,
)
from agentgrad.rewards.judge import (
                                    PASS_FAIL,
                                    RUBRICS,
                                    SCORE,
                                    Judge,
                                    JudgeInput,
                                    JudgeReward,
                                    JudgeVerdict,
                                    Rubric,
                                    VerdictCache,
                                    judge_input,
                                    parse_verdict,
                                    render_transcript,
)
from agentgrad.rewards.judge_backends import (
                                    CallableBackend,
                                    HFChatBackend,
                                    JudgeBackend,
                                    JudgeBackendError,
                                    OpenAIChatBackend,
)
from agentgrad.rewards.judge_factory import judge_reward, make_judge_reward
from agentgrad.rewards.labels import CalibrationError, LabelledExample, labelled_trajectory, load_labels
from agentgrad.rewards.metrics import reward_metrics
from agentgrad.rewards.process import (
                                    CODE_EXIT_ZERO,
                                    DEFAULT_FACTS,
                                    KNOWN_ENTITY,
                                    LOGGED_IN,
                                    SEARCH_RESULTS,
                                    SQL_VALID,
                                    Fact,
                                    ProcessReward,
                                    ProcessRewardConfig,
                                    dead_loop_penalties,
                                    fact_bonuses,
                                    make_process_reward,
                                    make_shaped_reward,
                                    process_reward,
                                    repeated_call_turns,
                                    shaped_reward,
)
from agentgrad.rewards.verifiers import (
                                    VERIFIERS,
                                    VerifierReward,
                                    exact_match,
                                    get_verifier,
                                    make_verifier_reward,
                                    normalize_text,
                                    normalized_match,
                                    numeric_match,
                                    parse_number,
                                    set_match,
                                    split_items,
)

__all__ = [
    "REWARDS", "RewardFactory", "RewardFn", "OutcomeReward", "make_outcome_reward", "make_verifier_reward",
    "make_process_reward", "make_shaped_reward", "make_judge_reward", "score", "CombinedReward", "with_timeout",
    "TimedReward", "RewardTimeoutError", "RewardSpecError", "load_reward", "apply_reward", "as_breakdown", "masked",
    "BatchRewardFn", "apply_rewards",
    "VERIFIERS", "VerifierReward", "exact_match", "normalized_match", "numeric_match", "set_match",
    "normalize_text", "parse_number", "split_items", "get_verifier",
    "Fact", "ProcessRewardConfig", "ProcessReward", "process_reward", "shaped_reward", "fact_bonuses",
    "dead_loop_penalties", "repeated_call_turns", "DEFAULT_FACTS", "SEARCH_RESULTS", "CODE_EXIT_ZERO", "SQL_VALID",
    "KNOWN_ENTITY", "LOGGED_IN",
    "JudgeBackend", "OpenAIChatBackend", "CallableBackend", "HFChatBackend", "JudgeBackendError", "Rubric", "RUBRICS",
    "PASS_FAIL",
    "SCORE", "Judge", "JudgeInput", "JudgeVerdict", "JudgeReward", "VerdictCache", "judge_reward", "judge_input",
    "parse_verdict", "render_transcript",
    "CalibrationReport", "CalibrationError", "JudgeNotCalibratedError", "calibrate", "calibrate_cli",
    "agreement_report", "load_labels", "labelled_trajectory", "LabelledExample", "write_report", "read_report",
    "require_calibrated",
    "reward_metrics",
]
