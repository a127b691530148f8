"""model.compute_dtype: bf16 detection and the bf16 learner's logprobs against fp32."""

import pytest
import torch
from test_shared_prefix import _grouped_batch, _model

from agentgrad.backends.hf import TorchLearner
from agentgrad.backends.precision import cpu_flags, resolve_compute_dtype


def test_auto_picks_bf16_only_where_the_cpu_has_bf16_arithmetic():
    assert resolve_compute_dtype("auto", "cpu", {"avx512f", "avx512_bf16"}).dtype is torch.bfloat16
    assert resolve_compute_dtype("auto", "cpu", {"amx_tile", "amx_bf16"}).dtype is torch.bfloat16
    plain = resolve_compute_dtype("auto", "cpu", {"avx2", "avx512f"})
    assert plain.dtype is None and "fp32" in plain.note and "has no bf16" in plain.note
    assert resolve_compute_dtype("fp32", "cpu", {"amx_bf16"}).dtype is None
    forced = resolve_compute_dtype("bf16", "cpu", {"avx2"})  # honoured, with a warning that it is emulated
    assert forced.dtype is torch.bfloat16 and forced.note.startswith("warning:")


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx512_bf16", "amx_tile"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "plain"])
def test_bf16_learner_logprobs_are_fp32_within_bf16_rounding(kind, shared):
    """bf16 keeps 8 significant bits: each rounding is at most 2^-9 = 2e-3 relative. The logits of this model
    are O(1-10) and a logprob is logit - logsumexp, so per-token errors of a few 1e-3 nats are expected; the
    test allows a mean |difference| of 1e-2 and a max of 5e-2 nats. It also asks for a mean above 1e-4, far
    above fp32's own reordering noise (~1e-6): autocast must actually be on. Logprobs come back fp32."""
    model, batch = _model(kind), _grouped_batch()
    if not shared:  # one row per group: the learner takes the plain (transformers) forward
        batch = batch.replace(group_index=torch.arange(batch.num_sequences))
    fp32 = TorchLearner(model, lr=1e-3)
    bf16 = TorchLearner(model, lr=1e-3, compute=resolve_compute_dtype("bf16", "cpu"))
    with torch.no_grad():
        ref, low = fp32.logprobs(batch), bf16.logprobs(batch)  # (B, T)
    assert low.dtype == torch.float32
    diff = (ref - low).abs()[batch.attention_mask > 0]
    assert 1e-4 < float(diff.mean()) < 1e-2
    assert float(diff.max()) < 5e-2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
