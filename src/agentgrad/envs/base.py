"""Env protocol (Gymnasium conventions), action masks, task suites, and `check_env`.

Environments see actions and text, never tokens or groups. They are deterministic given
(task, seed, action history), so tree search can restore any node by replaying its actions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from agentgrad.registry import Registry
from agentgrad.types import Action, FinalAnswer, InvalidAction, Message, StopReason, Task, ToolCall, Trajectory, Turn


@dataclass(frozen=True)
class ActionMask:
    """Which categories and tools are legal in the current state. `final_answer` says whether answering is."""

    categories: frozenset[str]
    tools: frozenset[str]
    final_answer: bool = True

    def allows(self, action: Action) -> bool:
        if isinstance(action, ToolCall):
            return action.name in self.tools
        if isinstance(action, FinalAnswer):
            return self.final_answer
        return True  # invalid text is always "legal": it earns an error observation


StepResult = tuple[str, float, bool, bool, dict[str, Any]]  # observation, reward, terminated, truncated, info


@runtime_checkable
class Env(Protocol):
    """One episode at a time. `reset` takes the task in options; `step` takes exactly one parsed action.

    Observations are text: the task prompt after reset, the tool's result after a tool call.
    `info` after reset holds "tools" (JSON schemas) and "system" (the system prompt); after a step,
    "tool_ok", "tool_error" and "signals" describe the tool call.

    The env may end an episode itself (`terminated=True` after a tool call: a game won or lost) and own its
    outcome: `info["success"]` (a bool) and its `reward` are kept on the trajectory (`Trajectory.final_info`,
    `Turn.env_reward`) for the suite's success (`success_from`) and for reward functions. An env may also have
    `close()`, called once its owner is done with it (`close_env`), to release what it holds (a process, a
    connection).
    """

    def reset(self, *, seed: int | None = None,
              options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: Action) -> StepResult: ...

    def legal_actions(self) -> ActionMask: ...


@runtime_checkable
class SnapshotEnv(Protocol):
    """An env that can hand out its state mid-episode and take it back (optional, beside `Env`).

    `snapshot()` returns the state after the steps so far, independent of any later step; `restore(state)` puts
    it into another env from the same suite's `make_env()`, after `reset` with the same task and seed. Tree
    search (`search/driver.py`) then restores a node without replaying its tool calls; an env without these
    methods is restored by replay, which is exact too (envs are deterministic) but runs the calls again. Offer
    them only when the state is all the env's own: a tool holding per-episode state elsewhere (a live
    interpreter, a scratch database) would not come back with it.
    """

    def snapshot(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


SuccessSource = Literal["verifier", "env", "both"]
SUCCESS_SOURCES: tuple[str, ...] = ("verifier", "env", "both")


@runtime_checkable
class TaskSuite(Protocol):
    """A family of tasks: a generator, an expert that writes demonstrations, a verifier, and an env factory.

    Optional attributes: `success_from` ("verifier", the default: `verify(task, final_answer)`; "env": the env's
    `info["success"]` when it ended the episode, for games that need no answer step; "both": both must hold),
    `config_defaults` (a mapping of config sections the suite needs to differ from the defaults, e.g.
    `{"rollout": {"max_turns": 8}}`, applied under the preset and overrides), `split_key(task) -> str` (what
    no two splits may share: the prompt by default, the world where each split has its own worlds; read it with
    `split_key_of`), and `close()`.
    """

    name: str

    def sample_tasks(self, n: int, *, split: str, seed: int) -> list[Task]: ...

    def expert_actions(self, task: Task) -> list[Action]: ...

    def verify(self, task: Task, answer: str | None) -> bool: ...

    def make_env(self) -> Env: ...


# Factories taking the suite's options (a plain mapping from config `env.options`).
SUITES: Registry[Any] = Registry("task suite", plugins=True, entry_point_group="agentgrad.suites")


class EnvCheckError(AssertionError):
    pass


def success_from(suite: Any) -> str:
    source = getattr(suite, "success_from", "verifier")
    if source not in SUCCESS_SOURCES:
        raise ValueError(f"suite {getattr(suite, 'name', suite)!r}: success_from must be one of "
                         f"{', '.join(SUCCESS_SOURCES)}, got {source!r}")
    return source


def outcome_success(suite: Any, task: Task, final_answer: str | None, final_info: Mapping[str, Any]) -> bool:
    """Whether an episode succeeded, from the source the suite chose (`success_from`)."""
    source = success_from(suite)
    by_env = bool(final_info.get("success", False))
    if source == "env":
        return by_env
    by_verifier = bool(suite.verify(task, final_answer))
    return by_verifier if source == "verifier" else (by_verifier and by_env)


def episode_success(suite: Any, trajectory: Trajectory) -> bool:
    """The one definition of success every caller (scoring, evaluation, BC's stopping rule, imports) uses."""
    return outcome_success(suite, trajectory.task, trajectory.final_answer, trajectory.final_info)


def close_env(env: Any) -> None:
    """Call the env's `close()` if it has one (it is optional in the protocol)."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def close_envs(envs: Sequence[Any]) -> None:
    for env in envs:
        close_env(env)


def close_suite(suite: Any) -> None:
    """Call the suite's `close()` if it has one (it is optional in the protocol): a sandbox pool, MCP servers."""
    close = getattr(suite, "close", None)
    if callable(close):
        close()


def make_suite(name: str, options: Mapping[str, Any] | None = None, *, mcp_servers: Sequence[Any] = ()) -> Any:
    """The suite `name` names, built with `options` (config `env.name`, `env.options`), its envs also serving
    the tools of `mcp_servers` (config `env.mcp_servers`; `agentgrad.envs.mcp`)."""
    suite = SUITES.get(name)(**dict(options or {}))
    if not mcp_servers:
        return suite
    from agentgrad.envs.mcp import with_mcp_tools

    try:
        return with_mcp_tools(suite, mcp_servers)
    except BaseException:
        close_suite(suite)
        raise


def check_env(env: Env, task: Task, *, seed: int = 0, actions: Sequence[Action] = ()) -> None:
    """Check an env against the protocol and its promises, in the spirit of Gymnasium's `check_env`.

    Checks: reset returns (str, dict) with tools; the same seed and actions replay to the same observations;
    malformed and unknown-tool actions become error observations (no exception, not terminated);
    a final answer terminates (where the mask allows answering); stepping after termination raises.
    Raises EnvCheckError on failure.
    """

    def run(acts: Sequence[Action]) -> list[tuple]:
        obs, info = env.reset(seed=seed, options={"task": task})
        if not isinstance(obs, str) or not isinstance(info, dict):
            raise EnvCheckError(f"reset must return (str, dict), got ({type(obs).__name__}, {type(info).__name__})")
        if "tools" not in info:
            raise EnvCheckError("reset info must include 'tools' (the JSON schemas to render)")
        if not isinstance(env.legal_actions(), ActionMask):
            raise EnvCheckError("legal_actions() must return an ActionMask")
        trace: list[tuple] = [(obs,)]
        for a in acts:
            out = env.step(a)
            if not (isinstance(out, tuple) and len(out) == 5):
                raise EnvCheckError("step must return (observation, reward, terminated, truncated, info)")
            o, r, term, trunc, inf = out
            if not isinstance(o, str) or not isinstance(r, (int, float)) or not isinstance(inf, dict):
                raise EnvCheckError("step returned values of the wrong types")
            if not isinstance(term, bool) or not isinstance(trunc, bool):
                raise EnvCheckError("terminated and truncated must be bools")
            trace.append((o, float(r), term, trunc))
            if term or trunc:
                break
        return trace

    probes: list[Action] = [
        InvalidAction(text="<tool_call>{not json", error="malformed JSON"),
        ToolCall(name="definitely_not_a_tool", arguments={}),
        *actions,
    ]
    first = run(probes)
    for o, _, term, _ in first[1:3]:
        if term:
            raise EnvCheckError("a malformed or unknown tool call must not terminate the episode")
        if "error" not in o.lower():
            raise EnvCheckError(f"a malformed or unknown tool call must yield an error observation, got {o!r}")
    if first != run(probes):
        raise EnvCheckError("env is not deterministic given (task, seed, action history)")
    run([])
    answering = env.legal_actions().final_answer
    _, _, terminated, _, _ = env.step(FinalAnswer(text=""))
    if not terminated:
        if answering:
            raise EnvCheckError("a final answer must terminate the episode (or legal_actions() must forbid it)")
        return  # a game that forbids answering may answer a final answer with an error observation
    try:
        env.step(FinalAnswer(text=""))
    except RuntimeError:
        pass
    else:
        raise EnvCheckError("step after termination must raise RuntimeError (call reset first)")


class SuiteCheckError(AssertionError):
    pass


def prompt_key(task: Task) -> str:
    """The default split key: the prompt, so no question text is shared between splits."""
    return task.prompt


def split_key_of(suite: Any) -> Callable[[Task], str]:
    """What `suite`'s splits may not share: its `split_key`, or the prompt."""
    return getattr(suite, "split_key", None) or prompt_key


def check_suite(suite: Any, *, n: int = 20, seed: int = 0, env_checks: int = 2) -> dict[str, Any]:
    """Check a task suite before training on it: what `tests/unit/test_suites.py` asserts of the built-ins.

    - it has the TaskSuite methods, and `success_from` is valid;
    - `sample_tasks` is deterministic per seed and returns Tasks; the train, heldout and test splits share no
      task (by content hash) and no split key (`suite.split_key(task)`, by default the prompt);
    - the expert solves every one of `n` train tasks through a real env: its actions are legal, end the episode,
      and succeed by the suite's own success source;
    - the verifier agrees: it accepts the expert's answer and rejects an empty one (verifier-based suites),
      and the env says `info["success"]` at the end (env-based ones);
    - `check_env` passes on `env_checks` held-out tasks with the expert's actions.

    Raises SuiteCheckError naming the first problem; returns counts (distinct tasks per split, ...)."""
    missing = [m for m in ("sample_tasks", "expert_actions", "verify", "make_env")
               if not callable(getattr(suite, m, None))]
    if missing or not isinstance(getattr(suite, "name", None), str):
        raise SuiteCheckError(f"not a TaskSuite: missing {', '.join(missing) or 'a str name'}")
    try:
        source = success_from(suite)
    except ValueError as exc:
        raise SuiteCheckError(str(exc)) from None
    splits = {s: suite.sample_tasks(n, split=s, seed=seed) for s in ("train", "heldout", "test")}
    for split, tasks in splits.items():
        if not all(isinstance(t, Task) for t in tasks):
            raise SuiteCheckError(f"sample_tasks(split={split!r}) must return Task records")
        if tasks != suite.sample_tasks(n, split=split, seed=seed):
            raise SuiteCheckError(f"sample_tasks(split={split!r}, seed={seed}) is not deterministic")
    if not splits["train"]:
        raise SuiteCheckError("the train split is empty")
    hashes = {s: {t.content_hash() for t in ts} for s, ts in splits.items()}
    split_key = split_key_of(suite)
    keys = {s: {split_key(t) for t in ts} for s, ts in splits.items()}
    for a, b in (("train", "heldout"), ("train", "test"), ("heldout", "test")):
        if hashes[a] & hashes[b]:
            raise SuiteCheckError(f"the {a} and {b} splits share {len(hashes[a] & hashes[b])} task(s)")
        if keys[a] & keys[b] and source == "verifier":  # a game may show every task the same prompt
            raise SuiteCheckError(f"the {a} and {b} splits share split keys (prompts unless the suite defines "
                                  f"split_key), e.g. {sorted(keys[a] & keys[b])[0]!r}")
    episodes = []
    for task in splits["train"]:
        episode = expert_episode(suite, task, seed=seed)
        if episode.stop_reason is StopReason.MAX_TURNS:
            raise SuiteCheckError(f"the expert's actions do not end the episode ({task.task_id})")
        answer, info = episode.final_answer, episode.final_info
        if not outcome_success(suite, task, answer, info):
            raise SuiteCheckError(f"the expert fails {task.task_id} (success from {source}; answer {answer!r}, "
                                  f"env info {dict(info)!r})")
        if source != "env" and (suite.verify(task, None) or suite.verify(task, "")):
            raise SuiteCheckError(f"the verifier accepts an empty answer for {task.task_id}")
        if source != "verifier" and info.get("success") is not True:
            raise SuiteCheckError(f"the env did not report info['success'] = True after the expert ({task.task_id})")
        episodes.append(episode)
    for task in splits["heldout"][:env_checks]:
        env = suite.make_env()
        try:
            check_env(env, task, seed=seed, actions=suite.expert_actions(task))
        except EnvCheckError as exc:
            raise SuiteCheckError(f"check_env on {task.task_id}: {exc}") from None
        finally:
            close_env(env)
    return {"success_from": source, "expert_tasks": len(episodes),
            "distinct_tasks": {s: len(h) for s, h in hashes.items()}, "episodes": episodes}


def expert_episode(suite: Any, task: Task, *, seed: int = 0) -> Trajectory:
    """The expert's episode on `task` through a fresh env, as a token-free Trajectory (no tokenizer needed:
    `token_ids` are empty, turns carry the text, actions, observations, env rewards and `final_info`), for
    `check_suite` and for trying a reward function on it. Raises SuiteCheckError for an illegal action or one
    after the episode ended."""
    env = suite.make_env()
    try:
        obs, info = env.reset(seed=seed, options={"task": task})
        messages = ([Message("system", info["system"])] if info.get("system") else []) + [Message("user", obs)]
        turns: list[Turn] = []
        stop, final_info = StopReason.MAX_TURNS, {}
        for action in suite.expert_actions(task):
            if stop is not StopReason.MAX_TURNS:
                raise SuiteCheckError(f"expert acts after the episode ended ({task.task_id})")
            if not env.legal_actions().allows(action):
                raise SuiteCheckError(f"expert action {action} is masked out ({task.task_id})")
            obs, reward, terminated, truncated, info = env.step(action)
            ended = terminated or truncated or isinstance(action, FinalAnswer)
            text = action.text if isinstance(action, FinalAnswer) else ""
            turns.append(Turn(0, 0, text, action, None if ended else obs, tool_ok=info.get("tool_ok"),
                              tool_error=info.get("tool_error"), signals=info.get("signals", {}),
                              env_reward=float(reward)))
            calls = (action,) if isinstance(action, ToolCall) else ()
            messages.append(Message("assistant", text, tool_calls=calls))
            if not ended:
                messages.append(Message("tool", obs))
            else:
                final_info = dict(info)
                stop = StopReason.ANSWERED if isinstance(action, FinalAnswer) else StopReason.ENV_TERMINATED
    finally:
        close_env(env)
    return Trajectory(task=task, token_ids=(), loss_mask=(), logprobs=(), prompt_length=0, turns=tuple(turns),
                      stop_reason=stop, messages=tuple(messages), final_info=final_info)
