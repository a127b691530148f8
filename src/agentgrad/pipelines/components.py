"""Build the pieces a run needs from its config. The only place (with cli.py) that wires packages together."""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentgrad.backends.base import Learner
from agentgrad.backends.hf import HFPolicy, TorchLearner
from agentgrad.backends.precision import ComputeDtype, resolve_compute_dtype
from agentgrad.batch import TokenBatch, collate
from agentgrad.config import Config, ModelConfig, RolloutConfig
from agentgrad.envs import TaskSuite
from agentgrad.envs import make_suite as build_suite
from agentgrad.logging import ProgressDisplay, ProgressFn, no_progress
from agentgrad.models.factored_head import FactoredToolHead
from agentgrad.models.hf import LoadedModel, ModelLoadError, load_model
from agentgrad.models.lora import ADAPTER_DIR, Adapters, attach_lora, merge_saved_adapter
from agentgrad.rewards.base import RewardFn, load_reward
from agentgrad.rollout.chat import INCREMENTAL_HINT, ChatCodec, ChatTemplateError
from agentgrad.rollout.copying import CopySpec
from agentgrad.rollout.factored import HEAD_DECIDES
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings
from agentgrad.types import Message, ScoredTrajectory, Trajectory


@dataclass
class Components:
    config: Config
    suite: TaskSuite
    loaded: LoadedModel
    codec: ChatCodec
    policy: HFPolicy
    learner: Learner  # TorchLearner, or backends.distributed.ShardedLearner
    reward_fn: RewardFn
    limits: EpisodeLimits
    sampler: SamplerSettings
    tool_head: FactoredToolHead | None = None  # rollout.action_head=factored|category: also `policy.tool_head`
    model_dir: str | None = None  # where the model was loaded from (Ray rollout workers load its config/tokenizer)
    run_dir: str | None = None  # the run's directory (a vLLM server the run starts logs there)
    rollout_runner: Any = None  # rollout.backend=ray: the driver, started at the first rollout (rollout_backend.py)
    sampling_replica: Any = None  # rollout.max_staleness > 0, local: (policy, codec) on a copy of the model
    adapters: Adapters | None = None  # model.lora.r > 0: injected into loaded.model, which policy and learner share

    @property
    def pad_token_id(self) -> int:
        return self.loaded.pad_token_id

    @property
    def device(self) -> torch.device:
        """Where the model (and so every batch the learner scores) lives."""
        return next(self.loaded.model.parameters()).device

    def collate(self, samples: Sequence[ScoredTrajectory | Trajectory], **options: Any) -> TokenBatch:
        """The learner's batch: `batch.collate` pads on the CPU, then the batch moves to the model's device (a
        no-op on CPU). Every stage builds its batches here, so none reaches a CUDA model from the CPU."""
        return collate(samples, pad_token_id=self.pad_token_id, **options).to(self.device)

    @property
    def saved_model(self) -> Any:
        """What a checkpoint's `save_pretrained` writes: the model, or under LoRA the base plus `adapter/`."""
        return self.adapters if self.adapters is not None else self.loaded.model

    def frozen_reference(self) -> torch.nn.Module:
        """The policy frozen as a stage starts (a copy); under LoRA the same model with its adapters disabled
        (the base model: no second copy in memory)."""
        if self.adapters is not None:
            return self.adapters.base_view()
        return copy.deepcopy(self.loaded.model).eval().requires_grad_(False)


def make_suite(config: Config) -> TaskSuite:
    e = config.env
    return build_suite(e.name, e.options, mcp_servers=e.mcp_servers)


def episode_limits(config: Config) -> EpisodeLimits:
    r = config.rollout
    return EpisodeLimits(max_turns=r.max_turns, max_new_tokens_per_turn=r.max_new_tokens_per_turn,
                         max_total_tokens=r.max_total_tokens, max_invalid_calls=r.max_invalid_calls,
                         repeated_call_limit=r.repeated_call_limit)


def sampler_settings(config: Config) -> SamplerSettings:
    r = config.rollout
    return SamplerSettings(max_concurrent_episodes=r.max_concurrent_episodes, tool_workers=r.tool_workers,
                           deterministic_schedule=r.deterministic_schedule, tool_name_mask=r.tool_name_mask,
                           action_head=r.action_head, waiting_episodes=r.waiting_episodes,
                           tool_wait_steps=r.tool_wait_steps, copy_args=CopySpec.parse(r.copy_args, r.copy_literals))


