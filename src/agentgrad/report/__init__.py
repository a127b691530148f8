"""`agentgrad report RUN_DIR`: one self-contained HTML file of a run (plotly.js inlined: it opens offline).

Learning curves from metrics.jsonl (stage switches marked), tool-usage, stop-reason and error-kind breakdowns
from the stored trajectories, and a trajectory viewer: each turn's text, tool call, observation and per-turn
reward, the loss mask on the tokens, filters by task, outcome, step and stage, and a group's successful and
failed siblings side by side. Reads the run directory only; a run still in progress can be reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agentgrad.report.data import breakdowns, entropy_by_step, read_metrics, read_trajectories, timeline, viewer_records

HERE = Path(__file__).parent
TOKENIZER_DIRS = ("checkpoints/final", "checkpoints/bc", "base-model")


class ReportError(ValueError):
    """The directory cannot be reported on; the one-line message says why."""


def token_pieces(run_dir: Path, ids: Iterable[int]) -> dict[int, str]:
    """Each token id's text, decoded alone with the run's own tokenizer (a checkpoint's tokenizer.json, else
    model.path's); empty when none is found (the viewer then shows ids)."""
    from tokenizers import Tokenizer

    candidates = [run_dir / d / "tokenizer.json" for d in TOKENIZER_DIRS]
    config = run_dir / "config.yaml"
    if config.exists():
        import yaml

        path = ((yaml.safe_load(config.read_text()) or {}).get("model") or {}).get("path")
        if path:
            candidates.append(Path(path).expanduser() / "tokenizer.json")
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        return {}
    tok = Tokenizer.from_file(str(found))
    return {i: tok.decode([i], skip_special_tokens=False) for i in sorted(ids)}


def _pct(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, (int, float)) else "–"


def summary_rows(summary: Mapping[str, Any], num_records: int) -> list[tuple[str, str]]:
    rows = [("algorithm", str(summary.get("algorithm", "–"))),
            ("held-out success, start", _pct(summary.get("initial_success_rate"))),
            ("held-out success, end", _pct(summary.get("final_success_rate")))]
    final = summary.get("final_eval") or {}
    if final.get("ci95"):
        lo, hi = final["ci95"]
        rows.append(("end, 95% CI", f"{lo:.1%}–{hi:.1%} (n={final.get('num_tasks')})"))
    rows += [("BC steps", str(summary.get("bc_steps", "–"))), ("RL steps", str(summary.get("rl_steps", "–"))),
             ("wall time", f"{summary['wall_time_s']:.0f} s" if "wall_time_s" in summary else "–"),
             ("trajectories stored", str(num_records))]
    if not summary:
        rows[0] = ("status", "no summary.json (still running, or stopped early)")
    return rows


def _json_for_script(obj: Any) -> str:
    """JSON safe inside a <script> element: no '<', '>' or '&' outside escapes (model text can hold '</script>')."""
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace(
        "&", "\\u0026")


def build_report(run_dir: str | Path, out: str | Path | None = None, *, max_trajectories: int = 2000) -> Path:
    """Write the report of `run_dir` (default RUN_DIR/report.html) and return its path."""
    import jinja2

    from agentgrad.report.figures import PANELS, breakdown_figures, curve_figure, plotly_js, to_div

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "trajectories").is_dir():
        raise ReportError(f"{run_dir} is not a run directory (no metrics.jsonl, no trajectories/)")
    rows = read_metrics(run_dir / "metrics.jsonl")
    t = timeline(rows)
    records, bad = read_trajectories(run_dir / "trajectories")
    t.add_rl_series("rollout/entropy_estimate", entropy_by_step(records))
    shown, ids = viewer_records(records, max_trajectories)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    curves = [to_div(curve_figure(p, t), f"curve-{i}") for i, p in enumerate(PANELS)]
    bars = [to_div(fig, div_id) for div_id, fig in breakdown_figures(breakdowns(records))]
    note = (f"All {len(shown)} stored trajectories." if len(shown) == len(records) else
            f"{len(shown)} of {len(records)} trajectories (whole groups, spread over the run; "
            f"--max-trajectories sets how many).")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), autoescape=True)
    html = env.get_template("page.html").render(
        run_name=run_dir.resolve().name, run_dir=str(run_dir.resolve()),
        written=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), summary=summary_rows(summary, len(records)),
        curves=curves, bars=bars, num_records=len(records), bad_lines=bad, viewer_note=note,
        plotly_js=plotly_js(), viewer_js=(HERE / "viewer.js").read_text(),
        data_json=_json_for_script({"trajectories": shown,
                                    "pieces": {str(k): v for k, v in token_pieces(run_dir, ids).items()}}))
    out = Path(out) if out is not None else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out
