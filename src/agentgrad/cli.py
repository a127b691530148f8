"""Command line: `agentgrad train | eval | check | config | tool run | judge calibrate | data`."""

from __future__ import annotations

import contextlib
import errno
import json
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train tool-using LLM agents with reinforcement learning.")
tool_app = typer.Typer(no_args_is_help=True, help="Run tools by hand.")
app.add_typer(tool_app, name="tool")
judge_app = typer.Typer(no_args_is_help=True, help="LLM-as-judge rewards: calibrate before use.")
app.add_typer(judge_app, name="judge")
data_app = typer.Typer(no_args_is_help=True, help="Trajectory data: import offline chat logs, export a run's store.")
app.add_typer(data_app, name="data")


def _display(enabled: bool = True):
    """The progress display (logging.py), on stderr and only on a terminal: stdout keeps the JSON answer."""
    from agentgrad.logging import ProgressDisplay

    return ProgressDisplay(enabled=enabled)


def _libraries_to_stderr():
    """While models load and train, whatever a library prints goes to stderr (DeepSpeed's logger, created on
    its first import by accelerate inside `save_pretrained`, writes to the stdout of that moment): stdout keeps
    only the command's answer, so `agentgrad train > out.json` stays parseable."""
    return contextlib.redirect_stdout(sys.stderr)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _disk_full(exc: BaseException, run_dir: Path) -> bool:
    """ENOSPC, however the writer reported it: OSError, safetensors' error text, or torch's bare "file write
    failed" while the run directory's disk has no room left."""
    import shutil

    chain = [exc]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain):
        return True
    text = " ".join(str(e) for e in chain)
    if "No space left on device" in text or "os error 28" in text:
        return True
    try:
        return "write" in text.lower() and shutil.disk_usage(run_dir).free < (1 << 20)
    except OSError:
        return False


def _fewer_gc_passes() -> None:
    """This process's garbage collector for a training run: the modules loaded so far (torch, transformers:
    ~400k objects) leave the generations it scans, and a pass waits for 10,000 new objects instead of 700. A
    rollout allocates millions of short-lived objects; with the defaults, full passes over the whole heap (0.2 s
    each) took ~12% of an api-catalog GRPO step. Collection only frees memory: the numbers are unchanged."""
    import gc

    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


