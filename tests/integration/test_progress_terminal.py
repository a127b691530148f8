"""What a user sees: `agentgrad` commands in real processes, with stderr on a pseudo-terminal (progress bars for
every long step) and on a pipe (none of them; only the result lines)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading

import pytest


def _run_cli(args: list[str], *, stderr_tty: bool) -> tuple[str, str]:
    """Run `agentgrad ARGS` in a real process; stderr on a pseudo-terminal or a pipe. Returns (stdout, stderr),
    the terminal's without its colour and cursor codes."""
    cmd = [sys.executable, "-m", "agentgrad.cli", *args]
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    env.pop("FORCE_COLOR", None)
    env.pop("TTY_COMPATIBLE", None)
    if not stderr_tty:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:  # a pty's buffer is small: read while the process writes
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the other side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=600)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    assert proc.returncode == 0
    colours_and_cursor = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
    return proc.stdout, colours_and_cursor.sub("", b"".join(chunks).decode(errors="replace"))


def test_the_cli_shows_progress_on_a_terminal_only(tmp_path):
    args = ["data", "expert", "--episodes", "300", "--out", str(tmp_path / "expert.jsonl")]
    stdout, stderr = _run_cli(args, stderr_tty=True)
    assert '"episodes": 300' in stdout  # stdout keeps the answer alone
    assert "expert episodes" in stderr and "300/300" in stderr
    stdout, stderr = _run_cli(args, stderr_tty=False)
    assert '"episodes": 300' in stdout
    assert "expert episodes" not in stderr and "300/300" not in stderr


TRAIN = ["train", "bc.steps=3", "bc.num_demos=32", "bc.stop_at_success=null", "algo.steps=1", "algo.tasks_per_step=2",
         "algo.group_size=2", "algo.epochs_per_step=1", "eval.num_tasks=12", "model.tiny.tokenizer_corpus_episodes=50"]
STEPS = ("tiny model: tokenizer corpus", "tiny model: tokenizer, weights, save", "loading model",
         "expert demonstrations", "bc", "held-out eval", "grpo")


@pytest.mark.slow
def test_a_short_train_run_shows_each_of_its_steps_on_a_terminal_and_none_on_a_pipe(tmp_path):
    _, stderr = _run_cli([*TRAIN, f"run.output_dir={tmp_path}", "run.name=tty"], stderr_tty=True)
    for label in STEPS:
        assert re.search(rf"(^|\r|\n){re.escape(label)}[^\r\n]* ━", stderr), label  # the label, then its bar
    assert "12/12" in stderr  # a held-out eval bar that ran to its end
    assert "held-out success after BC" in stderr
    stdout, stderr = _run_cli([*TRAIN, f"run.output_dir={tmp_path}", "run.name=pipe"], stderr_tty=False)
    assert json.loads(stdout)["run_dir"].endswith("pipe")
    assert "━" not in stderr and "held-out success after BC" in stderr  # the result lines, no bars

    # the run's commands afterwards: evaluating it again, importing a chat log with its model
    _, stderr = _run_cli(["eval", str(tmp_path / "tty"), "--num-tasks", "12"], stderr_tty=True)
    assert re.search(r"(^|\r|\n)held-out eval[^\r\n]* 12/12", stderr)
    log = tmp_path / "expert.jsonl"
    _run_cli(["data", "expert", "--episodes", "20", "--out", str(log)], stderr_tty=False)
    stdout, stderr = _run_cli(["data", "import", str(log), "--out", str(tmp_path / "store"), "--model",
                               str(tmp_path / "tty" / "base-model")], stderr_tty=True)
    assert json.loads(stdout)["episodes"] == 20
    assert re.search(r"(^|\r|\n)data import expert.jsonl[^\r\n]* 20/20", stderr)
