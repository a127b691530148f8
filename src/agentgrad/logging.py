"""The run logger (every metric record to each sink, and to the live progress display) and the display.

Metrics are flat `{"section/name": float}` records (e.g. `rollout/success_rate`, `loss/policy`); the sinks
(`metrics.jsonl` always, tensorboard, wandb, mlflow) live in `agentgrad.sinks`.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from agentgrad.sinks import JsonlSink, MetricSink

__all__ = ["JsonlSink", "MetricSink", "ProgressDisplay", "RunLogger"]  # the sinks' names, kept importable here


class ProgressDisplay:
    """One rich progress bar per stage, with the numbers a user watches: success, reward, KL, tokens/s."""

    FIELDS = (("rollout/success_rate", "success", "{:.0%}"), ("rollout/reward_mean", "reward", "{:.2f}"),
              ("loss/kl", "kl", "{:.4f}"), ("loss/approx_kl_old", "kl_old", "{:.4f}"), ("loss/bc", "bc_loss", "{:.3f}"),
              ("eval/bc_validation_success", "valid", "{:.0%}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"))

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task = None

    def start(self, stage: str, total: int) -> None:
        self.stop()
        if not self.enabled:
            return
        self._progress = Progress(TextColumn(f"[bold]{stage}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(stage, total=total, stats="")

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
