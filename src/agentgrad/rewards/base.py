"""Reward functions are plain callables: Trajectory -> RewardBreakdown.

`score` applies one to a list of trajectories with the failure semantics every caller relies on: a reward
function that raises, times out (see `with_timeout`) or returns a non-finite number masks that sample
(excluded from the loss, counted in metrics), it is never scored 0.

This module also holds the generic plumbing: weighted composition (`CombinedReward`), a thread-based timeout
wrapper (`with_timeout`) and `load_reward`, which resolves a registered name or a user's
"module.path:callable" reference. No torch here.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentgrad.envs.base import TaskSuite, episode_success
from agentgrad.registry import ImportRefError, Registry, import_ref
from agentgrad.types import RewardBreakdown, ScoredTrajectory, Trajectory


class RewardFn(Protocol):
    def __call__(self, trajectory: Trajectory) -> RewardBreakdown: ...


class BatchRewardFn(RewardFn, Protocol):
    """A reward that can also score a whole batch at once (a judge asks its endpoint concurrently); `score`
    prefers `batch`, which returns one result per trajectory, in order."""

    def batch(self, trajectories: Sequence[Trajectory]) -> Sequence[RewardBreakdown]: ...


class RewardFactory(Protocol):
    """The one signature of every `REWARDS` entry: `factory(suite, **options) -> RewardFn`.

    `suite` is the task suite (`suite.verify(task, answer) -> bool`; a factory may ignore it) and `options` are
    the reward's options from a YAML config mapping (plain JSON-able values).
    """

    def __call__(self, suite: TaskSuite, **options: Any) -> RewardFn: ...


# Name -> factory(suite, **options) -> RewardFn, e.g. `REWARDS.get("shaped")(suite, cap=0.3)`.
REWARDS: Registry[RewardFactory] = Registry("reward function")

_REASON_CHARS = 200


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within its time limit (see `with_timeout`). Masks the sample."""


class RewardSpecError(ValueError):
    """A reward spec ("name" or "module.path:callable") that cannot be resolved."""


def masked(reason: str) -> RewardBreakdown:
    """The breakdown of a sample that must not be trained on; `reason` says why (kept short)."""
    return RewardBreakdown(outcome=0.0, masked=True, reason=reason[:_REASON_CHARS])


def as_breakdown(value: Any, trajectory: Trajectory) -> RewardBreakdown:
    """Normalise what a reward function returned.

    A `RewardBreakdown` passes through (its `process`, when not empty, must have one entry per turn). A plain
    real number is accepted as an outcome-only reward; a non-finite one masks the sample. Anything else
    (including bools: use `VerifierReward` for a pass/fail check) raises TypeError.
    """
    if isinstance(value, RewardBreakdown):
        if not value.masked and value.process and len(value.process) != len(trajectory.turns):
            raise ValueError(f"process rewards have {len(value.process)} entries for {len(trajectory.turns)} turns")
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        v = float(value)
        if not math.isfinite(v):
            return masked(f"non-finite reward {v}")
        return RewardBreakdown(outcome=v, process=(0.0,) * len(trajectory.turns))
    raise TypeError(f"reward function returned {type(value).__name__}, not RewardBreakdown")


def _checked(compute: Callable[[], Any], trajectory: Trajectory) -> RewardBreakdown:
    try:
        reward = as_breakdown(compute(), trajectory)
    except Exception as exc:  # a failing reward masks the sample; it is never a silent 0
        return masked(f"{type(exc).__name__}: {exc}")
    if not reward.masked and not math.isfinite(reward.total):
        return masked("non-finite reward")
    return reward


def apply_reward(reward_fn: RewardFn, trajectory: Trajectory) -> RewardBreakdown:
    """Call `reward_fn` on one trajectory; any exception or non-finite result becomes a masked breakdown."""
    return _checked(lambda: reward_fn(trajectory), trajectory)