@app.command()
def train(
    overrides: list[str] | None = typer.Argument(None, help="Dotted overrides, e.g. algo.group_size=16 env=arithmetic"),
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="Built-in preset name or path to a YAML file."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue a run directory from its last "
                                          "checkpoint (run.checkpoint_every > 0); overrides apply on top of its "
                                          "config.yaml."),
) -> None:
    """Train: BC warm-up on expert demonstrations, then online RL; held-out success after each."""
    from agentgrad.config import ConfigError, build_config, load_config, read_yaml
    from agentgrad.pipelines.launch import (
        end_rank_process,
        follow_rank_zero,
        init_processes,
        launched,
        launched_rank,
        leave_processes,
        needs_relaunch,
        relaunch,
        world_size_error,
    )
    from agentgrad.pipelines.preflight import BadInputError, check_fresh_run, check_resumable, preflight

    try:  # everything that can be checked before torch and the model are loaded, so a bad command fails fast
        if resume is not None:
            if not (resume / "config.yaml").exists():
                _fail(f"{resume} is not a run directory (no config.yaml)")
            config = build_config(None, overrides or [], base=read_yaml(resume / "config.yaml"))
            check_resumable(resume, load_config(resume / "config.yaml").run.checkpoint_every)
        else:
            config = build_config(preset, overrides or [])
            if config.run.name and launched_rank() == 0:  # the other ranks of a sharded run write nothing
                check_fresh_run(Path(config.run.output_dir) / config.run.name)
        preflight(config)
        if (mismatch := world_size_error(config)) is not None:
            raise BadInputError(mismatch)
    except (ConfigError, BadInputError) as exc:
        _fail(str(exc))
    if needs_relaunch(config):  # learner.world_size > 1: this command again, as that many processes
        raise typer.Exit(relaunch(config.learner.world_size, sys.argv[1:]))
    if launched() and config.learner.backend != "torch" and init_processes(config) > 0:
        follow_rank_zero(config)  # rank 0 runs the pipeline; this rank serves its learner
        return
    from agentgrad.faults import NonFiniteLossError
    from agentgrad.models.hf import ModelLoadError
    from agentgrad.pipelines.bc import DemoLimitError
    from agentgrad.pipelines.data import DemoLoadError
    from agentgrad.pipelines.train import train as run_train
    from agentgrad.registry import ImportRefError, UnknownNameError
    from agentgrad.rewards.base import RewardSpecError
    from agentgrad.tools.mcp import McpError

    plugin_errors = (ImportRefError, UnknownNameError, RewardSpecError, DemoLoadError, McpError)  # user code, data
    _fewer_gc_passes()
    try:
        with _libraries_to_stderr():
            summary = run_train(config, run_dir=resume, resume=resume is not None)
    except (ModelLoadError, BadInputError, FileExistsError, NonFiniteLossError, DemoLimitError, *plugin_errors) as exc:
        _fail(str(exc))
    except Exception as exc:
        where = resume or Path(config.run.output_dir) / (config.run.name or "RUN_DIR")
        if not _disk_full(exc, where):
            raise
        _fail(f"disk full while writing to {where}: free space, then "
              + (f"continue with `agentgrad train --resume {where}`" if config.run.checkpoint_every else
                 "run again under another run.name (run.checkpoint_every=0 left no run-state checkpoint to "
                 "resume from; set it > 0 to make a run resumable)"))
    finally:
        leave_processes()  # a sharded learner's group
    typer.echo(json.dumps({k: summary[k] for k in ("run_dir", "initial_success_rate", "final_success_rate",
                                                   "wall_time_s")}))
    if launched():  # a rank of a sharded run (see there)
        end_rank_process()


@app.command("eval")
def eval_cmd(
    run_dir: Path = typer.Argument(..., help="A run directory written by `agentgrad train`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (includes success_rate)."),
    checkpoint: str | None = typer.Option(None, help="Checkpoint tag under checkpoints/ (default: final)."),
    num_tasks: int | None = typer.Option(None, help="Held-out tasks (default: the run's eval.num_tasks)."),
    seed: int | None = typer.Option(None, help="Held-out task seed (default: the run's seed)."),
) -> None:
    """Held-out success of a trained run, with a 95% confidence interval."""
    from agentgrad.config import ConfigError, load_config

    if not (run_dir / "config.yaml").exists():
        _fail(f"{run_dir} is not a run directory (no config.yaml)")
    try:  # before torch is imported: a broken config.yaml fails in a second
        config = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        _fail(str(exc))
    import torch

    from agentgrad.checkpoint import latest_checkpoint
    from agentgrad.models.hf import ModelLoadError, load_model
    from agentgrad.models.lora import merge_saved_adapter
    from agentgrad.pipelines.components import (
        episode_limits,
        inference,
        make_suite,
        make_tool_head,
        quiet_hf,
        sampler_settings,
    )
    from agentgrad.pipelines.evaluate import evaluate

    quiet_hf()
    display = _display(config.run.progress)
    try:
        ckpt = run_dir / "checkpoints" / checkpoint if checkpoint else latest_checkpoint(run_dir)
        with display.track(f"loading {ckpt.name}"):
            loaded = load_model(ckpt, dtype=config.model.dtype, device=config.model.device)
        loaded.model = merge_saved_adapter(loaded.model, ckpt)  # a LoRA run's adapters, merged for sampling
    except (ConfigError, ModelLoadError, FileNotFoundError) as exc:
        _fail(str(exc))
    torch.set_num_threads(config.run.threads)
    policy, codec = inference(loaded, config.model, config.rollout)
    from agentgrad.envs import close_suite
    from agentgrad.registry import ImportRefError, UnknownNameError
    from agentgrad.tools.mcp import McpError

    try:
        suite = make_suite(config)
    except (ImportRefError, UnknownNameError, McpError) as exc:  # e.g. a user's suite module not importable here
        _fail(str(exc))
    if config.rollout.action_head != "tokens" and not (ckpt / "tool_head.pt").exists():
        _fail(f"{ckpt} has no tool_head.pt, which rollout.action_head={config.rollout.action_head} needs")
    try:
        policy.tool_head = make_tool_head(config, suite, loaded, ckpt)
    except ModelLoadError as exc:  # a tool_head.pt of another layout, or deciding another thing
        _fail(str(exc))
    n = num_tasks or config.eval.num_tasks
    try:
        with display.track("held-out eval", n) as progress, _libraries_to_stderr():
            result = evaluate(policy, codec, suite, episode_limits(config), sampler_settings(config), num_tasks=n,
                              seed=config.run.seed if seed is None else seed, temperature=config.eval.temperature,
                              batch_size=config.eval.batch_size, progress=progress)
    finally:
        close_suite(suite)
    if as_json:
        typer.echo(json.dumps({"checkpoint": str(ckpt), **result.to_dict()}))
    else:
        typer.echo(f"{ckpt}: held-out success {result.success_rate:.1%} "
                   f"(95% CI {result.ci_low:.1%}-{result.ci_high:.1%}, {result.num_successes}/{result.num_tasks})")
        if result.kinds_line():
            typer.echo(result.kinds_line())
    if result.note:
        typer.secho(result.note, fg=typer.colors.YELLOW, err=True)


