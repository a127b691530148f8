"""Token scoring: the one place where a model's logits become per-token log-probabilities.

Every learner, reference and critic path goes through here. A token is scored under one distribution: the
logits divided by the temperature it was sampled at (`tempered`), restricted to its legal set when it was sampled
under constrained decoding (`TokenBatch.logit_masks`, `algos.masked_token_logprobs`). `Scoring` fixes the
temperature once per stage, and scores the trained policy and a frozen model (a reference) with the same rule
from the same batch, so a ratio or a DPO margin always compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from agentgrad.algos.constrained import masked_token_logprobs
from agentgrad.batch import LogitMasks, TokenBatch
from agentgrad.models.hf import hidden_states, model_parts


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in fp32 divided by the sampling temperature (0 means greedy sampling: scored untempered)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits


def score_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                 logit_masks: LogitMasks | None = None) -> torch.Tensor:
    """log p(token t | tokens < t) from the logits (B, T, V) of every position: (B, T), position 0 gets 0."""
    logits = tempered(logits[:, :-1, :], temperature)  # (B, T-1, V) predicts tokens 1..T-1
    targets = input_ids[:, 1:]  # (B, T-1)
    if logit_masks is not None:  # align with the shifted targets: position t of `lp` is token t + 1
        logit_masks = LogitMasks(logit_masks.index[:, 1:], logit_masks.token_ids, logit_masks.allow)
    lp = masked_token_logprobs(logits, targets, logit_masks)  # (B, T-1)
    return F.pad(lp, (1, 0))  # (B, T)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, logit_masks: LogitMasks | None = None) -> torch.Tensor:
    """log p(token t | tokens < t) for every position (B, T); position 0 gets 0. Right-padded input. Tokens
    sampled under constrained decoding (`logit_masks`) are scored over their legal set, as they were sampled."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    return score_logits(logits, input_ids, temperature, logit_masks)


def token_logprobs_and_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              temperature: float = 1.0, logit_masks: LogitMasks | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` (B, T) and the final-norm hidden states (B, T, H) from one forward: the states an
    action head reads (the same ones the sampling engine hands it)."""
    body, head = model_parts(model)
    hidden = hidden_states(body, input_ids, attention_mask)  # (B, T, H)
    return score_logits(head(hidden), input_ids, temperature, logit_masks), hidden


def with_head_decisions(lp: torch.Tensor, hidden: torch.Tensor, head: torch.nn.Module, batch: TokenBatch,
                        temperature: float) -> torch.Tensor:
    """Token logprobs `lp` (B, T) with each head decision (`batch.head`) scored by `head` at its score position:
    log p of its choice from the hidden states (B, T, H) up to the position the head read."""
    h = batch.head
    assert h is not None
    logp = head(hidden, h.row, h.position, h.legal, temperature)  # (D, K)
    return lp.index_put((h.row, h.score_position), logp.gather(-1, h.choice[:, None]).squeeze(-1))


class ScoresBatches(Protocol):
    """What `Scoring.policy` needs of a learner (`backends.base.Learner`)."""

    def logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor: ...


@dataclass(frozen=True)
class Scoring:
    """The distribution a stage scores tokens under: its `temperature`, and the batch's own logit masks.

    Built once per stage (RL: the rollout temperature, the distribution the behaviour logprobs were recorded
    under; SFT and DPO: 1, the model's own distribution). `policy` scores with the learner (gradients, length
    buckets, shared prefixes); `frozen` scores a frozen model (a reference) with one plain forward, no gradient.
    """

    temperature: float = 1.0

    def policy(self, learner: ScoresBatches, batch: TokenBatch) -> torch.Tensor:
        return learner.logprobs(batch, temperature=self.temperature)  # (B, T)

    @torch.no_grad()
    def frozen(self, model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
        return token_logprobs(model, batch.input_ids, batch.attention_mask, self.temperature,
                              batch.logit_masks)  # (B, T)

    @torch.no_grad()
    def frozen_with_head(self, model: torch.nn.Module, head: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
        """`frozen`, with the batch's head decisions scored by a frozen head (a reference head) on the frozen
        model's hidden states, as the learner scores them with the trained head."""
        lp, hidden = token_logprobs_and_hidden(model, batch.input_ids, batch.attention_mask, self.temperature,
                                               batch.logit_masks)  # (B, T), (B, T, H)
        return with_head_decisions(lp, hidden, head, batch, self.temperature)  # (B, T)
