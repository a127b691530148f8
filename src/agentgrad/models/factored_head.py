"""Optional factored action head for large tool catalogs (issue 3): category, then tool, as classifications.

Two modes (`decides`, set by `rollout.action_head`): "tool" (`factored`) classifies the category and then the tool
within it; "category" (`category`) classifies the category only, and the LM, the second head, writes the tool's
name (masked to that category's legal tools) and its arguments as tokens.

The head reads the LM's final hidden states up to the call position (the last token of `<tool_call>` + header,
right before the name would be written) and gives p(category) and p(tool | category), both restricted to the
env's legal set, so  log p(tool) = log p(category) + log p(tool | category)  (`algos.factored_tool_logprobs`).
The name is then one decision instead of several sampled tokens; arguments are still generated as text.

What it reads: the call position's state, and an attention read-out over the states of the whole context (a
query from the call position, keys and values from every earlier token, as in attention pooling). The call
position's state alone is trained to predict the name's *first* token; the LM writes the rest attending back to
the task text at every step, and a classifier on that one state named the right tool much less often (probes
on three BC'd models, unseen demos: linear 60-72% right tool, with the context read-out 79-91%; the LM itself
95-97%; benchmarks/action_space_probe.py, docs/action-space.md).

Wiring: `rollout.action_head=factored` makes the agent loop pause at the call position, ask `decide`, and
write the name in (rollout/factored.py); BC trains the head beside the LM (pipelines/bc.py); its weights are
saved as `tool_head.pt` next to the policy checkpoint; RL scores its decisions as actions
(`collate(head_tools=...)`, `TorchLearner(tool_head=...)`; docs/action-space.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from agentgrad.algos.constrained import factored_tool_logprobs
from agentgrad.algos.sampling import sample_rows
from agentgrad.models.hf import ModelLoadError

# The head's layout, saved in tool_head.pt: a file written by another layout is refused with a clear error.
LAYOUT = "context-attention-v1"

Decides = Literal["tool", "category"]


class FactoredToolHead(nn.Module):
    def __init__(self, hidden_size: int, tools: Sequence[tuple[str, str]], *, decides: Decides = "tool",
                 width: int = 256, key_size: int = 64, attention_heads: int = 4) -> None:
        """`tools`: (name, category) pairs, in the order of the tool logits. `decides`: what one decision picks
        ("tool": category and tool; "category": the category only). `key_size` is split over `attention_heads`
        heads; `width` is the hidden layer the classifiers share."""
        super().__init__()
        if not tools:
            raise ValueError("a factored head needs at least one tool")
        if key_size % attention_heads:
            raise ValueError(f"key_size {key_size} is not a multiple of attention_heads {attention_heads}")
        if decides not in ("tool", "category"):
            raise ValueError(f"decides must be 'tool' or 'category', not {decides!r}")
        self.decides: Decides = decides
        self.tool_names = tuple(name for name, _ in tools)
        self.categories = tuple(dict.fromkeys(cat for _, cat in tools))
        self.category_of = dict(tools)
        self.sizes = {"width": width, "key_size": key_size, "attention_heads": attention_heads}
        self.query = nn.Linear(hidden_size, key_size)
        self.key = nn.Linear(hidden_size, key_size)
        self.value = nn.Linear(hidden_size, key_size)
        self.body = nn.Sequential(nn.Linear(hidden_size + key_size, width), nn.GELU())
        self.category_head = nn.Linear(width, len(self.categories))
        self.tool_head = nn.Linear(width, len(self.tool_names)) if decides == "tool" else None
        index = {c: i for i, c in enumerate(self.categories)}
        self.register_buffer("tool_category", torch.tensor([index[c] for _, c in tools], dtype=torch.long),
                             persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.query.in_features

    @property
    def choices(self) -> tuple[str, ...]:
        """What a decision picks from, in the order of the head's output: tool names, or categories."""
        return self.tool_names if self.decides == "tool" else self.categories

    def legal_choices(self, legal_tools: Iterable[str]) -> frozenset[str]:
        """The choices open when `legal_tools` (an env's `legal_actions().tools`) are: those tools, or the
        categories holding at least one of them."""
        known = [n for n in legal_tools if n in self.category_of]
        return frozenset(known) if self.decides == "tool" else frozenset(self.category_of[n] for n in known)

    def legal_mask(self, legal: Sequence[frozenset[str]], device: torch.device | None = None) -> torch.Tensor:
        """(D, K) bool over `choices` from each decision's legal choices (`legal_choices`)."""
        return torch.tensor([[n in names for n in self.choices] for names in legal], dtype=torch.bool,
                            device=device)

    def features(self, states: torch.Tensor, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """states (B, T, H): final hidden states of right-padded sequences; decision d reads row[d] up to and
        including position[d] (the call position). -> (D, width)."""
        D, A = len(row), self.sizes["attention_heads"]
        here = states[row, position]  # (D, H)
        keys = self.key(states)[row]  # (D, T, K): projected once per sequence, then picked per decision
        values = self.value(states)[row]  # (D, T, K)
        T, K = keys.shape[1], keys.shape[2]
        q = self.query(here).view(D, A, 1, K // A)  # (D, A, 1, K/A)
        k = keys.view(D, T, A, K // A).transpose(1, 2)  # (D, A, T, K/A)
        v = values.view(D, T, A, K // A).transpose(1, 2)  # (D, A, T, K/A)
        upto = torch.arange(T, device=states.device)[None, :] <= position[:, None]  # (D, T) up to the call
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=upto[:, None, None, :]).reshape(D, K)  # (D, K)
        return self.body(torch.cat([here, pooled], -1))  # (D, W)

    def forward(self, states: torch.Tensor, row: torch.Tensor, position: torch.Tensor, legal: torch.Tensor,
                temperature: float = 1.0) -> torch.Tensor:
        """-> (D, K) log p of each choice (`choices`) per decision (see `features`), -inf where illegal (legal (D, K)
        bool): log p(category) + log p(tool | category), or log p(category); at a temperature other than 1 (or 0:
        greedy) the tempered distribution, which sampler and learner share."""
        f = self.features(states, row, position)  # (D, W)
        if self.tool_head is not None:
            logp = factored_tool_logprobs(self.category_head(f), self.tool_head(f), self.tool_category, legal)
        else:
            logp = torch.log_softmax(self.category_head(f).masked_fill(~legal, float("-inf")), dim=-1)  # (D, C)
        if temperature > 0 and temperature != 1.0:
            logp = torch.log_softmax(logp / temperature, -1)
        return logp

    @torch.no_grad()
    def decide(self, states: torch.Tensor, legal: frozenset[str], *, temperature: float,
               uniform: float) -> tuple[str, float]:
        """One decision for the agent loop: states (L, H) of the context, the last one the call position, and the
        legal tool names -> (choice, logprob), drawn by inverse CDF with `uniform` (keyed by the episode and
        position, so seeded rollouts repeat); temperature 0 takes the argmax."""
        mask = self.legal_mask([self.legal_choices(legal)], device=states.device)  # (1, K)
        start = torch.zeros(1, dtype=torch.long, device=states.device)
        end = torch.full((1,), len(states) - 1, dtype=torch.long, device=states.device)
        logp = self(states[None].to(self.query.weight.dtype), start, end, mask, temperature)  # (1, N)
        if temperature > 0:
            index = int(sample_rows(logp, torch.tensor([uniform], dtype=torch.float64, device=logp.device))[0])
        else:
            index = int(logp.argmax(-1))
        return self.choices[index], float(logp[0, index])

    def bc_loss(self, states: torch.Tensor, row: torch.Tensor, position: torch.Tensor, legal: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood of the expert's choices (D,) long: behaviour cloning of the head."""
        return -self(states, row, position, legal).gather(-1, target[:, None]).mean()

    def to_blob(self) -> dict:
        """What `load` reads back: the layout, the catalog (names and categories, in order), sizes, weights."""
        return {"layout": LAYOUT, "hidden_size": self.hidden_size, "sizes": dict(self.sizes), "decides": self.decides,
                "tools": list(zip(self.tool_names, (self.categories[i] for i in self.tool_category.tolist()))),
                "state": self.state_dict()}

    def save(self, path: str | Path) -> None:
        torch.save(self.to_blob(), path)

    @classmethod
    def load(cls, path: str | Path) -> FactoredToolHead:
        blob = torch.load(path, weights_only=True)
        if blob.get("layout") != LAYOUT:
            found = blob.get("layout", "linear, before 2026-12-06")
            raise ModelLoadError(f"{path} holds a tool head of another layout ({found!r}, this version reads "
                                 f"{LAYOUT!r}): train the head again (BC with rollout.action_head=factored)")
        head = cls(blob["hidden_size"], [tuple(t) for t in blob["tools"]], decides=blob.get("decides", "tool"),
                   **blob["sizes"])
        head.load_state_dict(blob["state"])
        return head
