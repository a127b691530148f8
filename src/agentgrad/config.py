"""Typed run configuration: one source of truth for defaults, validation and help text.

Sources, later wins: field defaults -> the task suite's defaults (`configs/suites/<env.name>.yaml` for a built-in
suite, or the suite class's `config_defaults` for your own) -> a YAML preset (`configs/<name>.yaml` in the
package, or a path) -> dotted overrides from the command line (`algo.group_size=16`). Unknown keys are errors
listing valid keys.

Presets layer: a preset file starts from the default preset (`tiny-cpu`) unless it says what it extends
(`extends: other.yaml`, a built-in name, or `extends: null` for the bare field defaults), so a preset that
names only `env` keeps every other default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from agentgrad.config_sections import (
    AdaptiveConfig,
    CriticConfig,
    DPOConfig,
    EnvConfig,
    EvalConfig,
    FaultsConfig,
    LearnerConfig,
    LoraConfig,
    McpServerConfig,  # noqa: F401 (re-exported: import config sections from agentgrad.config)
    MctsConfig,
    MetricsConfig,
    MismatchConfig,
    ReplayConfig,
    RestConfig,
    RewardConfig,
    RunConfig,
    Section,
    SinkName,  # noqa: F401 (re-exported: the config accepts these sink names)
    TinyModelConfig,
)
from agentgrad.rollout.copying import CopySpec

PRESET_DIR = Path(__file__).parent / "configs"


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.2's booleans (true/false only): under YAML 1.1 `rollout.tool_name_mask=on` or `tool_name_mask: off`
    would reach a field of "on"/"off"/"auto" as a bool. A bool field still takes on/off/yes/no (pydantic parses
    those strings)."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                  list("tTfF"))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


class ConfigError(ValueError):
    """A configuration problem, with a message that says which key and what is valid."""


class ModelConfig(Section):
    path: str | None = Field(None, description="Local directory (or hub id) of an HF causal LM whose chat template "
                                               "renders tools; empty builds the embedded tiny model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    device: str = Field("cpu", description="torch device for policy and learner (cpu, cuda, cuda:1, ...).")
    compute_dtype: Literal["fp32", "bf16", "auto"] = Field("fp32", description="The learner's forward and "
                                                           "backward (BC and RL updates): fp32, or bf16 autocast "
                                                           "over fp32 weights; auto picks bf16 where the CPU has "
                                                           "avx512_bf16/amx_bf16 (or the GPU bf16), fp32 elsewhere. "
                                                           "Sampling stays fp32 (docs/learning.md \"bf16\").")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    chat_template: str = Field("auto", description="Chat template: auto (the model's own; a Qwen3 template, which "
                               "is not incremental, is swapped for agentgrad's incremental variant; the tiny model's "
                               "own is its compact 'tiny' format), a family agentgrad ships (tiny, qwen2.5, qwen3, "
                               "llama3: for the tiny model also its tokens), or a path to a .jinja file "
                               "(docs/chat-templates.md).")
    enable_thinking: bool | None = Field(None, description="Passed to the chat template as enable_thinking (Qwen3: "
                                         "false closes an empty think block in every generation prompt); empty: "
                                         "not passed (Qwen3 then thinks).")
    tool_format: str = Field("auto", description="How turns are parsed into tool calls: auto (read off the chat "
                             "template), hermes (<tool_call> blocks: Qwen2.5), qwen3 (a think block, then "
                             "<tool_call> blocks) or llama3_json ({\"name\": ..., \"parameters\": ...}).")

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        from agentgrad.models.chat_templates import TEMPLATE_FAMILIES

        if value != "auto" and value not in TEMPLATE_FAMILIES and not (
                value.endswith(".jinja") and Path(value).expanduser().is_file()):
            raise ValueError(f"{value!r} is not 'auto', a template family ({', '.join(TEMPLATE_FAMILIES)}) "
                             "or an existing .jinja file")
        return value

    @field_validator("tool_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        from agentgrad.rollout.formats import TOOL_FORMATS

        if value != "auto" and value not in TOOL_FORMATS:
            raise ValueError(f"{value!r} is not 'auto' or a tool-call format ({', '.join(TOOL_FORMATS)})")
        return value


class RolloutConfig(Section):
    max_turns: int = Field(4, gt=0, description="Policy turns per episode before it is stopped (max_turns).")
    max_new_tokens_per_turn: int = Field(48, gt=0, description="Generated tokens per turn.")
    max_total_tokens: int = Field(320, gt=0, description="Tokens per episode, prompt and observations included.")
    max_invalid_calls: int = Field(2, ge=0, description="Invalid or failed tool calls that end an episode (0: never).")
    repeated_call_limit: int = Field(3, ge=0, description="Identical calls that end an episode (0: never).")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature for training rollouts (the learner "
                                                     "scores tokens at the same temperature, so ratios stay exact).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for training rollouts.")
    tool_name_mask: Literal["auto", "on", "off"] = Field("auto", description="Constrained decoding of tool "
                                                        "names to the env's legal_actions() (logprobs of the masked "
                                                        "distribution, scored alike by the learner). auto: in states "
                                                        "where the mask hides tools the prompt offers or forbids "
                                                        "answering; on: in every state; off: never.")
    copy_args: list[str] = Field(default_factory=list, description="Arguments to copy rather than write: "
                                 "'tool.argument' (a string argument) or 'answer' (a final answer). While the policy "
                                 "writes one, only tokens that keep it the start of a span of what the episode has "
                                 "read (the prompt and observations; a span runs from word boundary to word boundary, "
                                 "so a name or number is copied whole) are legal; logprobs are those of the masked "
                                 "distribution, scored alike by the learner. For extractive tools (search for a name "
                                 "in the question, open a listed id); needs a template with <tool_call> blocks.")

    copy_literals: list[str] = Field(default_factory=list, description="Composed arguments ('tool.argument', e.g. "
                                     "sql.query) written freely except that each number (a digit run not glued to a "
                                     "name) and '-quoted string in them must be a whole span of what the episode has "
                                     "read; scored alike by the learner. Double-quoted strings are not checked.")

    @field_validator("copy_args", "copy_literals")
    @classmethod
    def _copy_args(cls, names: list[str], info: ValidationInfo) -> list[str]:
        if info.field_name == "copy_args":
            CopySpec.parse(names)
        else:
            CopySpec.parse((), names)
        return names
    max_concurrent_episodes: int = Field(64, gt=0, description="Episodes in flight at once (continuous batching: "
                                                               "a finished episode's slot goes to the next one).")
    deterministic_schedule: bool = Field(False, description="Wait for every pending tool call after each decode "
                                         "step, so which episodes share a step (and so the last bits of the logprobs) "
                                         "never depends on tool timing: bit-repeatable runs, at the cost of overlap.")
    waiting_episodes: int = Field(0, ge=0, description="Latency hiding: episodes kept (with their KV cache) "
                                  "beyond max_concurrent_episodes while they wait on tools. An episode that calls "
                                  "a tool then leaves the decode batch and its slot goes to a queued episode, and "
                                  "answers rejoin in call order as slots free up; with deterministic_schedule an "
                                  "answer is taken back tool_wait_steps decode steps after its call (waiting for "
                                  "it if late), so the floats still never depend on tool timing. 0: off (an "
                                  "episode waiting on a tool keeps its slot).")
    tool_wait_steps: int = Field(8, ge=0, description="With waiting_episodes and deterministic_schedule: decode "
                                 "steps that run between a tool call and the taking back of its answer (sooner "
                                 "when nothing else is left to decode). Near the tool's latency over one decode "
                                 "step's time hides it; larger only delays the episode.")
    batch_invariant: bool = Field(False, description="Attend over the whole key length (max_total_tokens) at "
                                  "every decode step, so an episode's floats never depend on which episodes share "
                                  "its step: a fixed seed repeats tokens and logprobs bit for bit whatever the tool "
                                  "timing, with overlap kept. With torch's attention that costs decode speed (28% "
                                  "fewer tokens/s on the tiny model, benchmarks/rollout_throughput.py); the compiled "
                                  "attention (native_attention) reads each row's own length either way. Off, a "
                                  "draw that falls within "
                                  "rounding of a sampling boundary can flip a token when tool timing changes.")
    native_attention: bool = Field(True, description="The rollout engine on CPU in fp32 runs each layer's RoPE, "
                                   "KV-cache write and attention as one compiled C call (backends/decode_attention.c, "
                                   "built on first use by the machine's C compiler, $CC or cc, in under a second, and "
                                   "cached in ~/.cache/agentgrad/native) instead of ~15 torch ops: 1.3-1.4x faster "
                                   "rollouts of the tiny model, the same numbers up to float rounding, and a row's "
                                   "attention never depends on its batch mates. Without a C compiler, or false: "
                                   "torch's ops.")
    tool_workers: int = Field(0, ge=0, description="Threads running tool calls concurrently (0: one per episode "
                                                   "in flight).")
    action_head: Literal["tokens", "factored", "category"] = Field(
        "tokens", description="How a call's tool name is chosen. tokens: the LM writes it (constrained by "
        "tool_name_mask); factored: a head reading the LM's hidden states of the context picks category then tool "
        "over the legal set, the name is written in, arguments stay text; category: the head picks the category, "
        "the start its legal tools' names share is written in, and the LM writes the rest of the name (masked to "
        "that category) and the arguments (rollout/factored.py, docs/action-space.md). Trained by BC "
        "(bc.head_loss_coef) and RL (each decision is one more action).")
    backend: Literal["local", "ray", "vllm"] = Field("local", description="Where RL rollouts run. local: this "
                                                     "process; ray: `workers` Ray actors, each with a policy replica "
                                                     "and its own envs, weights broadcast after each update (pip "
                                                     "install 'agentgrad[ray]'); vllm: a vLLM engine in this process, "
                                                     "weights reloaded in place after each update (pip install "
                                                     "'agentgrad[vllm]'; the tool-name mask in-process only, no "
                                                     "factored head). "
                                                     "docs/scale-out.md.")
    vllm_kv_cache_mb: int = Field(256, gt=0, description="backend=vllm: memory the engine reserves for its KV cache "
                                  "(and prefix cache), in MiB.")
    vllm_server: str | None = Field(None, description="backend=vllm: None: the engine in this process; 'start': "
                                    "start vLLM's OpenAI-compatible server on 127.0.0.1 and talk to it over HTTP; a "
                                    "URL: a running server (started with VLLM_SERVER_DEV_MODE=1, on this filesystem: "
                                    "weights go to it as files). A server cannot apply the tool-name mask.")
    workers: int = Field(2, gt=0, description="backend=ray: rollout worker actors (groups are spread over them).")
    worker_cpus: float = Field(1.0, gt=0, description="backend=ray: CPUs Ray reserves for each worker.")
    ray_address: str | None = Field(None, description="backend=ray: a cluster to join (`ray start --head` prints it; "
                                    "'auto' finds a local one); None: start Ray inside this run (ray.init()).")
    max_staleness: int = Field(0, ge=0, description="Async RL rollouts: sample step s+k (k = this) with the weights "
                               "before step s's update while s trains; 0: synchronous. Needs replay off and "
                               "action_head=tokens; stale groups past the bound are dropped (docs/scale-out.md).")


class BCConfig(Section):
    steps: int = Field(600, ge=0, description="Optimizer steps of behaviour cloning on expert trajectories (at most, "
                                             "with stop_at_success).")
    batch_size_episodes: int = Field(32, gt=0, description="Expert episodes per BC step.")
    num_demos: int = Field(2000, gt=0, description="Distinct expert episodes generated for BC.")
    demos: str | None = Field(None, description="Clone logged expert trajectories instead of the suite's expert: "
                              "an OpenAI-format chat log with tool calls (JSONL, the format `agentgrad data import` "
                              "reads, docs/replay.md) or a store directory; encoded with the run's own tokenizer, "
                              "bad lines counted and reported. None: bc.num_demos episodes of the suite's expert.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of BC (linear warm-up, cosine decay).")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["cosine", "constant"] = Field("constant", description="LR after warm-up: cosine decay "
                                                                              "to 10% at bc.steps, or constant.")
    stop_at_success: float | None = Field(0.25, ge=0, le=1, description="Stop BC early once greedy success on "
                                          "validation tasks (the suite's 'test' split, never the held-out one) "
                                          "reaches this; None trains all bc.steps.")
    eval_every: int = Field(2, gt=0, description="Steps between validation checks when stop_at_success is set, "
                            "until a check sees any success (or bc.dense_checks_from); from then on every "
                            "bc.dense_eval_every steps (BC's phase change takes the tiny model from 0% to 80% "
                            "validation success within ~10 steps).")
    dense_checks_from: float = Field(0.0, ge=0, le=1, description="Check every bc.dense_eval_every steps "
                                     "(instead of every eval_every) only once the best smoothed check reaches "
                                     "this; 0: from the first success. Where success trickles in over hundreds of "
                                     "steps (api-catalog), checking every step from the first 1% costs most of "
                                     "BC's time; half of stop_at_success keeps the checks dense where the rule "
                                     "stops.")
    dense_eval_every: int = Field(1, gt=0, description="Steps between validation checks once they are dense "
                                  "(bc.dense_checks_from). 1: every step; where validation success hovers below "
                                  "the target for hundreds of steps (api-catalog), a few steps apart costs a "
                                  "fraction and stops at most that many steps late.")
    eval_tasks: int = Field(48, gt=0, description="Validation tasks per check.")
    probe_tasks: int | None = Field(None, gt=0, description="Until a check sees any success: check this many "
                                    "tasks first, and run the full eval_tasks check only when they show a "
                                    "success (cheaper checks on BC's plateau). None: every check is full.")
    stop_window: int = Field(2, gt=0, description="Validation checks averaged by the stop rule: BC stops once the "
                             "mean of the last stop_window checks reaches stop_at_success, so one lucky check of "
                             "eval_tasks tasks does not decide where RL starts.")
    lr_scale_near_target: float = Field(0.25, gt=0, le=1, description="Once a validation check sees any success, "
                                        "BC's learning rate is multiplied by this, so that the phase change takes "
                                        "several checks and the stop rule lands where it aims (at lr 1e-3 one step "
                                        "took validation success from 27% to 60%).")
    keep_best: bool = Field(True, description="When BC uses all bc.steps without reaching stop_at_success, hand on "
                            "the weights of its best validation check (by the same smoothed signal), not the last.")
    shared_prefix: bool = Field(True, description="Run the prefix all demos of a BC batch share (system prompt "
                                "and tool list) once per batch, not once per demo: the same loss, fewer tokens.")
    head_loss_coef: float = Field(1.0, ge=0, description="Weight of the factored head's loss (mean NLL of the "
                                  "expert's choice per call) added to the token loss; rollout.action_head=factored "
                                  "or category only.")
    head_grad: Literal["attached", "detached"] = Field("detached", description="Whether the factored head's "
                                                       "losses (BC's NLL, and RL's policy gradient) reach the LM: "
                                                       "detached (the head is a probe on the LM's hidden states) or "
                                                       "attached (its gradient also trains the LM; measured to "
                                                       "damage it, docs/action-space.md).")
    lm_learns_names: bool = Field(True, description="Under rollout.action_head=factored or category, keep the "
                                  "tokens a head writes of each expert call's name in the LM's BC loss: the LM "
                                  "learns to write the names, which trains the hidden state the head reads; at "
                                  "rollout the head still chooses. False: they leave the LM's loss (loss_mask 0).")


ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "ppo", "adaptive", "rest", "dpo", "mcts", "bc")
"""Stage algorithms `algo.name` and `schedule.stages[].algo` accept; `pipelines.schedule.STAGES` implements them."""

AlgoName = Literal["grpo", "rloo", "reinforce_pp", "ppo", "adaptive", "rest", "dpo", "mcts", "bc"]


class AlgoConfig(Section):
    name: AlgoName = Field("grpo", description="Algorithm of the stage after BC: online RL (grpo, rloo, "
                                               "reinforce_pp, ppo; adaptive: grpo <-> ppo, see adaptive.*), "
                                               "rest, dpo, mcts, or bc (BC only). Ignored when "
                                               "schedule.stages is set.")
    steps: int = Field(110, ge=0, description="RL steps (one rollout batch, then epochs_per_step passes over it).")
    tasks_per_step: int = Field(16, gt=0, description="Distinct tasks per RL step.")
    group_size: int = Field(8, ge=2, description="Samples per task (G); advantages are relative within a group.")
    lr: float = Field(1e-4, gt=0, description="RL learning rate (constant).")
    epochs_per_step: int = Field(4, gt=0, description="Passes over each rollout batch (PPO epochs).")
    minibatch_size_episodes: int = Field(64, gt=0, description="Episodes per optimizer step within an epoch.")
    clip_low: float = Field(0.2, gt=0, description="PPO clip: ratio floor is 1 - clip_low.")
    clip_high: float = Field(0.28, gt=0, description="PPO clip: ratio ceiling is 1 + clip_high (clip-higher).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip bound c > 1 on negative-advantage tokens "
                                                            "(Ye et al. 2020); None: off.")
    norm_by_std: bool = Field(True, description="Divide group-centred rewards by the group std (False: Dr.GRPO).")
    advantage_estimator: str | None = Field(None, description="Advantage estimator to use instead of the online "
                                            "algorithm's own: a name in ADVANTAGE_ESTIMATORS or an import path "
                                            "'package.module:function' (docs/adding-an-algorithm.md). None: grpo's, "
                                            "rloo's, reinforce_pp's, or gae for ppo.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount: per turn for grpo/rloo/reinforce_pp, per policy "
                                                      "token for ppo's GAE.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda (ppo only).")
    kl_coef: float = Field(0.0, ge=0, description="Initial KL-to-reference coefficient (0: no reference model).")
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL as a loss term (GRPO style) or as a "
                                                                  "per-token reward penalty (Ziegler et al. 2019).")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="Keep kl_coef fixed, or adapt it "
                                                       "towards kl_target (Ziegler et al. 2019); logged as "
                                                       "train/kl_coef.")
    kl_target: float = Field(0.05, gt=0, description="Adaptive controller: target KL of the rollout policy to the "
                             "reference (k1, nats, mean over the step's episodes) in kl_target_unit.")
    kl_target_unit: Literal["episode-sum", "token-mean"] = Field("episode-sum", description="What one episode's "
                                  "KL is for kl_target: episode-sum sums it over the episode's policy tokens "
                                  "(Ziegler et al. 2019); token-mean averages it per token, as verl does, so a "
                                  "verl target_kl carries over only with token-mean.")
    kl_horizon_episodes: int = Field(2000, gt=0, description="Adaptive controller: horizon in episodes (larger "
                                                             "adapts the coefficient more slowly).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the reference term.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token policy, KL and value losses become one number (verl's names): "
        "token-mean over the batch's policy tokens (DAPO); seq-mean-token-mean, each episode's token mean then the "
        "mean over episodes (GRPO); seq-mean-token-sum, each episode's token sum then the mean; "
        "seq-mean-token-sum-norm, the sum over all policy tokens / loss_agg_norm (Dr.GRPO; with norm_by_std=False "
        "it reproduces a verl Dr.GRPO run).")
    loss_agg_norm: int | None = Field(None, gt=0, description="The constant divisor of seq-mean-token-sum-norm "
                                      "(Dr.GRPO's generation budget); None: rollout.max_total_tokens.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    target_kl: float | None = Field(None, gt=0, description="Stop a step's remaining minibatch updates once the "
                                    "approx. KL to the sampling policy exceeds this (None: never).")
    zero_signal: Literal["keep", "filter", "resample"] = Field(
        "keep", description="Groups whose samples all scored the same: keep them, filter them out, or resample "
                            "new tasks until tasks_per_step groups have signal (DAPO dynamic sampling).")
    max_resample_rounds: int = Field(3, ge=0, description="zero_signal=resample: extra rollout rounds per step "
                                                          "at most (then train on what has signal).")
    task_sampling: Literal["uniform", "signal"] = Field(
        "uniform", description="How RL draws its training tasks: uniform over the suite's train split, or signal: "
                               "task_pool x as many drawn uniformly, then kept in proportion to how often groups of "
                               "their kind (task.metadata['kind']) had signal over the last ~10 steps "
                               "(algos/task_sampling.py; logged as sampling/signal_rate/KIND). Evaluation is never "
                               "reweighted.")
    task_pool: int = Field(4, ge=1, description="task_sampling=signal: candidate tasks drawn per task kept.")
    expert_samples: int = Field(0, ge=0, description="Copies of the suite's expert episode added to each fresh "
                                "group (off-policy guidance, LUFFY, Yan et al. 2025; pipelines/guidance.py): a group "
                                "the policy fails in every sample then has signal. Scored by the policy as it "
                                "samples; kept out of rollout metrics and the store. 0: off. Needs the suite's "
                                "expert.")


class StageConfig(Section):
    algo: AlgoName = Field(..., description="Algorithm of this stage.")
    steps: int = Field(..., ge=0, description="Most steps (BC/RL steps, ReST or DPO iterations) of this stage.")
    until_metric: str | None = Field(None, description="Switch to the next stage early once the rolling mean of "
                                                      "this metric (e.g. rollout/success_rate) reaches until_value.")
    until_value: float = Field(0.0, description="Threshold for until_metric.")
    window_steps: int = Field(5, gt=0, description="Logged steps in the rolling mean of until_metric.")
    algo_overrides: dict[str, Any] = Field(default_factory=dict, description="algo.* fields set for this stage "
                                                                              "only (e.g. {lr: 5e-5}).")

    @model_validator(mode="after")
    def _known_overrides(self) -> StageConfig:
        keys = set(self.algo_overrides)
        unknown = sorted((keys - set(AlgoConfig.model_fields)) | (keys & {"name"}))
        if unknown:
            raise ValueError(f"algo_overrides has keys {unknown} that are not algo fields (or is 'name', which is "
                             f"the stage's algo); valid: {', '.join(sorted(set(AlgoConfig.model_fields) - {'name'}))}")
        if self.until_metric is None and self.until_value != 0.0:
            raise ValueError("until_value is set but until_metric is not")
        return self


class ScheduleConfig(Section):
    stages: list[StageConfig] = Field(default_factory=list, description="Stages run in order (empty: bc, then "
                                                                        "algo.name for algo.steps).")


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    bc: BCConfig = Field(default_factory=BCConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig)
    rest: RestConfig = Field(default_factory=RestConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    mcts: MctsConfig = Field(default_factory=MctsConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.rollout.max_new_tokens_per_turn >= self.rollout.max_total_tokens:
            raise ValueError("rollout.max_new_tokens_per_turn must be smaller than rollout.max_total_tokens")
        if self.model.path is None and self.rollout.max_total_tokens > self.model.tiny.max_positions:
            raise ValueError(f"rollout.max_total_tokens={self.rollout.max_total_tokens} exceeds the tiny model's "
                             f"context, model.tiny.max_positions={self.model.tiny.max_positions}")
        if self.rollout.max_staleness and (self.replay.enabled or self.rollout.action_head != "tokens"
                                          or self.algo.expert_samples):
            raise ValueError("rollout.max_staleness > 0 needs replay.enabled=false, rollout.action_head=tokens "
                             "and algo.expert_samples=0")
        if self.rollout.backend == "vllm" and (self.rollout.action_head != "tokens" or self.model.lora.r > 0):
            raise ValueError("rollout.backend=vllm cannot pause a turn for an action head and loads full weights: it "
                             "needs rollout.action_head=tokens and model.lora.r=0")
        if (self.rollout.backend == "vllm" and self.rollout.vllm_server is not None
                and self.rollout.tool_name_mask == "on"):
            raise ValueError("rollout.vllm_server (vLLM's HTTP server) cannot apply the tool-name mask: it needs "
                             "rollout.tool_name_mask auto or off, or the in-process engine (rollout.vllm_server "
                             "unset)")
        if self.rollout.copy_args or self.rollout.copy_literals:
            if self.rollout.backend == "vllm" and self.rollout.vllm_server is not None:
                raise ValueError("rollout.copy_args and rollout.copy_literals need the in-process engine: vLLM's "
                                 "HTTP server (rollout.vllm_server) cannot apply a logits mask")
        if self.model.path is None and self.model.chat_template.endswith(".jinja"):
            raise ValueError("model.chat_template: the tiny model takes a template family (its tokenizer is built "
                             "for one), not a .jinja file")
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
        try:
            value = _load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(exc)})") from None
        if "." not in key and isinstance(value, str) and _section_at([key]) is not None:
            key = f"{key}.name"
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


DEFAULT_PRESET = "tiny-cpu"


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not path.suffix or name_or_path in list_presets():  # a preset's name may hold dots (qwen2.5-0.5b-gpu)
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"no preset {name_or_path!r}; built-in presets: {', '.join(list_presets())}, or a path "
                          f"to a YAML file")
    return path.resolve()


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset's values, layered on what it extends: its `extends:` key (a preset name or a path, relative to
    the file; null: the field defaults alone), else the default preset, which itself extends nothing."""
    return _load_preset_file(_preset_path(name_or_path), ())


