"""One rank of test_fsdp.py's run under torchrun: two steps of the FSDP2 learner on the shared test batch (rank 0
builds it, the others receive it), then rank 0 writes losses, grad norms and the full weights to argv[1]."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))

from test_shared_prefix import _grouped_batch, _model

from agentgrad.algos.losses import sft_loss
from agentgrad.backends.fsdp import FSDPLearner, broadcast_batch

STEPS = 2
LR = 1e-2


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = _model("qwen2")  # seeded: the same initial weights on every rank and in the test
    full_numel = sum(p.numel() for p in model.parameters())
    learner = FSDPLearner(model, lr=LR)
    local_numel = sum(p.to_local().numel() for p in model.parameters())  # DTensors now: this rank's shards
    batch = broadcast_batch(_grouped_batch() if dist.get_rank() == 0 else None)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = sft_loss(learner.logprobs(batch), batch.loss_mask)
        losses.append(loss.item())
        norms.append(learner.step(loss)["train/grad_norm"])
    state = learner.full_state_dict()
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "grad_norms": norms, "state": state,
                    "world_size": dist.get_world_size(),
                    "local_fraction": local_numel / full_numel}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
