"""TokenBatch and `collate`: the one place where lists of trajectories become tensors.

Conventions (all tensors right-padded to the longest sequence, T):
- position t of every per-token tensor describes token t of `input_ids`;
- `old_logprobs[b, t]` is log pi_behaviour(input_ids[b, t] | input_ids[b, :t]); position 0 is always 0;
- `loss_mask[b, t] == 1` exactly where token t was sampled by the policy and the sample is trainable
  (padding, prompt, tool observations and masked samples are 0);
- `values[b, t]` (critics) is V(input_ids[b, :t]), the value of the state in which token t was chosen, read from
  the hidden state at position t - 1, exactly as `old_logprobs[b, t]` is; position 0 is 0;
- `token_rewards[b, t]` credits rewards at tokens: each turn's process reward on that turn's last generated
  token, the outcome reward on the last generated token of the episode.
- `logit_masks` (only when some trajectory was sampled under constrained decoding) names, per token, the legal
  set it was sampled from, so the learner scores it with the same masked softmax (`algos.masked_token_logprobs`).
Turns are the maximal runs of 1s in the (unmasked) policy mask; estimators that discount per turn derive them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentgrad.types import ScoredTrajectory, Trajectory


@dataclass(frozen=True)
class LogitMasks:
    """Legal token sets of constrained positions, deduplicated into a small table (a dense (B, T, V) mask would
    not fit a 150k vocabulary)."""

    index: torch.Tensor  # (B, T) long: row of `token_ids` holding token t's legal set, -1 where unconstrained
    token_ids: torch.Tensor  # (S, K) long, -1 padded
    allow: torch.Tensor  # (S,) bool: True = only these ids were legal; False = all ids but these

    def select(self, rows: torch.Tensor | slice, width: int) -> LogitMasks:
        return LogitMasks(self.index[rows][:, :width], self.token_ids, self.allow)

    def to(self, device: torch.device | str) -> LogitMasks:
        return LogitMasks(self.index.to(device), self.token_ids.to(device), self.allow.to(device))


@dataclass(frozen=True)
class HeadBatch:
    """The factored head's decisions in a list of trajectories (`Trajectory.head_decisions`), one row each."""

    row: torch.Tensor  # (D,) long: which trajectory
    position: torch.Tensor  # (D,) long: the token whose hidden state the head read
    choice: torch.Tensor  # (D,) long: an index into the head's choices (tools, or categories)
    legal: torch.Tensor  # (D, K) bool: the choices legal at that decision
    old_logprob: torch.Tensor  # (D,) float: the behaviour policy's log p of the choice

    @property
    def score_position(self) -> torch.Tensor:
        """(D,) where an RL batch scores the decision: the name's first token (loss_mask 0 otherwise), so the
        decision is one more action in the per-token loss with the advantage of that position."""
        return self.position + 1

    def select(self, rows: torch.Tensor | slice, num_rows: int) -> HeadBatch:
        """The decisions of batch rows `rows` (of `num_rows`), renumbered as the selected batch's rows."""
        device = self.row.device
        picked = torch.arange(num_rows, device=device)[rows]  # (b,)
        new_row = torch.full((num_rows,), -1, dtype=torch.long, device=device)
        new_row[picked] = torch.arange(len(picked), device=device)
        keep = new_row[self.row] >= 0  # (D,)
        return HeadBatch(new_row[self.row][keep], self.position[keep], self.choice[keep], self.legal[keep],
                         self.old_logprob[keep])

    def to(self, device: torch.device | str) -> HeadBatch:
        return HeadBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate_head(trajs: Sequence[Trajectory], choices: Sequence[str]) -> HeadBatch:
    """Head decisions as tensors over the head's choices (tool names or categories; the trajectories, being plain
    data, do not know them). A decision naming a choice the head lacks is an error: the head could never have
    made it."""
    index = {n: i for i, n in enumerate(choices)}
    rows = [(b, d) for b, t in enumerate(trajs) for d in t.head_decisions]
    unknown = {d.choice for _, d in rows} - index.keys()
    if unknown:
        raise ValueError(f"head decisions name choices the head does not have: {sorted(unknown)[:5]}")
    legal = torch.zeros((len(rows), len(choices)), dtype=torch.bool)  # (D, K)
    for k, (_, d) in enumerate(rows):
        legal[k, [index[n] for n in d.legal if n in index]] = True
    return HeadBatch(row=torch.tensor([b for b, _ in rows], dtype=torch.long),
                     position=torch.tensor([d.position for _, d in rows], dtype=torch.long),
                     choice=torch.tensor([index[d.choice] for _, d in rows], dtype=torch.long), legal=legal,
                     old_logprob=torch.tensor([d.logprob for _, d in rows], dtype=torch.float32))


