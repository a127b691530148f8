"""Metric sinks: one real tiny `agentgrad train` with TensorBoard, W&B (offline) and MLflow (local file store) on
at once; each test reads back what its backend wrote, with the backend's own reader, and compares it with
metrics.jsonl value by value."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from agentgrad.config import ConfigError, build_config
from agentgrad.pipelines.preflight import BadInputError, check_sinks
from agentgrad.sinks import SINKS, SinkContext, make_sinks, missing_packages

pytest.importorskip("tensorboard", reason="the sinks extra is not installed: pip install -e '.[sinks]'")
pytest.importorskip("wandb", reason="the sinks extra is not installed: pip install -e '.[sinks]'")
pytest.importorskip("mlflow", reason="the sinks extra is not installed: pip install -e '.[sinks]'")

pytestmark = pytest.mark.slow  # each module trains one tiny run

TINY = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
    "model.tiny.tokenizer_corpus_episodes=50", "bc.steps=4", "bc.eval_every=2", "bc.eval_tasks=4",
    "bc.num_demos=32", "bc.batch_size_episodes=8", "algo.steps=2", "algo.tasks_per_step=2", "algo.group_size=2",
    "algo.epochs_per_step=1", "algo.kl_coef=0.01", "eval.num_tasks=4", "run.progress=false", "run.name=sinks",
    "metrics.sinks=[tensorboard, wandb, mlflow]",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, monkeypatch_module):
    from agentgrad.pipelines.train import train

    out = tmp_path_factory.mktemp("sinks")
    monkeypatch_module.setenv("WANDB_MODE", "offline")  # belt and braces: the sink asks for offline itself
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    train(build_config(overrides=[*TINY, f"run.output_dir={out}"]))
    return out / "sinks"


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def jsonl_values(run_dir: Path) -> dict[tuple[str, int], float]:
    """(<stage>/<key>, step) -> value of every finite metric in metrics.jsonl: what each sink must hold."""
    out: dict[tuple[str, int], float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("step", "stage", "time") and isinstance(value, (int, float)) and math.isfinite(value):
                out[(f"{row['stage']}/{key}", row["step"])] = float(value)
    return out


def assert_same(got: dict[tuple[str, int], float], want: dict[tuple[str, int], float], rel: float) -> None:
    assert set(got) == set(want), (sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5])
    bad = [(k, got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=rel, abs_tol=1e-12)]
    assert bad == [], bad[:5]


def test_the_run_logged_the_stages_the_sinks_are_read_for(run_dir):
    want = jsonl_values(run_dir)
    stages = {k.split("/")[0] for k, _ in want}
    assert {"bc", "grpo", "schedule", "eval_bc", "eval_final"} <= stages, stages
    assert ("grpo/train/kl_coef", 1) in want and ("bc/loss/bc", 1) in want
    assert len(want) > 50


def test_tensorboard_holds_every_jsonl_value(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert_same(got, jsonl_values(run_dir), rel=1e-6)  # event files store float32


def test_mlflow_file_store_holds_every_jsonl_value(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("agentgrad")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "sinks" and run.info.status == "FINISHED"
    assert run.data.params["algo.kl_coef"] == "0.01"  # the config went in as the run's params
    got = {(m.key, m.step): m.value for key in run.data.metrics
           for m in client.get_metric_history(run.info.run_id, key)}
    assert_same(got, jsonl_values(run_dir), rel=1e-12)


def wandb_records(run_file: Path) -> list[bytes]:
    """The protobuf records of a .wandb file. W&B writes them in LevelDB's log framing after a 7-byte header
    (':W&B', magic, version): 32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: full, first,
    middle, last). W&B no longer ships a Python reader for it, so the test reads the framing itself."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, out, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            out.append(partial + chunk)
        else:  # zero padding at the end of the last block
            break
    return out


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run, parsed with W&B's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_every_jsonl_value(run_dir):
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    got = {}
    for row in wandb_history(run_file):
        (step_key,) = [k for k in row if k.endswith("/step") and k.count("/") == 1]
        stage = step_key.split("/")[0]
        got |= {(k, row[step_key]): float(v) for k, v in row.items()
                if k.startswith(stage + "/") and k != step_key}
    assert_same(got, jsonl_values(run_dir), rel=1e-12)


def test_a_sink_whose_package_is_missing_is_one_line_before_the_run(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_packages(["tensorboard", "wandb", "jsonl"]) == [("wandb", "wandb")]
    with pytest.raises(BadInputError, match=r"metrics.sinks: wandb needs the 'wandb' package; install them with "
                                            r"pip install 'agentgrad\[sinks\]'"):
        check_sinks(["wandb"])


def test_unknown_sink_names_are_a_config_error_listing_the_valid_ones():
    with pytest.raises(ConfigError, match="metrics.sinks.0.*'jsonl', 'tensorboard', 'wandb' or 'mlflow'"):
        build_config(overrides=["metrics.sinks=[tensorbored]"])
    from typing import get_args

    from agentgrad.config import SinkName

    assert sorted(get_args(SinkName)) == sorted(SINKS)  # the config accepts exactly what the registry builds


def test_jsonl_is_always_first_and_each_sink_is_built_once(tmp_path):
    sinks = make_sinks(["tensorboard", "jsonl", "tensorboard"], SinkContext(tmp_path, "r"))
    try:
        assert [type(s).__name__ for s in sinks] == ["JsonlSink", "TensorBoardSink"]
        sinks[0].write(1, "bc", {"loss/bc": float("nan"), "x/y": 2.0})
        sinks[1].write(1, "bc", {"loss/bc": float("nan"), "x/y": 2.0})
    finally:
        for s in sinks:
            s.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss/bc"] is None  # non-finite: null, as before
