"""A sharded learner inside a run (`learner.backend=fsdp|deepspeed`; docs/scale-out.md, "Training").

Rank 0 runs the whole pipeline (rollouts, rewards, losses, the run directory) with a `ShardedLearner` in place
of `TorchLearner`; every other rank runs `follow`, which does what rank 0's learner tells it. The Learner
protocol is the seam: each call that is a collective of the sharded learner (a forward, a step, gathering the
weights or the optimizer state) is first broadcast to the other ranks as a command with its arguments (the
batch, the temperature, ...), then run on every rank.

The loss is pipeline code that only rank 0 runs. What the other ranks need of it is its gradient with respect to
the logprobs they computed themselves: rank 0 takes d loss / d logprobs for every logprobs tensor handed out
since the last step (`torch.autograd.grad`) and broadcasts those (B, T) tensors; every rank then backpropagates
`sum(logprobs * grad)`, whose gradient is the loss's by the chain rule, so every rank's FSDP/ZeRO backward is the
same collective over the same graph.

Generation on rank 0 runs on a separate, unsharded copy of the model (the engine's lean decoder reads weights
directly and cannot read shards): after every update the learner gathers the full weights (`full_state_dict`)
and loads them into that copy (`version` counts the syncs). Rank 0 thus holds the full weights twice plus its
shard; the other ranks hold only their shards.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agentgrad.batch import TokenBatch


@dataclass(frozen=True)
class ShardedSpec:
    """What every rank needs to build the same sharded learner (sent with the model's path)."""

    backend: str  # fsdp | deepspeed
    lr: float
    grad_clip: float
    zero_stage: int = 2
    offload_optimizer: bool = False
    device_type: str = "cpu"


class Channel:
    """Rank 0's commands to the other ranks: pickled tuples broadcast over the default process group."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()

    def send(self, *message: Any) -> None:
        if self.world_size > 1:
            dist.broadcast_object_list([message], src=0)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def make_sharded(model: torch.nn.Module, spec: ShardedSpec) -> Any:
    if spec.backend == "fsdp":
        from agentgrad.backends.fsdp import FSDPLearner

        return FSDPLearner(model, lr=spec.lr, grad_clip=spec.grad_clip, device_type=spec.device_type)
    from agentgrad.backends.deepspeed import DeepSpeedLearner

    return DeepSpeedLearner(model, lr=spec.lr, grad_clip=spec.grad_clip, stage=spec.zero_stage,
                            offload_optimizer=spec.offload_optimizer)


def surrogate(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """A scalar whose gradient is the loss's: sum over outputs of <output, d loss / d output>."""
    terms = [(out * g.to(out.device)).sum() for out, g in zip(outputs, grads, strict=True) if g is not None]
    return torch.stack(terms).sum() if terms else None


class _Replica:
    """The state every rank keeps: the sharded learner and the logprobs it handed out since the last step."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner
        self.outputs: list[torch.Tensor] = []

    def logprobs(self, batch: TokenBatch, temperature: float, grad: bool) -> torch.Tensor:
        device = next(self.learner.model.parameters()).device  # this rank's (the batch travels on the CPU)
        with torch.set_grad_enabled(grad):
            out = self.learner.logprobs(batch.to(device), temperature=temperature)  # (B, T)
        if out.requires_grad:
            self.outputs.append(out)
        return out

    def step(self, grads: Sequence[torch.Tensor | None] | None) -> dict[str, float]:
        loss = surrogate(self.outputs, grads) if grads is not None else None
        self.outputs = []
        return dict(self.learner.step(loss))

    def run(self, command: str, args: tuple) -> Any:
        """A command rank 0 sent (`follow`), or rank 0's own call of it."""
        if command == "logprobs":
            return self.logprobs(*args)
        if command == "step":
            return self.step(*args)
        if command == "full_state_dict":
            return self.learner.full_state_dict(*args)
        if command == "set_lr":
            return self.learner.set_lr(*args)
        if command == "drop":
            self.outputs = []
            return self.learner.optimizer.zero_grad(set_to_none=True)
        if command == "optimizer_state":
            return optimizer_state(self.learner)
        if command == "load_optimizer_state":
            return load_optimizer_state(self.learner, *args)
        if command == "load_weights":
            return load_weights(self.learner, *args)
        raise ValueError(f"unknown learner command {command!r}")


def optimizer_state(learner: Any) -> dict[str, Any]:
    """The full (gathered) optimizer state on rank 0 (FSDP: empty elsewhere; DeepSpeed: on every rank)."""
    if hasattr(learner, "engine"):
        return learner.optimizer_state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(learner.model, learner.optimizer, options=options)


def load_optimizer_state(learner: Any, state: Mapping[str, Any]) -> None:
    if hasattr(learner, "engine"):
        return learner.load_optimizer_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(learner.model, learner.optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


def load_weights(learner: Any, state: Mapping[str, torch.Tensor]) -> None:
    if hasattr(learner, "engine"):
        return learner.load_weights(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(learner.model, dict(state), options=StateDictOptions(full_state_dict=True))


class ShardedOptimizer:
    """What the pipeline and checkpoints use of `learner.optimizer`, for a sharded learner: the learning rate,
    dropping a skipped update's gradients, and the full optimizer state (gathered to rank 0, restored on all)."""

    def __init__(self, owner: ShardedLearner) -> None:
        self.owner = owner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.owner.replica.learner.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.owner.call("drop")

    def state_dict(self) -> dict[str, Any]:
        return self.owner.call("optimizer_state")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.owner.call("load_optimizer_state", state)


class ShardedLearner:
    """Rank 0's learner (the Learner protocol): each call is sent to the other ranks, then run here too. After
    every step the gathered weights go into `generation_model` (versioned weight sync)."""

    tool_head = None  # the factored head is not supported by sharded learners (preflight says so)

    def __init__(self, generation_model: torch.nn.Module, spec: ShardedSpec, *, model_path: str, dtype: str,
                 device: str) -> None:
        self.channel = Channel()
        self.channel.send("build", spec, model_path, dtype, device)  # the other ranks load the same weights
        self.generation_model = generation_model
        self.model = copy.deepcopy(generation_model)  # the copy that gets sharded; generation keeps the original
        self.replica = _Replica(make_sharded(self.model, spec))
        self.optimizer = ShardedOptimizer(self)
        self.version = 0
        """Weight syncs so far: the generation copy holds the weights of update number `version`."""

    def call(self, command: str, *args: Any) -> Any:
        self.channel.send(command, *args)
        return self.replica.run(command, args)

    def logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor:
        # on the CPU: a CUDA tensor unpickles onto the sender's device index, not the receiving rank's GPU
        return self.call("logprobs", batch.to("cpu"), temperature, torch.is_grad_enabled())  # (B, T)

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        outputs = self.replica.outputs
        grads = None
        if loss is not None:
            found = torch.autograd.grad(loss, outputs, allow_unused=True, retain_graph=True) if outputs else ()
            grads = [g.detach().cpu() if g is not None else None for g in found]  # each (B, T) like its output
        metrics = self.call("step", grads)
        started = time.perf_counter()
        self.sync_weights()
        return metrics | {"perf/weight_sync_s": time.perf_counter() - started}

    def sync_weights(self) -> None:
        """Gather the updated weights (a collective) into the generation copy."""
        full = self.call("full_state_dict", True)  # on_device: see FSDPLearner.full_state_dict
        result = self.generation_model.load_state_dict(full, strict=False)
        tied = getattr(getattr(self.generation_model, "config", None), "tie_word_embeddings", False)
        missing = set(result.missing_keys) - ({"lm_head.weight"} if tied else set())  # a tied head listed once
        if missing or result.unexpected_keys:
            raise RuntimeError(f"weight sync: the gathered weights miss {sorted(missing)} and have unexpected "
                               f"{sorted(result.unexpected_keys)}")
        self.version += 1

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Weights set from outside (BC handing on its best check): into the shards and the generation copy."""
        self.call("load_weights", {k: v.detach().cpu() for k, v in state.items()})
        self.generation_model.load_state_dict(state)

    def set_lr(self, lr: float) -> None:
        self.call("set_lr", lr)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.call("full_state_dict"), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.load_weights(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def stop(self) -> None:
        """Release the other ranks from `follow`."""
        self.channel.send("stop")


def follow(load_model: Any) -> None:
    """The loop of every rank but 0: build the learner rank 0 builds (`load_model(path, dtype, device)` -> the
    model), then run its commands until "stop"."""
    channel = Channel()
    command, *args = channel.receive()
    if command == "stop":
        return
    if command != "build":
        raise RuntimeError(f"expected the learner's build command, got {command!r}")
    spec, model_path, dtype, device = args
    replica = _Replica(make_sharded(load_model(model_path, dtype, device), spec))
    while True:
        command, *args = channel.receive()
        if command == "stop":
            return
        replica.run(command, tuple(args))
