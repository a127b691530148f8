"""Config sections that live apart from config.py (to keep it readable): the base every section shares, the tiny
model's shape, an MCP server entry, and the mcts stage. `agentgrad.config` re-exports them; import from there."""

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


class MctsConfig(Section):
    """Stage `mcts` (docs/search.md): tree search over tool calls, distilled into the policy by BC and DPO."""

    iterations: int = Field(5, ge=0, description="Search/distil rounds.")
    trees_per_iteration: int = Field(16, gt=0, description="Tasks searched per round, one tree each, all at once "
                                     "(their candidate sampling shares one decode batch).")
    simulations: int = Field(16, gt=0, description="Simulations per tree (each selects one leaf by PUCT, restores "
                             "it by replay, and evaluates or expands it).")
    max_generated_tokens: int = Field(0, ge=0, description="Per-tree budget of generated tokens (every candidate "
                                      "sampled, pruned or not, and rollout turns); 0: none.")
    max_tool_calls: int = Field(0, ge=0, description="Per-tree budget of tool calls (replays that restore nodes "
                                "included); 0: none.")
    top_k: int = Field(5, ge=0, description="Children kept per expansion, ranked by the value model's estimate "
                       "(5 to 10 keeps trees small where dozens of calls are legal); 0: keep all.")
    samples_per_expansion: int = Field(8, gt=0, description="Candidate turns sampled per expanded node before "
                                       "de-duplication by (tool, normalised arguments).")
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
