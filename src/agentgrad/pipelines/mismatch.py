"""The train/inference mismatch monitor of an RL step (config `mismatch`, math in `algos/mismatch.py`).

The learner scores the step's fresh rows before the update (the same pi_prox the replay correction uses); the
monitor compares that with the logprobs the sampler recorded, and, when the correction is on (or `auto` and the
mean |difference| passed its threshold), replaces the fresh rows' pi_old with the learner's and weights them by
the bounded ratio. Replayed rows are left to the replay correction (their mu is an older policy, not the sampler's
numerics)."""

from __future__ import annotations

import torch

from agentgrad.algos.mismatch import correct_mismatch, mismatch_metrics, mismatch_stats
from agentgrad.batch import TokenBatch
from agentgrad.config import MismatchConfig


def monitor_mismatch(config: MismatchConfig, batch: TokenBatch, learner_logprobs: torch.Tensor, num_fresh: int
                     ) -> tuple[TokenBatch, dict[str, float]]:
    """Mismatch metrics over rows [0, num_fresh) of `batch` against `learner_logprobs` (B, T), and the batch with
    those rows corrected when the config says so (`mismatch/corrected` is 1.0 then)."""
    fresh = torch.arange(batch.num_sequences, device=batch.loss_mask.device) < num_fresh  # (B,)
    fresh_mask = batch.loss_mask * fresh[:, None].to(batch.loss_mask.dtype)  # (B, T)
    stats = mismatch_stats(learner_logprobs, batch.old_logprobs, fresh_mask)
    metrics = mismatch_metrics(stats)
    on = config.correction == "on" or (config.correction == "auto"
                                       and stats.mean_abs_diff.item() > config.auto_threshold)
    metrics["mismatch/corrected"] = float(on)
    if not on:
        return batch, metrics
    old, weights, w = correct_mismatch(learner_logprobs, batch.old_logprobs, batch.loss_mask, fresh,
                                       level=config.is_level, mode=config.is_mode, bound=config.is_bound,
                                       is_weights=batch.is_weights)
    metrics |= {"mismatch/is_weight_mean": w.mean.item(), "mismatch/is_weight_max": w.max.item(),
                "mismatch/ess": w.ess.item(), "mismatch/frac_truncated": w.frac_truncated.item()}
    return batch.replace(old_logprobs=old, is_weights=weights), metrics
