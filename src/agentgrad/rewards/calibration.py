"""Judge calibration: score a judge against human labels before it is allowed to shape training.

Labels are JSONL, one example per line: {"prompt": ..., "response": ..., "reference"?: ..., "label": 0|1} or
{"trajectory": <store record | transcript string>, "label": 0|1} (1 = the response is acceptable); each becomes
a `Trajectory`, what a judge reads (`rewards.labels`).

`calibrate` asks the judge about every example and reports agreement with the humans: accuracy, the confusion
matrix, per-class precision and recall, and Cohen's kappa (agreement beyond chance: a judge that always says
PASS on a 85%-positive set has accuracy 0.85 but kappa 0). A verdict the judge fails to give counts against
it: it is scored as the opposite of the human label. `require_calibrated` refuses a judge whose stored report is
missing, for another judge, too small, or below the threshold.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentgrad.logging import ProgressDisplay
from agentgrad.rewards.judge import Judge
from agentgrad.rewards.judge_backends import OpenAIChatBackend
from agentgrad.rewards.labels import CalibrationError, LabelledExample, load_labels

__all__ = [
    "DEFAULT_THRESHOLD",
    "MIN_EXAMPLES",
    "CalibrationError",
    "CalibrationReport",
    "JudgeNotCalibratedError",
    "LabelledExample",
    "agreement_report",
    "calibrate",
    "calibrate_cli",
    "load_labels",
    "read_report",
    "require_calibrated",
    "write_report",
]

MIN_EXAMPLES = 100
DEFAULT_THRESHOLD = 0.80


class JudgeNotCalibratedError(RuntimeError):
    """A judge without a (good enough) calibration report was about to be used as a reward."""

    def __init__(self, message: str, *, judge_id: str, report_path: str | None,
                 accuracy: float | None = None, threshold: float | None = None) -> None:
        super().__init__(message)
        self.judge_id = judge_id
        self.report_path = report_path
        self.accuracy = accuracy
        self.threshold = threshold


@dataclass(frozen=True)
class CalibrationReport:
    """Agreement of a judge with human labels. `confusion[h][j]` counts examples with human label h and
    judge verdict j (0 = fail, 1 = pass); unparsed verdicts are counted as the opposite of the human label.
    `precision`/`recall` are keyed by class ("0", "1"); `kappa` is Cohen's kappa."""

    judge_id: str
    n: int
    n_unparsed: int
    accuracy: float
    confusion: tuple[tuple[int, int], tuple[int, int]]
    precision: Mapping[str, float]
    recall: Mapping[str, float]
    kappa: float
    pass_threshold: float = 0.5
    labels_path: str = ""
    labels_sha256: str = ""
    created_at: str = ""
    errors: tuple[str, ...] = field(default=())  # a few examples of failed verdicts, for debugging

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["confusion"] = [list(r) for r in self.confusion]
        d["errors"] = list(self.errors)
        d["precision"], d["recall"] = dict(self.precision), dict(self.recall)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CalibrationReport:
        d = dict(d)
        c = d["confusion"]
        d["confusion"] = ((int(c[0][0]), int(c[0][1])), (int(c[1][0]), int(c[1][1])))
        d["errors"] = tuple(d.get("errors", ()))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def summary(self) -> str:
        (tn, fp), (fn, tp) = self.confusion
        return (f"judge {self.judge_id}: n={self.n} accuracy={self.accuracy:.3f} kappa={self.kappa:.3f} "
                f"[tn={tn} fp={fp} fn={fn} tp={tp}] precision(pass)={self.precision['1']:.3f} "
                f"recall(pass)={self.recall['1']:.3f} precision(fail)={self.precision['0']:.3f} "
                f"recall(fail)={self.recall['0']:.3f} unparsed={self.n_unparsed}")


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def agreement_report(judge_id: str, labels: Sequence[int], verdicts: Sequence[int | None], **meta: Any
                     ) -> CalibrationReport:
    """The report for human `labels` and judge `verdicts` (0/1, or None for no verdict). Pure arithmetic.

    >>> r = agreement_report("j", [1, 1, 0, 0], [1, 0, 0, None])
    >>> r.accuracy, r.confusion, r.kappa
    (0.5, ((1, 1), (1, 1)), 0.0)
    """
    if len(labels) != len(verdicts):
        raise ValueError(f"{len(labels)} labels for {len(verdicts)} verdicts")
    n = len(labels)
    if n == 0:
        raise CalibrationError("no examples")
    m = [[0, 0], [0, 0]]
    unparsed = 0
    for h, j in zip(labels, verdicts):
        if j is None:
            unparsed += 1
            j = 1 - h
        m[h][j] += 1
    (tn, fp), (fn, tp) = m
    accuracy = (tp + tn) / n
    p_e = ((tn + fp) / n) * ((tn + fn) / n) + ((fn + tp) / n) * ((fp + tp) / n)
    kappa = (accuracy - p_e) / (1 - p_e) if p_e < 1 else (1.0 if accuracy == 1 else 0.0)
    return CalibrationReport(
        judge_id=judge_id, n=n, n_unparsed=unparsed, accuracy=accuracy,
        confusion=((tn, fp), (fn, tp)),
        precision={"0": _ratio(tn, tn + fn), "1": _ratio(tp, tp + fp)},
        recall={"0": _ratio(tn, tn + fp), "1": _ratio(tp, tp + fn)},
        kappa=kappa, **meta)


