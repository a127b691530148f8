"""Value-function plumbing shared by critics: aligning per-position head outputs with token positions, and the
explained-variance diagnostic.

A causal LM's hidden state at position t summarises tokens 0..t. Token t is *chosen* in the state made of
tokens 0..t-1, whose summary sits at position t - 1; that is why `agentgrad.batch` stores
`old_logprobs[b, t]` from the logits at t - 1. Values follow the same convention, so GAE's
delta_t = r_t + gamma * V_{t'} - V_t (t' the next policy token) compares the value before an action with the
value before the next one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["values_at_tokens", "explained_variance"]


def values_at_tokens(head_out: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """(B, T) value-head outputs, one per hidden state, -> (B, T) values in `batch` convention:
    out[b, t] = head_out[b, t - 1] for t >= 1 and out[b, 0] = 0; zero where `loss_mask == 0` if a mask is given
    (so a critic never reports values for prompt, observation or padding tokens)."""
    if head_out.dim() != 2:
        raise ValueError(f"head_out must be (B, T), got shape {tuple(head_out.shape)}")
    out = F.pad(head_out[:, :-1], (1, 0))  # (B, T)
    if loss_mask is not None:
        if loss_mask.shape != out.shape:
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != head_out shape {tuple(out.shape)}")
        out = torch.where(loss_mask > 0, out, torch.zeros_like(out))  # (B, T)
    return out


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over the masked entries (a critic diagnostic, as in OpenAI
    baselines): 1 is a perfect critic, 0 no better than a constant, < 0 worse. NaN when returns are constant."""
    m = mask > 0  # (B, T)
    y, v = returns[m].double(), values[m].double()  # (n,)
    if y.numel() < 2:
        return torch.tensor(float("nan"))
    var_y = y.var(unbiased=False)
    if var_y == 0:
        return torch.tensor(float("nan"))
    return (1 - (y - v).var(unbiased=False) / var_y).float()
