"""The agent loop: multi-turn, token-in/token-out episodes for a batch of environments at once.

Each episode repeats: generate until end-of-turn (`begin_turn` records and parses it), step the env with its
actions (`run_actions`, on a tool thread), append the observation's ids with loss_mask 0 (`end_turn`).
Malformed calls become error observations and are counted. Episodes do not wait for each other: with an
incremental policy an episode rejoins generation as soon as its own tools have answered.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal, Sequence

from agentgrad.backends.base import (DecodeSession, Generation, LogitsProcessor, Policy, SamplingParams,
                                    SessionPolicy)
from agentgrad.envs.base import Env
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.constrained import EpisodeMasks, MaskMode, episode_masks
from agentgrad.rollout.factored import HeadCalls, HeadSpan, ToolHead, expert_spans
from agentgrad.types import (Action, FinalAnswer, HeadDecision, InvalidAction, Message, StopReason, Task, TokenMask,
                             ToolCall, Trajectory, Turn)

ActionHeadMode = Literal["tokens", "factored"]


@dataclass(frozen=True)
class RolloutLimits:
    max_turns: int = 4
    max_new_tokens_per_turn: int = 64
    max_total_tokens: int = 512
    max_invalid_calls: int = 2  # the episode stops when this many invalid calls have been made
    repeated_call_limit: int = 3  # the same call (tool + arguments) this many times stops the episode
    max_concurrent_episodes: int = 64  # episodes in flight at once (not a per-episode limit: a sampler setting)
    tool_workers: int = 0  # threads for tool calls; 0 = one per episode in flight
    deterministic_schedule: bool = False  # drain all tool calls after each decode step (timing-independent floats)
    tool_name_mask: MaskMode = "auto"  # constrained decoding of tool names (rollout/constrained.py)
    action_head: ActionHeadMode = "tokens"  # "factored": a head chooses tool names (rollout/factored.py)


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
    turn_text: str = ""  # the turn in flight, between begin_turn and end_turn
    turn_start: int = 0
    observations: list[Message] = field(default_factory=list)
    offered_tools: frozenset[str] = frozenset()  # tool names the prompt shows
    token_masks: list[TokenMask] = field(default_factory=list)
    head_decisions: list[HeadDecision] = field(default_factory=list)
    final_info: dict = field(default_factory=dict)  # info of the env step that ended the episode

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


def begin_turn(ep: _Episode, gen: Generation, codec: ChatCodec, limits: RolloutLimits,
               token_masks: Sequence[TokenMask] = (), head_spans: Sequence[HeadSpan] = ()) -> list[Action]:
    """Record a generated turn's tokens and parse it. Returns the actions to step (none if the episode ended).
    `token_masks` (positions relative to the turn) are the legal sets its tokens were sampled from;
    `head_spans` the tool names a factored head chose and wrote in (not sampled: loss_mask 0).

    Runs on the rollout thread: it uses the tokenizer, which is not safe to share between threads."""
    start = len(ep.token_ids)
    budget = limits.max_total_tokens - start
    ids, lps = list(gen.token_ids[:budget]), list(gen.logprobs[:budget])
    ep.token_masks += [TokenMask(start + m.position, m.token_ids, m.allow) for m in token_masks
                       if m.position < len(ids)]
    ep.token_ids += ids
    ep.loss_mask += [1] * len(ids)
    ep.logprobs += lps
    for h in head_spans:
        if h.name_end <= len(ids):
            ep.loss_mask[start + h.name_start:start + h.name_end] = [0] * (h.name_end - h.name_start)
            ep.head_decisions.append(HeadDecision(start + h.name_start - 1, start + h.name_end, h.tool, h.logprob,
                                                  h.legal))
    text = codec.decode(ids)
    ep.turn_text, ep.turn_start = text, start
    if gen.finish_reason != "stop" or len(ids) < len(gen.token_ids):
        ep.turns.append(Turn(start, len(ep.token_ids), text, InvalidAction(text, "turn cut off by a token limit"),
                             None))
        ep.stop_reason = StopReason.MAX_TOKENS
        return []
    actions = codec.parse(text)
    ep.messages.append(codec.assistant_message(text, actions))
    return actions


def run_actions(ep: _Episode, actions: Sequence[Action], limits: RolloutLimits) -> None:
    """Step the env with a turn's actions (the tool calls). Touches only this episode: safe in a worker thread."""
    start, text = ep.turn_start, ep.turn_text
    ep.observations = []
    for action in actions:
        obs, reward, terminated, truncated, info = ep.env.step(action)
        bad = isinstance(action, InvalidAction) or info.get("tool_error") is not None
        ep.turns.append(Turn(start, len(ep.token_ids), text, action, obs if not terminated else None,
                             tool_ok=info.get("tool_ok"), tool_error=info.get("tool_error"),
                             signals=info.get("signals", {}), env_reward=float(reward)))
        start = len(ep.token_ids)  # later actions of the same turn own no extra tokens
        if isinstance(action, FinalAnswer) or terminated or truncated:
            # The env may own the outcome (a game ends itself on a win): keep what it said, JSON-able for the store.
            ep.final_info = json.loads(json.dumps(info, default=str))
            ep.stop_reason = StopReason.ANSWERED if isinstance(action, FinalAnswer) else StopReason.ENV_TERMINATED
            return
        ep.observations.append(Message("tool", obs))
        ep.invalid_calls += int(bad)
        if isinstance(action, ToolCall):
            ep.call_counts[action.key()] += 1


