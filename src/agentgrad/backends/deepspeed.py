"""DeepSpeed ZeRO learner (stage 2 or 3; docs/scale-out.md): `TorchLearner`'s scoring over a model that a
DeepSpeed engine partitions across the ranks of the default process group, with torch's AdamW as the (client)
optimizer, so its arithmetic is the single-process learner's. On CPU: `DS_ACCELERATOR=cpu`, gloo.

Same data plan as the FSDP learner (`backends/fsdp.py`): every rank scores the same batch (`broadcast_batch`), so
the averaged gradient is the single-process one. The plain HF forward (ZeRO-3 leaves each rank only a partition
of every weight until a module's hooks gather it; the lean forward reads weights directly).

Checkpoints hold the full weights and the AdamW state gathered into full tensors by parameter name, FSDP's layout,
not `engine.save_checkpoint`'s per-rank files: a run's checkpoint then loads on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from agentgrad.backends.hf import TorchLearner


def init_distributed(backend: str) -> None:
    """`deepspeed.init_distributed`, without the shared-memory all-reduce op on gloo. DeepSpeed builds that C++ op
    (a JIT compile with ninja and g++, 45-85 s once per 2-vCPU machine) whenever its
    CPU accelerator forms a group, but only its inference all-reduce uses it; training's collectives go through
    torch.distributed, so on CPU the op is marked incompatible and never built."""
    import deepspeed
    import deepspeed.ops

    if backend == "gloo":
        # a module __getattr__ probes every op once per process and keeps the dict, so marking it here holds
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)


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

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Full weights into the running engine, every rank the same: into the model's parameters (ZeRO-3
        gathers them, rank 0's copy is re-partitioned), then the optimizer's fp32 master partitions refreshed
        from them, or the next step would continue from the old masters."""
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=self.stage == 3):
            self.model.load_state_dict(state)
        self.optimizer.refresh_fp32_params()

    def _flat_groups(self) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
        """(parameters, this rank's flat fp32 partition of them): the tensors torch's AdamW keys its state by."""
        zero = self.optimizer
        if self.stage == 3:
            return list(zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat, strict=True))
        return list(zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True))

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The AdamW state gathered into full tensors keyed by parameter name, on the CPU of every rank (a
        collective): the layout of a full optimizer state dict as FSDP's `get_optimizer_state_dict` writes it,
        so it loads on any number of ranks. The fp32 masters are not in it: sharded learners run fp32 models
        (preflight), whose weights are the masters bit for bit (`load_weights` refreshes them)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        names, adam = {p: n for n, p in self.model.named_parameters()}, self.optimizer.optimizer.state
        state: dict[str, dict[str, Any]] = {}
        for params, flat in self._flat_groups():
            for p in params:
                entry = {}
                for key, value in adam.get(flat, {}).items():  # "step": one per flat group, every parameter's
                    if torch.is_tensor(value) and value.shape == flat.shape:
                        value = safe_get_full_optimizer_state(p, key)  # a collective: every rank, same order
                    entry[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                if entry:
                    state[names[p]] = entry
        (group,) = self.optimizer.param_groups  # __init__ builds one group of every trainable parameter
        return {"state": state, "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                                 | {"params": [names[p] for p in self.params]}]}

    def load_optimizer_state_dict(self, saved: Mapping[str, Any]) -> None:
        """`optimizer_state_dict`'s full state, written by any number of ranks, into this rank's partitions."""
        from deepspeed.utils import safe_set_full_optimizer_state

        (group,) = self.optimizer.param_groups
        (hyper,) = saved["param_groups"]
        group.update({k: v for k, v in hyper.items() if k != "params"})
        names, adam = {p: n for n, p in self.model.named_parameters()}, self.optimizer.optimizer.state
        if not saved["state"]:  # saved before the first step: AdamW starts over, as a fresh one would
            for _, flat in self._flat_groups():
                adam.pop(flat, None)
            self.optimizer._hp_optimizer_states_linked = False  # ZeRO-2: link the state the next step makes
            return
        missing = sorted(set(names.values()) - set(saved["state"]))
        if missing:  # a partial state would silently restart those weights' Adam moments at zero
            raise ValueError(f"optimizer state has no entry for {len(missing)} parameters (e.g. {missing[0]}): "
                             "a checkpoint of another model")
        for params, flat in self._flat_groups():
            target = adam.setdefault(flat, {})
            for key, value in saved["state"][names[params[0]]].items():
                if torch.is_tensor(value) and value.dim() > 0:  # partitioned below, parameter by parameter
                    target.setdefault(key, torch.zeros_like(flat))
                else:
                    target[key] = value.clone() if torch.is_tensor(value) else value
        if self.stage == 2:  # ZeRO-2 reads the state through per-parameter views it makes once, after a step
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()
        for params, flat in self._flat_groups():
            for p in params:
                for key, value in saved["state"][names[p]].items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        safe_set_full_optimizer_state(p, value.to(flat.device), key)

    def state_dict(self) -> dict[str, Any]:
        """Full weights and full optimizer state, the same on every rank (collectives: every rank calls it)."""
        return {"model": {k: v.cpu() for k, v in self.full_state_dict().items()},
                "optimizer": self.optimizer_state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.load_weights(state["model"])
        self.load_optimizer_state_dict(state["optimizer"])
