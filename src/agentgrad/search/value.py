"""The search's value model: the critic machinery (`models/value.py`: a head on the policy's trunk, or a separate
copy of it, as config `critic.model` chooses) read at the last token of a sequence, trained on Monte-Carlo
returns of finished episodes (from search and from rollouts), and its calibration by bucket.

What it estimates: the probability that the episode succeeds from a state. The search asks it at two kinds of
sequence: a state (ending with the generation prompt: V(s)) and a state followed by a candidate turn (ending
with the turn's end-of-turn token: Q(s, a), which ranks candidates for pruning before their tools run). Each
finished episode teaches both at every turn: the prefix before the turn and the prefix through it, both with
the episode's outcome as target (undiscounted: rewards come at the end, so the return is the outcome).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentgrad.models.hf import hidden_states
from agentgrad.models.value import Critic
from agentgrad.types import Trajectory


@dataclass(frozen=True)
class ValueExample:
    """One finished episode's tokens, the positions whose value it teaches (each the last token of a prefix),
    and its return."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    target: float


def value_example(trajectory: Trajectory, target: float) -> ValueExample | None:
    """The episode's prefixes before and through each turn (the search's two query kinds); None if it has none."""
    positions = sorted({p for turn in trajectory.turns for p in (turn.start - 1, turn.end - 1)
                        if 0 <= p < len(trajectory.token_ids)})
    if not positions:
        return None
    return ValueExample(tuple(trajectory.token_ids), tuple(positions), float(target))


def _padded(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T)
    for b, seq in enumerate(sequences):
        ids[b, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention[b, :len(seq)] = 1
    return ids.to(device), attention.to(device)


def head_outputs(critic: Critic, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The value head at every position (unshifted: position t is V of tokens 0..t). (B, T)"""
    model = critic.model
    with torch.set_grad_enabled(torch.is_grad_enabled() and not model.detach_trunk):
        hidden = hidden_states(model.trunk, ids, attention)  # (B, T, H)
    return model.head(hidden.float()).squeeze(-1)  # (B, T)


class CriticValues:
    """A `search.driver.ValueFn` over a critic: V at each sequence's last token, clipped to [0, 1] (returns are
    outcomes), in batches of `batch_size`."""

    def __init__(self, critic: Critic, pad_token_id: int, *, batch_size: int = 32) -> None:
        self.critic, self.pad_token_id, self.batch_size = critic, pad_token_id, batch_size

    @torch.no_grad()
    def __call__(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        device = next(self.critic.model.parameters()).device
        out: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start:start + self.batch_size]
            ids, attention = _padded(chunk, self.pad_token_id, device)
            heads = head_outputs(self.critic, ids, attention)  # (B, T)
            last = attention.sum(dim=1) - 1  # (B,)
            values = heads.gather(1, last.unsqueeze(1)).squeeze(1)  # (B,)
            out += values.clamp(0.0, 1.0).tolist()
        return out

    @torch.no_grad()
    def predict(self, examples: Sequence[ValueExample]) -> list[tuple[float, float]]:
        """(predicted, realised) for every taught position of `examples`: the calibration's input."""
        pairs = []
        device = next(self.critic.model.parameters()).device
        for start in range(0, len(examples), self.batch_size):
            chunk = examples[start:start + self.batch_size]
            ids, attention = _padded([e.token_ids for e in chunk], self.pad_token_id, device)
            heads = head_outputs(self.critic, ids, attention).clamp(0.0, 1.0)  # (B, T)
            for b, e in enumerate(chunk):
                pairs += [(float(heads[b, p]), e.target) for p in e.positions]
        return pairs


def fit_values(critic: Critic, examples: Sequence[ValueExample], pad_token_id: int, *, steps: int,
               batch_size: int = 16, seed: int = 0) -> dict[str, float]:
    """`steps` AdamW steps of mean squared error between the head at each taught position and its episode's
    return, on minibatches taken in order from seeded shuffles of `examples` (each epoch sees every example once).
    Returns the first and last minibatch losses."""
    if not examples or steps <= 0:
        return {}
    rng = random.Random(seed)
    device = next(critic.model.parameters()).device
    losses, order = [], []
    for _ in range(steps):
        if len(order) < min(batch_size, len(examples)):
            order = list(range(len(examples)))
            rng.shuffle(order)
        chunk, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        ids, attention = _padded([e.token_ids for e in chunk], pad_token_id, device)
        weights = torch.zeros(ids.shape, device=device)  # (B, T): 1 at taught positions
        targets = torch.zeros(ids.shape, device=device)  # (B, T)
        for b, e in enumerate(chunk):
            weights[b, list(e.positions)] = 1.0
            targets[b, list(e.positions)] = e.target
        heads = head_outputs(critic, ids, attention)  # (B, T)
        loss = ((heads - targets) ** 2 * weights).sum() / weights.sum()
        critic.step(loss)
        losses.append(float(loss.detach()))
    return {"value/loss_first": losses[0], "value/loss_last": losses[-1]}


@dataclass(frozen=True)
class CalibrationBucket:
    low: float
    high: float
    count: int
    predicted: float  # mean prediction in the bucket
    realised: float  # mean realised return in the bucket


def calibration(pairs: Sequence[tuple[float, float]], buckets: int = 5) -> list[CalibrationBucket]:
    """Predicted vs realised return by equal-width bucket of the prediction over [0, 1] (empty buckets left
    out); a calibrated model has predicted ~ realised in every bucket."""
    grouped: dict[int, list[tuple[float, float]]] = {}
    for predicted, realised in pairs:
        grouped.setdefault(min(buckets - 1, max(0, int(predicted * buckets))), []).append((predicted, realised))
    return [CalibrationBucket(i / buckets, (i + 1) / buckets, len(g), sum(p for p, _ in g) / len(g),
                              sum(r for _, r in g) / len(g)) for i, g in sorted(grouped.items())]


def calibration_metrics(pairs: Sequence[tuple[float, float]], buckets: int = 5) -> dict[str, float]:
    """The buckets flattened for a metrics line, plus the count-weighted mean |predicted - realised| (ECE)."""
    found = calibration(pairs, buckets)
    total = sum(b.count for b in found)
    out: dict[str, float] = {}
    for b in found:
        name = f"value/calib_{b.low:.1f}_{b.high:.1f}"
        out[name + "_n"], out[name + "_pred"], out[name + "_real"] = float(b.count), b.predicted, b.realised
    if total:
        out["value/ece"] = sum(b.count * abs(b.predicted - b.realised) for b in found) / total
    return out
