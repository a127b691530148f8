"""DeepSpeed ZeRO learner (stage 2 or 3; docs/scale-out.md): `TorchLearner`'s scoring over a model that a
DeepSpeed engine partitions across the ranks of the default process group, with torch's AdamW as the (client)
optimizer, so its arithmetic is the single-process learner's. On CPU: `DS_ACCELERATOR=cpu`, gloo.

Same data plan as the FSDP learner (`backends/fsdp.py`): every rank scores the same batch (`broadcast_batch`), so
the averaged gradient is the single-process one. The plain HF forward (ZeRO-3 leaves each rank only a partition
of every weight until a module's hooks gather it; the lean forward reads weights directly).
"""

from __future__ import annotations

from typing import Any

import torch

from agentgrad.backends.hf import TorchLearner


def zero_config(stage: int, grad_clip: float, offload_optimizer: bool = False) -> dict[str, Any]:
    """The engine config: one micro-batch per step (the pipeline owns batching), ZeRO `stage`, the clip."""
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # torch's AdamW, on purpose: the single-process arithmetic
            "steps_per_print": 2**62, "wall_clock_breakdown": False}


class DeepSpeedLearner(TorchLearner):
    """AdamW under a DeepSpeed ZeRO engine. Every rank must make the same calls with the same batch."""

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), max_buckets: int = 4, stage: int = 2,
                 offload_optimizer: bool = False) -> None:
        import deepspeed

        if stage not in (2, 3):
            raise ValueError(f"ZeRO stage {stage}: 2 or 3")
        self.model = model
        self.tool_head = None
        self.max_buckets = max_buckets
        self.lean = None
        self.grad_clip = grad_clip
        self.stage = stage
        self.params = [p for p in model.parameters() if p.requires_grad]
        client = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=client, config=zero_config(stage, grad_clip, offload_optimizer))

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        if loss is not None:
            self.engine.backward(loss)
        self.engine.step()  # clip by the global norm, AdamW on this rank's partition, zero the gradients
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = not torch.isfinite(torch.tensor(grad_norm))
        return {"train/grad_norm": grad_norm, "train/skipped_steps": float(skipped)}

    def full_state_dict(self, on_device: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded weights on every rank, on the model's device (ZeRO-3 gathers its partitions for the
        copy); `on_device` is FSDPLearner's option, always true here."""
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.stage == 3):
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("DeepSpeed checkpoints (engine.save_checkpoint) are not wired yet")

    def load_state_dict(self, state: Any) -> None:
        raise NotImplementedError("DeepSpeed checkpoints (engine.load_checkpoint) are not wired yet")