@app.command("export")
def export(
    run_dir: Path = typer.Argument(..., help="A run directory written by `agentgrad train`."),
    out: Path = typer.Option(..., "--out", help="Directory to write the plain Hugging Face checkpoint to."),
    checkpoint: str | None = typer.Option(None, help="Checkpoint tag under checkpoints/ (default: final, else "
                                          "the latest)."),
) -> None:
    """A run's checkpoint as a plain Hugging Face model (LoRA adapters merged into the weights) and tokenizer."""
    from agentgrad.checkpoint import latest_checkpoint
    from agentgrad.models.hf import ModelLoadError, load_model
    from agentgrad.models.lora import merge_saved_adapter

    if out.exists() and any(out.iterdir()):
        _fail(f"{out} exists and is not empty")
    try:
        ckpt = run_dir / "checkpoints" / checkpoint if checkpoint else latest_checkpoint(run_dir)
        with _libraries_to_stderr():
            loaded = load_model(ckpt)
            model = merge_saved_adapter(loaded.model, ckpt)
    except (ModelLoadError, FileNotFoundError) as exc:
        _fail(str(exc))
    with _libraries_to_stderr():
        model.save_pretrained(out)
        loaded.tokenizer.save_pretrained(out)
    typer.echo(json.dumps({"checkpoint": str(ckpt), "out": str(out)}))


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory written by `agentgrad train` (finished or not)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN_DIR/report.html)."),
    max_trajectories: int = typer.Option(2000, "--max-trajectories", min=1, help="Trajectories in the viewer at "
                                         "most (whole groups, spread over the run); the breakdowns count them all."),
) -> None:
    """Write one self-contained HTML report of a run: learning curves, tool and stop-reason breakdowns, error
    kinds, and a trajectory viewer (turns, tool calls, observations, rewards, the loss mask on the tokens)."""
    from agentgrad.report import ReportError, build_report

    try:
        with _display().track(f"report of {run_dir.name}"):
            path = build_report(run_dir, out, max_trajectories=max_trajectories)
    except (ReportError, ImportError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps({"report": str(path), "bytes": path.stat().st_size}))


