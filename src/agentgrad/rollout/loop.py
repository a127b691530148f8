"""The agent loop: multi-turn, token-in/token-out episodes for a batch of environments at once.

Each episode repeats: generate until end-of-turn (`begin_turn` records and parses it), step the env with its
actions (`run_actions`, on a tool thread), append the observation's ids with loss_mask 0 (`end_turn`).
Malformed calls become error observations and are counted. `EpisodeLimits` end an episode; `SamplerSettings`
say how a batch of them is scheduled.

One scheduler (`run_episodes`) drives every backend through the decode-session protocol
(`backends/base.py: DecodeSession`): `HFPolicy`'s engine, or a `generate`-only policy through
`backends/generate_session.py`. Episodes do not wait for each other: an episode rejoins generation as soon as
its own tools have answered.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal

from agentgrad.backends.base import DecodeSession, Generation, LogitsProcessor, Policy, SamplingParams, SessionPolicy
from agentgrad.backends.generate_session import open_session
from agentgrad.envs.base import Env
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.constrained import EpisodeMasks, MaskMode, episode_masks
from agentgrad.rollout.copying import CopySpec
from agentgrad.rollout.factored import HEAD_DECIDES, HeadCalls, HeadSpan, NameWriter, expert_spans
from agentgrad.types import (
    Action,
    FinalAnswer,
    HeadDecision,
    InvalidAction,
    Message,
    StopReason,
    Task,
    TokenMask,
    ToolCall,
    Trajectory,
    Turn,
)

ActionHeadMode = Literal["tokens", "factored", "category"]


@dataclass(frozen=True)
class EpisodeLimits:
    """When one episode stops: what a demonstration must fit and what a rollout enforces."""

    max_turns: int = 4
    max_new_tokens_per_turn: int = 64
    max_total_tokens: int = 512
    max_invalid_calls: int = 2  # the episode stops when this many invalid calls have been made
    repeated_call_limit: int = 3  # the same call (tool + arguments) this many times stops the episode


@dataclass(frozen=True)
class SamplerSettings:
    """How a batch of episodes is sampled and scheduled; no episode's outcome limit lives here."""

    max_concurrent_episodes: int = 64  # episodes in flight at once (a finished one's slot goes to the next)
    tool_workers: int = 0  # threads for tool calls; 0 = one per episode in flight
    deterministic_schedule: bool = False  # drain all tool calls after each decode step (timing-independent floats)
    waiting_episodes: int = 0  # extra episodes kept while others wait on tools (0: a waiting episode keeps its slot)
    tool_wait_steps: int = 8  # with waiting_episodes and the deterministic schedule: see _QueuedSchedule
    tool_name_mask: MaskMode = "auto"  # constrained decoding of tool names (rollout/constrained.py)
    copy_args: CopySpec = CopySpec()  # arguments / answers copied from what the episode read (rollout/copying.py)
    action_head: ActionHeadMode = "tokens"  # "factored" / "category": a head chooses (rollout/factored.py)


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


