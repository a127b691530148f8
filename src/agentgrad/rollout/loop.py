"""The agent loop: multi-turn, token-in/token-out episodes for a batch of environments at once.

Every episode advances one policy turn per round: generate until end-of-turn, parse, step the env, append the
observation's ids with loss_mask 0, repeat. Malformed calls become error observations and are counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from agentgrad.backends.base import Generation, Policy, SamplingParams
from agentgrad.envs.base import Env
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.constrained import MaskMode, turn_processor
from agentgrad.rollout.parser import parse_turn
from agentgrad.types import (Action, FinalAnswer, InvalidAction, Message, StopReason, Task, TokenMask, ToolCall,
                             Trajectory, Turn)


@dataclass(frozen=True)
class RolloutLimits:
    max_turns: int = 4
    max_new_tokens_per_turn: int = 64
    max_total_tokens: int = 512
    max_invalid_calls: int = 2  # the episode stops when this many invalid calls have been made
    repeated_call_limit: int = 3  # the same call (tool + arguments) this many times stops the episode
    tool_name_mask: MaskMode = "auto"  # constrained decoding of tool names (rollout/constrained.py)


@dataclass
class _Episode:
    env: Env
    task: Task
    sample_index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    messages: list[Message]
    turns: list[Turn] = field(default_factory=list)
    invalid_calls: int = 0
    call_counts: Counter = field(default_factory=Counter)
    stop_reason: StopReason | None = None
    offered_tools: frozenset[str] = frozenset()  # tool names the prompt shows
    token_masks: list[TokenMask] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None


def start_episode(env: Env, task: Task, codec: ChatCodec, *, seed: int | None, sample_index: int = 0) -> _Episode:
    observation, info = env.reset(seed=seed, options={"task": task})
    messages = [Message("system", info.get("system", ""))] if info.get("system") else []
    messages.append(Message("user", observation))
    ids = codec.prompt_ids(messages, info.get("tools"))
    offered = frozenset(s.get("function", s).get("name", "") for s in info.get("tools") or ())
    return _Episode(env=env, task=task, sample_index=sample_index, token_ids=ids, loss_mask=[0] * len(ids),
                    logprobs=[0.0] * len(ids), prompt_length=len(ids), messages=messages, offered_tools=offered)


def _assistant_message(text: str, actions: Sequence[Action]) -> Message:
    calls = tuple(a for a in actions if isinstance(a, ToolCall))
    return Message("assistant", text if not calls else text.split("<tool_call>")[0].strip(), tool_calls=calls)


def advance(ep: _Episode, gen: Generation, codec: ChatCodec, limits: RolloutLimits,
            token_masks: Sequence[TokenMask] = ()) -> None:
    """Apply one generated turn to an episode: record tokens, step the env, append the observation.
    `token_masks` (positions relative to the turn) are the legal sets its tokens were sampled from."""
    start = len(ep.token_ids)
    budget = limits.max_total_tokens - start
    ids, lps = list(gen.token_ids[:budget]), list(gen.logprobs[:budget])
    ep.token_masks += [TokenMask(start + m.position, m.token_ids, m.allow) for m in token_masks
                       if m.position < len(ids)]
    ep.token_ids += ids
    ep.loss_mask += [1] * len(ids)
    ep.logprobs += lps
    text = codec.decode(ids)
    if gen.finish_reason != "stop" or len(ids) < len(gen.token_ids):
        ep.turns.append(Turn(start, len(ep.token_ids), text, InvalidAction(text, "turn cut off by a token limit"),
                             None))
        ep.stop_reason = StopReason.MAX_TOKENS
        return
    actions = parse_turn(text)
    ep.messages.append(_assistant_message(text, actions))
    observations: list[Message] = []
    for action in actions:
        obs, reward, terminated, truncated, info = ep.env.step(action)
        bad = isinstance(action, InvalidAction) or info.get("tool_error") is not None
        ep.turns.append(Turn(start, len(ep.token_ids), text, action, obs if not terminated else None,
                             tool_ok=info.get("tool_ok"), tool_error=info.get("tool_error"),
                             signals=info.get("signals", {}), env_reward=float(reward)))
        start = len(ep.token_ids)  # later actions of the same turn own no extra tokens
        if isinstance(action, FinalAnswer):
            ep.stop_reason = StopReason.ANSWERED
            return
        if terminated or truncated:
            ep.stop_reason = StopReason.ENV_TERMINATED
            return
        observations.append(Message("tool", obs))
        ep.invalid_calls += int(bad)
        if isinstance(action, ToolCall):
            ep.call_counts[action.key()] += 1
    if ep.invalid_calls >= limits.max_invalid_calls > 0:
        ep.stop_reason = StopReason.INVALID_CALLS
    elif limits.repeated_call_limit > 0 and max(ep.call_counts.values(), default=0) >= limits.repeated_call_limit:
        ep.stop_reason = StopReason.REPEATED_CALL
    elif len(ep.turns) >= limits.max_turns:
        ep.stop_reason = StopReason.MAX_TURNS
    if ep.done:
        return
    obs_ids = codec.observation_ids(observations)
    if len(ep.token_ids) + len(obs_ids) >= limits.max_total_tokens:
        ep.stop_reason = StopReason.MAX_TOKENS
        return
    ep.messages.extend(observations)
    ep.token_ids += obs_ids
    ep.loss_mask += [0] * len(obs_ids)
    ep.logprobs += [0.0] * len(obs_ids)


def finish_episode(ep: _Episode, policy_version: int = 0) -> Trajectory:
    assert ep.stop_reason is not None
    return Trajectory(task=ep.task, token_ids=tuple(ep.token_ids), loss_mask=tuple(ep.loss_mask),
                      logprobs=tuple(ep.logprobs), prompt_length=ep.prompt_length, turns=tuple(ep.turns),
                      stop_reason=ep.stop_reason, messages=tuple(ep.messages), policy_version=policy_version,
                      sample_index=ep.sample_index, token_masks=tuple(ep.token_masks))


def run_episodes(policy: Policy, codec: ChatCodec, envs: Sequence[Env], tasks: Sequence[Task], *,
                 sampling: SamplingParams, limits: RolloutLimits, seeds: Sequence[int | None] | None = None,
                 sample_indices: Sequence[int] | None = None, policy_version: int = 0) -> list[Trajectory]:
    """Run one episode per (env, task) pair, all turns batched through the policy together."""
    if len(envs) != len(tasks):
        raise ValueError(f"{len(envs)} envs for {len(tasks)} tasks")
    seeds = seeds or [None] * len(tasks)
    sample_indices = sample_indices or [0] * len(tasks)
    episodes = [start_episode(env, task, codec, seed=s, sample_index=i)
                for env, task, s, i in zip(envs, tasks, seeds, sample_indices)]
    for ep in episodes:
        if ep.prompt_length >= limits.max_total_tokens:
            ep.stop_reason = StopReason.MAX_TOKENS
    round_index = 0
    while active := [ep for ep in episodes if not ep.done]:
        turn_sampling = SamplingParams(max_new_tokens=limits.max_new_tokens_per_turn,
                                       temperature=sampling.temperature, top_p=sampling.top_p,
                                       seed=None if sampling.seed is None else sampling.seed + round_index)
        masker = turn_processor(codec, limits.tool_name_mask, [ep.env.legal_actions() for ep in active],
                                [ep.offered_tools for ep in active])
        generations = policy.generate([ep.token_ids for ep in active], turn_sampling, masker)
        for row, (ep, gen) in enumerate(zip(active, generations)):
            advance(ep, gen, codec, limits, masker.token_masks(row) if masker else ())
        round_index += 1
    return [finish_episode(ep, policy_version) for ep in episodes]


def expert_trajectory(env: Env, task: Task, actions: Sequence[Action], codec: ChatCodec,
                      limits: RolloutLimits) -> Trajectory:
    """A demonstration encoded through the very path a rollout takes (same template, same observation ids)."""
    ep = start_episode(env, task, codec, seed=0)
    for action in actions:
        if ep.done:
            break
        if isinstance(action, ToolCall):
            msg = Message("assistant", "", tool_calls=(action,))
        elif isinstance(action, FinalAnswer):
            msg = Message("assistant", action.text)
        else:
            raise ValueError("expert actions must be ToolCall or FinalAnswer")
        ids = codec.assistant_ids(msg)
        advance(ep, Generation(tuple(ids), (0.0,) * len(ids), "stop"), codec, limits)
    if not ep.done:
        raise ValueError(f"expert actions for {task.task_id} did not finish the episode")
    return finish_episode(ep)
