"""BC's faster paths on the default tiny model and its expert demos: bf16 autocast (model.compute_dtype) and the
shared-prefix learner (bc.shared_prefix) against the plain fp32 forward."""

import random

import torch

from agentgrad.algos.losses import sft_loss
from agentgrad.batch import collate
from agentgrad.config import build_config
from agentgrad.pipelines.bc import bc_step, expert_demos, one_group
from agentgrad.pipelines.components import build_components


def _components(tmp_path, *overrides):
    torch.set_num_threads(1)
    return build_components(build_config(overrides=["run.threads=1", "run.progress=false", *overrides]), tmp_path)


def test_shared_prefix_bc_gives_the_plain_loss_and_gradients(tmp_path):
    """All demos open with the same system prompt and tool list; running it once per batch must change only the
    float summation order: loss and every gradient equal to the plain forward's within 1e-5 (relative for the
    gradients), while the shared prefix is tens of tokens long (otherwise the test would compare the plain path
    with itself)."""
    c = _components(tmp_path)
    demos = expert_demos(c, 32, seed=1)
    batch = collate(demos, pad_token_id=c.pad_token_id)
    results = []
    for b in (batch, one_group(batch)):
        loss = sft_loss(c.learner.logprobs(b), b.loss_mask)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in c.loaded.model.named_parameters()}))
        c.learner.optimizer.zero_grad(set_to_none=True)
    from agentgrad.backends.shared_prefix import plan_shared_prefixes

    assert int(plan_shared_prefixes(one_group(batch)).prefix_len[0]) >= 20
    (plain_loss, plain_grads), (shared_loss, shared_grads) = results
    assert abs(plain_loss - shared_loss) < 1e-5
    for name, g in plain_grads.items():
        assert torch.allclose(shared_grads[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max())), name


def _bc_losses(tmp_path, *overrides, steps=16):
    c = _components(tmp_path, "bc.lr=3e-3", *overrides)
    demos = expert_demos(c, 256, seed=1)
    rng = random.Random(0)
    return [bc_step(c, demos, rng, step)["loss/bc"] for step in range(steps)]


def test_short_bf16_bc_run_lowers_its_loss_like_fp32(tmp_path):
    """16 BC steps from the same init on the same minibatches: fp32 at least halves the token loss; bf16 autocast
    must do the same, its mean loss over the last 5 steps within 10% of fp32's (bf16 rounding is ~0.4% per
    operation; a broken bf16 backward would leave the loss near its start). Measured: 6.27 -> 1.23 over the last
    5 steps for both (halved by step 8), the tails 0.2% apart; 16 steps, not 40, as bf16 is emulated (~4x slower
    than fp32) on CPUs without avx512_bf16."""
    fp32 = _bc_losses(tmp_path / "fp32", "model.compute_dtype=fp32", "bc.shared_prefix=true")
    bf16 = _bc_losses(tmp_path / "bf16", "model.compute_dtype=bf16", "bc.shared_prefix=true")
    tail32, tail16 = sum(fp32[-5:]) / 5, sum(bf16[-5:]) / 5
    assert tail32 < 0.5 * fp32[0]
    assert tail16 < 0.5 * bf16[0]
    assert abs(tail16 - tail32) < 0.1 * tail32
