"""docs/configuration.md is generated from the config's own help text and cannot drift from it."""

from pathlib import Path

from typer.testing import CliRunner

from agentgrad.cli import app
from agentgrad.config_reference import describe, markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "regenerate it: agentgrad config --markdown > docs/configuration.md"


def test_the_committed_page_is_what_the_generator_writes_now():
    assert PAGE.read_text(encoding="utf-8") == markdown(), REGENERATE


def test_every_key_is_on_the_page_with_its_help_text():
    page = markdown()
    rows = describe()
    assert len(rows) > 100  # a broken walk of the config would make the checks below vacuous
    for key, _default, help_text in rows:
        line = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert line is not None, key
        assert help_text.replace("|", "\\|") in line, key


def test_the_preset_column_shows_what_the_default_run_changes():
    lines = {line.split(" | ")[0]: line for line in markdown().splitlines() if line.startswith("| `")}
    # algo.steps: field default 110, the tiny-cpu preset runs 30 (src/agentgrad/configs/tiny-cpu.yaml)
    assert "| `110` | `30` |" in lines["| `algo.steps`"]
    # run.seed: the preset keeps the default, so its cell is empty
    assert "| `0` |  |" in lines["| `run.seed`"]
    # items of a list of records get rows too, and a required field says so
    assert "| `(required)` |" in lines["| `schedule.stages[].algo`"]


def test_agentgrad_config_markdown_prints_the_page():
    result = CliRunner().invoke(app, ["config", "--markdown"])
    assert result.exit_code == 0 and result.output == markdown()
