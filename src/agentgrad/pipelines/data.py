"""`agentgrad data import | export`: offline chat logs <-> a TrajectoryStore that replay can read.

Behaviour logprobs fallback: when a log has no (or mismatched) per-token logprobs, the episode is scored at
import with a named behaviour model, `--behaviour-model`, which defaults to the policy the logs will train
(`--model`). Logs rarely say which model wrote them; scoring with the policy at import time makes the
replayed samples' importance weights start at 1, so the correction then measures how far the policy has moved
since import, while the PPO clip around the current policy still bounds each update. When the logging model
is available, pass it as `--behaviour-model`: that gives the true pi/mu weights. Scores use the run's
`rollout.temperature`, the temperature the learner scores tokens at, so ratios compare like with like.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from agentgrad.backends.scoring import token_logprobs
from agentgrad.config import Config
from agentgrad.data.offline import LogFormatError, encode_episode, read_log, to_chat_line
from agentgrad.data.store import TrajectoryStore
from agentgrad.envs.base import TaskSuite, close_env, episode_success
from agentgrad.logging import ProgressFn, no_progress
from agentgrad.models.hf import load_model
from agentgrad.pipelines.components import inference, make_suite, quiet_hf
from agentgrad.rewards.base import apply_reward, load_reward
from agentgrad.rollout.chat import ChatCodec
from agentgrad.types import RewardBreakdown, ScoredTrajectory, Task, Trajectory


@dataclass(frozen=True)
class ImportReport:
    episodes: int
    rescored: int
    bad_lines: int
    masked: int
    errors: tuple[str, ...]
    out: str

    def to_dict(self) -> dict:
        return {"episodes": self.episodes, "rescored_with_behaviour_model": self.rescored,
                "bad_lines": self.bad_lines, "masked": self.masked, "out": self.out,
                "first_errors": list(self.errors[:5])}


@torch.no_grad()
def rescore(model: torch.nn.Module, trajs: Sequence[Trajectory], temperature: float) -> list[Trajectory]:
    """Fill behaviour logprobs on the policy tokens from `model`, one episode at a time (no padding effects)."""
    out = []
    model.eval()
    for t in trajs:
        ids = torch.tensor([t.token_ids])  # (1, T)
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0].tolist()  # (T,)
        out.append(Trajectory(**{**t.__dict__,
                                 "logprobs": tuple(lp[i] if m else 0.0 for i, m in enumerate(t.loss_mask))}))
    return out


def _default_tools(config: Config) -> tuple[list[dict], str]:
    return suite_tools(make_suite(config))


def suite_tools(suite: TaskSuite) -> tuple[list[dict], str]:
    """The tool schemas and system prompt the suite's env shows (for log lines that carry no "tools")."""
    try:  # a real task: an env may read its metadata at reset (a game's range)
        task = suite.sample_tasks(1, split="train", seed=0)[0]
    except (ValueError, IndexError):  # a task file without train tasks
        task = Task("probe", "probe", "")
    env = suite.make_env()
    try:
        _, info = env.reset(seed=0, options={"task": task})
    finally:
        close_env(env)
    return info.get("tools") or [], info.get("system", "")


class DemoLoadError(ValueError):
    """bc.demos cannot be used: no such file, nothing usable in it, or an unsupported combination."""


@dataclass(frozen=True)
class DemoLog:
    """What `read_demos` made of a log: the episodes to clone and an account of every line it did not use."""

    demos: tuple[Trajectory, ...]
    lines: int
    bad_lines: int
    failed: int  # episodes the log marks `"success": false`: not cloned
    errors: tuple[str, ...]

    def summary(self, path: str | Path) -> str:
        first = f" (first: {self.errors[0]})" if self.errors else ""
        return (f"bc.demos: {len(self.demos)} episodes from {path}; {self.bad_lines} bad line(s){first}; "
                f"{self.failed} marked unsuccessful, not cloned")

    def metrics(self) -> dict[str, float]:
        return {"bc/demos": float(len(self.demos)), "bc/demos_bad_lines": float(self.bad_lines),
                "bc/demos_unsuccessful": float(self.failed)}


