"""LoRA adapters through PEFT (`model.lora.r > 0`; docs/scale-out.md).

The adapters are injected into the loaded HF model in place (`peft.get_peft_model`), so the model object every
other part holds (`LoadedModel.model`: the rollout engine, the learner, the critic) is the same one and runs the
adapted weights; the `PeftModel` wrapper is kept here only for what PEFT does for us (disable, save, load).
Only the adapters' A and B matrices require gradients, so only they reach the optimizer.

- The reference policy is the same model with its adapters disabled (`base_view`): no second copy in memory.
- Checkpoints hold the base model in plain HF format (the adapters stripped: `base_state_dict`) and the adapters
  in `adapter/` (PEFT's own format); `attach_lora(..., adapter_dir=)` resumes from them, `load_merged` loads such
  a checkpoint for inference with the adapters merged, `merged_state_dict` is the plain model an export writes.

peft is optional (`pip install 'agentgrad[lora]'`); it is imported only when LoRA is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentgrad.models.hf import ModelLoadError

ADAPTER_DIR = "adapter"  # inside a checkpoint directory: adapter_config.json + adapter_model.safetensors
BASE_LAYER = ".base_layer"  # PEFT's name for the wrapped original Linear inside a LoRA layer
MISSING_PEFT = "model.lora.r > 0 needs peft: pip install 'agentgrad[lora]'"


class LoraUnavailable(ModelLoadError):
    """peft is not installed (a ModelLoadError: the CLI prints it as one `error:` line)."""


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise LoraUnavailable(MISSING_PEFT) from exc
    return peft


def is_lora_key(key: str) -> bool:
    return ".lora_" in key


def base_key(key: str) -> str:
    """The HF model's own name of a (non-adapter) parameter of a LoRA-injected model."""
    return key.replace(BASE_LAYER, "")


class BaseModelView(torch.nn.Module):
    """The model with its adapters disabled, called like a model: the frozen reference. It owns no parameters
    (the model is not registered as a submodule), so its `state_dict` is empty and a checkpoint holds the base
    weights once, with the policy. Runs in eval mode (no dropout), as a deep-copied reference did."""

    def __init__(self, adapters: Adapters) -> None:
        super().__init__()
        object.__setattr__(self, "adapters", adapters)  # not a submodule: see above

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.adapters.model
        was_training = model.training
        model.eval()
        try:
            with self.adapters.disabled():
                return model(*args, **kwargs)
        finally:
            model.train(was_training)


@dataclass
class Adapters:
    """The LoRA adapters of `model` (the HF model itself, injected in place) and PEFT's wrapper around it."""

    model: torch.nn.Module
    peft_model: Any

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        return self.peft_model.disable_adapter()

    def base_view(self) -> BaseModelView:
        return BaseModelView(self)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """The base weights under the HF model's own names (what `from_pretrained` loads), adapters left out."""
        return {base_key(k): v for k, v in self.model.state_dict().items() if not is_lora_key(k)}

    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The base weights with every LoRA delta added (W + alpha/r * B @ A): a plain model that behaves as the
        adapted one."""
        state = self.base_state_dict()
        for name, module in lora_modules(self.model):
            key = f"{name}.weight"
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    state[key] = state[key] + module.get_delta_weight(adapter)
        return state

    def save_pretrained(self, directory: str | Path) -> None:
        """A checkpoint's model files: the base in HF format (loadable as a plain model) and `adapter/`."""
        directory = Path(directory)
        self.model.save_pretrained(directory, state_dict=self.base_state_dict())
        self.peft_model.save_pretrained(directory / ADAPTER_DIR)


def attach_lora(model: torch.nn.Module, *, r: int, alpha: float, dropout: float, target_modules: Sequence[str],
                adapter_dir: str | Path | None = None) -> Adapters:
    """Inject fresh LoRA adapters into `model` (B = 0, so the model's outputs are unchanged), or the saved ones in
    `adapter_dir` when it holds some (a resumed run). Freezes every non-adapter parameter."""
    peft = _peft()
    saved = Path(adapter_dir) if adapter_dir is not None else None
    if saved is not None and (saved / "adapter_config.json").is_file():
        wrapped = peft.PeftModel.from_pretrained(model, str(saved), is_trainable=True)
    else:
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                                 bias="none", task_type="CAUSAL_LM")
        wrapped = peft.get_peft_model(model, config)
    return Adapters(model=model, peft_model=wrapped)


def merge_saved_adapter(model: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """`model` (loaded from checkpoint `directory`) with the adapters saved there merged in; unchanged when the
    checkpoint has none (a full fine-tuning run). What `agentgrad eval` and `agentgrad export` load."""
    saved = Path(directory) / ADAPTER_DIR
    if not (saved / "adapter_config.json").is_file():
        return model
    peft = _peft()
    return peft.PeftModel.from_pretrained(model, str(saved)).merge_and_unload()


def lora_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "get_delta_weight"))
