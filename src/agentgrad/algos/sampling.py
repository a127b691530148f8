"""Per-row seeded sampling: a row's draw depends on (seed, row key, token position) only.

Batched samplers usually draw from one generator for the whole batch, so a row's sample depends on which other
rows happen to share its decode step. With continuous batching and concurrent tools that composition depends on
thread timing; here each draw is a counter-based hash (SplitMix64, Steele et al. 2014) of the row's own
coordinates, followed by inverse-CDF sampling, so a fixed seed gives the same tokens whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic on CPU)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser; int64 multiplication wraps like uint64's."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def counter_uniform(seed: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) doubles, one per row, a pure function of (seed, keys[b], positions[b]).  # (B,)"""
    x = _mix(torch.full_like(keys, _i64(seed)) + keys.long() * _GOLDEN)
    x = _mix(x + (positions.long() + 1) * _GOLDEN)
    return _shr(x, 11).double() * (2.0**-53)  # (B,) the top 53 bits, as numpy's random doubles


def sample_rows(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one id per row from log-probabilities `logp` (B, V) with uniforms `u` (B,).

    A zero-probability id (masked, -inf) is never returned: its CDF step is empty."""
    cdf = logp.double().exp().cumsum(-1)  # (B, V)
    target = (u * cdf[:, -1]).unsqueeze(-1)  # (B, 1) scaled by the total, which float error keeps off 1.0
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)
    return ids.clamp_max(logp.shape[-1] - 1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of ids whose probability reaches top_p."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
    probs = sorted_logits.softmax(-1)  # (B, V)
    drop_sorted = probs.cumsum(-1) - probs >= top_p  # keep the id that crosses top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token_logprobs(logits: torch.Tensor, temperature: float, top_p: float,
                        processor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Log-probabilities (B, V) of the distribution actually sampled from: temperature, then the (masking)
    processor, then top-p. Recording these makes PPO/GRPO ratios exact under masks and truncation."""
    if temperature > 0:
        logits = logits / temperature
    if processor is not None:
        logits = processor(logits)
    if temperature > 0 and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return torch.log_softmax(logits, dim=-1)
