"""The compiled attention of the rollout engine (backends/decode_attention.c through backends/native.py): RoPE,
the cache write and softmax attention per token; checked by hand, against torch's ops, and through the engine."""

import math

import pytest
import torch

from agentgrad.backends import native
from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy
from agentgrad.backends.lean import grouped_attention

pytestmark = pytest.mark.skipif(native.kernel() is None, reason="no C compiler on this machine")


def _call(qkv, cos, sin, slots, positions, k, v, heads):
    scratch = torch.empty((heads // k.shape[1], k.shape[2]))
    return native.decode_attention(native.kernel(), qkv, cos, sin, torch.tensor(slots), torch.tensor(positions),
                                   k, v, heads, scratch)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _reference(qkv, cos, sin, slots, positions, k, v, heads):
    """Token by token, in order, with torch: RoPE (HF's rotate-half), the write, attention over 0..position."""
    kvh, d = k.shape[1], k.shape[3]
    out = []
    for row, slot, p in zip(qkv, slots, positions):
        q, key, val = row.view(heads + 2 * kvh, d).split((heads, kvh, kvh))
        q = q * cos[p] + _rotate_half(q) * sin[p]
        k[slot, :, p] = key * cos[p] + _rotate_half(key) * sin[p]
        v[slot, :, p] = val
        K, V = k[slot : slot + 1, :, : p + 1], v[slot : slot + 1, :, : p + 1]  # (1, kvh, p+1, d)
        out.append(grouped_attention(q[None, None], K, V, torch.zeros(1, 1, 1, 1, p + 1))[0, 0])
    return torch.stack(out)


def test_one_head_by_hand():
    """d = 8, one head, no rotation (cos 1, sin 0). The query (1, 0, ...) scores position 0's key (0, ...) 0 and
    position 1's key (ln 3, 0, ...) ln 3, so the weights are 1/4 and 3/4, and the values 4 and 8 (first lane)
    mix to 7; position 0's own token sees only itself (its value, 4)."""
    d, C = 8, 4
    cos, sin = torch.ones(C, d), torch.zeros(C, d)
    k, v = torch.zeros(1, 1, C, d), torch.zeros(1, 1, C, d)
    e0 = torch.eye(d)[0]
    first = torch.cat([e0, 0 * e0, 4 * e0])  # query, key, value of position 0
    second = torch.cat([e0, math.log(3) * e0, 8 * e0])
    out = _call(torch.stack([first, second]), cos, sin, [0, 0], [0, 1], k, v, heads=1)
    assert out[0, 0].item() == pytest.approx(4.0, abs=1e-6)
    assert out[1, 0].item() == pytest.approx(0.25 * 4 + 0.75 * 8, abs=1e-5)
    assert k[0, 0, 1, 0].item() == pytest.approx(math.log(3)) and v[0, 0, 1, 0].item() == 8.0  # written in


def test_rope_is_hf_rotate_half():
    """d = 8, one position, cos 0 and sin 1: the key becomes rotate_half(key) = (-x[4:], x[:4])."""
    d = 8
    k, v = torch.zeros(1, 1, 2, d), torch.zeros(1, 1, 2, d)
    key = torch.arange(1.0, 9.0)
    qkv = torch.cat([torch.zeros(d), key, torch.zeros(d)])[None]
    _call(qkv, torch.zeros(2, d), torch.ones(2, d), [0], [0], k, v, heads=1)
    assert k[0, 0, 0].tolist() == [-5.0, -6.0, -7.0, -8.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 32), (4, 4, 16), (14, 2, 64), (8, 1, 128), (6, 2, 24)])
def test_matches_torch_token_by_token(heads, kv_heads, d):
    """Rows in any slots, several tokens of a row in one call (a prefill: each written before the next attends),
    lengths that are and are not multiples of 8, heads per kv head with and without a specialised path."""
    torch.manual_seed(0)
    S, C, P = 5, 48, 48
    k0, v0 = torch.randn(S, kv_heads, C, d), torch.randn(S, kv_heads, C, d)
    cos, sin = torch.randn(P, d), torch.randn(P, d)
    slots = [3, 3, 3, 0, 4, 1, 1]
    positions = [10, 11, 12, 0, 37, 7, 8]
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * d) * 0.5
    k1, v1, k2, v2 = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    got = _call(qkv, cos, sin, slots, positions, k1, v1, heads)
    want = _reference(qkv, cos, sin, slots, positions, k2, v2, heads)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)
    assert torch.allclose(k1, k2, atol=1e-6) and torch.equal(v1, v2)


