"""Config sections that live apart from config.py (to keep it under 600 lines); `agentgrad.config` re-exports
them, so import from there."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Unknown keys are rejected, values frozen, defaults validated: what every config section is."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class TinyModelConfig(Section):
    hidden_size: int = Field(128, gt=0, description="Width of the embedded tiny model.")
    num_layers: int = Field(4, gt=0, description="Transformer layers of the tiny model.")
    num_heads: int = Field(4, gt=0, description="Attention heads of the tiny model.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(384, gt=0, description="MLP width of the tiny model.")
    vocab_size: int = Field(512, ge=300, description="BPE vocabulary trained locally (digits are single tokens).")
    word_spaces: Literal["attached", "split-before-capitals", "split"] = Field(
        "attached", description="The space before a word: attached to it (GPT-2's BPE), or its own token before a "
        "capital letter or everywhere, so that a name is the same tokens after a space, a quote or a newline "
        "(easier to copy from a question into a tool call; ~4% or ~25% more tokens).")
    tokenizer_corpus_episodes: int = Field(400, gt=0, description="Expert episodes rendered to train the tokenizer.")
    init_std: float = Field(0.06, gt=0, description="Std of the tiny model's initial weights (HF's "
                            "initializer_range). HF's 0.02 left BC on a loss plateau for 200 to 600+ steps, "
                            "seed- and CPU-dependent; 0.06 leaves it within ~80 (docs/learning.md).")
    max_positions: int = Field(1024, gt=0, description="Context length of the tiny model: at least "
                               "rollout.max_total_tokens (RoPE has no learnt positions, so it costs no parameters).")


class McpServerConfig(Section):
    """One MCP server whose tools the env's episodes call (docs/mcp.md): a command for stdio, or a URL."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="What errors and the tools' category call "
                      "this server.")
    command: str | None = Field(None, description="stdio: the executable that starts the server (e.g. python).")
    args: list[str] = Field(default_factory=list, description="stdio: the command's arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="stdio: environment variables for the server, "
                                "over a minimal inherited set (HOME, PATH, ...; the SDK's default).")
    cwd: str | None = Field(None, description="stdio: the server's working directory; made absolute (unset: the "
                            "directory the run was configured in), so the run's config.yaml works from anywhere.")
    url: str | None = Field(None, pattern=r"^https?://", description="Streamable HTTP: the endpoint, e.g. "
                            "http://127.0.0.1:8000/mcp.")
    headers: dict[str, str] = Field(default_factory=dict, description="Streamable HTTP: headers sent with "
                                    "every request (e.g. Authorization).")
    tools: list[str] | None = Field(None, description="Use only these of the server's tools (None: all it lists).")
    timeout_s: float = Field(30.0, gt=0, description="A call that takes longer is a `timeout` error observation.")
    connect_timeout_s: float = Field(60.0, gt=0, description="Starting, connecting and listing tools; longer is "
                                     "a one-line error before the run starts.")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: set exactly one of command (stdio) or url (HTTP)")
        return self


class EnvConfig(Section):
    name: str = Field("arithmetic", description="Task suite: a registered name (arithmetic, search-qa, ...), an "
                                                "import path of your own suite class ('my_module:MySuite', the "
                                                "current directory importable), or an entry point of "
                                                "'agentgrad.suites'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options passed to the suite's constructor "
                                    "(a relative 'path' or '*_path' option that exists is made absolute, so the "
                                    "run's config.yaml works from any directory).")
    mcp_servers: list[McpServerConfig] = Field(default_factory=list, description="MCP servers whose tools every "
                                               "env of the suite also offers; a tool named like one of the suite's "
                                               "replaces it (docs/mcp.md). Each: name, and command (+ args, env, "
                                               "cwd) or url (+ headers); tools, timeout_s, connect_timeout_s.")


class RewardConfig(Section):
    name: str = Field("outcome", description="Reward function: a registered name (outcome, verifier, process, "
                                             "shaped, judge) or 'module.path:callable'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options for the reward factory "
                                                                      "(e.g. cap, facts for 'shaped').")


