"""One rank of test_sharded_learners.py's run under torchrun: two steps of a sharded learner (argv[1]: fsdp, zero2
or zero3) on the shared test batch (rank 0 builds it, the others receive it), then the checkpoint round trip
(`round_trip`); rank 0 writes losses, grad norms, the full weights and the round trip's results to argv[2]."""

import io
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))

from test_shared_prefix import _grouped_batch, _model

from agentgrad.algos.losses import sft_loss
from agentgrad.backends.fsdp import broadcast_batch
from agentgrad.pipelines.launch import end_rank_process, leave_processes

STEPS = 2
LR = 1e-2
STEPS_AFTER_RESTORE = 2


def make_learner(backend: str, model: torch.nn.Module):
    if backend == "fsdp":
        from agentgrad.backends.fsdp import FSDPLearner

        return FSDPLearner(model, lr=LR)
    from agentgrad.backends.deepspeed import DeepSpeedLearner

    return DeepSpeedLearner(model, lr=LR, stage=int(backend.removeprefix("zero")))


def local_numel(backend: str, learner) -> int:
    """Parameters this rank holds: FSDP's DTensor shards, ZeRO-3's partitions, ZeRO-2's fp32 optimizer partition."""
    params = list(learner.model.parameters())
    if backend == "fsdp":
        return sum(p.to_local().numel() for p in params)
    if backend == "zero3":
        return sum(p.ds_tensor.numel() for p in params)
    return sum(t.numel() for t in learner.optimizer.single_partition_of_fp32_groups)


def main(backend: str, out: str) -> None:
    torch.set_num_threads(1)
    if backend == "fsdp":
        dist.init_process_group("gloo")
    else:
        from agentgrad.backends.deepspeed import init_distributed

        init_distributed("gloo")
    model = _model("qwen2")  # seeded: the same initial weights on every rank and in the test
    full_numel = sum(p.numel() for p in model.parameters())
    learner = make_learner(backend, model)
    batch = broadcast_batch(_grouped_batch() if dist.get_rank() == 0 else None)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = sft_loss(learner.logprobs(batch), batch.loss_mask)
        losses.append(loss.item())
        norms.append(learner.step(loss)["train/grad_norm"])
    state = learner.full_state_dict()
    local_fraction = local_numel(backend, learner) / full_numel
    resumed = round_trip(backend, learner, batch)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "grad_norms": norms, "state": state, "world_size": dist.get_world_size(),
                    "local_fraction": local_fraction, "resume": resumed, "shm_op": shm_op_built(backend)}, out)
    dist.barrier()  # rank 0's file is written before any rank ends
    leave_processes()
    end_rank_process()  # without the interpreter's finalization, as a run's ranks end (its docstring says why)


def shm_op_built(backend: str) -> bool:
    """Whether DeepSpeed built its shared-memory all-reduce op (agentgrad.backends.deepspeed.init_distributed
    keeps it from being compiled on gloo)."""
    if backend == "fsdp":
        return False
    from deepspeed.comm import comm

    return comm.cdb.shm_comm_op is not None


def to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def same(a, b) -> bool:
    """Equal nested dicts / lists / tensors (tensors bit for bit, DTensors never equal to plain ones)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def round_trip(backend: str, learner, batch) -> dict:
    """`learner`'s `state_dict()` (after its STEPS steps) loaded into a fresh learner built from the initial
    weights, then STEPS_AFTER_RESTORE more steps of both on the same batch: the saved state, the restored
    learner's own state_dict right after loading, both learners' losses and final weights."""
    # through bytes, as a run's checkpoint goes through a file that every rank loads: rank 0's state (FSDP's is
    # empty elsewhere)
    held = learner.state_dict()  # kept in memory: the steps below and the load must leave it as it was
    box = [to_bytes(held)]
    dist.broadcast_object_list(box, src=0)
    saved = torch.load(io.BytesIO(box[0]), weights_only=False)
    restored = make_learner(backend, _model("qwen2"))  # the initial weights and a fresh AdamW
    restored.load_state_dict(saved)
    untouched = all(type(v) is torch.Tensor for v in saved["model"].values())
    reloaded = torch.load(io.BytesIO(to_bytes(restored.state_dict())), weights_only=False)  # before more steps
    losses = {"continued": [], "restored": []}
    for _ in range(STEPS_AFTER_RESTORE):
        for name, which in (("continued", learner), ("restored", restored)):
            loss = sft_loss(which.logprobs(batch), batch.loss_mask)
            losses[name].append(loss.item())
            which.step(loss)
    # a snapshot: equal, value for value, to the bytes written before the steps (rank 0 holds FSDP's state)
    snapshot = dist.get_rank() != 0 or same(held, torch.load(io.BytesIO(box[0]), weights_only=False))
    return {"saved": torch.load(io.BytesIO(box[0]), weights_only=False), "reloaded": reloaded, "losses": losses,
            "snapshot": snapshot, "untouched_by_load": untouched,
            "states": {"continued": learner.full_state_dict(), "restored": restored.full_state_dict()}}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