def _render_expert_transcripts(suite: TaskSuite, n: int, seed: int, template: str | None = None,
                               progress: ProgressFn = no_progress, **template_vars: Any) -> list[str]:
    """Expert chats rendered with a chat template (the tiny one by default): the tokenizer's training corpus.
    Rendered as HF does (trim_blocks, lstrip_blocks, its tojson), before any tokenizer exists."""
    import json

    import jinja2

    from agentgrad.models.chat_templates import TINY_TEMPLATE

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template or TINY_TEMPLATE)
    texts = []
    for task in suite.sample_tasks(n, split="train", seed=seed + 7):
        senv = suite.make_env()
        obs, info = senv.reset(seed=0, options={"task": task})
        msgs: list[Message] = [Message("system", info.get("system", "")), Message("user", obs)]
        for action in suite.expert_actions(task):
            out = senv.step(action)
            if hasattr(action, "arguments"):
                msgs += [Message("assistant", "", tool_calls=(action,)), Message("tool", out[0])]
            else:
                msgs.append(Message("assistant", action.text))
        texts.append(compiled.render(messages=[m.to_chat() for m in msgs], tools=info["tools"],
                                     add_generation_prompt=False, **template_vars))
        progress(len(texts), None)
    return texts


def _template_vars(config: Config) -> dict[str, Any]:
    """What the chat template gets besides the chat: `enable_thinking` when the config sets it."""
    thinking = config.model.enable_thinking
    return {} if thinking is None else {"enable_thinking": thinking}


def build_tiny_model_dir(config: Config, suite: TaskSuite, directory: Path,
                         display: ProgressDisplay | None = None) -> Path:
    from agentgrad.models.chat_templates import TEMPLATE_FAMILIES
    from agentgrad.models.tiny import TINY_BUILD_PHASES, save_tiny_model

    if (directory / "config.json").exists():
        return directory
    display = display or ProgressDisplay(enabled=False)
    t = config.model.tiny
    family = "tiny" if config.model.chat_template == "auto" else config.model.chat_template
    fam = TEMPLATE_FAMILIES.get(family)
    extra = {"bos_token": fam.bos_token, **_template_vars(config)} if family != "tiny" else {}
    with display.track("tiny model: tokenizer corpus", t.tokenizer_corpus_episodes) as progress:
        corpus = _render_expert_transcripts(suite, t.tokenizer_corpus_episodes, config.run.seed,
                                            None if family == "tiny" else fam.template, progress=progress, **extra)
    with display.track("tiny model: tokenizer, weights, save", len(TINY_BUILD_PHASES)) as progress:
        return save_tiny_model(directory, corpus, vocab_size=t.vocab_size, seed=config.run.seed, family=family,
                               word_spaces=t.word_spaces,
                               hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                               num_kv_heads=t.num_kv_heads, intermediate_size=t.intermediate_size,
                               init_std=t.init_std, max_positions=t.max_positions, progress=progress)


TOOL_HEAD_FILE = "tool_head.pt"