def end_turn(ep: _Episode, codec: ChatCodec, limits: RolloutLimits) -> list[int]:
    """Apply the episode limits, then append the observation. Returns the appended ids ([] if it ended)."""
    if ep.done:
        return []
    if ep.invalid_calls >= limits.max_invalid_calls > 0:
        ep.stop_reason = StopReason.INVALID_CALLS
    elif limits.repeated_call_limit > 0 and max(ep.call_counts.values(), default=0) >= limits.repeated_call_limit:
        ep.stop_reason = StopReason.REPEATED_CALL
    elif len(ep.turns) >= limits.max_turns:
        ep.stop_reason = StopReason.MAX_TURNS
    if ep.done:
        return []
    obs_ids = codec.observation_ids(ep.observations)
    if len(ep.token_ids) + len(obs_ids) >= limits.max_total_tokens:
        ep.stop_reason = StopReason.MAX_TOKENS
        return []
    ep.messages.extend(ep.observations)
    ep.token_ids += obs_ids
    ep.loss_mask += [0] * len(obs_ids)
    ep.logprobs += [0.0] * len(obs_ids)
    return obs_ids


def advance(ep: _Episode, gen: Generation, codec: ChatCodec, limits: RolloutLimits,
            head_spans: Sequence[HeadSpan] = ()) -> None:
    """Apply one generated turn to an episode: record tokens, step the env, append the observation."""
    actions = begin_turn(ep, gen, codec, limits, head_spans=head_spans)
    if not ep.done:
        run_actions(ep, actions, limits)
        end_turn(ep, codec, limits)


def finish_episode(ep: _Episode, policy_version: int = 0) -> Trajectory:
    assert ep.stop_reason is not None
    return Trajectory(task=ep.task, token_ids=tuple(ep.token_ids), loss_mask=tuple(ep.loss_mask),
                      logprobs=tuple(ep.logprobs), prompt_length=ep.prompt_length, turns=tuple(ep.turns),
                      stop_reason=ep.stop_reason, messages=tuple(ep.messages), policy_version=policy_version,
                      sample_index=ep.sample_index, token_masks=tuple(ep.token_masks),
                      head_decisions=tuple(ep.head_decisions), final_info=ep.final_info)


def _turn_budget(ep: _Episode, limits: RolloutLimits) -> int:
    return min(limits.max_new_tokens_per_turn, limits.max_total_tokens - len(ep.token_ids))


