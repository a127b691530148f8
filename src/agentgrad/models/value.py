"""Value models for PPO: a scalar head on a causal-LM trunk, either the policy's own (detached) trunk or a
separate copy of it. Both return values in `agentgrad.batch` convention (see `algos.values.values_at_tokens`)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from agentgrad.algos.values import values_at_tokens
from agentgrad.models.hf import hidden_states


class ValueModel(nn.Module):
    """V(prefix) for every token position of a right-padded batch: a linear head on the trunk's last hidden
    state. With `detach_trunk` the trunk runs without gradient (the head learns from frozen features and the
    value loss never moves a shared policy)."""

    def __init__(self, trunk: nn.Module, hidden_size: int, *, detach_trunk: bool) -> None:
        super().__init__()
        self.trunk = trunk
        self.detach_trunk = detach_trunk
        self.head = nn.Linear(hidden_size, 1)
        # A zero head starts every value at 0: GAE then begins as plain REINFORCE on the returns.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.detach_trunk):
            hidden = hidden_states(self.trunk, input_ids, attention_mask)  # (B, T, H)
        head_out = self.head(hidden.float()).squeeze(-1)  # (B, T)
        return values_at_tokens(head_out, loss_mask)  # (B, T)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.head.parameters()) if self.detach_trunk else list(self.parameters())


class Critic:
    """A value model with its own AdamW. `values` has gradient; `step(loss)` updates the value model only."""

    def __init__(self, model: ValueModel, *, lr: float, grad_clip: float = 1.0) -> None:
        self.model = model
        self.params = model.trainable_parameters()
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               loss_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask, loss_mask)  # (B, T)

    def step(self, loss: torch.Tensor) -> dict[str, float]:
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or math.inf)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # A shared, detached trunk gets no gradient from here; a separate trunk owns its gradients.
        return {"train/critic_grad_norm": float(grad_norm)}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def build_critic(policy_model: nn.Module, kind: str, *, lr: float, grad_clip: float = 1.0) -> Critic:
    """`kind="head"`: a head on the policy's own trunk (shared, detached). `kind="separate"`: a deep copy of the
    policy's trunk (initialised from the current policy, as InstructGPT initialises its value model from a
    trained model rather than from scratch) plus a head, all trained."""
    trunk = policy_model.base_model  # the transformer body of an HF *ForCausalLM
    hidden = policy_model.config.hidden_size
    if kind == "head":
        model = ValueModel(trunk, hidden, detach_trunk=True)
    elif kind == "separate":
        model = ValueModel(copy.deepcopy(trunk).requires_grad_(True), hidden, detach_trunk=False)
    else:
        raise ValueError(f"unknown critic model {kind!r}; valid: head, separate")
    device = next(policy_model.parameters()).device
    return Critic(model.to(device), lr=lr, grad_clip=grad_clip)