class AdaptiveConfig(Section):
    """The `adaptive` stage: a critic-free algorithm while rolling success is low, PPO once it is high, and back
    when it collapses; a band (hysteresis), so a noisy success rate near one threshold does not flap
    (docs/algorithms.md, "Adaptive: GRPO <-> PPO with hysteresis")."""

    low_algo: Literal["grpo", "rloo", "reinforce_pp"] = Field("grpo", description="Algorithm while rolling "
                                                               "success is below up_at (group baselines, no critic).")
    up_at: float = Field(0.15, gt=0, le=1, description="Switch to ppo once the rolling mean of "
                         "rollout/success_rate over window_steps steps reaches this (and zero-signal allows it).")
    down_at: float = Field(0.05, ge=0, lt=1, description="Switch back to low_algo once the rolling success falls "
                           "below this (a collapse). Between down_at and up_at the running algorithm stays.")
    max_zero_signal: float = Field(0.5, ge=0, le=1, description="Switch up only while the rolling mean of "
                                   "rollout/zero_signal_groups is at most this: while most groups carry no signal, "
                                   "low_algo gives them zero advantage where a critic would push them all down.")
    window_steps: int = Field(5, gt=0, description="Steps in the rolling means; the window restarts at every "
                              "switch, so each decision is on a full window of the running algorithm's own steps.")
    warm_critic: bool = Field(True, description="While low_algo runs, fit ppo's value model (critic.*) on its "
                              "batches' Monte-Carlo returns, so PPO takes over with a trained critic.")
    min_critic_ev: float | None = Field(0.0, description="Switch up only once the critic's mean "
                                        "critic/explained_variance over the window (each on a batch before the "
                                        "critic was fitted on it) is above this: PPO takes over from a critic "
                                        "that predicts returns better than a constant. None: do not wait for it.")

    @model_validator(mode="after")
    def _band(self) -> AdaptiveConfig:
        if self.down_at >= self.up_at:
            raise ValueError(f"adaptive.down_at ({self.down_at}) must be below adaptive.up_at ({self.up_at}): "
                             "the band between them is what keeps the schedule from flapping")
        if self.min_critic_ev is not None and not self.warm_critic:
            raise ValueError("adaptive.min_critic_ev waits for a critic that adaptive.warm_critic=false never "
                             "trains: set adaptive.min_critic_ev=null too")
        return self


class MismatchConfig(Section):
    """The train/inference mismatch monitor (algos/mismatch.py; docs/scale-out.md#mismatch-monitor)."""

    monitor: bool = Field(False, description="Each RL step, score the fresh rollout tokens with the learner before "
                          "the update and log how far they are from the sampler's logprobs (mismatch/*: mean and max "
                          "|difference|, ratio quantiles, a |difference| histogram). Costs one forward pass a step. "
                          "Forced on by correction=on|auto.")
    correction: Literal["off", "on", "auto"] = Field("off", description="Importance correction of the mismatch on "
                                                     "fresh rows: pi_old := the learner's logprobs, weight := bounded "
                                                     "learner/sampler ratio. on: every step; auto: the steps whose "
                                                     "mean |difference| exceeds auto_threshold; off: monitor only.")
    auto_threshold: float = Field(0.01, ge=0, description="correction=auto: correct a step whose "
                                  "mismatch/mean_abs_logprob_diff exceeds this (nats per token).")
    is_level: Literal["token", "sequence"] = Field("token", description="Correction weights per token or per "
                                                   "sequence (product of the token ratios).")
    is_mode: Literal["truncate", "mask"] = Field("truncate", description="Weights above is_bound are truncated "
                                                 "(TIS) or masked out of the loss (MIS).")
    is_bound: float = Field(2.0, gt=0, description="Correction weight bound.")

    @property
    def scores(self) -> bool:
        """Whether a step needs the learner's recomputation at all."""
        return self.monitor or self.correction != "off"


