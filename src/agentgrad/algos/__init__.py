"""Pure tensor math for RL on token sequences: advantages, losses, KL, off-policy weights, seeded sampling.

Tensors in, tensors out. Imports nothing of agentgrad but `types`, `batch` and the leaf `registry` (checked by
tests/unit/test_import_rules.py). Conventions (shapes, masks, reward placement) are those of `agentgrad.batch`.
"""

from agentgrad.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageOutput,
    AdvantageParams,
    masked_whiten,
    turn_index,
    turn_returns,
    zero_signal_groups,
)
from agentgrad.algos.constrained import factored_tool_logprobs, masked_token_logprobs
from agentgrad.algos.kl import (
    K3_CAP,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_UNITS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    make_kl_controller,
    sequence_kl,
)
from agentgrad.algos.losses import (
    AGGREGATIONS,
    DPOLoss,
    PolicyLoss,
    ValueLoss,
    aggregate,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    masked_mean,
    ppo_clip_loss,
    sequence_logprobs,
    sft_loss,
    value_loss,
)
from agentgrad.algos.off_policy import IS_LEVELS, IS_MODES, ISWeights, importance_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "AdvantageOutput", "AdvantageParams", "masked_whiten",
    "turn_index", "turn_returns", "zero_signal_groups",
    "K3_CAP", "KL_CONTROLLERS", "KL_ESTIMATORS", "KL_UNITS", "AdaptiveKLController", "FixedKLController",
    "KLController", "kl_estimate", "kl_loss", "kl_reward_penalty", "make_kl_controller", "sequence_kl",
    "AGGREGATIONS", "DPOLoss", "PolicyLoss", "ValueLoss", "aggregate", "dpo_loss", "entropy_bonus",
    "entropy_from_logits", "masked_mean", "ppo_clip_loss", "sequence_logprobs", "sft_loss", "value_loss",
    "IS_LEVELS", "IS_MODES", "ISWeights", "importance_weights", "masked_token_logprobs", "factored_tool_logprobs",
]
