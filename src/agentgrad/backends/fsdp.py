"""FSDP2 learner (`learner.backend=fsdp`; docs/scale-out.md): `TorchLearner`'s scoring and step over a model
whose parameters, gradients and AdamW state are sharded across the ranks of the default process group with
`torch.distributed.fsdp.fully_shard` (one unit per decoder layer, one for the rest). gloo on CPU, nccl on GPU.

The data plan is the simplest one that is exact: every rank scores the *same* batch (the one rank 0's rollouts
produced, broadcast with `broadcast_batch`), so FSDP's averaged reduce-scatter of identical gradients is the
single-process gradient, and any loss computed from the logprobs is the single-process loss. What sharding buys
here is memory (each rank holds 1/world of the weights, gradients and optimizer state), not throughput; splitting
rows across ranks needs every loss aggregation normalised by global counts (not done).

The lean forward (`backends/lean.py`) reads weights directly and would see shards: this learner takes the plain
HF forward (module hooks gather each layer's weights). Weights for generation come from `full_state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from agentgrad.backends.hf import TorchLearner
from agentgrad.batch import TokenBatch
from agentgrad.models.hf import model_parts


def shard_model(model: torch.nn.Module, device_type: str = "cpu") -> torch.nn.Module:
    """Shard `model` in place across the default process group: each decoder layer its own FSDP unit (gathered
    only while it runs), then the root (embeddings, final norm, lm head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    body, _ = model_parts(model)
    for layer in body.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the total grad norm FSDP's clip returns), a plain tensor as is."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value


class FSDPLearner(TorchLearner):
    """AdamW on an FSDP2-sharded model. Every rank must make the same calls with the same batch (collectives)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), max_buckets: int = 4, device_type: str = "cpu") -> None:
        if not dist.is_initialized():
            raise RuntimeError("learner.backend=fsdp needs torch.distributed initialised (torchrun, or "
                               "agentgrad train learner.world_size=N)")
        shard_model(model, device_type)
        super().__init__(model, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, betas=betas,
                         max_buckets=max_buckets)
        self.lean = None  # the plain forward: FSDP's hooks gather a layer's weights as it runs

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        if loss is not None:
            loss.backward()
        grad_norm = _local(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or math.inf))
        skipped = not torch.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": float(grad_norm), "train/skipped_steps": float(skipped)}

    def full_state_dict(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded weights (on CPU, every rank): what a checkpoint or the generation copy receives.
        `on_device` (the weight sync) with one process: left on the model's device, so a sync on a GPU is one
        device copy instead of two trips through host memory (the 0.5B preset on an H200: 1.3 s per update
        through the CPU, measured). With several processes the gather stays on the CPU: on-device, every rank
        would hold the whole model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        offload = not (on_device and dist.get_world_size() == 1)
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))

    def state_dict(self) -> dict[str, Any]:
        """Full weights and optimizer state, a snapshot: torch hands out AdamW's step counters themselves (0-dim
        tensors the next step increments), so they are cloned."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return {"model": self.full_state_dict(), "optimizer": _own_containers(optimizer, clone_scalars=True)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        # torch replaces the entries of the dicts it is given with DTensors: give it containers of its own
        set_model_state_dict(self.model, dict(state["model"]), options=options)
        set_optimizer_state_dict(self.model, self.optimizer, _own_containers(state["optimizer"]), options=options)


def _own_containers(obj: Any, clone_scalars: bool = False) -> Any:
    """`obj`'s nested dicts and lists copied (tensors shared, 0-dim ones cloned with `clone_scalars`)."""
    if isinstance(obj, Mapping):
        return {k: _own_containers(v, clone_scalars) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own_containers(v, clone_scalars) for v in obj]
    if clone_scalars and isinstance(obj, torch.Tensor) and obj.dim() == 0:
        return obj.clone()
    return obj


def broadcast_batch(batch: TokenBatch | None, src: int = 0) -> TokenBatch:
    """Rank `src`'s batch on every rank (the others pass None): how the ranks that do not roll out join an
    update on rank 0's rollouts."""
    box = [batch if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)  # pickled: the batch is a frozen record of CPU tensors
    return box[0]