class ReplayConfig(Section):
    enabled: bool = Field(False, description="Mix replayed groups (offline logs, earlier rollouts) into each RL "
                                             "step, with importance-weight correction.")
    offline_paths: list[str] = Field(default_factory=list, description="Store directories to preload (a run's "
                                     "trajectories/ or the --out of `agentgrad data import`).")
    capacity_groups: int = Field(4096, gt=0, description="Groups held; adding past capacity evicts the oldest (FIFO).")
    add_fresh: bool = Field(True, description="Also add each step's fresh rollout groups to the buffer.")
    sampling: Literal["uniform", "reward"] = Field("uniform", description="Replay sampling: uniform, or "
                                                   "reward-prioritised (P ~ exp(mean group reward / temperature)).")
    priority_temperature: float = Field(1.0, gt=0, description="Temperature of reward-prioritised sampling.")
    offline_fraction: float = Field(0.7, ge=0, lt=1, description="Fraction of each step's groups drawn from the "
                                    "buffer (the rest are fresh rollouts); the start value under schedule=success.")
    schedule: Literal["constant", "success"] = Field("constant", description="constant, or move the offline "
                                                     "fraction toward final_offline_fraction as success rises.")
    final_offline_fraction: float = Field(0.0, ge=0, lt=1, description="Offline fraction once rollout success "
                                          "reaches success_target (schedule=success).")
    success_target: float = Field(0.8, gt=0, le=1, description="Rollout success (EMA) at which the schedule ends.")
    success_ema: float = Field(0.5, gt=0, le=1, description="Weight of the newest step in the success EMA.")
    is_level: Literal["token", "sequence"] = Field("token", description="Importance weights per token or per "
                                                   "sequence (pi_theta / pi_behaviour).")
    is_mode: Literal["truncate", "mask"] = Field("truncate", description="Weights above is_bound are truncated "
                                                 "(TIS) or masked out.")
    is_bound: float = Field(2.0, gt=0, description="Importance-weight bound.")


class FaultsConfig(Section):
    max_consecutive_nonfinite: int = Field(3, gt=0, description="Abort after this many optimizer updates in a row "
                                           "with a non-finite loss (each one is skipped, parameters unchanged).")
    mask_tool_faults: bool = Field(True, description="Mask samples whose tool timed out or crashed (an "
                                   "infrastructure fault, not the policy's doing) instead of training on them.")
    inject_tool_failure_rate: float = Field(0.0, ge=0, le=1, description="Chaos testing: this fraction of tool "
                                            "calls returns a timeout or crash instead of running.")


class EvalConfig(Section):
    num_tasks: int = Field(200, gt=0, description="Held-out tasks for evaluation.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature at evaluation (0: greedy).")
    batch_size: int = Field(100, gt=0, description="Episodes evaluated together.")


class MctsConfig(Section):
    """Stage `mcts` (docs/search.md): tree search over tool calls, distilled into the policy by BC and DPO."""

    iterations: int = Field(5, ge=0, description="Search/distil rounds.")
    trees_per_iteration: int = Field(16, gt=0, description="Tasks searched per round, one tree each, all at once "
                                     "(their candidate sampling shares one decode batch).")
    simulations: int = Field(16, gt=0, description="Simulations per tree (each selects one leaf by PUCT, restores "
                             "it (snapshot or replay), and evaluates or expands it).")
    max_generated_tokens: int = Field(0, ge=0, description="Per-tree budget of generated tokens (every candidate "
                                      "sampled, pruned or not, and rollout turns); 0: none.")
    max_tool_calls: int = Field(0, ge=0, description="Per-tree budget of tool calls (replays that restore nodes "
                                "included); 0: none.")
    top_k: int = Field(5, ge=0, description="Children kept per expansion, ranked by the value model's estimate "
                       "(5 to 10 keeps trees small where dozens of calls are legal); 0: keep all.")
    samples_per_expansion: int = Field(8, gt=0, description="Most candidate turns sampled per expansion or "
                                       "widening, before de-duplication by (tool, normalised arguments).")
    expansion_batch: int = Field(2, ge=0, description="Candidates drawn per batch, up to samples_per_expansion, "
                                 "with the coverage rule checked between batches; 0: all in one batch.")
    coverage: float = Field(0.9, gt=0, le=1, description="A node draws no more candidates (nor widens) once the "
                            "distinct turns drawn there hold this share of the sampling distribution's mass "
                            "(their summed probability); 1.0: always samples_per_expansion (docs/search.md: 0.9 "
                            "halved the tokens of a search at the same success).")
    snapshots: bool = Field(True, description="Restore a node from its env's snapshot where the env offers one "
                            "(envs/base.py: SnapshotEnv) instead of replaying its tool calls.")
    widenings: int = Field(2, ge=0, description="Times a node whose children all ended (every sampled turn "
                           "tried) samples samples_per_expansion more and adds the top_k new ones (docs/search.md).")
    c_puct: float = Field(1.25, ge=0, description="PUCT exploration constant (AlphaZero's c_init).")
    temperature: float | None = Field(None, ge=0, description="Sampling temperature of candidate turns (None: "
                                      "rollout.temperature, the policy's own rollouts' temperature).")
    rollout_mix: float = Field(0.0, ge=0, le=1, description="Leaf value = (1 - mix) * V(leaf) + mix * the outcome "
                               "of one policy rollout from the leaf.")
    stop_on_success: bool = Field(True, description="A tree stops once it reached a successful episode.")
    baseline_samples: int = Field(1, ge=1, description="Policy-alone rollouts per searched task each round (the "
                                  "'policy alone' success, and Monte-Carlo returns for the value model).")
    value_fit_steps: int = Field(30, ge=0, description="Value-model steps on each round's finished episodes "
                                 "(config critic.model: head or separate; critic.lr).")
    value_batch_size: int = Field(16, gt=0, description="Episodes per value-model step.")
    distill: Literal["bc", "dpo", "both"] = Field("both", description="Train on successful root-to-leaf paths "
                                                  "(bc), on sibling pairs (dpo: same parent, one child led to "
                                                  "success, one to failure; dpo.* settings), or both.")
    sft_steps: int = Field(8, ge=0, description="BC steps per round on the successful paths.")
    batch_size_episodes: int = Field(16, gt=0, description="Episodes per BC step.")
    lr: float = Field(3e-4, gt=0, description="Learning rate of the BC steps (the DPO steps use dpo.lr).")