def read_demos(path: str | Path, codec: ChatCodec, default_tools: Sequence[dict] | None = None) -> DemoLog:
    """Expert episodes from an OpenAI-format chat log (JSONL) or a store directory, encoded token-in/token-out
    through `codec` by the importer's own `read_log` / `encode_episode`: a store's episodes go through their chat
    form too, so they are re-encoded with this run's tokenizer whatever model wrote them. A line that does not
    parse or encode is counted with its error, never dropped silently."""
    path = Path(path)
    if path.is_dir():
        lines: Iterable[str] = (json.dumps(to_chat_line(s.trajectory, success=s.success))
                                for s in TrajectoryStore(path).trajectories())
    elif path.is_file():
        lines = path.open(encoding="utf-8")
    else:
        raise DemoLoadError(f"bc.demos: no such log or store {str(path)!r}")
    demos: list[Trajectory] = []
    errors: list[str] = []
    failed = total = 0
    for parsed in read_log(lines):
        total += 1
        if isinstance(parsed, LogFormatError):
            errors.append(str(parsed))
            continue
        if parsed.success is False:
            failed += 1
            continue
        try:
            demos.append(encode_episode(parsed, codec, default_tools)[0])
        except (LogFormatError, KeyError, TypeError, ValueError) as exc:  # a template that rejects the chat
            errors.append(f"task {parsed.task.task_id}: {type(exc).__name__}: {exc}")
    if not demos:
        raise DemoLoadError(f"bc.demos: no usable episode in {path} ({total} lines, {len(errors)} bad, {failed} "
                            f"unsuccessful){': ' + errors[0] if errors else ''}")
    return DemoLog(tuple(demos), total, len(errors), failed, tuple(errors))


def import_chat_log(config: Config, log: Path, out: Path, *, model_path: str,
                    behaviour_model_path: str | None = None, progress: ProgressFn = no_progress) -> ImportReport:
    """Encode, score and store every episode of `log`; `progress(lines done, lines)` as it goes."""
    with log.open(encoding="utf-8") as fh:
        progress(0, sum(1 for line in fh if line.strip()))
    quiet_hf()
    torch.set_num_threads(config.run.threads)
    loaded = load_model(model_path, dtype=config.model.dtype, device="cpu")
    _, codec = inference(loaded, config.model)
    behaviour = loaded.model if behaviour_model_path is None else load_model(behaviour_model_path).model
    suite = make_suite(config)
    reward_fn = load_reward(config.reward.name, suite, **config.reward.options)
    tools, _ = _default_tools(config)
    store = TrajectoryStore(out)
    errors: list[str] = []
    n = rescored = masked = 0
    pending: list[ScoredTrajectory] = []

    def flush() -> None:  # one fsync per batch, not per episode
        store.append(pending, step=0, stage="import", groups=[f"import:{s.trajectory.task.task_id}" for s in pending],
                     source=f"import:{log.name}")
        pending.clear()

    with log.open() as fh:
        for parsed in read_log(fh):
            progress(n + len(errors) + 1, None)
            if isinstance(parsed, LogFormatError):
                errors.append(str(parsed))
                continue
            try:
                traj, complete = encode_episode(parsed, codec, tools)
            except LogFormatError as exc:
                errors.append(str(exc))
                continue
            if not complete:
                traj = rescore(behaviour, [traj], config.rollout.temperature)[0]
                rescored += 1
            if parsed.reward is not None:
                reward = RewardBreakdown(parsed.reward, (0.0,) * len(traj.turns))
                success = parsed.success if parsed.success is not None else parsed.reward > 0
            else:
                reward = apply_reward(reward_fn, traj)
                success = episode_success(suite, traj)
            masked += int(reward.masked)
            pending.append(ScoredTrajectory(traj, reward, bool(success)))
            n += 1
            if len(pending) >= 256:
                flush()
    flush()
    return ImportReport(n, rescored, len(errors), masked, tuple(errors), str(out))


def export_chat_log(config: Config, store_dir: Path, out: Path, *, progress: ProgressFn = no_progress) -> int:
    """Write a store's trajectories as an OpenAI-format chat log (with per-turn logprobs); returns the count.
    `progress(episodes read, None)`: a store does not know its length before it is read."""
    tools, _ = _default_tools(config)
    n = 0
    with out.open("w") as fh:
        for read, s in enumerate(TrajectoryStore(store_dir).trajectories(), start=1):
            progress(read, None)
            if s.reward.masked:
                continue
            fh.write(json.dumps(to_chat_line(s.trajectory, reward=s.total_reward, success=s.success, tools=tools))
                     + "\n")
            n += 1
    return n