@dataclass(frozen=True)
class TokenBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    loss_mask: torch.Tensor  # (B, T) float, 1 on trainable policy tokens
    old_logprobs: torch.Tensor  # (B, T) float, behaviour logprobs
    token_rewards: torch.Tensor  # (B, T) float
    group_index: torch.Tensor  # (B,) long, which TrajectoryGroup each row came from
    advantages: torch.Tensor | None = None  # (B, T) float
    returns: torch.Tensor | None = None  # (B, T) float
    ref_logprobs: torch.Tensor | None = None  # (B, T) float, frozen reference policy
    values: torch.Tensor | None = None  # (B, T) float, critic's V(input_ids[b, :t]) at the rollout, 0 off-policy
    is_weights: torch.Tensor | None = None  # (B, T) float, off-policy correction pi/mu (1 on fresh rows)
    logit_masks: LogitMasks | None = None  # legal sets of tokens sampled under constrained decoding
    head: HeadBatch | None = None  # factored-head decisions scored as actions (collate(head_tools=...))

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_policy_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def replace(self, **changes: torch.Tensor | None) -> TokenBatch:
        return dataclasses.replace(self, **changes)

    def select(self, rows: torch.Tensor | slice) -> TokenBatch:
        """Rows of the batch (for minibatches); trims trailing all-padding columns."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("logit_masks", "head")}
        picked = {k: (v[rows] if v is not None else None) for k, v in fields.items()}
        width = int(picked["attention_mask"].sum(dim=1).max().item()) if picked["attention_mask"].numel() else 0
        masks = self.logit_masks.select(rows, width) if self.logit_masks is not None else None
        head = self.head.select(rows, self.num_sequences) if self.head is not None else None
        return TokenBatch(**{k: (v[:, :width] if v is not None and v.dim() == 2 else v) for k, v in picked.items()},
                          logit_masks=masks, head=head)

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(**{f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None
                                      else None) for f in dataclasses.fields(self)})


def _token_rewards(sample: ScoredTrajectory) -> list[float]:
    traj = sample.trajectory
    rewards = [0.0] * len(traj.token_ids)
    if sample.reward.masked:
        return rewards
    gen_turns = [t for t in traj.turns if t.end > t.start]
    for turn, r in zip(traj.turns, sample.reward.process):
        if turn.end > turn.start:
            rewards[turn.end - 1] += r
    if gen_turns:
        rewards[gen_turns[-1].end - 1] += sample.reward.outcome
    else:  # nothing generated: credit the last token so the reward is not silently lost
        last = max(i for i, m in enumerate(traj.loss_mask) if m) if any(traj.loss_mask) else len(rewards) - 1
        rewards[last] += sample.reward.outcome
    return rewards


def collate(
    samples: Sequence[ScoredTrajectory | Trajectory],
    *,
    pad_token_id: int,
    group_index: Sequence[int] | None = None,
    max_length: int | None = None,
    head_choices: Sequence[str] | None = None,
) -> TokenBatch:
    """Pad a list of trajectories into a TokenBatch. Plain `Trajectory`s (e.g. expert demos) get zero rewards.

    Masked samples (`reward.masked`) keep their tokens but get an all-zero loss_mask, so they cost no
    gradient and are still visible to metrics. With `head_choices` (a factored head's choices, for RL), each
    head decision becomes one more action at its `score_position`: loss_mask 1 there (unless the sample is
    masked), old_logprobs the decision's, and `TokenBatch.head` tells the learner to score it with the head.
    """
    if not samples:
        raise ValueError("collate() needs at least one trajectory")
    trajs = [s.trajectory if isinstance(s, ScoredTrajectory) else s for s in samples]
    lengths = [len(t.token_ids) for t in trajs]
    width = max(lengths)
    if max_length is not None and width > max_length:
        raise ValueError(f"trajectory of {width} tokens exceeds max_length={max_length}")
    B = len(trajs)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((B, width), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((B, width), dtype=torch.float32)  # (B, T)
    old_logprobs = torch.zeros((B, width), dtype=torch.float32)  # (B, T)
    token_rewards = torch.zeros((B, width), dtype=torch.float32)  # (B, T)
    for b, (sample, traj) in enumerate(zip(samples, trajs)):
        n = lengths[b]
        input_ids[b, :n] = torch.tensor(traj.token_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        old_logprobs[b, :n] = torch.tensor(traj.logprobs, dtype=torch.float32)
        masked = isinstance(sample, ScoredTrajectory) and sample.reward.masked
        if not masked:
            loss_mask[b, :n] = torch.tensor(traj.loss_mask, dtype=torch.float32)
        if isinstance(sample, ScoredTrajectory):
            token_rewards[b, :n] = torch.tensor(_token_rewards(sample), dtype=torch.float32)
    groups = torch.tensor(list(group_index) if group_index is not None else range(B), dtype=torch.long)  # (B,)
    if groups.shape[0] != B:
        raise ValueError(f"group_index has {groups.shape[0]} entries for {B} samples")
    head = None
    if head_choices is not None and any(t.head_decisions for t in trajs):
        head = collate_head(trajs, head_choices)
        at = (head.row, head.score_position)
        old_logprobs[at] = head.old_logprob
        loss_mask[at] = attention_mask[at].float() * loss_mask[head.row].amax(dim=1)  # 0 on masked samples
    return TokenBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      old_logprobs=old_logprobs, token_rewards=token_rewards, group_index=groups,
                      logit_masks=_logit_masks(trajs, width), head=head)


def _logit_masks(trajs: Sequence[Trajectory], width: int) -> LogitMasks | None:
    if not any(t.token_masks for t in trajs):
        return None
    table: dict[tuple[tuple[int, ...], bool], int] = {}
    index = torch.full((len(trajs), width), -1, dtype=torch.long)  # (B, T)
    for b, traj in enumerate(trajs):
        for m in traj.token_masks:
            index[b, m.position] = table.setdefault((m.token_ids, m.allow), len(table))
    K = max(len(ids) for ids, _ in table)
    token_ids = torch.full((len(table), K), -1, dtype=torch.long)  # (S, K)
    for (ids, _), s in table.items():
        token_ids[s, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    allow = torch.tensor([a for (_, a) in table], dtype=torch.bool)  # (S,) in insertion order, as the rows
    return LogitMasks(index=index, token_ids=token_ids, allow=allow)