def test_scores_far_apart_and_a_row_alone():
    """Scores spread over ~200 (softmax weights down to e^-200, below float range) still match, and a row's output
    is bit for bit the same computed alone or beside rows of other lengths."""
    torch.manual_seed(1)
    heads, kvh, d, C = 4, 2, 32, 64
    k, v = torch.randn(3, kvh, C, d) * 3, torch.randn(3, kvh, C, d)
    cos, sin = torch.ones(C, d), torch.zeros(C, d)
    qkv = torch.randn(3, (heads + 2 * kvh) * d) * 3
    crowded = _call(qkv, cos, sin, [0, 1, 2], [40, 5, 63], k.clone(), v.clone(), heads)
    alone = _call(qkv[:1], cos, sin, [0], [40], k.clone(), v.clone(), heads)
    assert torch.equal(crowded[0], alone[0])
    want = _reference(qkv, cos, sin, [0, 1, 2], [40, 5, 63], k.clone(), v.clone(), heads)
    assert torch.allclose(crowded, want, atol=1e-4, rtol=1e-5)


def test_engine_logprobs_match_the_torch_ops(loaded_tiny):
    """The same session run with the kernel and with torch's ops (rollout.native_attention=false): prompts sharing
    a prefix, two turns with an observation between; same tokens, logprobs within float rounding."""
    def run(native_attention):
        policy = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids,
                          pad_token_id=loaded_tiny.pad_token_id, native_attention=native_attention)
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        prompts = {k: [5, 6, 7, 8, 9, 10 + k, 11] for k in range(4)}
        with policy.session(sampling, max_sequences=4, max_tokens=64) as s:
            assert (s.lean.native is not None) == native_attention
            for key, ids in prompts.items():
                s.submit(key, ids, 8)
            done = {}
            while len(done) < 4:
                done.update(s.step())
            for key in prompts:
                s.submit(key, [30 + key, 31], 8)
            later = {}
            while len(later) < 4:
                later.update(s.step())
        return done, later

    for native_turns, torch_turns in zip(run(True), run(False)):
        for key, gen in native_turns.items():
            assert gen.token_ids == torch_turns[key].token_ids
            assert gen.logprobs == pytest.approx(torch_turns[key].logprobs, abs=1e-5)


def test_no_compiler_falls_back_to_torch(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.kernel.cache_clear()
    try:
        assert native.kernel() is None
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.undo()
        native.kernel.cache_clear()
    assert native.kernel() is not None


def test_positions_read_from_another_slot():
    """With src/shared, a token reads its first `shared` positions from another slot: equal to reading its own
    when the two hold the same there, and different when they do not (so the other slot is really read)."""
    torch.manual_seed(2)
    heads, kvh, d, C = 4, 2, 32, 40
    k, v = torch.randn(2, kvh, C, d), torch.randn(2, kvh, C, d)
    k[1, :, :20], v[1, :, :20] = k[0, :, :20], v[0, :, :20]
    cos, sin = torch.randn(C, d), torch.randn(C, d)
    qkv = torch.randn(1, (heads + 2 * kvh) * d)
    scratch = torch.empty(heads // kvh, C)

    def attend(kc, vc, shared):
        return native.decode_attention(native.kernel(), qkv, cos, sin, torch.tensor([1]), torch.tensor([30]),
                                       kc, vc, heads, scratch, torch.tensor([0]), torch.tensor([shared]))

    own = attend(k.clone(), v.clone(), 0)
    assert torch.equal(attend(k.clone(), v.clone(), 20), own)
    k2 = k.clone()
    k2[0, :, 5] += 1.0  # slot 0 no longer equals slot 1 at position 5
    assert not torch.allclose(attend(k2, v.clone(), 20), own)


def test_a_released_prompt_owner_is_no_longer_read(loaded_tiny):
    """Two samples of one prompt (the second reads the prompt in the first's slot); the first is released and its
    slot taken by another prompt, which overwrites it; the second's next turn still matches a full forward."""
    from agentgrad.backends.scoring import token_logprobs

    policy = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids,
                      pad_token_id=loaded_tiny.pad_token_id)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    with policy.session(sampling, max_sequences=2, max_tokens=64) as s:
        s.submit("a", prompt, 6)
        s.submit("b", prompt, 6)
        first = {}
        while len(first) < 2:
            first.update(s.step())
        assert s.cache.alias_len.tolist() == [0, len(prompt)]  # b reads the prompt in a's slot
        s.release("a")
        s.submit("c", [13, 14, 15, 16, 17, 18, 19, 20, 21, 22], 6)  # a's slot, rewritten from position 0
        s.submit("b", [30, 31], 6)
        later = {}
        while "b" not in later:
            later.update(s.step())
    context = prompt + list(first["b"].token_ids) + [30, 31]
    full = context + list(later["b"].token_ids)
    with torch.no_grad():
        ids = torch.tensor([full])
        lp = token_logprobs(loaded_tiny.model, ids, torch.ones_like(ids), 1.0)[0]
    assert torch.allclose(lp[len(context):], torch.tensor(later["b"].logprobs), atol=1e-4)