def apply_rewards(reward_fn: RewardFn, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
    """`apply_reward` over a batch, through the reward's `batch` method when it has one (`BatchRewardFn`). A
    `batch` that raises, or returns another number of results, masks every sample of the batch."""
    batch = getattr(reward_fn, "batch", None)
    if batch is None:
        return [apply_reward(reward_fn, t) for t in trajectories]
    try:
        values = list(batch(trajectories))
        if len(values) != len(trajectories):
            raise ValueError(f"batch returned {len(values)} rewards for {len(trajectories)} trajectories")
    except Exception as exc:
        return [masked(f"{type(exc).__name__}: {exc}")] * len(trajectories)
    return [_checked(lambda v=v: v, t) for v, t in zip(values, trajectories)]


@dataclass(frozen=True)
class OutcomeReward:
    """1.0 when the episode succeeded, else 0.0; no process rewards. Success is the suite's choice
    (`success_from`): its verifier on the final answer, the env's own `info["success"]` (a game won), or both."""

    suite: TaskSuite

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        correct = episode_success(self.suite, trajectory)
        return RewardBreakdown(outcome=1.0 if correct else 0.0, process=(0.0,) * len(trajectory.turns))


@dataclass(frozen=True)
class EnvReward:
    """The reward the env computed: the sum of its per-step rewards (`Turn.env_reward`) as the outcome.
    For the built-in suites (ToolEnv: 1.0 for a verified answer) it equals "outcome"; a game may score
    partial wins, penalties or points its own way."""

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        return RewardBreakdown(outcome=sum(t.env_reward for t in trajectory.turns),
                               process=(0.0,) * len(trajectory.turns))


def reject_options(name: str, options: dict[str, Any]) -> None:
    """For factories that take no options: a misspelt or misplaced option must not be silently ignored."""
    if options:
        raise TypeError(f"reward {name!r} takes no options, got {', '.join(sorted(options))}")


def make_outcome_reward(suite: TaskSuite, **options: Any) -> OutcomeReward:
    """Registered as "outcome": `OutcomeReward(suite)`; no options."""
    reject_options("outcome", options)
    return OutcomeReward(suite)


REWARDS.add("outcome", make_outcome_reward)


def make_env_reward(suite: TaskSuite, **options: Any) -> EnvReward:
    """Registered as "env": `EnvReward()`; no options."""
    reject_options("env", options)
    return EnvReward()


REWARDS.add("env", make_env_reward)


def score(trajectories: Sequence[Trajectory], reward_fn: RewardFn, suite: TaskSuite) -> list[ScoredTrajectory]:
    """Apply `reward_fn`; success is always the suite's (`episode_success`: its verifier, or the env's own
    outcome), never the reward's (a shaped reward must not redefine success).

    A reward function that raises, times out (`with_timeout`), returns a non-finite value or a process tuple
    that does not match the turns masks that sample: `reward.masked` is True and `reward.reason` says why.
    A reward with a `batch` method scores the whole list through it (`apply_rewards`).
    """
    rewards = apply_rewards(reward_fn, trajectories)
    return [ScoredTrajectory(traj, reward, success=episode_success(suite, traj))
            for traj, reward in zip(trajectories, rewards)]


# ---- composition -------------------------------------------------------------------------------------------


def _label(fn: Any) -> str:
    name = getattr(fn, "name", None)
    if isinstance(name, str):
        return name
    return getattr(fn, "__name__", None) or type(fn).__name__


WeightedFn = RewardFn | tuple[RewardFn, float]


class CombinedReward:
    """Weighted sum of reward functions: outcome = sum w_i * outcome_i, process[t] = sum w_i * process_i[t].

    The sample is masked if any component masks (or raises): a partial sum would silently change the reward's
    meaning. Components that return an empty `process` contribute zeros.

    >>> from agentgrad.rewards.testing import make_trajectory, answer_turn
    >>> const = lambda value: (lambda traj: RewardBreakdown(outcome=value, process=(0.5,)))
    >>> CombinedReward([(const(1.0), 2.0), (const(0.25), -1.0)])(make_trajectory([answer_turn("4")]))
    RewardBreakdown(outcome=1.75, process=(0.5,), masked=False, reason=None)
    """

    def __init__(self, components: Iterable[WeightedFn]) -> None:
        comps: list[tuple[RewardFn, float]] = []
        for item in components:
            fn, weight = item if isinstance(item, tuple) else (item, 1.0)
            if not callable(fn):
                raise TypeError(f"reward component {fn!r} is not callable")
            weight = float(weight)
            if not math.isfinite(weight):
                raise ValueError(f"weight of {_label(fn)} must be finite, got {weight}")
            comps.append((fn, weight))
        if not comps:
            raise ValueError("CombinedReward needs at least one component")
        self.components: tuple[tuple[RewardFn, float], ...] = tuple(comps)

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        return self._combine(trajectory, [apply_reward(fn, trajectory) for fn, _ in self.components])

    def batch(self, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
        """Each component over the whole batch (its own `batch` when it has one), then the weighted sums."""
        by_component = [apply_rewards(fn, trajectories) for fn, _ in self.components]
        return [self._combine(t, [rewards[i] for rewards in by_component]) for i, t in enumerate(trajectories)]

    def _combine(self, trajectory: Trajectory, rewards: Sequence[RewardBreakdown]) -> RewardBreakdown:
        n = len(trajectory.turns)
        outcome = 0.0
        process = [0.0] * n
        reasons: list[str] = []
        for (fn, weight), r in zip(self.components, rewards):
            if r.masked:
                reasons.append(f"{_label(fn)}: {r.reason}")
                continue
            outcome += weight * r.outcome
            for i, p in enumerate(r.process):
                process[i] += weight * p
        if reasons:
            return masked("; ".join(reasons))
        return RewardBreakdown(outcome=outcome, process=tuple(process))

    def __repr__(self) -> str:
        return "CombinedReward([" + ", ".join(f"({_label(f)}, {w:g})" for f, w in self.components) + "])"


# ---- timeouts ----------------------------------------------------------------------------------------------


class TimedReward:
    """`fn` run in a daemon thread; raises `RewardTimeoutError` when it does not return within `seconds`.

    Python cannot kill a thread: a timed-out call keeps running in the background until it returns (its
    result is dropped). Use it for reward functions that block on I/O (a judge endpoint), not for ones that
    spin the CPU forever.
    """

    def __init__(self, fn: RewardFn, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"timeout must be a positive number of seconds, got {seconds}")
        self.fn = fn
        self.seconds = float(seconds)
        self.name = _label(fn)

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = self.fn(trajectory)
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"reward-{self.name}", daemon=True).start()
        if not done.wait(self.seconds):
            raise RewardTimeoutError(f"{self.name} did not return within {self.seconds:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def __repr__(self) -> str:
        return f"with_timeout({self.name}, {self.seconds:g})"


def with_timeout(fn: RewardFn, seconds: float) -> TimedReward:
    """Wrap a reward function so a call taking longer than `seconds` raises `RewardTimeoutError` (which `score`
    turns into a masked sample)."""
    return TimedReward(fn, seconds)


# ---- loading by name or reference --------------------------------------------------------------------------


def _import_ref(spec: str) -> Any:
    try:
        return import_ref(spec, what="reward")
    except ImportRefError as exc:
        raise RewardSpecError(str(exc)) from None


def _suite_parameter(obj: Any) -> inspect.Parameter | None:
    """The parameter named `suite` of a callable (a function or a callable object), or None."""
    try:
        return inspect.signature(obj).parameters.get("suite")
    except (TypeError, ValueError):  # builtins and the like: not a factory
        return None


def load_reward(spec: str | Callable[..., Any], suite: TaskSuite, /, **options: Any) -> RewardFn:
    """Resolve a reward spec into a RewardFn, with the one factory signature `factory(suite, **options)`.

    `spec` is one of:

    - a registered name (`REWARDS`): `REWARDS.get(spec)(suite, **options)`, e.g. `load_reward("outcome",
      suite)`, `load_reward("shaped", suite, cap=0.3)`, `load_reward("verifier", suite, verifier="numeric")`;
    - "package.module:attr", a user's object, or that object itself. Then:
      - a class, or a callable with a parameter named `suite` (a factory), is called as
        `obj(suite, **options)` (`suite` by keyword unless it is positional-only);
      - any other callable is a plain reward function (Trajectory -> RewardBreakdown) and is used as is,
        which is only allowed without options (`RewardSpecError` otherwise: they would be silently ignored).

    Raises `RewardSpecError` for a reference that cannot be imported or resolves to something unusable, and
    `UnknownNameError` (listing the valid names) for an unknown name.
    """
    if isinstance(spec, str):
        if ":" not in spec:
            return REWARDS.get(spec)(suite, **options)
        obj: Any = _import_ref(spec)
    elif callable(spec):
        obj = spec
    else:
        raise RewardSpecError(f"reward spec must be a name or 'module:callable', got {type(spec).__name__}")
    label = spec if isinstance(spec, str) else _label(spec)
    if isinstance(obj, type):
        fn = obj(suite, **options)
    elif not callable(obj):
        raise RewardSpecError(f"reward {label!r} resolved to a non-callable {type(obj).__name__}")
    elif (param := _suite_parameter(obj)) is not None:
        fn = obj(suite, **options) if param.kind is inspect.Parameter.POSITIONAL_ONLY else obj(suite=suite, **options)
    elif options:
        raise RewardSpecError(
            f"reward {label!r} got options ({', '.join(sorted(options))}) but is a plain reward function; a "
            f"factory must take a parameter named `suite`: def {getattr(obj, '__name__', 'factory')}(suite, "
            f"**options) -> RewardFn")
    else:
        return obj
    if not callable(fn):
        raise RewardSpecError(f"reward factory {label!r} returned a non-callable {type(fn).__name__}")
    return fn
