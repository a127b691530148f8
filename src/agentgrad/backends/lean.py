"""One hand-written forward of a Llama-family decoder stack, for the rollout engine and the learner alike.

Why hand-written: the tiny default model is overhead-bound; transformers' module wrappers, mask builders and
per-call checks cost several times the arithmetic of a decode step (measured: ~11 ms of a step vs ~3 ms here),
and its modules take no keys/values of another row, which the learner's shared prefixes need. The numerics are
the HF modules' (fp32 RMSNorm, rotate-half RoPE, softmax attention with grouped kv heads); tests compare.

One weight extractor (`layer_weights`), one layer loop (`LeanStack.hidden`), and the attention as a strategy:
- `CachedAttention` (rollout decoding): keys/values go into and come from a per-sequence slot cache; the weights
  are extracted once per session with the attention scale folded into the query rows, and every matmul is
  padded to `MIN_GEMM_ROWS` rows (`linear_rows`) so a sequence's logits do not depend on its batch mates;
- `PrefixAttention` (shared-prefix training): keys/values of a shared prefix run are prepended per row and torch's
  fused attention runs over them; the weights are fused from the parameters once per learner call (autograd
  reaches them), and the per-token work runs on real tokens only (`LeanStack.hidden(real=...)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

# Architectures whose decoder layers are (RMSNorm, q/k/v/o attention with RoPE, RMSNorm, SwiGLU MLP) and whose
# attention is global: `LeanStack` runs them without transformers' per-module wrappers.
LEAN_MODEL_TYPES = frozenset({"qwen2", "llama"})

# CPU GEMM kernels give a row the same bits whatever the other rows are only from ~7 rows up (measured with
# MKL/oneDNN, torch 2.13: M=1..6 take gemv/small-M paths that round differently). Padding every matmul to at least
# this many rows makes a sequence's logits independent of which sequences share its step, so a fixed seed
# reproduces rollouts bit for bit whatever the tool timing. (Attention is per row and was measured invariant.)
MIN_GEMM_ROWS = 8

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the last dim, padded to MIN_GEMM_ROWS rows so each row's result is batch-invariant."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m < MIN_GEMM_ROWS:
        flat = torch.cat([flat, flat.new_zeros(MIN_GEMM_ROWS - m, flat.shape[1])])
    return F.linear(flat, weight, bias)[:m].view(*x.shape[:-1], weight.shape[0])


def supports(model: torch.nn.Module) -> bool:
    cfg = model.config
    body = getattr(model, model.base_model_prefix, None)
    return (getattr(cfg, "model_type", None) in LEAN_MODEL_TYPES and getattr(cfg, "hidden_act", "") == "silu"
            and not getattr(cfg, "use_sliding_window", False) and body is not None
            and all(layer.mlp.gate_proj.bias is None and layer.mlp.up_proj.bias is None for layer in body.layers))


def applied_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight a linear layer applies: its own, plus the delta (alpha/r * B @ A) of each active, unmerged LoRA
    adapter when PEFT wrapped it (read by duck type: no peft import). Reading `.weight` alone would run the base
    model and silently drop the adapters. Differentiable, so shared-prefix training reaches A and B."""
    weight = linear.weight
    lora_a = getattr(linear, "lora_A", None)
    if lora_a is None or linear.disable_adapters or linear.merged:
        return weight
    for name in linear.active_adapters:
        if name in lora_a:
            weight = weight + linear.get_delta_weight(name)
    return weight


def has_lora_dropout(model: torch.nn.Module) -> bool:
    """True when a LoRA layer drops its input in training (model.lora.dropout > 0): merged weights cannot, so the
    learner takes the plain forward then."""
    return any(not isinstance(d, torch.nn.Identity) for m in model.modules()
               for d in getattr(m, "lora_dropout", {}).values())


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, q/k/v and gate/up fused into single matmuls."""

    norm1: torch.Tensor
    qkv: torch.Tensor  # (heads*d + 2*kv_heads*d, H)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm2: torch.Tensor
    gate_up: torch.Tensor  # (2*I, H)
    down: torch.Tensor
    down_bias: torch.Tensor | None


def layer_weights(body: torch.nn.Module, query_scale: float | None = None) -> list[LayerWeights]:
    """The weights of every layer of `body`; `query_scale` folds the attention scale into the query rows (RoPE is
    linear, so it commutes) for a strategy that then skips scaling the scores."""
    out = []
    for layer in body.layers:
        a, m = layer.self_attn, layer.mlp
        q_w, q_b = applied_weight(a.q_proj), a.q_proj.bias
        if query_scale is not None:
            q_w, q_b = q_w * query_scale, (q_b * query_scale if q_b is not None else None)
        qkv_b = torch.cat([q_b, a.k_proj.bias, a.v_proj.bias]) if q_b is not None else None
        out.append(LayerWeights(layer.input_layernorm.weight,
                                torch.cat([q_w, applied_weight(a.k_proj), applied_weight(a.v_proj)]), qkv_b,
                                applied_weight(a.o_proj), a.o_proj.bias, layer.post_attention_layernorm.weight,
                                torch.cat([applied_weight(m.gate_proj), applied_weight(m.up_proj)]),
                                applied_weight(m.down_proj), m.down_proj.bias))
    return out


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax attention of queries q (N, q, heads, d), the attention scale already folded in (`layer_weights`'
    `query_scale`), over keys/values k, v (N, kv_heads, L, d) under `bias` (N, 1, 1, q, L) (0 or -inf), a kv
    head's query heads side by side: the decoder's (the learner uses torch's fused attention). (N, q, heads*d)."""
    N, nq, nh, d = q.shape
    kvh, L = k.shape[1], k.shape[2]
    g = nh // kvh
    qg = q.permute(0, 2, 1, 3).reshape(N, kvh, g * nq, d)  # (N, kvh, g*q, d)
    scores = (qg @ k.transpose(-1, -2)).view(N, kvh, g, nq, L)  # (N, kvh, g, q, L)
    scores = scores + bias
    attn = scores.softmax(-1).view(N, kvh, g * nq, L) @ v  # (N, kvh, g*q, d)
    return attn.view(N, nh, nq, d).transpose(1, 2).reshape(N, nq, nh * d)


