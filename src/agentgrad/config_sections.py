"""Config sections that live apart from config.py (to keep it readable): the base every section shares, the tiny
model's shape, LoRA, and an MCP server entry. `agentgrad.config` re-exports them; import from there."""

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