@app.command()
def check(
    overrides: list[str] | None = typer.Argument(None, help="Dotted overrides naming the suite and reward, e.g. "
                                                   "env=my_module:MySuite reward.name=my_module:my_reward"),
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="Built-in preset name or path to a YAML file."),
    tasks: int = typer.Option(20, help="Tasks per split to check."),
) -> None:
    """Check a task suite and reward before training: the expert solves the suite's tasks, the verifier (or the
    env) agrees, the splits are disjoint, check_env passes, and the reward scores the expert's episodes."""
    from agentgrad.config import ConfigError, build_config
    from agentgrad.envs import SuiteCheckError, check_suite, close_suite, make_suite
    from agentgrad.registry import ImportRefError, UnknownNameError
    from agentgrad.rewards.base import RewardSpecError, apply_reward, load_reward
    from agentgrad.tools.mcp import McpError

    suite = None
    try:
        config = build_config(preset, overrides or [])
        suite = make_suite(config.env.name, config.env.options, mcp_servers=config.env.mcp_servers)
        reward_fn = load_reward(config.reward.name, suite, **config.reward.options)
        with _display().track(f"checking {config.env.name}"):
            report = check_suite(suite, n=tasks, seed=config.run.seed)
    except (ConfigError, ImportRefError, UnknownNameError, RewardSpecError, SuiteCheckError, McpError) as exc:
        _fail(str(exc))
    except (TypeError, ValueError) as exc:  # the suite's constructor rejected its options
        _fail(f"{config.env.name}: {type(exc).__name__}: {exc}")
    finally:
        close_suite(suite)
    rewards = [apply_reward(reward_fn, e) for e in report.pop("episodes")]
    kept = [r.total for r in rewards if not r.masked]
    typer.echo(json.dumps({"suite": config.env.name, **report, "reward": config.reward.name,
                           "expert_mean_reward": sum(kept) / len(kept) if kept else None,
                           "expert_masked": sum(r.masked for r in rewards),
                           "first_masked_reason": next((r.reason for r in rewards if r.masked), None)}))


@app.command()
def config(
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="Show the values of this preset (default: the "
                                                                 "one `agentgrad train` uses)."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted overrides to apply before showing."),
    as_markdown: bool = typer.Option(False, "--markdown", help="Print the configuration reference page instead "
                                     "(docs/configuration.md: every key's type, default, preset value and help)."),
) -> None:
    """List every config key with its value and help text."""
    from agentgrad.config import ConfigError, build_config
    from agentgrad.config_reference import describe, markdown

    if as_markdown:
        try:
            typer.echo(markdown(preset), nl=False)
        except ConfigError as exc:
            _fail(str(exc))
        return
    try:
        cfg = build_config(preset, overrides or []).to_dict()
    except ConfigError as exc:
        _fail(str(exc))
    for key, _default, help_text in describe():
        value = cfg
        for part in key.split("."):
            value = value[part]
        typer.echo(f"{key} = {value!r}\n    {help_text}")


@tool_app.command("run")
def tool_run(
    name: str = typer.Argument(..., help="Tool name: calculator, python, search, open, sql."),
    args: str = typer.Option("{}", "--args", help="Arguments as a JSON object."),
    corpus: Path | None = typer.Option(None, help="JSONL corpus ({doc_id,title,text}) for search/open."),
    db: Path | None = typer.Option(None, help="SQLite file for sql."),
    timeout: float | None = typer.Option(None, help="Tool timeout in seconds."),
) -> None:
    """Run one tool and print its result as JSON."""
    from agentgrad.tools.runner import run_tool

    out = run_tool(name, args, corpus_path=corpus, db_path=db, timeout_s=timeout)
    typer.echo(json.dumps(out))
    if not out.get("ok"):
        raise typer.Exit(1)