class Attention(Protocol):
    """Where a layer's keys and values come from and go to. `linear` is the matmul the stack uses with it.

    A strategy whose `takes_projections` is True applies RoPE itself: the stack calls its
    `attend_projections(layer, qkv)` with the layer's raw projections (N*q, (heads + 2 kv_heads) d) instead
    (the compiled decode step, `native.py`, fuses RoPE, the cache write and the attention in one call)."""

    linear: Linear
    takes_projections: bool

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, q, heads, d), this step's k and v (N, q, kv_heads, d) after RoPE -> (N, q, heads*d)."""
        ...


class LeanStack:
    """The decoder stack of a Llama-family model as ~20 tensor ops per layer, reading the model's own weights."""

    def __init__(self, body: torch.nn.Module) -> None:
        cfg = body.config
        self.body = body
        self.hidden_size = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = float(getattr(body.norm, "variance_epsilon", None) or getattr(body.norm, "eps", 1e-6))

    def rope_table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (P, d) of positions 0..P-1, looked up per token instead of recomputed per step."""
        with torch.no_grad():
            pos = torch.arange(positions, device=self.body.embed_tokens.weight.device)[None]
            cos, sin = self.body.rotary_emb(self.body.embed_tokens.weight[:1, None], pos)  # (1, P, d)
        return cos[0], sin[0]

    def hidden(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: list[LayerWeights],
               attention: Attention, real: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states (N, q, H) of ids (N, q) whose RoPE rows are cos, sin (N, q, d).

        With `real` (R,), the flat indices (into N*q) of the positions that are not padding, every per-token op
        (embedding, norms, the four matmuls, SwiGLU) runs on those R positions only and the result is (R, H): a
        learner batch of ragged rows then pays for padding in the attention alone. The attention still sees
        (N, q, ...) with padding positions zero."""
        N, q = ids.shape
        nh, kvh, d, H = self.heads, self.kv_heads, self.head_dim, self.hidden_size
        linear = attention.linear
        x = F.embedding(ids.flatten()[real] if real is not None else ids, self.body.embed_tokens.weight)  # (R|N,q, H)
        half = d // 2
        fused = getattr(attention, "takes_projections", False)
        if not fused:
            # rotate_half(x) * sin == x.roll(half) * (sin with its first half negated), bit for bit, and the roll
            # is one op forward and backward where slicing, negating and concatenating are four.
            sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            cos, sin = cos[:, :, None], sin[:, :, None]  # (N, q, 1, d)
        for li, w in enumerate(layers):
            h = F.rms_norm(x, (H,), w.norm1, self.eps)
            qkv = linear(h, w.qkv, w.qkv_bias)  # (R|N,q, (heads + 2 kv_heads) d)
            if real is not None:
                qkv = qkv.new_zeros((N * q, qkv.shape[-1])).index_copy(0, real, qkv)
            if fused:
                attn = attention.attend_projections(li, qkv.view(N * q, -1)).view(N, q, nh * d)
            else:
                # split, not slices: its backward is one concatenation where each slice's is a zero fill and a copy
                qk, v = qkv.view(N, q, nh + 2 * kvh, d).split((nh + kvh, kvh), dim=2)
                qk = qk * cos + qk.roll(half, dims=-1) * sin  # RoPE, queries and keys
                attn = attention(li, *qk.split((nh, kvh), dim=2), v)  # (N, q, heads*d)
            if real is not None:
                attn = attn.reshape(N * q, nh * d).index_select(0, real)  # (R, heads*d)
            x = x + linear(attn, w.o, w.o_bias)
            h = F.rms_norm(x, (H,), w.norm2, self.eps)
            gate, up = linear(h, w.gate_up, None).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w.down, w.down_bias)
        return F.rms_norm(x, (H,), self.body.norm.weight, self.eps)
