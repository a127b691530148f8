"""The run logger (every metric record to each sink, and to the live progress display) and the display.

The display is the one progress display of the package: a bar per stage (BC, RL, ...) with the numbers a user
watches, and `track` bars for every other step that can take more than a few seconds (held-out evaluation, the
tiny model's build, expert demonstrations, `data import`, `judge calibrate`, ...). It shows only on a terminal:
with its stream redirected to a file or a pipe (CI, `2> log`) it stays quiet and only `print`'s lines go out.

Metrics are flat `{"section/name": float}` records (e.g. `rollout/success_rate`, `loss/policy`); the sinks
(`metrics.jsonl` always, tensorboard, wandb, mlflow) live in `agentgrad.sinks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from agentgrad.sinks import JsonlSink, MetricSink

__all__ = ["JsonlSink", "MetricSink", "ProgressDisplay", "ProgressFn", "RunLogger", "no_progress"]
# (the sinks' names are kept importable here)

ProgressFn = Callable[[int, "int | None"], None]
"""`(done, total)`: how far a long step is; what `ProgressDisplay.track` yields and long steps take (total None:
not known yet, or unchanged)."""


def no_progress(done: int, total: int | None = None) -> None:
    """A `ProgressFn` that shows nothing (the default of every function that takes one)."""


class ProgressDisplay:
    """One rich progress bar per stage, with the numbers a user watches (success, reward, KL, tokens/s), and one
    per other long step (`track`). Off (`enabled` False) unless asked for and its console is a terminal."""

    FIELDS = (("rollout/success_rate", "success", "{:.0%}"), ("rollout/reward_mean", "reward", "{:.2f}"),
              ("loss/kl", "kl", "{:.4f}"), ("loss/approx_kl_old", "kl_old", "{:.4f}"), ("loss/bc", "bc_loss", "{:.3f}"),
              ("eval/bc_validation_success", "valid", "{:.0%}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"))

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        # a bar redrawn into a file or a pipe is noise (rich would write its last frame there): terminals only
        self.enabled = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task = None

    def _new_progress(self) -> Progress:
        return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=self.console, transient=False)

    def start(self, stage: str, total: int) -> None:
        self.stop()
        if not self.enabled:
            return
        self._progress = self._new_progress()
        self._progress.start()
        self._task = self._progress.add_task(stage, total=total, stats="")

    @contextmanager
    def track(self, label: str, total: int | None = None) -> Iterator[ProgressFn]:
        """A bar for a step that is not a stage; yields its `ProgressFn`. Under a running stage's bar it is a
        second row, removed when the step ends; on its own it stays on screen, with the time it took."""
        if not self.enabled:
            yield no_progress
            return
        nested = self._progress is not None
        progress = self._progress if nested else self._new_progress()
        if not nested:
            progress.start()
        task = progress.add_task(label, total=total, stats="")

        def update(done: int, new_total: int | None = None) -> None:
            progress.update(task, completed=done, **({} if new_total is None else {"total": new_total}))

        try:
            yield update
            shown = next(t for t in progress.tasks if t.id == task)
            if shown.total is None:  # a count only known now (done: its total), or a spinner (shown as 1/1)
                progress.update(task, total=shown.completed or 1, completed=shown.completed or 1)
        finally:
            if nested:
                progress.remove_task(task)
            else:
                progress.stop()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._progress is None:
            return
        stats = "  ".join(f"{label} {fmt.format(metrics[key])}" for key, label, fmt in self.FIELDS if key in metrics)
        self._progress.update(self._task, completed=step, stats=stats)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def print(self, message: str) -> None:
        self.console.print(message)


class RunLogger:
    def __init__(self, sinks: list[MetricSink], display: ProgressDisplay) -> None:
        self.sinks = sinks
        self.display = display

    def log(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, stage, metrics)
        self.display.update(step, metrics)

    def close(self) -> None:
        self.display.stop()
        for sink in self.sinks:
            sink.close()
