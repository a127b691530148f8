"""The sharded learners under torchrun with 2 gloo processes on loopback give the single-process learner's
losses, grad norms and updated weights on the same batch: FSDP2 (backends/fsdp.py) and DeepSpeed ZeRO-2 and
ZeRO-3 (backends/deepspeed.py, DS_ACCELERATOR=cpu; skipped without the deepspeed extra).

Tolerance: the forward is the same computation on gathered (bit-exact) weights, so the losses are compared to
1e-6 relative; the gradients are the mean of two identical gradients (exact in floating point), but the clip's
total norm is a sum of per-shard squares in another order (grad norms to 1e-5 relative), which moves updated
weights by float rounding: FSDP2 and ZeRO-2 to 2e-7 absolute after two AdamW steps at lr 1e-2 (a step moves a
weight by up to 1e-2; measured max 1.2e-7 for both). AdamW divides a gradient by its own root mean square, so an
element whose gradient is near zero turns rounding into a visible part of a step: the key biases (attention's
softmax is invariant to a bias on every key, so their true gradient is 0) are held to 1e-5 (measured 2.7e-6), and
under ZeRO-3, which clips and averages partitioned flat gradients in yet another order, every weight to 2e-5
(measured 9.2e-6, on a down_proj element whose gradient is 1.4e-7 against a median of 4e-3).
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

from sharded_worker import LR, STEPS  # noqa: E402
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
@pytest.mark.parametrize("backend", ["fsdp", "zero2", "zero3"])
def test_two_gloo_ranks_match_the_single_process_learner(tmp_path, backend):
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (pip install "
                            "'agentgrad[deepspeed]')")
    out = tmp_path / "rank0.pt"
    # PYTHONPATH keeps the parent's entries (where an extra may be installed) behind our src
    path = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                           str(HERE / "sharded_worker.py"), backend, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
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
        atol = 2e-5 if backend == "zero3" else 1e-5 if key.endswith("k_proj.bias") else 2e-7
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=key)  # ...to the same place
