"""Typed run configuration: one source of truth for defaults, validation and help text.

Sources, later wins: field defaults -> a YAML preset (`configs/<name>.yaml` in the package, or a path) ->
dotted overrides from the command line (`algo.group_size=16`). Unknown keys are errors listing valid keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PRESET_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A configuration problem, with a message that says which key and what is valid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class TinyModelConfig(_Section):
    hidden_size: int = Field(128, gt=0, description="Width of the embedded tiny model.")
    num_layers: int = Field(4, gt=0, description="Transformer layers of the tiny model.")
    num_heads: int = Field(4, gt=0, description="Attention heads of the tiny model.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(384, gt=0, description="MLP width of the tiny model.")
    vocab_size: int = Field(512, ge=300, description="BPE vocabulary trained locally (digits are single tokens).")
    tokenizer_corpus_episodes: int = Field(400, gt=0, description="Expert episodes rendered to train the tokenizer.")


class ModelConfig(_Section):
    path: str | None = Field(None, description="Local directory (or hub id) of an HF causal LM whose chat template "
                                               "renders tools; empty builds the embedded tiny model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    device: str = Field("cpu", description="torch device for policy and learner (cpu, cuda, cuda:1, ...).")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)


class EnvConfig(_Section):
    name: str = Field("arithmetic", description="Task suite (registered in agentgrad.envs.SUITES).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options passed to the suite's constructor.")


class RewardConfig(_Section):
    name: str = Field("outcome", description="Reward function: a registered name (outcome, verifier, process, "
                                             "shaped, judge) or 'module.path:callable'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options for the reward factory "
                                                                      "(e.g. cap, facts for 'shaped').")


class RolloutConfig(_Section):
    max_turns: int = Field(4, gt=0, description="Policy turns per episode before it is stopped (max_turns).")
    max_new_tokens_per_turn: int = Field(48, gt=0, description="Generated tokens per turn.")
    max_total_tokens: int = Field(320, gt=0, description="Tokens per episode, prompt and observations included.")
    max_invalid_calls: int = Field(2, ge=0, description="Invalid or failed tool calls that end an episode (0: never).")
    repeated_call_limit: int = Field(3, ge=0, description="Identical calls that end an episode (0: never).")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature for training rollouts (the learner "
                                                     "scores tokens at the same temperature, so ratios stay exact).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for training rollouts.")
    max_concurrent_episodes: int = Field(64, gt=0, description="Episodes in flight at once (continuous batching: "
                                                               "a finished episode's slot goes to the next one).")
    tool_workers: int = Field(0, ge=0, description="Threads running tool calls concurrently (0: one per episode "
                                                   "in flight).")


class BCConfig(_Section):
    steps: int = Field(600, ge=0, description="Optimizer steps of behaviour cloning on expert trajectories (at most, "
                                             "with stop_at_success).")
    batch_size_episodes: int = Field(32, gt=0, description="Expert episodes per BC step.")
    num_demos: int = Field(2000, gt=0, description="Distinct expert episodes generated for BC.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of BC (linear warm-up, cosine decay).")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["cosine", "constant"] = Field("constant", description="LR after warm-up: cosine decay "
                                                                              "to 10% at bc.steps, or constant.")
    stop_at_success: float | None = Field(0.25, ge=0, le=1, description="Stop BC early once greedy success on "
                                          "validation tasks (the suite's 'test' split, never the held-out one) "
                                          "reaches this; None trains all bc.steps.")
    eval_every: int = Field(5, gt=0, description="Steps between validation checks when stop_at_success is set "
                                                 "(BC success here can jump 20% -> 98% within 25 steps).")
    eval_tasks: int = Field(48, gt=0, description="Validation tasks per check.")


class AlgoConfig(_Section):
    name: Literal["grpo"] = Field("grpo", description="Online RL algorithm.")
    steps: int = Field(110, ge=0, description="RL steps (one rollout batch, then epochs_per_step passes over it).")
    tasks_per_step: int = Field(16, gt=0, description="Distinct tasks per RL step.")
    group_size: int = Field(8, ge=2, description="Samples per task (G); advantages are relative within a group.")
    lr: float = Field(1e-4, gt=0, description="RL learning rate (constant).")
    epochs_per_step: int = Field(4, gt=0, description="Passes over each rollout batch (PPO epochs).")
    minibatch_size_episodes: int = Field(64, gt=0, description="Episodes per optimizer step within an epoch.")
    clip_low: float = Field(0.2, gt=0, description="PPO clip: ratio floor is 1 - clip_low.")
    clip_high: float = Field(0.28, gt=0, description="PPO clip: ratio ceiling is 1 + clip_high (clip-higher).")
    norm_by_std: bool = Field(True, description="Divide group-centred rewards by the group std (False: Dr.GRPO).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss term (0: no reference model).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the reference term.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field("token-mean", description="Loss aggregation.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")


class EvalConfig(_Section):
    num_tasks: int = Field(200, gt=0, description="Held-out tasks for evaluation.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature at evaluation (0: greedy).")
    batch_size: int = Field(100, gt=0, description="Episodes evaluated together.")


class RunConfig(_Section):
    name: str | None = Field(None, description="Run name; defaults to a timestamp.")
    output_dir: str = Field("runs", description="Directory under which the run directory is created.")
    seed: int = Field(0, description="Seed for tasks, model init and sampling.")
    threads: int = Field(2, ge=1, description="torch CPU threads.")
    log_every: int = Field(1, gt=0, description="Steps between metric records.")
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints (0: only at stage ends).")
    progress: bool = Field(True, description="Show the live progress display.")


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    bc: BCConfig = Field(default_factory=BCConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if self.rollout.max_new_tokens_per_turn >= self.rollout.max_total_tokens:
            raise ValueError("rollout.max_new_tokens_per_turn must be smaller than rollout.max_total_tokens")
        return self

    @property
    def episodes_per_step(self) -> int:
        """Derived: episodes generated per RL step."""
        return self.algo.tasks_per_step * self.algo.group_size

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _section_at(path: Sequence[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for key in path:
        field = model.model_fields.get(key)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        dotted = ".".join(loc) or "(config)"
        if err["type"] == "extra_forbidden":
            section = _section_at(loc[:-1])
            valid = ", ".join(sorted(section.model_fields)) if section else "?"
            lines.append(f"unknown key {dotted!r}; valid keys here: {valid}")
        else:
            lines.append(f"{dotted}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {k!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """`["algo.group_size=16", "env=arithmetic"]` -> nested dict. Values are parsed as YAML scalars.

    A bare section name set to a string (`env=sql-qa`) is shorthand for that section's `name` key.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. algo.group_size=16)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else None
        if "." not in key and isinstance(value, str) and _section_at([key]) is not None:
            key = f"{key}.name"
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name_or_path: str) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"no preset {name_or_path!r}; built-in presets: {', '.join(list_presets())}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping of sections")
    return data


def build_config(preset: str | None = "tiny-cpu", overrides: Sequence[str] = (),
                 base: Mapping[str, Any] | None = None) -> Config:
    tree: dict[str, Any] = dict(base or {})
    if preset:
        tree = _merge(tree, load_preset(preset))
    tree = _merge(tree, parse_overrides(overrides))
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def load_config(path: str | Path) -> Config:
    try:
        return Config.model_validate(yaml.safe_load(Path(path).read_text()) or {})
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the `--help` of `agentgrad config`."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe(ann, f"{prefix}{name}.")
        else:
            default = field.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}", repr(default), field.description or ""))
    return rows
