"""Optional factored action head for large tool catalogs (issue 3): category, then tool, as classifications.

Two linear heads read the LM's hidden state at the call position (the last token of `<tool_call>` + header,
right before the name would be written): p(category) and p(tool | category), both restricted to the env's
legal set, so  log p(tool) = log p(category) + log p(tool | category)  (`algos.factored_tool_logprobs`).
The name is then one decision instead of several sampled tokens; arguments are still generated as text.

Status: the head, its log-probabilities, a BC loss and greedy/sampled choice are built and tested; it is not
wired into the agent loop or the learner (see docs/action-space.md for what that needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from agentgrad.algos.constrained import factored_tool_logprobs


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

    def forward(self, hidden: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        """hidden (B, H) at the call position, legal (B, N) bool -> (B, N) log p(tool), -inf where illegal."""
        return factored_tool_logprobs(self.category_head(hidden), self.tool_head(hidden), self.tool_category, legal)

    def choose(self, hidden: torch.Tensor, legal: torch.Tensor, *, temperature: float = 1.0,
               generator: torch.Generator | None = None) -> ToolChoice:
        """Sample (or, at temperature 0, take the argmax of) the joint distribution; logprob is the sampled one's."""
        logp = self(hidden, legal)  # (B, N)
        if temperature == 0:
            index = logp.argmax(-1)
        else:
            index = torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=generator).squeeze(-1)
            logp = torch.log_softmax(logp / temperature, -1)
        return ToolChoice(index, logp.gather(-1, index[:, None]).squeeze(-1))

    def bc_loss(self, hidden: torch.Tensor, legal: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood of the expert's tools (B,) long: behaviour cloning of the head."""
        return -self(hidden, legal).gather(-1, target[:, None]).mean()