def calibrate(judge: Judge, labels_path: str | Path, *, min_examples: int = MIN_EXAMPLES,
              pass_threshold: float = 0.5, max_workers: int = 4,
              progress: Callable[[int, int | None], None] | None = None) -> CalibrationReport:
    """Ask `judge` about every labelled example and report its agreement with the human labels;
    `progress(verdicts, examples)` as verdicts come in.

    A verdict counts as PASS when its score >= `pass_threshold`. Needs at least `min_examples` examples and
    both classes present (CalibrationError otherwise).
    """
    path = Path(labels_path)
    examples = load_labels(path)
    if len(examples) < min_examples:
        raise CalibrationError(f"{path} has {len(examples)} labelled examples; calibration needs at least "
                               f"{min_examples}")
    labels = [e.label for e in examples]
    if len(set(labels)) < 2:
        raise CalibrationError(f"{path} has only label {labels[0]}: both classes (0 and 1) are needed")
    shown = progress or (lambda done, total: None)
    shown(0, len(examples))
    results = judge.judge_many([e.trajectory for e in examples], max_workers=max_workers,
                               on_verdict=lambda count: shown(count, None))
    verdicts = [None if r.score is None else int(r.score >= pass_threshold) for r in results]
    errors = tuple(f"line {e.line}: {r.error}" for e, r in zip(examples, results) if r.error)[:5]
    return agreement_report(
        judge.judge_id, labels, verdicts, pass_threshold=pass_threshold, labels_path=str(path),
        labels_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), errors=errors)


def write_report(report: CalibrationReport, path: str | Path) -> Path:
    """Write the report as JSON (atomically: a temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_report(path: str | Path) -> CalibrationReport:
    return CalibrationReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def require_calibrated(judge_id: str, report_path: str | Path | None, threshold: float = DEFAULT_THRESHOLD,
                       override: bool = False, *, min_examples: int = MIN_EXAMPLES,
                       min_kappa: float | None = None) -> CalibrationReport | None:
    """Return the stored calibration report of `judge_id` if it shows accuracy >= `threshold` (and kappa >=
    `min_kappa`, if given) on >= `min_examples` examples. Otherwise raise `JudgeNotCalibratedError` saying
    why, unless `override=True`, which only warns (and returns the report, or None if there is none)."""

    def refuse(why: str, report: CalibrationReport | None = None) -> CalibrationReport | None:
        message = (f"judge {judge_id!r} is not calibrated: {why}. Run `agentgrad judge calibrate --labels "
                   f"FILE.jsonl` on >= {min_examples} human-labelled examples, or override explicitly.")
        if override:
            warnings.warn(message + " (overridden)", stacklevel=3)
            return report
        raise JudgeNotCalibratedError(message, judge_id=judge_id,
                                      report_path=None if report_path is None else str(report_path),
                                      accuracy=None if report is None else report.accuracy, threshold=threshold)

    if report_path is None:
        return refuse("no calibration report given")
    path = Path(report_path)
    if not path.exists():
        return refuse(f"no calibration report at {path}")
    try:
        report = read_report(path)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return refuse(f"calibration report {path} is unreadable ({type(exc).__name__}: {exc})")
    if report.judge_id != judge_id:
        return refuse(f"{path} calibrates a different judge ({report.judge_id!r})", report)
    if report.n < min_examples:
        return refuse(f"{path} covers {report.n} examples, fewer than {min_examples}", report)
    if not (math.isfinite(report.accuracy) and report.accuracy >= threshold):
        return refuse(f"accuracy {report.accuracy:.3f} on {report.n} examples is below the threshold "
                      f"{threshold:.2f}", report)
    if min_kappa is not None and not report.kappa >= min_kappa:
        return refuse(f"Cohen's kappa {report.kappa:.3f} is below {min_kappa:.2f}", report)
    return report


def calibrate_cli(labels: str | Path, base_url: str, model: str, out: str | Path,
                  threshold: float = DEFAULT_THRESHOLD, *, rubric: str = "pass_fail", criteria: str = "",
                  min_examples: int = MIN_EXAMPLES, api_key_env: str | None = None, timeout_s: float = 60.0,
                  max_workers: int = 4, cache_path: str | Path | None = None,
                  display: ProgressDisplay | None = None) -> int:
    """`agentgrad judge calibrate --labels FILE.jsonl`: calibrate an OpenAI-compatible judge, write the report
    to `out`, print a summary. Exit code: 0 accepted (accuracy >= threshold), 1 below threshold (the report is
    still written), 2 error (bad labels, unreachable endpoint for every example, ...). A bar on `display` while
    the judge answers (closed before the summary goes to stdout)."""
    try:
        backend = OpenAIChatBackend(base_url, model, api_key_env=api_key_env, timeout_s=timeout_s)
        judge = Judge(backend, rubric, criteria=criteria, cache=cache_path if cache_path is not None else True)
        with (display or ProgressDisplay(enabled=False)).track(f"judge calibrate ({model})") as progress:
            report = calibrate(judge, labels, min_examples=min_examples, max_workers=max_workers, progress=progress)
    except (CalibrationError, OSError, ValueError) as exc:
        print(f"judge calibrate: {exc}", file=sys.stderr)
        return 2
    write_report(report, out)
    print(report.summary())
    print(f"report written to {out}")
    if report.n_unparsed == report.n:
        print(f"judge calibrate: no verdict at all; first error: {report.errors[0] if report.errors else '?'}",
              file=sys.stderr)
        return 2
    if report.accuracy < threshold:
        print(f"judge calibrate: REFUSED: accuracy {report.accuracy:.3f} < threshold {threshold:.2f}",
              file=sys.stderr)
        return 1
    print(f"judge calibrate: ACCEPTED: accuracy {report.accuracy:.3f} >= threshold {threshold:.2f}")
    return 0