class RestConfig(Section):
    iterations: int = Field(3, ge=0, description="Grow/Improve iterations (ReST-EM gains most in the first few).")
    improve_from: Literal["start", "current"] = Field("start", description="Weights each Improve step fine-tunes: "
                                                      "'start', the policy the stage began with, with a fresh "
                                                      "optimizer (ReST-EM, Singh et al. 2023), so the set sampled "
                                                      "by the latest policy is all it learns from and errors do "
                                                      "not compound; 'current', the policy as the last Improve "
                                                      "left it (Gulcehre et al. 2023), which from BC starts fell "
                                                      "below its start over long runs (docs/algorithms.md).")
    tasks_per_iteration: int = Field(512, gt=0, description="Tasks sampled by each Grow step: with "
                                     "improve_from=start one Grow is all an Improve step learns from, so it must "
                                     "be large (64 lost ground on api-catalog and sql-qa: docs/algorithms.md).")
    samples_per_task: int = Field(8, gt=0, description="Samples per task (N) in each Grow step.")
    max_per_task: int | None = Field(None, ge=1, description="Most kept samples per task (ReST-EM's cap against "
                                     "easy tasks filling the Improve set); None keeps all.")
    demo_fraction: float = Field(0.0, ge=0, le=1, description="Share of each Improve minibatch drawn from BC's "
                                 "demonstrations (bc.demos or bc.num_demos of the suite's expert), so fine-tuning "
                                 "on the tasks the policy already solves does not erase the ones it does not.")
    dedup: bool = Field(True, description="Drop a kept sample whose tokens repeat one already kept for its task.")
    threshold_start: float = Field(0.5, description="Reward threshold of the first Improve step.")
    threshold_increment: float = Field(0.1, ge=0, description="Threshold rise per iteration (with 0/1 rewards any "
                                       "threshold in (0, 1] keeps exactly the successes).")
    threshold_max: float = Field(1.0, description="Ceiling of the rising threshold.")
    sft_steps: int = Field(64, ge=0, description="SFT optimizer steps per Improve step.")
    batch_size_episodes: int = Field(32, gt=0, description="Episodes per SFT step.")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate of the Improve steps.")


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters through PEFT (docs/scale-out.md). Off unless r > 0; then only the adapters train, the
    reference policy is the model with them disabled, and checkpoints hold them in `adapter/`."""

    r: int = Field(0, ge=0, description="LoRA rank; 0: off (every weight trains). Needs the lora extra (peft).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapters' update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input in training; > 0 makes "
                           "the learner take the plain forward (merged weights cannot drop inputs).")
    target_modules: list[LoraTarget] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="Linear layers that get adapters (a Llama-family decoder's projections).")


class LearnerConfig(Section):
    """Where the policy update runs (docs/scale-out.md, "Training"): one process (torch), or a sharded learner
    over `world_size` processes, of which rank 0 rolls out and every rank updates on rank 0's batch."""

    backend: Literal["torch", "fsdp", "deepspeed"] = Field("torch", description="torch: AdamW in this process, "
                                                           "on the model generation also uses. fsdp: FSDP2 "
                                                           "(fully_shard) over torch.distributed; deepspeed: "
                                                           "DeepSpeed ZeRO (learner.zero_stage; the deepspeed "
                                                           "extra). gloo on CPU, nccl on CUDA.")
    world_size: int = Field(1, ge=1, description="Processes of a sharded learner. `agentgrad train` with "
                            "world_size > 1 starts them itself (torch.distributed.run on 127.0.0.1); under "
                            "torchrun or the deepspeed launcher their WORLD_SIZE is used (leave this at 1 or "
                            "set it to match).")
    zero_stage: Literal[2, 3] = Field(2, description="learner.backend=deepspeed: ZeRO stage 2 (optimizer state "
                                      "and gradients partitioned) or 3 (the weights too).")
    offload_optimizer: bool = Field(False, description="learner.backend=deepspeed: keep the optimizer state in "
                                    "CPU memory (ZeRO-Offload; untested).")