def run_episodes(policy: Policy, codec: ChatCodec, envs: Sequence[Env], tasks: Sequence[Task], *,
                 sampling: SamplingParams, limits: RolloutLimits, seeds: Sequence[int | None] | None = None,
                 sample_indices: Sequence[int] | None = None, policy_version: int = 0,
                 logits_processor: LogitsProcessor | None = None, max_concurrent: int | None = None,
                 tool_workers: int | None = None, tool_head: ToolHead | None = None) -> list[Trajectory]:
    """Run one episode per (env, task) pair and return their trajectories in input order.

    Up to `max_concurrent` episodes (default `limits.max_concurrent_episodes`) are in flight; their tool calls
    run concurrently on a thread pool of `tool_workers` threads (default `limits.tool_workers`, 0 meaning one per
    episode in flight). With a `SessionPolicy` (e.g. HFPolicy) generation is
    continuously batched: an episode rejoins the decode batch as soon as its observation arrives, its KV cache
    kept from the previous turn, so one slow tool never holds the others back. Other policies are stepped in
    rounds through `generate`. `logits_processor` gets the episode's index in `envs` as its row and the ids of
    the current turn. With `sampling.seed` set, the tokens do not depend on thread timing: each episode's
    randomness is keyed by (seed, episode index, token position).

    With `limits.action_head == "factored"`, tool names are chosen by `tool_head` (default: the policy's
    `tool_head` attribute) at the call position instead of sampled as tokens (rollout/factored.py); this needs a
    `SessionPolicy`, and the tool-name mask is then on in every state (it closes the chosen name).
    """
    if len(envs) != len(tasks):
        raise ValueError(f"{len(envs)} envs for {len(tasks)} tasks")
    seeds = seeds or [None] * len(tasks)
    sample_indices = sample_indices or [0] * len(tasks)
    episodes = [start_episode(env, task, codec, seed=s, sample_index=i)
                for env, task, s, i in zip(envs, tasks, seeds, sample_indices)]
    for ep in episodes:
        if ep.prompt_length >= limits.max_total_tokens:
            ep.stop_reason = StopReason.MAX_TOKENS
    live = [i for i, ep in enumerate(episodes) if not ep.done]
    calls = _head_calls(policy, codec, sampling, limits, tool_head, len(episodes))
    masker = episode_masks(codec, "on" if calls is not None else limits.tool_name_mask,
                           [ep.env.legal_actions() for ep in episodes], [ep.offered_tools for ep in episodes])
    processor = _chain(logits_processor, masker)
    max_concurrent = max_concurrent or limits.max_concurrent_episodes
    if live:
        workers = tool_workers or limits.tool_workers or max(1, min(max_concurrent, len(live)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agentgrad-tool") as pool:
            if isinstance(policy, SessionPolicy):
                _run_continuous(policy, codec, episodes, live, pool, sampling, limits, processor, masker,
                                max_concurrent, calls)
            else:
                _run_rounds(policy, codec, episodes, live, pool, sampling, limits, processor, masker, max_concurrent)
    return [finish_episode(ep, policy_version) for ep in episodes]


def _head_calls(policy: Policy, codec: ChatCodec, sampling: SamplingParams, limits: RolloutLimits,
                tool_head: ToolHead | None, num_rows: int) -> HeadCalls | None:
    if limits.action_head == "tokens":
        return None
    head = tool_head if tool_head is not None else getattr(policy, "tool_head", None)
    if head is None:
        raise ValueError("rollout.action_head=factored needs a tool head (the policy has none)")
    if not isinstance(policy, SessionPolicy):
        raise ValueError("rollout.action_head=factored needs a policy with incremental sessions (e.g. HFPolicy)")
    return HeadCalls(head, codec, sampling, num_rows)


def _chain(first: LogitsProcessor | None, then: LogitsProcessor | None) -> LogitsProcessor | None:
    """A caller's processor, then the action-mask one (so the recorded legal set is the last word)."""
    if first is None or then is None:
        return first or then
    return lambda row, generated, logits: then(row, generated, first(row, generated, logits))


def _start_turn(masker: EpisodeMasks | None, i: int, ep: _Episode, calls: HeadCalls | None = None,
                budget: int = 0) -> None:
    if masker is not None:
        masker.start_turn(i, ep.env.legal_actions())
    if calls is not None:
        calls.start_turn(i, ep.env.legal_actions(), budget)


def _head_turn(calls: HeadCalls, session: DecodeSession, masker: EpisodeMasks | None, i: int, ep: _Episode,
               gen: Generation) -> tuple[Generation, Sequence[HeadSpan]] | None:
    """A turn's generation under a factored head: None when the turn goes on (a name was chosen and written
    in), else the whole turn and its head decisions."""
    if gen.finish_reason != "pause":
        return calls.finish(i, gen)
    ids = calls.decide(i, gen, len(ep.token_ids), masker)
    if ids is None:
        return calls.cut(i), ()
    session.submit(i, ids, calls.remaining(i))
    return None


def _turn_masks(masker: EpisodeMasks | None, i: int) -> list[TokenMask]:
    return masker.token_masks(i) if masker is not None else []


def _run_continuous(policy: SessionPolicy, codec: ChatCodec, episodes: list[_Episode], live: list[int],
                    pool: ThreadPoolExecutor, sampling: SamplingParams, limits: RolloutLimits,
                    logits_processor: LogitsProcessor | None, masker: EpisodeMasks | None,
                    max_concurrent: int, calls: HeadCalls | None = None) -> None:
    waiting = deque(live)
    in_tools: dict[Future, int] = {}
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=limits.max_new_tokens_per_turn)
    capacity = max(1, min(max_concurrent, len(live)))
    head_kw = {} if calls is None else {"pause": calls.pause}
    if calls is not None:
        logits_processor = calls.processor(logits_processor)
    with policy.session(turn_sampling, logits_processor, max_sequences=capacity,
                        max_tokens=limits.max_total_tokens, **head_kw) as session:
        in_flight = 0

        def admit() -> None:
            nonlocal in_flight
            while waiting and in_flight < capacity:
                i = waiting.popleft()
                _start_turn(masker, i, episodes[i], calls, _turn_budget(episodes[i], limits))
                session.submit(i, episodes[i].token_ids, _turn_budget(episodes[i], limits))
                in_flight += 1

        def retire(i: int) -> None:
            nonlocal in_flight
            session.release(i)
            in_flight -= 1
            admit()

        admit()
        while in_flight:
            if session.has_work:
                for i, gen in session.step():
                    spans: Sequence[HeadSpan] = ()
                    if calls is not None:
                        whole = _head_turn(calls, session, masker, i, episodes[i], gen)
                        if whole is None:
                            continue
                        gen, spans = whole
                    actions = begin_turn(episodes[i], gen, codec, limits, _turn_masks(masker, i), spans)
                    if episodes[i].done:
                        retire(i)
                    else:
                        in_tools[pool.submit(run_actions, episodes[i], actions, limits)] = i
                if limits.deterministic_schedule:
                    # Batch composition then follows the data alone: float-identical logprobs run to run.
                    wait(list(in_tools))
                    ready = list(in_tools)
                else:
                    ready = [f for f in in_tools if f.done()]
            else:  # nothing to decode: sleep until a tool returns
                assert in_tools, "an episode in flight is neither generating nor waiting on a tool"
                ready = list(wait(in_tools, return_when=FIRST_COMPLETED).done)
            for f in sorted(ready, key=in_tools.__getitem__):
                i = in_tools.pop(f)
                f.result()
                obs_ids = end_turn(episodes[i], codec, limits)
                if episodes[i].done:
                    retire(i)
                else:
                    _start_turn(masker, i, episodes[i], calls, _turn_budget(episodes[i], limits))
                    session.submit(i, obs_ids, _turn_budget(episodes[i], limits))


def _run_rounds(policy: Policy, codec: ChatCodec, episodes: list[_Episode], live: list[int],
                pool: ThreadPoolExecutor, sampling: SamplingParams, limits: RolloutLimits,
                logits_processor: LogitsProcessor | None, masker: EpisodeMasks | None, max_concurrent: int) -> None:
    """Every active episode advances one turn per round through `Policy.generate`; tools run concurrently."""
    for chunk_start in range(0, len(live), max_concurrent):
        chunk = live[chunk_start:chunk_start + max_concurrent]
        round_index = 0
        while active := [i for i in chunk if not episodes[i].done]:
            turn_sampling = SamplingParams(max_new_tokens=limits.max_new_tokens_per_turn,
                                           temperature=sampling.temperature, top_p=sampling.top_p,
                                           seed=None if sampling.seed is None else sampling.seed + round_index)
            for i in active:
                _start_turn(masker, i, episodes[i])
            # `generate` numbers its rows 0..len(active)-1; processors see the episode's index, as documented.
            row_processor = None if logits_processor is None else (
                lambda row, generated, logits: logits_processor(active[row], generated, logits))
            generations = policy.generate([episodes[i].token_ids for i in active], turn_sampling, row_processor)
            acting = []
            for i, gen in zip(active, generations):
                ep = episodes[i]
                actions = begin_turn(ep, gen, codec, limits, _turn_masks(masker, i))
                if not ep.done:
                    acting.append((ep, pool.submit(run_actions, ep, actions, limits)))
            for ep, future in acting:
                future.result()
                end_turn(ep, codec, limits)
            round_index += 1


def expert_trajectory(env: Env, task: Task, actions: Sequence[Action], codec: ChatCodec,
                      limits: RolloutLimits) -> Trajectory:
    """A demonstration encoded through the very path a rollout takes (same template, same observation ids).
    Under `limits.action_head == "factored"` each call's name is recorded as a head decision (loss_mask 0)."""
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
        spans = (expert_spans(codec, ids, action if isinstance(action, ToolCall) else None, env.legal_actions().tools)
                 if limits.action_head == "factored" else ())
        advance(ep, Generation(tuple(ids), (0.0,) * len(ids), "stop"), codec, limits, spans)
    if not ep.done:
        raise ValueError(f"expert actions for {task.task_id} did not finish the episode")
    return finish_episode(ep)
