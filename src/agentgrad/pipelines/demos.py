"""Expert demonstrations for BC, and the check that they fit the rollout limits.

A demonstration the limits cut short teaches the policy an episode it could never finish, so it is never cloned.
Each suite ships limits with headroom over its longest measured demonstration (docs/demo-limits.md,
`benchmarks/demo_lengths.py`); the rare demonstration that still does not fit (a long tail the seeds measured did
not reach) is dropped and counted. Only when more than `MAX_DROPPED_SHARE` do not fit is it an error: then the
limits, not the tail, are wrong.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentgrad.envs.base import close_env
from agentgrad.logging import ProgressDisplay
from agentgrad.rollout.factored import NameWriter
from agentgrad.rollout.loop import EpisodeLimits, expert_trajectory
from agentgrad.types import StopReason, Trajectory

if TYPE_CHECKING:
    from agentgrad.logging import RunLogger
    from agentgrad.pipelines.components import Components

MAX_DROPPED_SHARE = 0.01
"""Most demonstrations (as a share) that may be dropped for not fitting the limits before BC refuses to start.
1% changes BC's data by less than its batch sampling does, and no suite measured comes near it (its tail is 0 to
a few in 2,000); more than that means the limits cut a whole kind of task, which BC would then never learn."""


FINISHED = (StopReason.ANSWERED, StopReason.ENV_TERMINATED)  # a game's env may end the episode itself


class DemoLimitError(ValueError):
    """Expert demonstrations that the rollout limits cut short: BC on them would teach truncated episodes."""


@dataclass(frozen=True)
class DemoLength:
    """What a demonstration needs from the limits: total tokens (prompt included), policy turns, longest turn."""

    total_tokens: int
    turns: int
    max_turn_tokens: int
    prompt_tokens: int

    @classmethod
    def of(cls, demo: Trajectory) -> DemoLength:
        return cls(len(demo.token_ids), len(demo.turns), max((t.end - t.start for t in demo.turns), default=0),
                   demo.prompt_length)


@dataclass(frozen=True)
class DemoFit:
    """The demonstrations that fit (in their original order) and an account of those that did not."""

    kept: tuple[Trajectory, ...]
    total: int
    problems: tuple[str, ...] = ()  # one line per limit that cut some, with the key to raise

    @property
    def dropped(self) -> int:
        return self.total - len(self.kept)

    def message(self) -> str:
        return (f"{self.dropped} of {self.total} expert demonstrations do not fit the rollout limits: "
                + "; ".join(self.problems))


def unlimited(limits: EpisodeLimits) -> EpisodeLimits:
    """`limits` with no episode limits: the lengths a demonstration needs, for measuring."""
    return dataclasses.replace(limits, max_turns=10**6, max_new_tokens_per_turn=10**9, max_total_tokens=10**9)


def check_demos_fit(demos: list[Trajectory], limits: EpisodeLimits, *,
                    max_dropped_share: float = MAX_DROPPED_SHARE) -> DemoFit:
    """Split the demonstrations into those that fit `limits` and those that do not (cut before answering, or with a
    turn longer than rollout.max_new_tokens_per_turn). Raises DemoLimitError, saying which limit to raise, when
    more than `max_dropped_share` of them do not fit."""
    cut = [d for d in demos if d.stop_reason not in FINISHED]
    long_turns = [d for d in demos if d.stop_reason in FINISHED
                  and DemoLength.of(d).max_turn_tokens > limits.max_new_tokens_per_turn]
    problems = []
    if cut:
        d = cut[0]
        problems.append(f"{len(cut)} stop before answering (first: {d.task.task_id}, {d.stop_reason.value} after "
                        f"{len(d.turns)} turns, {len(d.token_ids)} tokens, prompt {d.prompt_length}); limits: "
                        f"rollout.max_turns={limits.max_turns}, rollout.max_total_tokens={limits.max_total_tokens}")
    if long_turns:
        need = max(DemoLength.of(d).max_turn_tokens for d in long_turns)
        problems.append(f"{len(long_turns)} have turns of up to {need} tokens; "
                        f"rollout.max_new_tokens_per_turn={limits.max_new_tokens_per_turn}")
    bad = {id(d) for d in cut + long_turns}
    fit = DemoFit(tuple(d for d in demos if id(d) not in bad), len(demos), tuple(problems))
    if fit.dropped > max_dropped_share * fit.total:
        raise DemoLimitError(f"{fit.message()} (more than {max_dropped_share:.0%} may not be dropped: raise the "
                             f"limit named, see docs/demo-limits.md)")
    return fit


def with_names_in_lm_loss(demo: Trajectory) -> Trajectory:
    """A demo whose head decisions' name tokens are back in the LM's loss (loss_mask 1, as the tokens arm has
    them): the LM learns to write the names, which trains the very hidden state a detached head reads (the
    state that predicts the name's first token); at rollout the head still chooses the names."""
    if not demo.head_decisions:
        return demo
    mask = list(demo.loss_mask)
    for d in demo.head_decisions:
        mask[d.position + 1:d.end] = [1] * (d.end - d.position - 1)
    return dataclasses.replace(demo, loss_mask=tuple(mask))


def expert_demos(c: Components, n: int, seed: int, *, logger: RunLogger | None = None,
                 display: ProgressDisplay | None = None) -> list[Trajectory]:
    """`n` expert demonstrations of the suite's train split, encoded as rollouts are, less the few that do not fit
    the limits (counted: metric data/demos_dropped, and a warning line); a progress bar on `display`."""
    tasks = c.suite.sample_tasks(n, split="train", seed=seed)
    env = c.suite.make_env()
    writer = NameWriter(c.tool_head, c.codec) if c.tool_head is not None else None
    demos = []
    try:
        with (display or ProgressDisplay(enabled=False)).track("expert demonstrations", len(tasks)) as progress:
            for t in tasks:
                demo = expert_trajectory(env, t, c.suite.expert_actions(t), c.codec, c.limits, writer=writer)
                names = writer is not None and c.config.bc.lm_learns_names
                demos.append(with_names_in_lm_loss(demo) if names else demo)
                progress(len(demos), None)
    finally:
        close_env(env)
    fit = check_demos_fit(demos, c.limits)
    if logger is not None:
        logger.log(0, "bc", {"data/demos": float(fit.total), "data/demos_dropped": float(fit.dropped)})
    if fit.dropped:
        warning = f"warning: dropped {fit.message()}"
        if logger is not None:
            logger.display.print(warning)
        else:
            print(warning, file=sys.stderr)
    return list(fit.kept)
