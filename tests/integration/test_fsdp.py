"""The FSDP2 learner (backends/fsdp.py) under torchrun with 2 gloo processes on loopback gives the single-process
learner's losses, grad norms and updated weights on the same batch.

Tolerance: the forward is the same computation on all-gathered (bit-exact) weights, so the losses are compared
to 1e-6 relative; the gradients FSDP reduce-scatters are the mean of two identical gradients (exact in floating
point), but the clip's total norm is a sum of per-shard squares in another order, which moves the updated
weights by float rounding only: 2e-7 absolute after two AdamW steps at lr 1e-2 (a step moves a weight by up to
1e-2; measured max difference 1.2e-7). Except the key biases: attention's softmax is invariant to a bias added
to every key, so their true gradient is 0 and what they get is rounding noise, which AdamW divides by its own
tiny second moment; they are held to 1e-5 (measured 2.7e-6).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(HERE.parent / "unit"))

from fsdp_worker import LR, STEPS  # noqa: E402
from test_shared_prefix import _grouped_batch, _model  # noqa: E402

from agentgrad.algos.losses import sft_loss  # noqa: E402
from agentgrad.backends.hf import TorchLearner  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch was built without torch.distributed/gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process() -> dict:
    torch.set_num_threads(1)
    model = _model("qwen2")
    learner = TorchLearner(model, lr=LR)
    learner.lean = None  # the plain forward, as FSDP takes (the lean one differs by rounding)
    batch = _grouped_batch()
    losses, norms = [], []
    for _ in range(STEPS):
        loss = sft_loss(learner.logprobs(batch), batch.loss_mask)
        losses.append(loss.item())
        norms.append(learner.step(loss)["train/grad_norm"])
    return {"losses": losses, "grad_norms": norms, "state": model.state_dict()}


@pytest.mark.slow
def test_fsdp2_with_two_gloo_ranks_matches_the_single_process_learner(tmp_path):
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                           str(HERE / "fsdp_worker.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = torch.load(out, weights_only=False)
    threads = torch.get_num_threads()
    single = _single_process()
    torch.set_num_threads(threads)
    assert sharded["world_size"] == 2
    assert 0.45 < sharded["local_fraction"] < 0.55  # rank 0 held about half of the weights: really sharded
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5, abs=0)
    initial = _model("qwen2").state_dict()
    assert sharded["state"].keys() == single["state"].keys()
    for key, want in single["state"].items():
        got = sharded["state"][key]
        assert not torch.equal(want, initial[key]), key  # every tensor moved...
        atol = 1e-5 if key.endswith("k_proj.bias") else 2e-7
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=key)  # ...to the same place
