"""Metric sinks: where each `{"section/name": float}` record of a run goes, behind one protocol and one registry.

`metrics.jsonl` (`JsonlSink`) is always written: it is the run's own record (resume truncates it, `agentgrad
report` reads it). `metrics.sinks` in the config adds others, several at once: `tensorboard` (event files under
RUN_DIR/tensorboard), `wandb` (offline by default: RUN_DIR/wandb, `wandb sync` uploads it later) and `mlflow`
(a local file store, RUN_DIR/mlruns, unless `metrics.mlflow_tracking_uri` names another). Their packages are
optional (`pip install 'agentgrad[sinks]'`) and imported only when a sink is built.

The external sinks name a value `<stage>/<key>` (`grpo/rollout/success_rate`) at the record's step: steps
restart per stage (BC counts its own, RL stages count RL steps), so one name per stage keeps each curve
monotone in its step. Non-finite values are left out (the JSONL writes them as null).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from agentgrad.registry import Registry


class MetricSink(Protocol):
    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SinkContext:
    """What a sink factory gets: the run directory, a run name, the sink options and the run's config (a plain
    dict, logged as the run's parameters where the backend has them)."""

    run_dir: Path
    run_name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)


class MetricRecord(NamedTuple):
    step: int
    stage: str
    metrics: dict[str, Any]


class MemorySink:
    """Every record kept in memory (not a registered sink: nothing to configure), for code that reads a run's
    metrics back in the same process: tests, benchmarks, notebooks."""

    def __init__(self) -> None:
        self.records: list[MetricRecord] = []

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        self.records.append(MetricRecord(step, stage, dict(metrics)))

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Each record's metrics, in order."""
        return [r.metrics for r in self.records]

    def close(self) -> None:
        pass


SinkFactory = Callable[[SinkContext], MetricSink]
SINKS: Registry[SinkFactory] = Registry("metric sink")
REQUIRES: dict[str, str] = {}
"""Sink name -> the module it imports (for a one-line error before a run starts, `missing_packages`)."""


def finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def register(name: str, requires: str | None = None) -> Callable[[SinkFactory], SinkFactory]:
    if requires is not None:
        REQUIRES[name] = requires
    return SINKS.register(name)


def missing_packages(names: list[str]) -> list[tuple[str, str]]:
    """(sink, module) for each chosen sink whose package is not installed."""
    return [(n, REQUIRES[n]) for n in names if n in REQUIRES and importlib.util.find_spec(REQUIRES[n]) is None]


class JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1)

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "stage": stage, "time": round(time.time(), 3)}
        record.update({k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
                       for k, v in metrics.items()})
        self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._fh.close()


@register("jsonl")
def _jsonl(ctx: SinkContext) -> MetricSink:
    return JsonlSink(ctx.run_dir / "metrics.jsonl")


class TensorBoardSink:
    """Scalars through torch's `SummaryWriter` (it needs the `tensorboard` package)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        for key, value in finite(metrics).items():
            self._writer.add_scalar(f"{stage}/{key}", value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@register("tensorboard", requires="tensorboard")
def _tensorboard(ctx: SinkContext) -> MetricSink:
    return TensorBoardSink(Path(ctx.options.get("tensorboard_dir") or ctx.run_dir / "tensorboard"))


class WandbSink:
    """A W&B run; `mode=offline` writes RUN_DIR/wandb/offline-run-* and never touches the network. Each stage
    gets its own step axis (`<stage>/step`, W&B's define_metric), since W&B's own step must only grow."""

    def __init__(self, ctx: SinkContext) -> None:
        import wandb

        self._wandb = wandb
        self._stages: set[str] = set()
        self.run = wandb.init(project=ctx.options.get("wandb_project") or "agentgrad", name=ctx.run_name,
                              dir=str(ctx.run_dir), mode=ctx.options.get("wandb_mode") or "offline",
                              config=dict(ctx.config), reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        if stage not in self._stages:
            self._stages.add(stage)
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
        self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in finite(metrics).items()}})

    def close(self) -> None:
        self.run.finish()


@register("wandb", requires="wandb")
def _wandb(ctx: SinkContext) -> MetricSink:
    return WandbSink(ctx)


class MlflowSink:
    """An MLflow run in a tracking store (by default a local file store, RUN_DIR/mlruns): params from the
    config, each record's metrics at its step."""

    def __init__(self, ctx: SinkContext) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        uri = ctx.options.get("mlflow_tracking_uri") or (ctx.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses a file store (in maintenance) unless this opt-out is set; it needs no database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        name = ctx.options.get("mlflow_experiment") or "agentgrad"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=ctx.run_name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(ctx.config).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit on params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, step: int, stage: str, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(f"{stage}/{k}", v, now, step) for k, v in finite(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit on metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@register("mlflow", requires="mlflow")
def _mlflow(ctx: SinkContext) -> MetricSink:
    return MlflowSink(ctx)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def make_sinks(names: list[str], ctx: SinkContext) -> list[MetricSink]:
    """JSONL first (always), then each chosen sink once, in the order given."""
    chosen = ["jsonl", *dict.fromkeys(n for n in names if n != "jsonl")]
    sinks: list[MetricSink] = []
    try:
        for name in chosen:
            sinks.append(SINKS.get(name)(ctx))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
