"""Frozen records that flow one way: Task -> Trajectory -> ScoredTrajectory -> TrajectoryGroup.

Plain Python only (no torch): these records cross process boundaries (Ray workers, the trajectory store),
so they must pickle and serialise to JSON cheaply. `batch.collate` is the only place they become tensors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One problem for the agent. `answer` is what the verifier compares against; the env never shows it."""

    task_id: str
    prompt: str
    answer: str
    suite: str = "custom"
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def content_hash(self) -> str:
        """A hash of the problem itself (prompt, answer, metadata), not of its id: two tasks with the same hash
        are the same problem, so evaluation counts them once (a game whose prompt hides the secret differs
        by its answer)."""
        import hashlib
        import json

        data = json.dumps([self.prompt, self.answer, self.metadata], sort_keys=True, default=str)
        return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


# ---- actions: what the policy's text parses into; an Env.step takes exactly one of these --------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]

    def key(self) -> str:
        """Canonical identity of the call, used to detect repeated (dead-loop) calls."""
        import json

        return self.name + ":" + json.dumps(self.arguments, sort_keys=True, default=str)


@dataclass(frozen=True)
class FinalAnswer:
    text: str


@dataclass(frozen=True)
class InvalidAction:
    """Text that looked like a tool call but could not be parsed. Becomes an error observation, never a crash."""

    text: str
    error: str


Action = ToolCall | FinalAnswer | InvalidAction


class StopReason(str, enum.Enum):
    ANSWERED = "answered"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    INVALID_CALLS = "invalid_calls"
    REPEATED_CALL = "repeated_call"
    ENV_TERMINATED = "env_terminated"


@dataclass(frozen=True)
class Message:
    """A chat message in the OpenAI/HF shape. `tool_calls` only on assistant messages."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()

    def to_chat(self) -> dict[str, Any]:
        """The dict form that HF chat templates (and OpenAI logs) expect."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                for c in self.tool_calls
            ]
        return out


@dataclass(frozen=True)
class Turn:
    """One policy turn: the generated span, what it parsed to, and what the environment answered.

    `start`/`end` index into `Trajectory.token_ids` (end exclusive) and cover exactly the generated tokens.
    """

    start: int
    end: int
    text: str
    action: Action
    observation: str | None
    tool_ok: bool | None = None
    tool_error: str | None = None
    signals: Mapping[str, Any] = field(default_factory=dict)
    env_reward: float = 0.0


@dataclass(frozen=True)
class TokenMask:
    """The legal next tokens when token `position` of a trajectory was sampled under constrained decoding.

    `allow=True`: only `token_ids` were legal; `allow=False`: every token but `token_ids` was. The learner
    scores such a token with the log-softmax over the same legal set, so PPO/GRPO ratios stay exact.
    """

    position: int
    token_ids: tuple[int, ...]
    allow: bool = True


@dataclass(frozen=True)
class HeadDecision:
    """A choice made by a factored action head (`models/factored_head.py`) instead of sampled as tokens: a tool
    (`rollout.action_head=factored`) or a category (`category`, whose tool the LM then writes).

    `position` is the token whose hidden state the head read (the last token of the call header); the tokens
    the choice wrote in (the tool's name, or the start its category's legal names share) follow it at
    `position + 1 .. end - 1`, as context (loss_mask 0, logprob 0.0), so the LM's token loss never sees them.
    `logprob` is the behaviour policy's log p(category) + log p(tool | category), or log p(category), over
    `legal`, the choices legal in that state, which the learner needs to rescore the same decision.
    """

    position: int
    end: int
    choice: str
    logprob: float
    legal: tuple[str, ...]


@dataclass(frozen=True)
class Trajectory:
    """One episode, token-in/token-out.

    `token_ids`, `loss_mask` and `logprobs` have one entry per token of the whole episode (prompt, generated
    turns, observations). `loss_mask[i] == 1` exactly where token i was sampled by the policy; `logprobs[i]`
    is the behaviour policy's log-probability of token i (0.0 where loss_mask is 0), under the legal set of
    `token_masks` where a mask constrained that token.
    """

    task: Task
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_length: int
    turns: tuple[Turn, ...]
    stop_reason: StopReason
    messages: tuple[Message, ...] = ()
    policy_version: int = 0
    sample_index: int = 0
    token_masks: tuple[TokenMask, ...] = ()
    head_decisions: tuple[HeadDecision, ...] = ()  # names chosen by a factored head (rollout.action_head)
    final_info: Mapping[str, Any] = field(default_factory=dict)
    """The env's `info` from the step that ended the episode (a final answer, or the env's own `terminated` /
    `truncated`), JSON-able; empty when a rollout limit ended it. An env that owns its outcome (a game) reports
    `info["success"]` here, and reward functions may read anything else it put there."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids, loss_mask, logprobs must have equal length; got {n}, "
                f"{len(self.loss_mask)}, {len(self.logprobs)}"
            )
        if any(not (0 < m.position < n) or not m.token_ids for m in self.token_masks):
            raise ValueError("token_masks must name a sampled position (0 < position < len) and at least one id")
        if any(not (0 <= d.position < d.end <= n) or d.choice not in d.legal for d in self.head_decisions):
            raise ValueError("head_decisions must span tokens of the trajectory and make a legal choice")

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def final_answer(self) -> str | None:
        for turn in reversed(self.turns):
            if isinstance(turn.action, FinalAnswer):
                return turn.action.text
        return None

    @property
    def env_success(self) -> bool | None:
        """What the env said about success when it ended the episode (`info["success"]`), or None."""
        value = self.final_info.get("success")
        return None if value is None else bool(value)

    @property
    def num_invalid_calls(self) -> int:
        return sum(1 for t in self.turns if isinstance(t.action, InvalidAction) or t.tool_error is not None)


@dataclass(frozen=True)
class RewardBreakdown:
    """What a reward function says about one trajectory.

    `process` has one entry per turn (verifiable step rewards). `masked` means "do not train on this sample"
    (the reward function failed): such a sample is excluded from the loss and counted, never scored 0.
    """

    outcome: float
    process: tuple[float, ...] = ()
    masked: bool = False
    reason: str | None = None

    @property
    def total(self) -> float:
        return self.outcome + sum(self.process)

    def __post_init__(self) -> None:
        if not self.masked and not (math.isfinite(self.outcome) and all(math.isfinite(p) for p in self.process)):
            raise ValueError("a non-finite reward must be reported as masked=True, not returned as a score")


@dataclass(frozen=True)
class ScoredTrajectory:
    trajectory: Trajectory
    reward: RewardBreakdown
    success: bool

    @property
    def total_reward(self) -> float:
        return self.reward.total


@dataclass(frozen=True)
class TrajectoryGroup:
    """All samples of one task: the unit that group-relative estimators (GRPO, RLOO) normalise within."""

    task: Task
    samples: tuple[ScoredTrajectory, ...]

    @property
    def is_zero_signal(self) -> bool:
        """True when every unmasked sample got the same reward: group-relative advantages are all zero."""
        totals = {round(s.total_reward, 9) for s in self.samples if not s.reward.masked}
        return len(totals) <= 1