@judge_app.command("calibrate")
def judge_calibrate(
    labels: Path = typer.Option(..., "--labels", help="JSONL of human-labelled examples (>= 100)."),
    base_url: str = typer.Option(..., "--base-url", help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000"),
    model: str = typer.Option(..., "--model", help="Model name the endpoint serves."),
    out: Path = typer.Option(Path("judge-calibration.json"), "--out", help="Where to write the report."),
    threshold: float = typer.Option(0.80, help="Minimum accuracy for the judge to be accepted."),
    rubric: str = typer.Option("pass_fail", help="Rubric template name."),
) -> None:
    """Score a judge against human labels; write accuracy, confusion matrix, precision/recall and kappa."""
    from agentgrad.rewards.calibration import calibrate_cli

    raise typer.Exit(calibrate_cli(labels, base_url, model, out, threshold, rubric=rubric, display=_display()))


@data_app.command("import")
def data_import(
    log: Path = typer.Argument(..., help="JSONL of OpenAI-format chat episodes with tool calls (see docs/replay.md)."),
    out: Path = typer.Option(..., "--out", help="Store directory to write (replay.offline_paths reads it)."),
    model: str = typer.Option(..., "--model", help="Model dir of the policy to train: its tokenizer and chat "
                                                   "template encode the episodes."),
    behaviour_model: str | None = typer.Option(None, "--behaviour-model", help="Model that scores episodes "
                                                  "logged without logprobs (default: --model)."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted overrides (env, reward, rollout.temperature)."),
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="Preset naming the env and reward."),
) -> None:
    """Encode an offline agent log into trajectories, token-in/token-out through the policy's chat codec."""
    from agentgrad.config import ConfigError, build_config
    from agentgrad.pipelines.data import import_chat_log

    try:
        config = build_config(preset, overrides or [])
    except ConfigError as exc:
        _fail(str(exc))
    if not log.exists():
        _fail(f"no such log: {log}")
    with _display(config.run.progress).track(f"data import {log.name}") as progress:
        report = import_chat_log(config, log, out, model_path=model, behaviour_model_path=behaviour_model,
                                 progress=progress)
    typer.echo(json.dumps(report.to_dict()))


@data_app.command("export")
def data_export(
    store: Path = typer.Argument(..., help="A store directory, e.g. RUN_DIR/trajectories."),
    out: Path = typer.Option(..., "--out", help="JSONL chat log to write."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted overrides (env) for the tool schemas."),
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="Preset naming the env."),
) -> None:
    """Write a store as an OpenAI-format chat log with per-turn behaviour logprobs."""
    from agentgrad.config import build_config
    from agentgrad.pipelines.data import export_chat_log

    with _display().track(f"data export {store}") as progress:
        episodes = export_chat_log(build_config(preset, overrides or []), store, out, progress=progress)
    typer.echo(json.dumps({"episodes": episodes, "out": str(out)}))


@data_app.command("expert")
def data_expert(
    out: Path = typer.Option(..., "--out", help="JSONL chat log to write."),
    episodes: int = typer.Option(1000, "--episodes", help="Expert episodes (train split) to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the train-task stream."),
    overrides: list[str] | None = typer.Argument(None, help="Dotted overrides (env) naming the suite."),
    preset: str = typer.Option("tiny-cpu", "--preset", "-p", help="Preset naming the env."),
) -> None:
    """Write the suite's expert episodes as an OpenAI-format chat log (what `bc.demos` and `data import` read)."""
    from agentgrad.config import ConfigError, build_config
    from agentgrad.data.offline import to_chat_line
    from agentgrad.envs import SuiteCheckError, make_suite
    from agentgrad.envs.base import close_env, episode_success, expert_episode

    try:
        config = build_config(preset, overrides or [])
        suite = make_suite(config.env.name, config.env.options, mcp_servers=config.env.mcp_servers)
        env = suite.make_env()  # for each task's tool schemas (a jsonl task has its own)
        with out.open("w", encoding="utf-8") as fh, _display().track("expert episodes", episodes) as progress:
            for done, task in enumerate(suite.sample_tasks(episodes, split="train", seed=seed), start=1):
                ep = expert_episode(suite, task)
                _, info = env.reset(seed=0, options={"task": task})
                fh.write(json.dumps(to_chat_line(ep, success=episode_success(suite, ep), tools=info.get("tools")))
                         + "\n")
                progress(done, None)
        close_env(env)
    except (ConfigError, SuiteCheckError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps({"episodes": episodes, "out": str(out)}))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
