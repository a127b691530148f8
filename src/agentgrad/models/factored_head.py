"""Optional factored action head for large tool catalogs (issue 3): category, then tool, as classifications.

Two linear heads read the LM's hidden state at the call position (the last token of `<tool_call>` + header,
right before the name would be written): p(category) and p(tool | category), both restricted to the env's
legal set, so  log p(tool) = log p(category) + log p(tool | category)  (`algos.factored_tool_logprobs`).
The name is then one decision instead of several sampled tokens; arguments are still generated as text.

Wiring: `rollout.action_head=factored` makes the agent loop pause at the call position, ask `decide`, and
write the name in (rollout/factored.py); BC trains the head beside the LM (pipelines/bc.py); its weights are
saved as `tool_head.pt` next to the policy checkpoint; RL scores its decisions as actions
(`collate(head_tools=...)`, `TorchLearner(tool_head=...)`; docs/action-space.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from agentgrad.algos.constrained import factored_tool_logprobs
from agentgrad.algos.sampling import sample_rows


@dataclass(frozen=True)
class ToolChoice:
    tool_index: torch.Tensor  # (B,) long, index into FactoredToolHead.tool_names
    logprob: torch.Tensor  # (B,) log p(category) + log p(tool | category)


class FactoredToolHead(nn.Module):
    def __init__(self, hidden_size: int, tools: Sequence[tuple[str, str]]) -> None:
        """`tools`: (name, category) pairs, in the order of the tool logits."""
        super().__init__()
        if not tools:
            raise ValueError("a factored head needs at least one tool")
        self.tool_names = tuple(name for name, _ in tools)
        self.categories = tuple(dict.fromkeys(cat for _, cat in tools))
        self.category_head = nn.Linear(hidden_size, len(self.categories))
        self.tool_head = nn.Linear(hidden_size, len(self.tool_names))
        index = {c: i for i, c in enumerate(self.categories)}
        self.register_buffer("tool_category", torch.tensor([index[c] for _, c in tools], dtype=torch.long),
                             persistent=False)

    def legal_mask(self, legal_names: Sequence[frozenset[str]], device: torch.device | None = None) -> torch.Tensor:
        """(B, N) bool from each row's legal tool names (an env's `legal_actions().tools`)."""
        return torch.tensor([[n in names for n in self.tool_names] for names in legal_names], dtype=torch.bool,
                            device=device)

    def forward(self, hidden: torch.Tensor, legal: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """hidden (B, H) at the call position, legal (B, N) bool -> (B, N) log p(tool), -inf where illegal; at a
        temperature other than 1 (or 0: greedy) the tempered distribution, which sampler and learner share."""
        logp = factored_tool_logprobs(self.category_head(hidden), self.tool_head(hidden), self.tool_category, legal)
        if temperature > 0 and temperature != 1.0:
            logp = torch.log_softmax(logp / temperature, -1)
        return logp

    def choose(self, hidden: torch.Tensor, legal: torch.Tensor, *, temperature: float = 1.0,
               generator: torch.Generator | None = None) -> ToolChoice:
        """Sample (or, at temperature 0, take the argmax of) the joint distribution; logprob is the sampled one's."""
        logp = self(hidden, legal, temperature)  # (B, N)
        if temperature == 0:
            index = logp.argmax(-1)
        else:
            index = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return ToolChoice(index, logp.gather(-1, index[:, None]).squeeze(-1))

    def decide(self, hidden: torch.Tensor, legal: frozenset[str], *, temperature: float,
               uniform: float) -> tuple[str, float]:
        """One row for the agent loop: hidden (H,) -> (tool name, logprob), drawn by inverse CDF with `uniform`
        (keyed by the episode and position, so seeded rollouts repeat); temperature 0 takes the argmax."""
        mask = self.legal_mask([legal], device=hidden.device)  # (1, N)
        logp = self(hidden[None].to(self.tool_head.weight.dtype), mask, temperature)  # (1, N)
        if temperature > 0:
            index = int(sample_rows(logp, torch.tensor([uniform], dtype=torch.float64, device=logp.device))[0])
        else:
            index = int(logp.argmax(-1))
        return self.tool_names[index], float(logp[0, index])

    def to_blob(self) -> dict:
        """What `load` reads back: the catalog (names and categories, in order), the width, the weights."""
        return {"tools": list(zip(self.tool_names, (self.categories[i] for i in self.tool_category.tolist()))),
                "hidden_size": self.tool_head.in_features, "state": self.state_dict()}

    def save(self, path: str | Path) -> None:
        torch.save(self.to_blob(), path)

    @classmethod
    def load(cls, path: str | Path) -> FactoredToolHead:
        blob = torch.load(path, weights_only=True)
        head = cls(blob["hidden_size"], [tuple(t) for t in blob["tools"]])
        head.load_state_dict(blob["state"])
        return head

    def bc_loss(self, hidden: torch.Tensor, legal: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood of the expert's tools (B,) long: behaviour cloning of the head."""
        return -self(hidden, legal).gather(-1, target[:, None]).mean()
