"""`agentgrad report` on a real tiny run, opened in headless Chromium (Debian's package, driven by playwright's
python package, never a browser of its own): the page loads with every request off the machine refused, has no
script error, and shows the curves, the breakdowns and a working trajectory viewer. A screenshot is taken
(AGENTGRAD_REPORT_SCREENSHOT=path keeps a copy)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from agentgrad.config import build_config

pytestmark = pytest.mark.slow  # each module trains one tiny run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: "
                                    "apt-get install chromium; .ci/run installs it), so the page cannot be opened")

# The 2-operand shape of test_train_tiny, cut short: BC stops once a few validation tasks succeed, so the RL
# groups hold successes and failures side by side; kl_coef > 0 logs the KL and its coefficient.
TINY = [
    "env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '+', result_digits: 2}",
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=192", "model.tiny.tokenizer_corpus_episodes=100",
    "bc.steps=150", "bc.eval_tasks=16", "bc.num_demos=300", "bc.lr=3e-3", "bc.lr_scale_near_target=1.0",
    "bc.stop_at_success=0.3", "bc.eval_every=4",
    "algo.steps=3", "algo.tasks_per_step=6", "algo.group_size=4", "algo.epochs_per_step=1", "algo.kl_coef=0.01",
    "eval.num_tasks=16", "run.progress=false", "run.name=tiny",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from agentgrad.data.store import TrajectoryStore
    from agentgrad.pipelines.train import train
    from agentgrad.report import build_report

    out = tmp_path_factory.mktemp("report")
    train(build_config(overrides=[*TINY, f"run.output_dir={out}"]))
    run_dir = out / "tiny"
    records = list(TrajectoryStore(run_dir / "trajectories").records())
    return run_dir, build_report(run_dir), records


def test_the_page_is_one_file_that_needs_no_network(run):
    _, html_path, _ = run
    html = html_path.read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing to fetch: plotly.js is inline
    assert "Plotly" in html and html.count('<script type="application/json" id="agentgrad-data">') == 1


@needs_chromium
def test_report_in_headless_chromium(run, tmp_path):
    from playwright.sync_api import sync_playwright

    run_dir, html_path, records = run
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(300_000)  # a 5 MB page on a busy 2-core machine: slow, not broken
        page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
        page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else (errors.append(f"request: {route.request.url}"), route.abort()))
        page.goto(html_path.as_uri())
        page.wait_for_selector("body[data-viewer-ready='1']")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("AGENTGRAD_REPORT_SCREENSHOT"):
            shutil.copy(shot, os.environ["AGENTGRAD_REPORT_SCREENSHOT"])
        assert shot.stat().st_size > 50_000

        # Learning curves: every panel drew; success, reward, KL and its coefficient have data; switches marked.
        assert page.locator(".curve .js-plotly-plot").count() == 8
        traces = page.evaluate("() => [...document.querySelectorAll('.curve .js-plotly-plot')].map("
                               "d => d.data.filter(t => t.x.length).map(t => t.name))")
        drawn = {name for panel in traces for name in panel}
        assert {"rollout/success_rate", "eval/success_rate", "rollout/reward_mean", "loss/kl", "train/kl_coef",
                "rollout/entropy_estimate", "rollout/zero_signal_groups", "loss/bc"} <= drawn, drawn
        shapes = page.evaluate("() => document.getElementById('curve-0').layout.shapes.length")
        assert shapes == 1  # bc -> grpo (the last stage's end is the run's: not marked)
        for div in ("tool-usage", "stop-reasons", "error-kinds"):
            assert page.locator(f"#{div}.js-plotly-plot").count() == 1
        bars = page.evaluate("() => document.getElementById('tool-usage').data.map(t => t.x)")
        assert "calculator" in bars[0]

        # The viewer opens on a group with both outcomes (the run has some: the next test), side by side.
        assert page.locator("#sib-success .sibling").count() and page.locator("#sib-failure .sibling").count()

        # The viewer lists every stored trajectory; a row opens its turns and its tokens, mask on them.
        rows = page.locator("#traj-rows tr")
        assert rows.count() == len(records)
        rows.nth(0).click()
        opened = next(r for r in records if r.index == int(rows.nth(0).get_attribute("data-id")))
        first = opened.sample.trajectory
        assert first.task.task_id in page.locator("#detail h3").inner_text()
        assert page.locator("#detail .turn").count() == len(first.turns)
        assert page.locator("#detail .tokens .tok").count() == len(first.token_ids)
        assert page.locator("#detail .tokens .tok.m1").count() == sum(first.loss_mask)
        called = next(r for r in records if any(t.observation for t in r.sample.trajectory.turns))
        page.locator(f"#traj-rows tr[data-id='{called.index}']").click()
        assert page.locator("#detail pre.tool-call").count() >= 1 and page.locator("#detail pre.observation").count()

        # Filters: outcome, step, task.
        failures = sum(not r.sample.success for r in records)
        page.select_option("#f-outcome", "failure")
        assert rows.count() == failures and set(page.locator("#traj-rows td:nth-child(4)").all_inner_texts()) == {"✗"}
        page.select_option("#f-outcome", "")
        page.select_option("#f-step", "2")
        assert rows.count() == sum(r.step + 1 == 2 for r in records)
        page.select_option("#f-step", "")
        needle = first.task.task_id  # a substring of an id or a prompt matches ("...-1" matches "...-12" too)
        page.fill("#f-task", needle)
        assert rows.count() == sum(needle in r.sample.trajectory.task.task_id
                                   or needle in r.sample.trajectory.task.prompt for r in records)
        assert needle in page.locator("#traj-rows td:nth-child(3)").all_inner_texts()

        # Siblings side by side: the group of the opened trajectory, split by outcome.
        page.locator(f"#traj-rows tr[data-id='{opened.index}']").click()
        group = [r for r in records if r.step == opened.step and
                 r.sample.trajectory.task.task_id == first.task.task_id]
        ok = sum(r.sample.success for r in group)
        assert page.locator("#sib-success h4").inner_text() == f"Succeeded ({ok})"
        assert page.locator("#sib-failure h4").inner_text() == f"Failed ({len(group) - ok})"
        assert (page.locator("#sib-success .sibling").count()
                + page.locator("#sib-failure .sibling").count()) == len(group)
        browser.close()
    assert errors == []


def test_the_run_has_a_group_with_both_outcomes(run):
    # The run is sized for it (BC stops at a partial policy), so the viewer has a comparison to open on.
    _, _, records = run
    groups: dict[tuple, set] = {}
    for r in records:
        groups.setdefault((r.step, r.sample.trajectory.task.task_id), set()).add(r.sample.success)
    assert any(v == {True, False} for v in groups.values())


def test_cli_writes_the_report_and_refuses_a_directory_that_is_no_run(run, tmp_path):
    run_dir, _, _ = run
    out = subprocess.run([sys.executable, "-m", "agentgrad.cli", "report", str(run_dir), "--out",
                          str(tmp_path / "r.html"), "--max-trajectories", "8"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["report"] == str(tmp_path / "r.html")
    assert re.search(r"\d+ of \d+ trajectories \(whole groups", (tmp_path / "r.html").read_text())
    bad = subprocess.run([sys.executable, "-m", "agentgrad.cli", "report", str(tmp_path / "nothing")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nothing'} is not a run directory (no metrics.jsonl, no trajectories/)"]