class CriticConfig(Section):
    model: Literal["head", "separate"] = Field("head", description="ppo's value model: a linear head on the "
                                               "policy's (detached) hidden states, or a separate copy of the "
                                               "policy trunk with its own head and optimizer.")
    lr: float = Field(1e-3, gt=0, description="Value-model learning rate.")
    value_clip: float | None = Field(0.2, ge=0, description="Clip of the value update around the rollout's "
                                                            "values (None: plain squared error).")
    whiten_advantages: bool = Field(True, description="Whiten GAE advantages over the batch's policy tokens.")


class DPOConfig(Section):
    iterations: int = Field(10, ge=0, description="Rollout/train iterations (online DPO).")
    tasks_per_iteration: int = Field(16, gt=0, description="Tasks rolled out per iteration.")
    samples_per_task: int = Field(8, ge=2, description="Samples per task; pairs are (success, failure) of a task.")
    beta: float = Field(0.1, gt=0, description="DPO temperature beta (Rafailov et al. 2023).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO label smoothing.")
    epochs: int = Field(2, gt=0, description="Passes over each iteration's pairs.")
    batch_size_pairs: int = Field(16, gt=0, description="Pairs per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="DPO learning rate.")
    nll_coef: float = Field(1.0, ge=0, description="Weight of an NLL term on the chosen trajectories added to the "
                            "DPO loss (RPO, Pang et al. 2024): plain DPO lowers the chosen ones' likelihood too, "
                            "and from a 45% start it lost 15 points of held-out success here; 0 is plain DPO.")


class RunConfig(Section):
    name: str | None = Field(None, description="Run name; defaults to a timestamp.")
    output_dir: str = Field("runs", description="Directory under which the run directory is created.")
    seed: int = Field(0, description="Seed for tasks, model init and sampling.")
    threads: int = Field(1, ge=1, description="torch CPU threads (1: results do not depend on machine load).")
    log_every: int = Field(1, gt=0, description="Steps between metric records.")
    checkpoint_every: int = Field(0, ge=0, description="Steps (of any stage) between resumable run-state checkpoints "
                                  "(checkpoints/step-N, LATEST; `agentgrad train --resume`); 0: only at stage ends.")
    progress: bool = Field(True, description="Show the live progress display.")
    slow_step_warn_s: float | None = Field(60.0, gt=0, description="Warn (once per stage) when an RL step takes "
                                           "longer than this: the defaults are sized for two-turn arithmetic "
                                           "(~3-5 s a GRPO step on 2 CPU cores); None: never.")


SinkName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
"""Metric sinks `metrics.sinks` accepts; `agentgrad.sinks.SINKS` implements them."""


class MetricsConfig(Section):
    sinks: list[SinkName] = Field(default_factory=list, description="Metric sinks besides metrics.jsonl (always "
                                  "written), several at once: tensorboard (RUN_DIR/tensorboard), wandb, mlflow. "
                                  "Their packages: pip install 'agentgrad[sinks]'. Each value is named "
                                  "<stage>/<key> (grpo/rollout/success_rate) at the record's step.")
    tensorboard_dir: str | None = Field(None, description="TensorBoard log directory (None: RUN_DIR/tensorboard).")
    wandb_project: str = Field("agentgrad", description="W&B project.")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="W&B mode: offline writes "
                                                     "RUN_DIR/wandb without a network (`wandb sync` uploads it "
                                                     "later); online needs a login.")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI (None: a local file store, "
                                            "RUN_DIR/mlruns; `mlflow ui --backend-store-uri RUN_DIR/mlruns`).")
    mlflow_experiment: str = Field("agentgrad", description="MLflow experiment name (created when missing).")