def make_tool_head(config: Config, suite: TaskSuite, loaded: LoadedModel, path: str | Path | None
                   ) -> FactoredToolHead | None:
    """The factored head over the suite's tool catalog (rollout.action_head=factored or category): the one saved
    beside the model at `path` if there is one, else a fresh one."""
    if config.rollout.action_head == "tokens":
        return None
    decides = HEAD_DECIDES[config.rollout.action_head]
    saved = Path(path) / TOOL_HEAD_FILE if path is not None else None
    if saved is not None and saved.exists():
        head = FactoredToolHead.load(saved)
        if head.decides != decides:
            raise ModelLoadError(f"{saved} holds a head that decides a {head.decides}, but rollout.action_head="
                                 f"{config.rollout.action_head} needs one that decides a {decides}")
    else:
        tools = suite.make_env().tools
        head = FactoredToolHead(loaded.model.config.hidden_size, [(n, tools.get(n).category) for n in tools.names],
                                decides=decides)
    return head.to(next(loaded.model.parameters()).device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def quiet_hf() -> None:
    """Our own progress display replaces transformers' per-file bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def chat_codec(loaded: LoadedModel, model: ModelConfig | None = None) -> ChatCodec:
    """The codec of a loaded model under `model` (chat_template, enable_thinking, tool_format; None: the model's
    own template and format). The template must be incremental (rollout/chat.py: check_incremental): with
    chat_template=auto a Qwen3 template is swapped for the incremental variant, any other that is not raises
    ChatTemplateError saying where its prefix changes. The tokenizer keeps the template used, so checkpoints
    carry it."""
    from agentgrad.models.chat_templates import TEMPLATE_FAMILIES, chat_template_text, is_qwen3_template

    tok = loaded.tokenizer
    choice = "auto" if model is None else model.chat_template
    if choice != "auto":
        tok.chat_template = chat_template_text(choice)
        _check_vocab(tok, choice)
    kwargs = {} if model is None or model.enable_thinking is None else {"enable_thinking": model.enable_thinking}
    fmt = "auto" if model is None else model.tool_format

    def codec() -> ChatCodec:
        return ChatCodec(tok, loaded.eos_token_ids, template_kwargs=kwargs, tool_format=fmt)

    found = codec().check()
    if found and choice == "auto" and is_qwen3_template(tok.chat_template):
        warnings.warn(f"the model's Qwen3 chat template is not incremental ({found[0].step}); using agentgrad's "
                      "incremental variant (model.chat_template=qwen3, docs/chat-templates.md)", stacklevel=2)
        tok.chat_template = TEMPLATE_FAMILIES.get("qwen3").template
        found = codec().check()
    if found:
        raise ChatTemplateError(f"the chat template is not incremental: {found[0]}\n{INCREMENTAL_HINT}")
    return codec()


def _check_vocab(tokenizer: Any, family: str) -> None:
    from agentgrad.models.chat_templates import TEMPLATE_FAMILIES

    if family not in TEMPLATE_FAMILIES:
        return
    vocab = tokenizer.get_vocab()
    missing = [t for t in TEMPLATE_FAMILIES.get(family).required if t not in vocab]
    if missing:
        raise ModelLoadError(f"model.chat_template={family}: the vocabulary lacks {', '.join(missing)}")


def inference(loaded: LoadedModel, model: ModelConfig | None = None,
              rollout: RolloutConfig | None = None) -> tuple[HFPolicy, ChatCodec]:
    """The sampling side of a loaded model: what training rollouts and `agentgrad eval` both use."""
    return sampling_policy(loaded, loaded.model, rollout), chat_codec(loaded, model)


def sampling_policy(loaded: LoadedModel, model: torch.nn.Module, rollout: RolloutConfig | None) -> HFPolicy:
    """An `HFPolicy` over `model` (the loaded one, or a replica of it) with the rollout section's engine options."""
    rollout = rollout or RolloutConfig()
    return HFPolicy(model, eos_token_ids=loaded.eos_token_ids, pad_token_id=loaded.pad_token_id,
                    batch_invariant=rollout.batch_invariant, native_attention=rollout.native_attention)


def make_learner(config: Config, loaded: LoadedModel, path: str, head: FactoredToolHead | None,
                 compute: ComputeDtype) -> Learner:
    """learner.backend=torch: AdamW on the model generation uses. fsdp/deepspeed: a sharded copy of it, the
    other ranks following (backends/distributed.py), weights synced into `loaded.model` after every update."""
    if config.learner.backend == "torch":
        return TorchLearner(loaded.model, lr=config.algo.lr, grad_clip=config.algo.grad_clip, tool_head=head,
                            head_detached=config.bc.head_grad == "detached", compute=compute)
    from agentgrad.backends.distributed import ShardedLearner, ShardedSpec
    from agentgrad.pipelines.launch import init_processes, uses_cuda

    init_processes(config)  # a no-op under a launcher, which already joined the group
    le = config.learner
    spec = ShardedSpec(backend=le.backend, lr=config.algo.lr, grad_clip=config.algo.grad_clip,
                       zero_stage=le.zero_stage, offload_optimizer=le.offload_optimizer,
                       device_type="cuda" if uses_cuda(config) else "cpu")
    return ShardedLearner(loaded.model, spec, model_path=path, dtype=config.model.dtype, device=config.model.device)


def build_components(config: Config, run_dir: Path, *, model_path: str | Path | None = None,
                     display: ProgressDisplay | None = None) -> Components:
    """`model_path` (a resumed run's checkpoint) overrides config.model.path."""
    quiet_hf()
    torch.set_num_threads(config.run.threads)
    seed_everything(config.run.seed)
    suite = make_suite(config)
    display = display or ProgressDisplay(enabled=False)
    path = model_path or config.model.path or build_tiny_model_dir(config, suite, run_dir / "base-model", display)
    with display.track(f"loading model {path}"):  # a real checkpoint: a spinner while it reads the weights
        loaded = load_model(path, dtype=config.model.dtype, device=config.model.device)
    lora = config.model.lora
    adapters = None
    if lora.r > 0:  # before the learner: only the adapters require gradients, so only they reach its optimizer
        adapters = attach_lora(loaded.model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                               target_modules=lora.target_modules, adapter_dir=Path(path) / ADAPTER_DIR)
    else:  # a LoRA run's checkpoint trained on in full: its adapters merged in, not dropped
        loaded.model = merge_saved_adapter(loaded.model, path)
    policy, codec = inference(loaded, config.model, config.rollout)
    head = make_tool_head(config, suite, loaded, path)
    policy.tool_head = head
    # BC sets its own learning rate every step (bc_lr); RL sets algo.lr when it starts.
    compute = resolve_compute_dtype(config.model.compute_dtype, config.model.device)
    if config.model.compute_dtype != "fp32":
        display.print(compute.note)
    learner = make_learner(config, loaded, str(path), head, compute)
    return Components(config=config, suite=suite, loaded=loaded, codec=codec, policy=policy, learner=learner,
                      reward_fn=load_reward(config.reward.name, suite, **config.reward.options),
                      limits=episode_limits(config), sampler=sampler_settings(config), tool_head=head,
                      model_dir=str(path), run_dir=str(run_dir), adapters=adapters)
