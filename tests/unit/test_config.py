import pytest

from agentgrad.config import Config, ConfigError, build_config, load_config, parse_overrides, save_config
from agentgrad.config_reference import describe


def test_defaults_and_dotted_overrides():
    cfg = build_config(overrides=["algo.group_size=16", "rollout.temperature=0.7", "run.name=x"])
    assert cfg.algo.group_size == 16 and cfg.rollout.temperature == 0.7 and cfg.run.name == "x"
    assert cfg.episodes_per_step == cfg.algo.tasks_per_step * 16


def test_section_shorthand_sets_name():
    assert parse_overrides(["env=arithmetic"]) == {"env": {"name": "arithmetic"}}


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["algo.grup_size=4"])
    assert "algo.grup_size" in str(err.value) and "group_size" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["nonsense.x=1"])
    assert "valid keys here" in str(err.value) and "rollout" in str(err.value)


@pytest.mark.parametrize("bad", ["algo.group_size=1", "rollout.temperature=-1", "algo.group_size=abc",
                                 "rollout.max_new_tokens_per_turn=4000", "noequals"])
def test_invalid_values_are_errors(bad):
    with pytest.raises(ConfigError):
        build_config(overrides=[bad])


def test_copy_args_are_checked_where_they_are_set():
    cfg = build_config(overrides=["rollout.copy_args=[search.query,answer]"])
    assert cfg.rollout.copy_args == ["search.query", "answer"]
    with pytest.raises(ConfigError, match=r"rollout.copy_args: .*'query' is not 'tool.argument' or 'answer'"):
        build_config(overrides=["rollout.copy_args=[query]"])
    with pytest.raises(ConfigError, match="rollout.copy_args and rollout.copy_literals need the in-process engine"):
        build_config(overrides=["rollout.copy_args=[answer]", "rollout.backend=vllm",
                                "rollout.vllm_server=http://127.0.0.1:8000"])


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as err:
        build_config("nope")
    assert "tiny-cpu" in str(err.value)


def test_code_cpu_preset_runs_bc_then_rest_on_the_code_suite_with_its_limits():
    from agentgrad.pipelines.schedule import stages_of

    cfg = build_config("code-cpu")
    assert [s.algo for s in stages_of(cfg)] == ["bc", "rest"]
    assert cfg.env.name == "code" and cfg.model.tiny.hidden_size == 64 and cfg.bc.num_demos == 1000
    assert cfg.rollout.max_new_tokens_per_turn == 96  # the suite's own defaults still apply under a preset
    assert cfg.rollout.temperature == 0.7 and cfg.bc.stop_at_success == 0.3  # and the tiny-cpu preset's


def test_round_trip(tmp_path):
    cfg = build_config(overrides=["bc.steps=3"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_every_field_has_help():
    rows = describe(Config)
    assert rows and all(help_text for _, _, help_text in rows)


def test_suite_defaults_sit_between_field_defaults_and_overrides():
    from agentgrad.config import suite_defaults

    assert suite_defaults("arithmetic") == {}
    multi = build_config(overrides=["env=multi-tool"])
    assert (multi.rollout.max_turns, multi.rollout.max_total_tokens, multi.model.tiny.max_positions) == (7, 1280, 1280)
    with pytest.raises(ConfigError, match="exceeds the tiny model's context, model.tiny.max_positions=1024"):
        build_config(overrides=["rollout.max_total_tokens=1100"])  # longer episodes than the tiny model can read
    assert build_config(overrides=["env=multi-tool", "rollout.max_turns=3"]).rollout.max_turns == 3
    api = build_config(overrides=["env=api-catalog", "env.options={kinds: [single]}"])
    assert api.env.options == {"schemas": "none", "kinds": ["single"]}  # option mappings merge
    assert build_config().rollout.max_turns == 4  # the default run (arithmetic) is untouched


def test_config_command_shows_the_values_train_uses():
    """`agentgrad config` with no arguments lists what `agentgrad train` with no arguments runs (its preset)."""
    from typer.testing import CliRunner

    from agentgrad.cli import app

    train_defaults = build_config()  # the preset `agentgrad train` starts from
    out = CliRunner().invoke(app, ["config"]).output
    assert f"algo.steps = {train_defaults.algo.steps!r}" in out
    assert f"bc.stop_at_success = {train_defaults.bc.stop_at_success!r}" in out
    assert train_defaults.algo.steps != Config().algo.steps  # the preset really differs
    out = CliRunner().invoke(app, ["config", "algo.steps=7"]).output
    assert "algo.steps = 7" in out


def test_on_and_off_reach_a_three_way_field_as_words_not_booleans(tmp_path):
    # YAML 1.1 reads `on`/`off` as booleans; tool_name_mask is "auto" | "on" | "off", so the override and the
    # preset must keep them as words, while a bool field still takes on/off (pydantic parses the strings).
    config = build_config("tiny-cpu", ["rollout.tool_name_mask=on", "run.progress=off"])
    assert config.rollout.tool_name_mask == "on" and config.run.progress is False
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  tool_name_mask: off\nrun:\n  progress: yes\n")
    config = build_config(str(preset))
    assert config.rollout.tool_name_mask == "off" and config.run.progress is True
