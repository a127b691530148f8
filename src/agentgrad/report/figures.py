"""The report's plots, with plotly (an optional dependency: `pip install 'agentgrad[report]'`).

Each figure becomes a `<div>` without plotly.js; the page inlines plotly.js once (`plotly_js`), so the file
works offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentgrad.report.data import Timeline


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    secondary: tuple[str, ...] = ()
    """Keys drawn against a second y axis on the right (a coefficient beside the value it scales)."""
    markers: tuple[str, ...] = ()
    """Keys drawn as points (held-out evals: a few records, not a curve)."""
    empty_note: str = "not logged in this run"


PANELS = (
    Panel("Success", ("rollout/success_rate", "eval/bc_validation_success", "eval/success_rate"),
          markers=("eval/success_rate", "eval/bc_validation_success")),
    Panel("Reward", ("rollout/reward_mean",)),
    Panel("KL to the reference and its coefficient", ("loss/kl", "rollout/kl_ref"), secondary=("train/kl_coef",),
          empty_note="no reference model (algo.kl_coef=0)"),
    Panel("Entropy (sampled tokens)", ("rollout/entropy_estimate",)),
    Panel("Importance weights and mismatch", ("offpolicy/is_weight_mean", "offpolicy/is_weight_max",
                                              "offpolicy/frac_truncated", "loss/approx_kl_old", "loss/clipfrac",
                                              "mismatch/mean_abs_logprob_diff", "mismatch/max_abs_logprob_diff",
                                              "mismatch/is_weight_mean"),
          empty_note="no clipped updates, replay or mismatch monitor in this run"),
    Panel("Zero-signal groups", ("rollout/zero_signal_groups", "train/no_signal_steps")),
    Panel("Losses", ("loss/bc", "loss/policy", "loss/value", "loss/sft", "loss/dpo")),
    Panel("Throughput (tokens/s)", ("perf/tokens_per_s",)),
)


def _go():
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise ImportError("agentgrad report needs plotly: pip install 'agentgrad[report]'") from exc
    return go


def plotly_js() -> str:
    _go()
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def to_div(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _layout(fig: Any, title: str, **extra: Any) -> None:
    fig.update_layout(title={"text": title, "font": {"size": 14}}, height=300, margin={"l": 50, "r": 50, "t": 40,
                      "b": 40}, legend={"orientation": "h", "y": -0.2}, template="plotly_white", **extra)
    # plotly's default ticks use SI prefixes: an approx KL of 1e-13 read "100f", a ratio's 1e-3 "1m"
    fig.update_yaxes(exponentformat="e")


def curve_figure(panel: Panel, t: Timeline) -> Any:
    go = _go()
    fig = go.Figure()
    drawn = 0
    for key in panel.keys + panel.secondary:
        xs, ys = t.series(key)
        if not xs:
            continue
        drawn += 1
        fig.add_trace(go.Scatter(x=xs, y=ys, name=key, mode="markers" if key in panel.markers else "lines+markers",
                                 marker={"size": 9 if key in panel.markers else 4},
                                 yaxis="y2" if key in panel.secondary else "y"))
    for s in t.switches[:-1]:  # the last stage's end is the run's end: nothing switches there
        fig.add_vline(x=s.x, line_dash="dot", line_color="#888", annotation_text=s.label,
                      annotation_position="top left", annotation_font_size=10)
    extra: dict[str, Any] = {"xaxis": {"title": "run step (stages laid end to end)"}}
    if any(k in panel.secondary for k in (tr.name for tr in fig.data)):
        extra["yaxis2"] = {"overlaying": "y", "side": "right", "showgrid": False, "rangemode": "tozero",
                           "title": ", ".join(panel.secondary)}
    if not drawn:
        fig.add_annotation(text=panel.empty_note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    _layout(fig, panel.title, **extra)
    return fig


def bar_figure(title: str, stacks: Mapping[str, Mapping[str, int]], *, horizontal: bool = False,
               empty_note: str = "none in this run") -> Any:
    """`stacks`: series name -> category -> count, drawn as stacked bars."""
    go = _go()
    fig = go.Figure()
    for name, counts in stacks.items():
        cats, values = list(counts), list(counts.values())
        fig.add_trace(go.Bar(name=name, x=values if horizontal else cats, y=cats if horizontal else values,
                             orientation="h" if horizontal else "v"))
    if not any(stacks.values()):
        fig.add_annotation(text=empty_note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    _layout(fig, title, barmode="stack")
    if horizontal:
        fig.update_layout(margin={"l": 260}, yaxis={"automargin": True})
    return fig


def breakdown_figures(b: Mapping[str, Any]) -> list[tuple[str, Any]]:
    tools = {"ok": {k: v.get("ok", 0) for k, v in b["tools"].items()},
             "error": {k: v.get("error", 0) for k, v in b["tools"].items()}}
    return [("tool-usage", bar_figure("Tool calls by tool (ok / error)", tools, empty_note="no tool calls")),
            ("stop-reasons", bar_figure("Stop reasons by stage", b["stops"])),
            ("error-kinds", bar_figure("Error kinds", {"count": b["errors"]}, horizontal=True,
                                       empty_note="no errors"))]