def begin_turn(ep: _Episode, gen: Generation, codec: ChatCodec, limits: EpisodeLimits,
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
            ep.head_decisions.append(HeadDecision(start + h.name_start - 1, start + h.name_end, h.choice, h.logprob,
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


def run_actions(ep: _Episode, actions: Sequence[Action]) -> None:
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


def end_turn(ep: _Episode, codec: ChatCodec, limits: EpisodeLimits) -> list[int]:
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


def advance(ep: _Episode, gen: Generation, codec: ChatCodec, limits: EpisodeLimits,
            head_spans: Sequence[HeadSpan] = ()) -> None:
    """Apply one generated turn to an episode: record tokens, step the env, append the observation."""
    actions = begin_turn(ep, gen, codec, limits, head_spans=head_spans)
    if not ep.done:
        run_actions(ep, actions)
        end_turn(ep, codec, limits)


def finish_episode(ep: _Episode, policy_version: int = 0) -> Trajectory:
    assert ep.stop_reason is not None
    return Trajectory(task=ep.task, token_ids=tuple(ep.token_ids), loss_mask=tuple(ep.loss_mask),
                      logprobs=tuple(ep.logprobs), prompt_length=ep.prompt_length, turns=tuple(ep.turns),
                      stop_reason=ep.stop_reason, messages=tuple(ep.messages), policy_version=policy_version,
                      sample_index=ep.sample_index, token_masks=tuple(ep.token_masks),
                      head_decisions=tuple(ep.head_decisions), final_info=ep.final_info)


def _turn_budget(ep: _Episode, limits: EpisodeLimits) -> int:
    return min(limits.max_new_tokens_per_turn, limits.max_total_tokens - len(ep.token_ids))


def run_episodes(policy: Policy, codec: ChatCodec, envs: Sequence[Env], tasks: Sequence[Task], *,
                 sampling: SamplingParams, limits: EpisodeLimits, sampler: SamplerSettings = SamplerSettings(),
                 seeds: Sequence[int | None] | None = None, sample_indices: Sequence[int] | None = None,
                 policy_version: int = 0, logits_processor: LogitsProcessor | None = None,
                 on_episode_end: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Run one episode per (env, task) pair and return their trajectories in input order.

    Up to `sampler.max_concurrent_episodes` episodes are in flight on one decode session (`open_session`: the
    policy's own, else one over its `generate`); their tool calls run concurrently on a thread pool of
    `sampler.tool_workers` threads (0: one per episode in flight). An episode rejoins the decode batch as soon
    as its observation arrives, so one slow tool never holds the others back (a `generate` session waits for
    every tool after each step instead, as `sampler.deterministic_schedule` does: its rows' randomness depends
    on who shares the call). `logits_processor` gets the episode's index in `envs` as its row and the ids of the
    current turn. With `sampling.seed` set, a session's tokens do not depend on thread timing: each episode's
    randomness is keyed by (seed, episode index, token position).

    With `sampler.action_head` "factored" or "category", tools (or categories) are chosen by the policy's
    `tool_head` at the call position instead of sampled as tokens (rollout/factored.py); this needs a
    `SessionPolicy` (a turn pauses there), and the tool-name mask is then on in every state (it narrows the name
    to the choice).

    `on_episode_end(index)` is called as each episode ends (for a progress display; it changes nothing).
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
    ended = on_episode_end or (lambda i: None)
    for i, ep in enumerate(episodes):
        if ep.done:
            ended(i)
    calls = _head_calls(policy, codec, sampling, sampler, len(episodes))
    masker = episode_masks(codec, "on" if calls is not None else sampler.tool_name_mask,
                           [ep.env.legal_actions() for ep in episodes], [ep.offered_tools for ep in episodes],
                           sampler.copy_args)
    processor = _chain(logits_processor, masker)
    if calls is not None:
        processor = calls.processor(processor)
    if live:
        capacity = max(1, min(sampler.max_concurrent_episodes, len(live)))
        resident = min(capacity + sampler.waiting_episodes, len(live))  # episodes holding a session slot at once
        turn_sampling = dataclasses.replace(sampling, max_new_tokens=limits.max_new_tokens_per_turn)
        drain = sampler.deterministic_schedule or not isinstance(policy, SessionPolicy)
        pause = None if calls is None else calls.pause
        with (ThreadPoolExecutor(max_workers=sampler.tool_workers or resident, thread_name_prefix="agentgrad-tool")
              as pool,
              open_session(policy, turn_sampling, processor, max_sequences=resident,
                           max_tokens=limits.max_total_tokens, pause=pause,
                           max_batch=capacity if sampler.waiting_episodes > 0 else None) as session):
            if sampler.waiting_episodes > 0:
                _QueuedSchedule(session, pool, codec, episodes, limits, masker, calls, capacity, drain, ended,
                                resident=resident, tool_wait_steps=sampler.tool_wait_steps).run(live)
            else:
                _Schedule(session, pool, codec, episodes, limits, masker, calls, capacity, drain, ended).run(live)
    return [finish_episode(ep, policy_version) for ep in episodes]


def _head_calls(policy: Policy, codec: ChatCodec, sampling: SamplingParams, sampler: SamplerSettings,
                num_rows: int) -> HeadCalls | None:
    if sampler.action_head == "tokens":
        return None
    mode = f"rollout.action_head={sampler.action_head}"
    head = getattr(policy, "tool_head", None)
    if head is None:
        raise ValueError(f"{mode} needs a tool head (the policy has none)")
    if not isinstance(policy, SessionPolicy):
        raise ValueError(f"{mode} needs a policy with incremental sessions (e.g. HFPolicy)")
    states = getattr(policy, "context_states", None)
    if states is None:
        raise ValueError(f"{mode} needs a policy that exposes its hidden states (e.g. HFPolicy)")
    if head.decides != HEAD_DECIDES[sampler.action_head]:
        raise ValueError(f"{mode} does not match the policy's tool head, which decides a {head.decides}")
    return HeadCalls(head, codec, sampling, num_rows, states)


def _chain(first: LogitsProcessor | None, then: LogitsProcessor | None) -> LogitsProcessor | None:
    """A caller's processor, then the action-mask one (so the recorded legal set is the last word)."""
    if first is None or then is None:
        return first or then
    return lambda row, generated, logits: then(row, generated, first(row, generated, logits))


class _Schedule:
    """Episodes (keyed by their index) in flight on one decode session, their tool calls on a thread pool.

    An episode is admitted when a slot is free, generates a turn, steps its env on a tool thread, and is
    resubmitted with its observation, or retired (its slot goes to the next waiting episode). With `drain`,
    every pending tool call is waited for after each decode step, so which episodes share a step follows the
    data alone (float-identical logprobs run to run)."""

    def __init__(self, session: DecodeSession, pool: ThreadPoolExecutor, codec: ChatCodec, episodes: list[_Episode],
                 limits: EpisodeLimits, masker: EpisodeMasks | None, calls: HeadCalls | None, capacity: int,
                 drain: bool, ended: Callable[[int], None]) -> None:
        self.session, self.pool, self.codec, self.episodes, self.limits = session, pool, codec, episodes, limits
        self.masker, self.calls, self.capacity, self.drain, self.ended = masker, calls, capacity, drain, ended
        self.waiting: deque[int] = deque()
        self.in_tools: dict[Future, int] = {}
        self.in_flight = 0

    def run(self, live: list[int]) -> None:
        self.waiting.extend(live)
        self._admit()
        while self.in_flight:
            if self.session.has_work:
                for i, gen in self.session.step():
                    self._generated(i, gen)
                if self.drain:
                    wait(list(self.in_tools))
                    ready = list(self.in_tools)
                else:
                    ready = [f for f in self.in_tools if f.done()]
            else:  # nothing to decode: sleep until a tool returns
                assert self.in_tools, "an episode in flight is neither generating nor waiting on a tool"
                ready = list(wait(self.in_tools, return_when=FIRST_COMPLETED).done)
            for f in sorted(ready, key=self.in_tools.__getitem__):
                i = self.in_tools.pop(f)
                f.result()
                obs_ids = end_turn(self.episodes[i], self.codec, self.limits)
                if self.episodes[i].done:
                    self._retire(i)
                else:
                    self._submit_turn(i, obs_ids)

    def _submit_turn(self, i: int, new_ids: Sequence[int]) -> None:
        ep, budget = self.episodes[i], _turn_budget(self.episodes[i], self.limits)
        if self.masker is not None:
            self.masker.start_turn(i, ep.env.legal_actions(), ep.messages)
        if self.calls is not None:
            self.calls.start_turn(i, ep.env.legal_actions(), budget)
        self.session.submit(i, new_ids, budget)

    def _admit(self) -> None:
        while self.waiting and self.in_flight < self.capacity:
            i = self.waiting.popleft()
            self._submit_turn(i, self.episodes[i].token_ids)
            self.in_flight += 1

    def _retire(self, i: int) -> None:
        self.session.release(i)
        self.in_flight -= 1
        self.ended(i)
        self._admit()

    def _generated(self, i: int, gen: Generation) -> None:
        """A finished (or, under a factored head, paused) turn: record it, then retire or step its env."""
        ep, spans = self.episodes[i], ()
        if self.calls is not None:
            whole = self._head_turn(i, gen)
            if whole is None:
                return
            gen, spans = whole
        masks = self.masker.token_masks(i) if self.masker is not None else []
        actions = begin_turn(ep, gen, self.codec, self.limits, masks, spans)
        if ep.done:
            self._retire(i)
        else:
            self._call_tools(i, actions)

    def _call_tools(self, i: int, actions: Sequence[Action]) -> None:
        self.in_tools[self.pool.submit(run_actions, self.episodes[i], actions)] = i

    def _head_turn(self, i: int, gen: Generation) -> tuple[Generation, Sequence[HeadSpan]] | None:
        """A turn's generation under a factored head: None when the turn goes on (a name was chosen and written
        in), else the whole turn and its head decisions."""
        calls = self.calls
        assert calls is not None
        if gen.finish_reason != "pause":
            return calls.finish(i, gen)
        ids = calls.decide(i, gen, self.episodes[i].token_ids, self.masker)
        if ids is None:
            return calls.cut(i), ()
        self.session.submit(i, ids, calls.remaining(i))
        return None


class _QueuedSchedule(_Schedule):
    """Decode slots apart from session slots: an episode waiting on a tool leaves the decode batch and its decode
    slot goes to another episode (`resident` episodes hold a session slot and their KV cache, `capacity` decode).

    After every step, free decode slots are filled first with queued episodes (in input order, while session
    slots last), then with episodes whose tools were called, in call order. Eager (no `drain`): only those whose
    tools have answered, waiting for the first answer when nothing is left to decode. With `drain` (the
    deterministic schedule): an answer is taken back no sooner than `tool_wait_steps` decode steps after its
    call unless nothing else would decode, waiting for the tool if it has not answered yet. Which episodes share
    a step is then a function of the data and the step count, never of the clock: the floats repeat bit for bit
    whatever the tools' latency, and a slow tool costs wall time only when its answer is due before it comes."""

    def __init__(self, *args, resident: int, tool_wait_steps: int) -> None:
        super().__init__(*args)
        self.resident, self.tool_wait_steps = resident, tool_wait_steps
        self.decoding: set[int] = set()  # episodes submitted to the session whose turn has not come back
        self.called: dict[int, tuple[int, Future]] = {}  # episode -> (step of its call, the call), in call order
        self.steps = 0  # decode steps run

    def run(self, live: list[int]) -> None:
        self.waiting.extend(live)
        self._fill()
        while self.in_flight:
            if self.session.has_work:
                finished = self.session.step()
                self.steps += 1  # a call made in this step is 0 steps old
                for i, gen in finished:
                    self._generated(i, gen)
            self._fill()

    def _fill(self) -> None:
        while len(self.decoding) < self.capacity:
            if self.waiting and self.in_flight < self.resident:
                i = self.waiting.popleft()
                self.in_flight += 1
                self._submit_turn(i, self.episodes[i].token_ids)
                continue
            i = self._answered()
            if i is None:
                return
            self.called.pop(i)[1].result()
            obs_ids = end_turn(self.episodes[i], self.codec, self.limits)
            if self.episodes[i].done:
                self._retire(i)
            else:
                self._submit_turn(i, obs_ids)

    def _answered(self) -> int | None:
        """The episode whose tool answer goes back into the decode batch now, if one is due."""
        if not self.called:
            return None
        idle = not self.decoding
        if self.drain:
            i, (step, _) = next(iter(self.called.items()))
            return i if idle or self.steps - step >= self.tool_wait_steps else None
        if idle:
            wait([call for _, call in self.called.values()], return_when=FIRST_COMPLETED)
        return next((i for i, (_, call) in self.called.items() if call.done()), None)

    def _submit_turn(self, i: int, new_ids: Sequence[int]) -> None:
        self.decoding.add(i)
        super()._submit_turn(i, new_ids)

    def _call_tools(self, i: int, actions: Sequence[Action]) -> None:
        self.decoding.discard(i)
        self.called[i] = (self.steps, self.pool.submit(run_actions, self.episodes[i], actions))

    def _retire(self, i: int) -> None:
        self.decoding.discard(i)
        self.session.release(i)
        self.in_flight -= 1
        self.ended(i)


def expert_trajectory(env: Env, task: Task, actions: Sequence[Action], codec: ChatCodec,
                      limits: EpisodeLimits, *, writer: NameWriter | None = None) -> Trajectory:
    """A demonstration encoded through the very path a rollout takes (same template, same observation ids).
    With a head's `writer`, what the head would write of each call's name is recorded as its decision
    (loss_mask 0)."""
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
        spans = (expert_spans(writer, ids, action if isinstance(action, ToolCall) else None, env.legal_actions().tools)
                 if writer is not None else ())
        advance(ep, Generation(tuple(ids), (0.0,) * len(ids), "stop"), codec, limits, spans)
    if not ep.done:
        raise ValueError(f"expert actions for {task.task_id} did not finish the episode")
    return finish_episode(ep)
