"""Process rewards: small per-turn bonuses for objectively verifiable facts, and dead-loop penalties.

Only facts a tool reports about itself count (`Turn.signals`, `Turn.tool_ok`, `Turn.tool_error`): "the search
returned at least one result", "the code exited with status 0", "the SQL query was valid". Nothing here
guesses whether a step was *useful*; that is the outcome's job.

Two guards keep shaping from being gamed:

- a **cap**: the bonuses of one episode sum to at most `cap`, which must be strictly less than the reward for
  completing the task, so no amount of busywork can outscore a solved task;
- **dedup**: by default each fact pays at most once per episode (calling search 50 times pays once).

A dead loop (the same call, by `ToolCall.key()`, made `dead_loop_k` or more times) costs `dead_loop_penalty`
on each turn that repeats it; the loop itself ends such episodes (`StopReason.REPEATED_CALL`), which can cost
an extra `repeated_call_stop_penalty` on the last turn. Penalties are not capped.

Process rewards are per turn, aligned with `trajectory.turns`. A turn that owns no tokens (a later action parsed
from the same generated text) cannot carry credit in the token batch, so its reward moves to the nearest earlier
turn that does: the span that produced the action.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from agentgrad.rewards.base import REWARDS, CombinedReward, OutcomeReward, RewardFn
from agentgrad.types import RewardBreakdown, StopReason, ToolCall, Trajectory, Turn

Op = Literal["==", "!=", ">=", ">", "<=", "<", "truthy"]
Dedup = Literal["fact", "call", "none"]

_OPS: dict[str, Callable[[Any, Any], bool]] = {"==": operator.eq, "!=": operator.ne, ">=": operator.ge,
                                               ">": operator.gt, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Fact:
    """One verifiable fact a tool-call turn can establish, and the bonus it pays.

    The fact holds for a turn when its action is a `ToolCall` (to one of `tools`, if any are listed), the call
    succeeded (`tool_ok` is True and no `tool_error`, unless `require_ok=False`) and, if `signal` is given,
    `signals[signal] <op> value` (op "truthy": the signal is truthy).
    """

    name: str
    reward: float
    signal: str | None = None
    op: Op = "=="
    value: Any = None
    tools: tuple[str, ...] = ()
    require_ok: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tools, tuple):
            object.__setattr__(self, "tools", tuple(self.tools))
        if not (math.isfinite(self.reward) and self.reward >= 0):
            raise ValueError(f"fact {self.name!r}: reward must be a finite number >= 0 (penalties are separate), "
                             f"got {self.reward}")
        if self.op not in _OPS and self.op != "truthy":
            raise ValueError(f"fact {self.name!r}: unknown op {self.op!r}; valid: {sorted(_OPS) + ['truthy']}")

    def holds(self, turn: Turn) -> bool:
        action = turn.action
        if not isinstance(action, ToolCall):
            return False
        if self.tools and action.name not in self.tools:
            return False
        if self.require_ok and (turn.tool_ok is not True or turn.tool_error is not None):
            return False
        if self.signal is None:
            return True
        if self.signal not in turn.signals:
            return False
        got = turn.signals[self.signal]
        if self.op == "truthy":
            return bool(got)
        if isinstance(got, bool) != isinstance(self.value, bool):  # True == 1 must not count as exit code 1
            return False
        try:
            return bool(_OPS[self.op](got, self.value))
        except TypeError:  # e.g. None >= 1: a malformed signal is not a verified fact
            return False


SEARCH_RESULTS = Fact("search_results", 0.1, signal="results", op=">=", value=1)
CODE_EXIT_ZERO = Fact("code_exit_zero", 0.2, signal="exit_code", op="==", value=0)
SQL_VALID = Fact("sql_valid", 0.1, tools=("sql",))
KNOWN_ENTITY = Fact("known_entity", 0.1, signal="known_entity", op="truthy")  # api-catalog: a name copied right
LOGGED_IN = Fact("logged_in", 0.1, signal="logged_in", op="truthy", tools=("auth.login",))
DEFAULT_FACTS: tuple[Fact, ...] = (SEARCH_RESULTS, CODE_EXIT_ZERO, SQL_VALID, KNOWN_ENTITY, LOGGED_IN)


@dataclass(frozen=True)
class ProcessRewardConfig:
    """The shaping table. Defaults: search with >= 1 result +0.1, code with exit code 0 +0.2, valid SQL +0.1, an
    API lookup of something that exists +0.1, a successful login +0.1, task complete +1.0; bonuses capped at 0.5
    per episode, each fact paid once per episode; the 2nd and later identical call of an episode costs 0.1 each.

    - `facts`: the verifiable facts and their bonuses.
    - `task_complete`: the outcome reward for a solved task (used by `shaped_reward`); `cap` must be below it.
    - `cap`: the most the bonuses of one episode can add up to (>= 0, < task_complete).
    - `dedup`: "fact" (each fact pays once per episode), "call" (once per fact and distinct call), "none".
    - `dead_loop_k`: the occurrence of an identical call from which it is penalised (0 turns the penalty off).
    - `dead_loop_penalty`: subtracted on each such turn (a magnitude, >= 0).
    - `repeated_call_stop_penalty`: subtracted on the last turn of an episode the loop ended as REPEATED_CALL.
    """

    facts: tuple[Fact, ...] = DEFAULT_FACTS
    task_complete: float = 1.0
    cap: float = 0.5
    dedup: Dedup = "fact"
    dead_loop_k: int = 2
    dead_loop_penalty: float = 0.1
    repeated_call_stop_penalty: float = 0.0

    def __post_init__(self) -> None:
        facts = tuple(f if isinstance(f, Fact) else Fact(**f) for f in self.facts)
        object.__setattr__(self, "facts", facts)
        names = [f.name for f in facts]
        if len(set(names)) != len(names):
            raise ValueError(f"fact names must be unique, got {names}")
        for key in ("task_complete", "cap", "dead_loop_penalty", "repeated_call_stop_penalty"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"{key} must be a finite number, got {v!r}")
        if self.cap < 0:
            raise ValueError(f"cap must be >= 0, got {self.cap}")
        if not self.cap < self.task_complete:
            raise ValueError(f"cap ({self.cap}) must be strictly less than task_complete ({self.task_complete}): "
                             "otherwise process rewards could outweigh completing the task")
        if self.dedup not in ("fact", "call", "none"):
            raise ValueError(f"dedup must be 'fact', 'call' or 'none', got {self.dedup!r}")
        if self.dead_loop_k != 0 and self.dead_loop_k < 2:
            raise ValueError(f"dead_loop_k must be 0 (off) or >= 2 (the first call is never a loop), "
                             f"got {self.dead_loop_k}")
        if self.dead_loop_penalty < 0 or self.repeated_call_stop_penalty < 0:
            raise ValueError("penalties are magnitudes (subtracted): give them as numbers >= 0")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessRewardConfig:
        """From plain config data (YAML). `facts` is a list of Fact fields, or a mapping {fact name: reward}
        that re-weights the default facts (reward 0 drops one); unknown keys raise ValueError."""
        data = dict(data)
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown process reward option(s) {sorted(unknown)}; "
                             f"valid: {sorted(cls.__dataclass_fields__)}")
        facts = data.get("facts")
        if isinstance(facts, Mapping):
            defaults = {f.name: f for f in DEFAULT_FACTS}
            bad = set(facts) - set(defaults)
            if bad:
                raise ValueError(f"unknown fact(s) {sorted(bad)}; default facts: {sorted(defaults)} "
                                 "(give a list of Fact fields to define new ones)")
            data["facts"] = tuple(replace(f, reward=float(facts.get(f.name, f.reward))) for f in DEFAULT_FACTS
                                  if float(facts.get(f.name, f.reward)) > 0)
        elif facts is not None:
            data["facts"] = tuple(f if isinstance(f, Fact) else Fact(**f) for f in facts)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["facts"] = [asdict(f) | {"tools": list(f.tools)} for f in self.facts]
        return out


def fact_bonuses(trajectory: Trajectory, config: ProcessRewardConfig) -> tuple[float, ...]:
    """Per-turn bonuses for verified facts, deduplicated per `config.dedup` and capped at `config.cap` in
    total (the turn that reaches the cap gets the remainder, later ones nothing)."""
    bonus = [0.0] * len(trajectory.turns)
    paid: set[Any] = set()
    total = 0.0
    for i, turn in enumerate(trajectory.turns):
        for fact in config.facts:
            if fact.reward <= 0 or not fact.holds(turn):
                continue
            if config.dedup != "none":
                key = fact.name if config.dedup == "fact" else (fact.name, turn.action.key())  # type: ignore[union-attr]
                if key in paid:
                    continue
                paid.add(key)
            amount = min(fact.reward, config.cap - total)
            if amount <= 1e-12:  # the cap is reached (up to rounding)
                continue
            bonus[i] += amount
            total += amount
    return tuple(bonus)


def repeated_call_turns(trajectory: Trajectory, k: int) -> tuple[int, ...]:
    """Indices of the turns whose tool call (by `ToolCall.key()`) is at least the k-th identical call of the
    episode. k=0 means never.

    >>> from agentgrad.rewards.testing import make_trajectory, tool_turn
    >>> t = make_trajectory([tool_turn("search", {"q": "a"}), tool_turn("search", {"q": "b"}),
    ...                      tool_turn("search", {"q": "a"}), tool_turn("search", {"q": "a"})])
    >>> repeated_call_turns(t, 2), repeated_call_turns(t, 3)
    ((2, 3), (3,))
    """
    if k <= 0:
        return ()
    counts: Counter[str] = Counter()
    out = []
    for i, turn in enumerate(trajectory.turns):
        if isinstance(turn.action, ToolCall):
            counts[turn.action.key()] += 1
            if counts[turn.action.key()] >= k:
                out.append(i)
    return tuple(out)


def dead_loop_penalties(trajectory: Trajectory, config: ProcessRewardConfig) -> tuple[float, ...]:
    """Per-turn penalties (as negative numbers) for repeated calls and for an episode ended by a repeated call."""
    pen = [0.0] * len(trajectory.turns)
    if config.dead_loop_penalty > 0:
        for i in repeated_call_turns(trajectory, config.dead_loop_k):
            pen[i] -= config.dead_loop_penalty
    if config.repeated_call_stop_penalty > 0 and trajectory.stop_reason == StopReason.REPEATED_CALL and pen:
        pen[-1] -= config.repeated_call_stop_penalty
    return tuple(pen)


def attribute_to_generated_turns(trajectory: Trajectory, per_turn: Sequence[float]) -> tuple[float, ...]:
    """Move the reward of turns that own no tokens (`end == start`) onto the nearest earlier turn that does."""
    out = list(per_turn)
    owner: int | None = None
    for i, turn in enumerate(trajectory.turns):
        if turn.end > turn.start:
            owner = i
        elif owner is not None and out[i] != 0.0:
            out[owner] += out[i]
            out[i] = 0.0
    return tuple(out)


@dataclass(frozen=True)
class ProcessReward:
    """Process rewards only (outcome 0.0): capped fact bonuses plus dead-loop penalties, per turn."""

    config: ProcessRewardConfig = field(default_factory=ProcessRewardConfig)
    name: str = "process"

    def per_turn(self, trajectory: Trajectory) -> tuple[float, ...]:
        bonus = fact_bonuses(trajectory, self.config)
        pen = dead_loop_penalties(trajectory, self.config)
        return attribute_to_generated_turns(trajectory, [b + p for b, p in zip(bonus, pen)])

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        return RewardBreakdown(outcome=0.0, process=self.per_turn(trajectory))


def process_reward(config: ProcessRewardConfig | Mapping[str, Any] | None = None, **options: Any) -> ProcessReward:
    """`process_reward(cap=0.3, dedup="call")`; the registered "process" factory is `make_process_reward`."""
    if isinstance(config, ProcessRewardConfig):
        if options:
            config = replace(config, **options)
        return ProcessReward(config)
    return ProcessReward(ProcessRewardConfig.from_dict({**dict(config or {}), **options}))


def shaped_reward(outcome: Any, config: ProcessRewardConfig | Mapping[str, Any] | None = None,
                  **options: Any) -> CombinedReward:
    """Outcome plus process rewards: `task_complete * outcome + capped bonuses - penalties`.

    `outcome` is a task suite (its verifier decides, via `OutcomeReward`) or any reward function whose outcome
    is in [0, 1] (e.g. a `VerifierReward` or a `JudgeReward`). Since bonuses never exceed `cap <
    task_complete`, an episode that fails the task never outscores one that completes it without penalties.
    The registered "shaped" factory is `make_shaped_reward`: `load_reward("shaped", suite, cap=0.3)`.
    """
    proc = process_reward(config, **options)
    outcome_fn: RewardFn = OutcomeReward(outcome) if hasattr(outcome, "verify") else outcome
    if not callable(outcome_fn):
        raise TypeError(f"outcome must be a task suite or a reward function, got {type(outcome).__name__}")
    return CombinedReward([(outcome_fn, proc.config.task_complete), (proc, 1.0)])


def make_process_reward(suite: Any, **options: Any) -> ProcessReward:
    """Registered as "process": `REWARDS.get("process")(suite, cap=0.3, dedup="call")`; `suite` is unused, the
    options are `ProcessRewardConfig.from_dict` fields."""
    return ProcessReward(ProcessRewardConfig.from_dict(options))


def make_shaped_reward(suite: Any, *, outcome: str | Mapping[str, Any] | None = None,
                       **options: Any) -> CombinedReward:
    """Registered as "shaped": `REWARDS.get("shaped")(suite, cap=0.3, dedup="call", facts={...})`.

    The outcome is `OutcomeReward(suite)` unless `outcome` names another reward: a spec string
    (`"verifier"`, `"pkg.mod:factory"`) or a mapping `{"name": spec, **its_options}`, loaded with
    `load_reward(spec, suite, **its_options)`. The other options are `ProcessRewardConfig` fields.
    """
    from agentgrad.rewards.base import load_reward

    if outcome is None:
        outcome_fn: RewardFn = OutcomeReward(suite)
    elif isinstance(outcome, str):
        outcome_fn = load_reward(outcome, suite)
    elif isinstance(outcome, Mapping):
        if "name" not in outcome:
            raise ValueError("shaped reward: an `outcome` mapping needs a `name` (a reward spec)")
        sub = dict(outcome)
        outcome_fn = load_reward(sub.pop("name"), suite, **sub)
    else:
        raise TypeError(f"shaped reward: `outcome` must be a reward spec or a mapping, got {type(outcome).__name__}")
    return shaped_reward(outcome_fn, ProcessRewardConfig.from_dict(options))


REWARDS.add("process", make_process_reward)
REWARDS.add("shaped", make_shaped_reward)