def _load_preset_file(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    if path in chain:
        raise ConfigError(f"preset {path} extends itself: {' -> '.join(map(str, (*chain, path)))}")
    data = read_yaml(path)
    parent = data.pop("extends", None if path == _preset_path(DEFAULT_PRESET) else DEFAULT_PRESET)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: 'extends' must be a preset name, a path, or null; got {parent!r}")
    parent_path = Path(parent)
    if parent_path.suffix and not parent_path.is_absolute():
        parent = str(path.parent / parent_path)  # relative to the file that names it
    return _merge(_load_preset_file(_preset_path(parent), (*chain, path)), data)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (YAML's own message spans several lines, with a caret)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping; ConfigError (one line) when it is not valid YAML or not a mapping."""
    try:
        data = _load_yaml(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping of sections")
    return data


def suite_defaults(suite: str) -> dict[str, Any]:
    """Values a task suite needs to differ from the field defaults, e.g. rollout limits that fit its expert
    demonstrations: `configs/suites/<suite>.yaml` for a built-in suite, the `config_defaults` mapping of a
    suite class named by import path or entry point. Empty when the suite ships none.

    Resolving the suite here also makes a bad `env.name` a one-line config error instead of a traceback."""
    path = PRESET_DIR / "suites" / f"{suite}.yaml"
    if path.exists():
        return _load_yaml(path.read_text()) or {}
    from agentgrad.envs import SUITES  # no torch: envs never import it
    from agentgrad.registry import ImportRefError, UnknownNameError

    try:
        obj = SUITES.get(suite)
    except (UnknownNameError, ImportRefError) as exc:
        raise ConfigError(f"env.name: {exc}") from None
    defaults = getattr(obj, "config_defaults", None) or {}
    if not isinstance(defaults, Mapping):
        raise ConfigError(f"env.name: {suite!r} has config_defaults of type {type(defaults).__name__}, not a "
                          f"mapping of config sections")
    return _merge({}, defaults)


def _absolute_paths(options: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(options)
    for key, value in options.items():
        if (key == "path" or key.endswith("_path")) and isinstance(value, str) and value:
            p = Path(value)
            if not p.is_absolute() and p.exists():
                out[key] = str(p.resolve())
    return out


def build_config(preset: str | None = DEFAULT_PRESET, overrides: Sequence[str] = (),
                 base: Mapping[str, Any] | None = None) -> Config:
    """Field defaults -> the suite's defaults -> `base` -> preset (layered on what it extends) -> overrides."""
    layers = [dict(base or {}), load_preset(preset) if preset else {}, parse_overrides(overrides)]
    tree: dict[str, Any] = {}
    for layer in layers:
        tree = _merge(tree, layer)
    env = tree.get("env")
    suite = env.get("name") if isinstance(env, dict) else None
    tree = _merge({}, suite_defaults(suite or EnvConfig.model_fields["name"].default))
    for layer in layers:
        tree = _merge(tree, layer)
    if isinstance(tree.get("env"), dict) and isinstance(tree["env"].get("options"), Mapping):
        tree["env"] = {**tree["env"], "options": _absolute_paths(tree["env"]["options"])}
    if isinstance(tree.get("env"), dict) and isinstance(tree["env"].get("mcp_servers"), list):
        tree["env"] = {**tree["env"], "mcp_servers": [
            {**s, "cwd": str(Path(s.get("cwd") or ".").resolve())} if isinstance(s, dict) and s.get("command") else s
            for s in tree["env"]["mcp_servers"]]}
    if isinstance(tree.get("bc"), dict) and tree["bc"].get("demos"):
        tree["bc"] = {**tree["bc"], **_absolute_paths({"path": tree["bc"]["demos"]})}
        tree["bc"]["demos"] = tree["bc"].pop("path")
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def load_config(path: str | Path) -> Config:
    try:
        return Config.model_validate(read_yaml(path))
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None

