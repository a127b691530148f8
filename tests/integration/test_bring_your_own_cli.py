"""A user's own suite, tool and reward through the console script, as a user runs it (no launcher script):

- a game env in a module outside the package (a temporary directory) trains with `agentgrad train
  env=mymod:Suite`, its success coming from the env, and `agentgrad eval` works on that run;
- every `agentgrad ...` command of the README and the "your own ..." docs that uses `examples/` works verbatim
  from the repository root (train commands get a tiny budget appended: they check wiring, not learning).

The console script matters: `python -m agentgrad.cli` would put the current directory on the path and hide
the bug where `examples.custom_reward:...` did not import from the repository root.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AGENTGRAD = Path(sys.executable).parent / "agentgrad"
TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=64", "model.tiny.tokenizer_corpus_episodes=40"]
BUDGET = [*TINY, "bc.steps=2", "bc.batch_size_episodes=4", "bc.num_demos=8", "bc.stop_at_success=null",
          "algo.steps=1", "algo.tasks_per_step=2", "algo.group_size=2", "algo.epochs_per_step=1",
          "eval.num_tasks=4", "run.progress=false"]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("your-own-*.md"))]

pytestmark = pytest.mark.skipif(not AGENTGRAD.exists(), reason="the agentgrad console script is not installed")


def _run(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(AGENTGRAD), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_game_in_a_users_module_trains_and_evaluates(tmp_path):
    shutil.copy(REPO / "examples" / "guess_number.py", tmp_path / "mygame.py")
    out = _run(["train", "env=mygame:GuessNumberSuite", *BUDGET, "run.name=game"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "game" / "summary.json").read_text())
    assert summary["rl_steps"] == 1 and summary["final_eval"]["num_tasks"] == 4
    out = _run(["eval", "runs/game", "--json"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert 0.0 <= result["success_rate"] <= 1.0 and result["num_tasks"] == 4
    # Every RL rollout ended by the game itself or by a limit, never by a verifier on an answer step it forbids.
    from agentgrad.data.store import TrajectoryStore

    samples = list(TrajectoryStore(tmp_path / "runs" / "game" / "trajectories").trajectories())
    assert samples and all(s.success == bool(s.trajectory.final_info.get("success")) for s in samples)


def test_a_bad_suite_path_is_one_line(tmp_path):
    out = _run(["train", "env=nowhere_mod:Suite"], cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "cannot import module 'nowhere_mod'" in out.stderr


def _doc_commands() -> list[str]:
    commands = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("agentgrad ") and "examples" in line:
                    commands.append(line)
    return list(dict.fromkeys(commands))


def test_the_docs_show_the_custom_reward_tool_and_env_commands():
    commands = _doc_commands()
    for needed in ("reward.name=examples.custom_reward:short_and_right", "examples.custom_tool:convert",
                   "env=examples.guess_number:GuessNumberSuite", "examples/convert_tasks.jsonl"):
        assert any(needed in c for c in commands), needed


@pytest.mark.parametrize("command", _doc_commands())
def test_doc_command_works_verbatim_from_the_repository_root(command, tmp_path):
    args = shlex.split(command)[1:]
    if args[0] == "train":
        args += [*BUDGET, f"run.output_dir={tmp_path}"]
    if args[0] == "eval":
        pytest.skip("eval needs a run; test_a_game_in_a_users_module_trains_and_evaluates runs it")
    out = _run(args, cwd=REPO)
    assert out.returncode == 0, f"{command}\n{out.stderr[-3000:]}"
