"""Attention kernels at the default model's shapes: what the learner and the decoder could use, timed alone.

Learner (forward and backward, as `backends/shared_prefix.py` runs them on benchmark c's batch: 4 query heads,
2 kv heads, width 32, a boolean mask): torch's fused attention with grouped kv heads (what ships), the same with
the kv heads repeated, and matmul-softmax-matmul (the decoder's `grouped_attention`). Decoder (one query per
row over a slot cache, no gradient): the scores and weighted-value `bmm`s on the cache's views (what ships) and
on contiguous copies (the copy not counted), and an elementwise product-and-sum. CPU time per call, one thread
by default.

    nice -n 19 python benchmarks/attention_kernels.py [--threads 1] [--reps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import set_threads, table

from agentgrad.backends.lean import grouped_attention

HEADS, KV_HEADS, WIDTH = 4, 2, 32
# (rows, queries, keys) of benchmark c's runs: a continuation bucket, the long bucket, a prefix run
LEARNER_SHAPES = ((56, 36, 109), (8, 152, 225), (8, 73, 73))
DECODE_ROWS, DECODE_KEYS = 64, (40, 100, 200)


def cpu_ms(fn: Callable[..., object], args: tuple, reps: int) -> float:
    for _ in range(3):
        fn(*args)
    t0 = time.process_time()
    for _ in range(reps):
        fn(*args)
    return (time.process_time() - t0) / reps * 1e3


def forward_backward(attention: Callable, q, k, v, mask, grad) -> None:
    attention(q, k, v, mask).backward(grad)


def scores(q, k):
    return q @ k.transpose(-1, -2)


def scores_by_product(q, k):
    return (q[:, :, :, None] * k[:, :, None]).sum(-1)


def weighted_values(probs, v):
    return probs @ v


def fused_gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def fused_repeated_kv(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


def matmul_softmax(q, k, v, bias):
    """The decoder's `grouped_attention` (bias (N, 1, 1, q, L), 0 or -inf), the scale folded into the queries as
    `layer_weights` folds it."""
    return grouped_attention((q * q.shape[-1] ** -0.5).transpose(1, 2), k, v, bias)


def learner_rows(reps: int) -> list[tuple[str, ...]]:
    rows = []
    for N, nq, L in LEARNER_SHAPES:
        q = torch.randn(N, HEADS, nq, WIDTH, requires_grad=True)
        k, v = (torch.randn(N, KV_HEADS, L, WIDTH, requires_grad=True) for _ in range(2))
        mask = torch.rand(N, 1, nq, L) < 0.8
        mask[..., -1] = True  # no empty softmax row
        bias = torch.zeros(N, 1, 1, nq, L).masked_fill(~mask[:, :, None], float("-inf"))  # built once, as the decoder
        grad = torch.randn(N, HEADS, nq, WIDTH)
        times = [cpu_ms(forward_backward, (f, q, k, v, m, g), reps) for f, m, g in (
            (fused_gqa, mask, grad), (fused_repeated_kv, mask, grad),
            (matmul_softmax, bias, grad.transpose(1, 2).reshape(N, nq, HEADS * WIDTH)))]
        rows.append((f"{N} x {nq} queries x {L} keys", *(f"{t:.2f}" for t in times)))
    return rows


def decode_rows(reps: int) -> list[tuple[str, ...]]:
    rows = []
    slots = 512
    k_cache, v_cache = (torch.randn(DECODE_ROWS, KV_HEADS, slots, WIDTH) for _ in range(2))
    q = torch.randn(DECODE_ROWS, KV_HEADS, HEADS // KV_HEADS, WIDTH)  # (N, kvh, g, d)
    with torch.no_grad():
        for L in DECODE_KEYS:
            k, v = k_cache[:, :, :L], v_cache[:, :, :L]  # views, as CachedAttention reads the cache
            kc, vc = k.contiguous(), v.contiguous()
            probs = (q @ k.transpose(-1, -2)).softmax(-1)  # (N, kvh, g, L)
            times = [cpu_ms(fn, args, reps * 50) * 1e3 for fn, args in (
                (scores, (q, k)), (scores, (q, kc)), (scores_by_product, (q, k)),
                (weighted_values, (probs, v)), (weighted_values, (probs, vc)))]
            rows.append((f"{DECODE_ROWS} rows x {L} keys", *(f"{t:.0f}" for t in times)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    set_threads(args.threads)
    print(f"\nlearner attention, forward + backward, CPU ms per call ({args.threads} thread(s))")
    print(table(learner_rows(args.reps), ("shape", "fused, grouped kv (ships)", "fused, kv repeated",
                                          "matmul-softmax-matmul")))
    print(f"\ndecode attention, one query per row, CPU us per call ({args.threads} thread(s))")
    print(table(decode_rows(args.reps), ("shape", "scores: bmm on cache view (ships)", "scores: bmm, contiguous keys",
                                         "scores: product-and-sum", "values: bmm on cache view (ships)",
                                         "values: bmm, contiguous values")))


if __name__ == "__main__":
    main()
