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

The same run then takes the learner's `state_dict()` into a fresh learner and continues both (the checkpoint
round trip; its tolerances at the test).
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

from sharded_worker import LR, STEPS, STEPS_AFTER_RESTORE  # noqa: E402
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


@pytest.fixture(scope="module", params=["fsdp", "zero2", "zero3"])
def sharded(request, tmp_path_factory) -> dict:
    """One torchrun of sharded_worker.py per backend (its steps, then its checkpoint round trip), read by both
    tests below: the launch is most of a test's time."""
    backend = request.param
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (pip install "
                            "'agentgrad[deepspeed]')")
    out = tmp_path_factory.mktemp(backend) / "rank0.pt"
    # PYTHONPATH keeps the parent's entries (where an extra may be installed) behind our src
    path = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                           str(HERE / "sharded_worker.py"), backend, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False) | {"backend": backend}


def _atol(backend: str, key: str) -> float:
    """Updated weights against the single-process learner's (the module docstring's reasoning)."""
    return 2e-5 if backend == "zero3" else 1e-5 if key.endswith("k_proj.bias") else 2e-7


@pytest.mark.slow
def test_two_gloo_ranks_match_the_single_process_learner(sharded):
    backend = sharded["backend"]
    threads = torch.get_num_threads()
    single = _single_process()
    torch.set_num_threads(threads)
    assert sharded["world_size"] == 2
    assert not sharded["shm_op"]  # DeepSpeed's inference-only C++ op stayed unbuilt (a minute's compile)
    assert 0.45 < sharded["local_fraction"] < 0.55  # rank 0 held about half of the weights: really sharded
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5, abs=0)
    initial = _model("qwen2").state_dict()
    assert sharded["state"].keys() == single["state"].keys()
    for key, want in single["state"].items():
        got = sharded["state"][key]
        assert not torch.equal(want, initial[key]), key  # every tensor moved...
        torch.testing.assert_close(got, want, rtol=0, atol=_atol(backend, key), msg=key)  # ...to the same place


def _continue_in_one_process(saved: dict) -> tuple[list[float], dict]:
    """The 2-rank checkpoint continued by the single-process learner: its weights, and its optimizer state
    keyed by parameter name mapped to torch's indices (parameter order)."""
    torch.set_num_threads(1)
    model = _model("qwen2")
    model.load_state_dict(saved["model"])
    learner = TorchLearner(model, lr=LR)
    learner.lean = None  # the plain forward, as the sharded learners take
    names = [name for name, _ in model.named_parameters()]
    (group,) = saved["optimizer"]["param_groups"]
    learner.optimizer.load_state_dict({"state": {i: saved["optimizer"]["state"][n] for i, n in enumerate(names)},
                                       "param_groups": [group | {"params": list(range(len(names)))}]})
    batch = _grouped_batch()
    losses = []
    for _ in range(STEPS_AFTER_RESTORE):
        loss = sft_loss(learner.logprobs(batch), batch.loss_mask)
        losses.append(loss.item())
        learner.step(loss)
    return losses, model.state_dict()


@pytest.mark.slow
def test_a_learner_restored_from_state_dict_continues_as_the_one_that_saved_it(sharded):
    """After STEPS steps on 2 ranks, `state_dict()` into a fresh learner built from the initial weights
    (`load_state_dict`), then STEPS_AFTER_RESTORE steps of both on the same batch (sharded_worker.round_trip).

    Tolerance: the restored learner holds the same partitions as the one that saved it and runs the same
    arithmetic in the same reduction order, so losses and weights are held to 1e-6 relative and 1e-7 absolute
    (measured: equal bit for bit for FSDP2, ZeRO-2 and ZeRO-3). A restore that drops the Adam state moves the
    weights by ~lr = 1e-2 a step instead (measured: max 1.9e-2 with the optimizer load skipped). The checkpoint
    continued by the single-process learner (full tensors by name: no trace of the 2 ranks) is held to the
    2-rank-vs-single-process tolerances of the test above (measured: losses equal to 8e-8 relative, weights to
    8.6e-7 on a key bias under ZeRO-3)."""
    backend, run = sharded["backend"], sharded["resume"]
    saved, reloaded = run["saved"], run["reloaded"]
    # state_dict() is a snapshot (the steps after it leave it as saved), and loading leaves the caller's dict alone
    assert run["snapshot"] and run["untouched_by_load"]
    shapes = {name: p.shape for name, p in _model("qwen2").named_parameters()}
    state = saved["optimizer"]["state"]
    assert state.keys() == shapes.keys() and saved["model"].keys() >= shapes.keys()
    for name, entry in state.items():  # full tensors, the Adam moments of STEPS steps: not a fresh optimizer's
        assert float(entry["step"]) == STEPS, name
        assert entry["exp_avg"].shape == entry["exp_avg_sq"].shape == shapes[name], name
        assert entry["exp_avg"].abs().max() > 0 and entry["exp_avg_sq"].min() >= 0, name
        assert entry["exp_avg_sq"].max() > 0, name
    # the restored learner's own state_dict, taken right after loading, is the saved one (FSDP's load turns
    # betas into a list)
    def groups(which):
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                for g in which["optimizer"]["param_groups"]]

    assert groups(reloaded) == groups(saved)
    for name, entry in state.items():
        for key, value in entry.items():
            assert torch.equal(reloaded["optimizer"]["state"][name][key], value), (name, key)
    assert all(torch.equal(reloaded["model"][k], v) for k, v in saved["model"].items())

    continued, restored = run["states"]["continued"], run["states"]["restored"]
    assert run["losses"]["restored"] == pytest.approx(run["losses"]["continued"], rel=1e-6, abs=0)
    for key, want in continued.items():
        assert not torch.equal(want, saved["model"][key]), key  # the steps after the restore moved every tensor
        torch.testing.assert_close(restored[key], want, rtol=1e-6, atol=1e-7, msg=key)

    threads = torch.get_num_threads()
    losses, state_one = _continue_in_one_process(saved)
    torch.set_num_threads(threads)
    assert run["losses"]["continued"] == pytest.approx(losses, rel=1e-6, abs=0)
    for key, want in state_one.items():
        torch.testing.assert_close(continued[key], want, rtol=0, atol=_atol(backend, key), msg=key)
