"""Log-probabilities under constrained decoding: the softmax restricted to the legal tokens of each position.

When the sampler masks illegal tokens to -inf, the behaviour policy is pi_m(a) = pi(a) / pi(L) over the legal
set L, and its log-probability is  logit_a - logsumexp_{j in L} logit_j.  The learner must score the same
masked distribution, or the PPO ratio pi_theta / pi_old compares two different distributions (and its
gradient loses the -grad log pi(L) term that moves mass between legal tokens only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentgrad.batch import LogitMasks


def masked_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, masks: LogitMasks | None) -> torch.Tensor:
    """log p(target) under the (masked) softmax of `logits`, per position.

    logits: (B, T, V) scores that predict `targets` (B, T) (temperature already applied); `masks.index` (B, T)
    names the legal set of each position (-1: unconstrained, the full softmax).
    """
    lse_all = torch.logsumexp(logits, dim=-1)  # (B, T)
    lp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse_all  # (B, T)
    if masks is None:
        return lp
    where = (masks.index >= 0).nonzero(as_tuple=True)  # N constrained positions
    if where[0].numel() == 0:
        return lp
    sets = masks.index[where]  # (N,)
    ids = masks.token_ids[sets]  # (N, K), -1 padded
    # indexing (N, K) entries directly, not logits[where] (N, V) first
    listed = logits[where[0][:, None], where[1][:, None], ids.clamp(min=0)] - lse_all[where][:, None]  # (N, K)
    return lp.index_put(where, lp[where] - legal_log_mass(listed, ids >= 0, masks.allow[sets]))


def legal_log_mass(listed: torch.Tensor, present: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """log pi(L), the unmasked policy's mass on each position's legal set L, so that the masked log-probability
    of a legal token is its full log-probability minus this.

    listed (N, K): full-softmax log-probabilities of the ids each set lists; present (N, K) bool: which of the K
    are ids (the rest is padding); allow (N,) bool: the listed ids are L (True), or every id but them (False:
    log pi(L) = log(1 - pi(listed))).
    """
    lse_listed = torch.logsumexp(listed.masked_fill(~present, float("-inf")), dim=-1)  # (N,)
    # clamp keeps log1p finite (and its gradient bounded) when the listed ids hold ~all the mass
    lse_rest = torch.log1p(-torch.exp(lse_listed).clamp(max=1 - 1e-6))  # (N,)
    return torch.where(allow, lse_listed, lse_rest)


def factored_tool_logprobs(category_logits: torch.Tensor, tool_logits: torch.Tensor, tool_category: torch.Tensor,
                           legal: torch.Tensor) -> torch.Tensor:
    """log p(tool) = log p(category) + log p(tool | category) for a two-level (hierarchical) action space.

    category_logits (B, C), tool_logits (B, N), tool_category (N,) long (the category of each tool), legal (B, N)
    bool (the env's mask). p(category) is the softmax over categories holding at least one legal tool;
    p(tool | category) the softmax over that category's legal tools. Illegal tools get -inf. Returns (B, N).
    """
    C = category_logits.shape[-1]
    # a large finite floor instead of -inf keeps logsumexp's gradient finite for categories with no legal tool
    floor = torch.finfo(tool_logits.dtype).min / 4
    member = F.one_hot(tool_category, C).bool()  # (N, C)
    tool_logits = tool_logits.masked_fill(~legal, floor)  # (B, N)
    in_cat = tool_logits[:, :, None].masked_fill(~member[None], floor)  # (B, N, C)
    lse_cat = torch.logsumexp(in_cat, dim=1)  # (B, C)
    legal_cat = (legal[:, :, None] & member[None]).any(dim=1)  # (B, C)
    cat_logp = torch.log_softmax(category_logits.masked_fill(~legal_cat, float("-inf")), dim=-1)  # (B, C)
    cond = tool_logits - lse_cat[:, tool_category]  # (B, N) log p(tool | its category)
    joint = cat_logp[:, tool_category] + cond  # (B, N)
    return joint.masked_fill(~legal, float("-inf"))
