"""The one progress display (logging.py): shown on a terminal, quiet when its stream is a file or a pipe, and
fed by every long step (held-out evaluation, the tiny model's build, judge calls). The commands themselves, on
a pseudo-terminal and on a pipe: tests/integration/test_progress_terminal.py."""

from __future__ import annotations

import io
import time

from rich.console import Console

from agentgrad.backends.base import Generation
from agentgrad.logging import ProgressDisplay
from agentgrad.models.tiny import TINY_BUILD_PHASES, save_tiny_model
from agentgrad.pipelines.evaluate import evaluate
from agentgrad.rewards.judge import Judge
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings


def terminal() -> tuple[ProgressDisplay, io.StringIO]:
    out = io.StringIO()
    return ProgressDisplay(console=Console(file=out, force_terminal=True, width=120)), out


def not_a_terminal() -> tuple[ProgressDisplay, io.StringIO]:
    out = io.StringIO()
    return ProgressDisplay(console=Console(file=out, width=120)), out


def test_a_step_shows_its_bar_on_a_terminal():
    display, out = terminal()
    assert display.enabled
    with display.track("held-out eval", 4) as progress:
        progress(0, None)
        progress(3, None)
        progress(4, None)
    assert "held-out eval" in out.getvalue() and "4/4" in out.getvalue()


def test_nothing_but_messages_when_not_a_terminal():
    display, out = not_a_terminal()
    assert not display.enabled  # enabled=True asked for, but the stream is a file
    with display.track("held-out eval", 4) as progress:
        progress(4, None)
    display.start("bc", 10)
    display.update(3, {"rollout/success_rate": 0.5})
    display.stop()
    assert out.getvalue() == ""
    display.print("held-out success after BC: 40.0%")  # messages still go out: they are the run's story
    assert out.getvalue() == "held-out success after BC: 40.0%\n"


def test_a_step_under_a_stage_is_a_second_row_removed_when_it_ends():
    display, out = terminal()
    display.start("bc", 10)
    with display.track("expert demonstrations", 3) as progress:
        progress(3, None)
        assert len(display._progress.tasks) == 2  # the stage's bar and the step's
    assert [t.description for t in display._progress.tasks] == ["bc"]
    display.update(10, {"loss/bc": 0.25})
    display.stop()
    text = out.getvalue()
    assert "expert demonstrations" in text and "10/10" in text and "bc_loss 0.250" in text


def test_total_set_later_and_unknown_total():
    display, out = terminal()
    with display.track("data export") as progress:  # a store does not know its length: no total
        progress(7, None)
    assert "0/?" in out.getvalue() and "7/7" in out.getvalue()  # the count is the total once the step is done
    display, out = terminal()
    with display.track("judge calibrate") as progress:
        progress(0, 120)  # the labels file is read inside the step: the total comes then
        progress(120, None)
    assert "120/120" in out.getvalue()


class Answerer:
    """Answers every task of a batch at once with a fixed text (one turn, no tool call)."""

    def __init__(self, codec):
        self.codec = codec

    def generate(self, prompts, sampling, logits_processor=None):
        ids = self.codec.encode("0") + [self.codec.eos_token_ids[0]]
        return [Generation(tuple(ids), (-0.1,) * len(ids), "stop") for _ in prompts]

    def load_weights(self, state):
        pass


def test_evaluate_reports_every_episode(arithmetic_suite, codec):
    seen: list[tuple[int, int | None]] = []
    result = evaluate(Answerer(codec), codec, arithmetic_suite, EpisodeLimits(max_turns=2), SamplerSettings(),
                      num_tasks=7, seed=0, batch_size=3, progress=lambda done, total: seen.append((done, total)))
    assert result.num_tasks == 7
    # the total first, then one call per episode across the three batches (3 + 3 + 1), counting on
    assert seen == [(0, 7)] + [(k, None) for k in range(1, 8)]
    display, out = terminal()
    with display.track("held-out eval", 7) as progress:
        evaluate(Answerer(codec), codec, arithmetic_suite, EpisodeLimits(max_turns=2), SamplerSettings(),
                 num_tasks=7, seed=0, batch_size=3, progress=progress)
    assert "held-out eval" in out.getvalue() and "7/7" in out.getvalue()


def test_the_tiny_model_build_reports_its_phases(tmp_path):
    seen: list[tuple[int, int | None]] = []
    save_tiny_model(tmp_path / "m", ["1 + 2 = 3", "4 * 5 = 20"] * 20, vocab_size=300, hidden_size=16,
                    num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                    progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, len(TINY_BUILD_PHASES)), (2, None), (3, None)]
    assert (tmp_path / "m" / "config.json").exists()


class SlowFirstJudge:
    """Stands in for a Judge (judge_many only calls `self.judge`): the first trajectory answers last."""

    def judge(self, trajectory):
        time.sleep(0.2 if trajectory == 0 else 0.0)
        return f"verdict {trajectory}"


def test_judge_many_counts_each_verdict_and_keeps_the_input_order():
    counts: list[int] = []
    verdicts = Judge.judge_many(SlowFirstJudge(), [0, 1, 2, 3, 4], max_workers=3, on_verdict=counts.append)
    assert verdicts == [f"verdict {i}" for i in range(5)] and counts == [1, 2, 3, 4, 5]
    counts.clear()
    Judge.judge_many(SlowFirstJudge(), [0, 1, 2], max_workers=1, on_verdict=counts.append)
    assert counts == [1, 2, 3]
