"""Config sections that live apart from config.py (to keep it readable): the base every section shares, the tiny
model's shape, an MCP server entry, ReST's section. `agentgrad.config` re-exports them; import from there."""

from __future__ import annotations

from typing import Literal

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


class RestConfig(Section):
    iterations: int = Field(3, ge=0, description="Grow/Improve iterations (ReST-EM gains most in the first few).")
    improve_from: Literal["start", "current"] = Field("start", description="Weights each Improve step fine-tunes: "
                                                      "'start', the policy the stage began with, with a fresh "
                                                      "optimizer (ReST-EM, Singh et al. 2023), so the set sampled "
                                                      "by the latest policy is all it learns from and errors do "
                                                      "not compound; 'current', the policy as the last Improve "
                                                      "left it (Gulcehre et al. 2023), which from BC starts fell "
                                                      "below its start over long runs (docs/algorithms.md).")
    tasks_per_iteration: int = Field(64, gt=0, description="Tasks sampled by each Grow step: with improve_from=start "
                                     "one Grow is all an Improve step learns from, so it must be large.")
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
    sft_steps: int = Field(32, ge=0, description="SFT optimizer steps per Improve step.")
    batch_size_episodes: int = Field(32, gt=0, description="Episodes per SFT step.")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate of the Improve steps.")
