"""Learner logprobs that compute each group's shared prefix once.

The samples of a GRPO group share their prompt (~60 of ~110 tokens in the default run), so a plain forward over
a minibatch of whole groups runs every prompt token once per sample. Here the longest prefix that all rows of a
group have in common runs once per group; each row then runs only its continuation, attending to the prefix's
keys and values (indexed per row, so gradients flow back into the one prefix computation), and every token is
scored from the same logits as in a plain forward. Exact: only truly identical prefixes are shared.

The forward is `LeanForward`: the one hand-written stack (`backends.lean`, also the rollout engine's) with a
prefix-aware attention and autograd through the model's own parameters: transformers' modules take no keys/values
of another row, and at this model width their wrappers cost more than the arithmetic. Other architectures use
the plain path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentgrad.algos.constrained import legal_log_mass
from agentgrad.backends.lean import LayerWeights, LeanStack, has_lora_dropout, layer_weights
from agentgrad.backends.lean import supports as lean_supports
from agentgrad.backends.scoring import tempered
from agentgrad.batch import LogitMasks, TokenBatch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (N, kv_heads, L, head_dim), after RoPE


@dataclass(frozen=True)
class PrefixPlan:
    """Which rows share which prefix: row b's tokens [0, prefix_len[source[b]]) are row source[b] of
    `prefix_ids`, and only tokens from there on run per row."""

    prefix_ids: torch.Tensor  # (P, S) long, right-padded
    prefix_len: torch.Tensor  # (P,) long, >= 1
    source: torch.Tensor  # (B,) long, row of `prefix_ids` holding row b's prefix
    lengths: torch.Tensor  # (B,) long, real tokens per row


def plan_shared_prefixes(batch: TokenBatch) -> PrefixPlan | None:
    """The longest prefix all rows of each group (`group_index`) have in common, capped so that every row keeps
    at least one token of its own. None when no two rows share a token (e.g. BC batches, one row per group):
    those batches keep the plain forward, bit for bit."""
    ids, lengths = batch.input_ids, batch.attention_mask.sum(1)  # (B, T), (B,)
    groups, source = torch.unique(batch.group_index, return_inverse=True)  # (P,), (B,)
    P, (B, T) = len(groups), ids.shape
    if P == B:
        return None
    dev = ids.device
    first = torch.full((P,), B, device=dev).scatter_reduce(0, source, torch.arange(B, device=dev), "amin")  # (P,)
    positions = torch.arange(T, device=dev)
    same = (ids == ids[first[source]]) & (positions < lengths[:, None])  # (B, T) agrees with its group's 1st row
    common = same.long().cumprod(1).sum(1)  # (B,) length of the agreeing prefix
    shortest = torch.full((P,), T, device=dev).scatter_reduce(0, source, lengths, "amin")  # (P,)
    prefix_len = torch.full((P,), T, device=dev).scatter_reduce(0, source, common, "amin")  # (P,)
    prefix_len = torch.minimum(prefix_len, shortest - 1)
    shared = (torch.bincount(source, minlength=P) > 1) & (prefix_len > 0)  # (P,)
    if not bool(shared.any()):
        return None
    S = int(prefix_len.max())
    prefix_ids = ids[first, :S].masked_fill(positions[None, :S] >= prefix_len[:, None], 0)  # (P, S)
    return PrefixPlan(prefix_ids, prefix_len, source, lengths)


class PrefixAttention:
    """`LeanStack` attention for training: queries attend to `past` keys/values (a shared prefix run's, indexed
    per row) and then their own where `allowed` (N, 1, q, L_past + q); each layer's own keys/values are kept
    (`kv`) for the runs that continue from these ids. Scores are scaled as the HF modules scale them.

    Torch's fused attention (SDPA, grouped kv heads) rather than `grouped_attention`'s matmul-softmax-matmul: it
    never materialises the (q, L) scores for the backward, which made the learner's attention ~2x cheaper on
    long continuations (docs/benchmarks.md, issue 17); rounding differs from the decoder's by ~1e-6."""

    linear = staticmethod(F.linear)
    takes_projections = False

    def __init__(self, allowed: torch.Tensor, past: KV | None) -> None:
        self.allowed, self.past = allowed, past
        self.kv: KV = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (N, kvh, q, d)
        self.kv.append((k, v))
        if self.past is not None:
            k, v = torch.cat([self.past[layer][0], k], dim=2), torch.cat([self.past[layer][1], v], dim=2)
        N, nq, nh, d = q.shape
        q = q.transpose(1, 2)  # (N, heads, q, d)
        # Under bf16 autocast on CPU, torch's fused attention backward ran ~4x slower in bf16 than in fp32 (torch
        # 2.13, AMD EPYC with avx512_bf16): there the matmuls around it keep bf16 and this runs in fp32.
        cpu = q.device.type == "cpu"
        with torch.autocast("cpu", enabled=False) if cpu else contextlib.nullcontext():
            if cpu:
                q, k, v = q.float(), k.float(), v.float()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed,
                                                 enable_gqa=nh != k.shape[1])  # (N, heads, q, d)
        return out.transpose(1, 2).reshape(N, nq, nh * d)


class LeanForward:
    """`LeanStack` with autograd through the model's own parameters (the weights are fused on every call) and
    `PrefixAttention`: what the learner's shared-prefix runs use."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return (lean_supports(model) and not getattr(model.config, "attention_dropout", 0.0)
                and not has_lora_dropout(model))

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack = LeanStack(getattr(model, model.base_model_prefix))
        self.head = model.get_output_embeddings()

    def weights(self) -> list[LayerWeights]:
        """The fused weights, for every run of one learner step (one concatenation, one gradient split)."""
        return layer_weights(self.stack.body)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                 allowed: torch.Tensor, layers: list[LayerWeights], past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """Final-norm hidden states (R, H) of the first `lengths` (N,) of ids (N, q) in row order (the rest is
        padding and does not run), at `positions` (N, q), attending to `past` keys then its own where `allowed`
        (N, 1, q, L_past + q); also returns each layer's keys/values (N, kv_heads, q, d) of these ids. `logits`
        turns the hidden states of several runs into logits in one matmul."""
        body = self.stack.body
        cos, sin = body.rotary_emb(body.embed_tokens.weight[:1, None], positions)  # (N, q, d)
        real = (torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]).flatten().nonzero()[:, 0]  # (R,)
        attention = PrefixAttention(allowed, past)
        return self.stack.hidden(ids, cos, sin, layers, attention, real), attention.kv  # (R, H)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (R, V) of hidden states (R, H)."""
        return self.head(hidden).float()


def _causal_mask(past_len: torch.Tensor, q: int, past_width: int) -> torch.Tensor:
    """(N, 1, q, past_width + q) which keys each query attends to: a row's first `past_len` past keys, then its
    own keys up to the query (right padding sits after every real query, so it is never attended; every query
    attends at least to itself, so no softmax row is empty)."""
    dev = past_len.device
    keys = torch.arange(past_width + q, device=dev)  # (L,)
    query = torch.arange(q, device=dev)[:, None]  # (q, 1)
    own = (keys >= past_width) & (keys - past_width <= query)  # (q, L)
    past = keys[None, None, :] < past_len[:, None, None]  # (N, 1, L)
    return (own[None] | past)[:, None]  # (N, 1, q, L)


def shared_prefix_scores(forward: LeanForward, batch: TokenBatch, plan: PrefixPlan, buckets: list[torch.Tensor],
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token logprobs (B, T) of every row, each position exactly as a plain forward scores it (positions
    before a row's prefix length from its group's prefix run, the rest from its own continuation run; padding
    0), and the distinct final hidden states (N, H) with each position's row in them (B, T), for a head that
    reads them. `buckets` splits the rows (continuations of similar length run together)."""
    hidden, where = shared_prefix_hidden(forward, batch, plan, buckets)  # (N, H), (B, T)
    # one head matmul over every run's rows: concatenating H-wide hidden states, not V-wide logits
    table = forward.logits(hidden)  # (N, V)
    lp = table_logprobs(table, where, batch.input_ids, temperature, batch.logit_masks)  # (B, T)
    return lp.masked_fill(batch.attention_mask == 0, 0.0), hidden, where


def table_logprobs(table: torch.Tensor, where: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                   logit_masks: LogitMasks | None = None) -> torch.Tensor:
    """Per-token logprobs (B, T) from the distinct logit rows (N, V) and each position's row in them (B, T),
    without expanding the logits to (B, T, V): each distinct row (a group's prompt positions are shared by its
    rows) is normalised once, and only the target token's log-probability is gathered per position (and, at
    positions sampled under constrained decoding, the log-probabilities of their listed ids). Position 0 gets 0;
    equal to `score_logits`' to float rounding (it subtracts a logsumexp, this takes log_softmax as the sampler
    does)."""
    # log_softmax, as the sampler normalises (algos.sampling): one fused kernel each way, ~2.5x cheaper than a
    # logsumexp and a subtraction here
    table = F.log_softmax(tempered(table, temperature), dim=-1)  # (N, V)
    rows, targets = where[:, :-1], input_ids[:, 1:]  # (B, T-1): position t predicts token t + 1
    lp = table[rows, targets]  # (B, T-1)
    if logit_masks is not None:  # position t of `lp` is token t + 1, so its set is that of token t + 1
        at = (logit_masks.index[:, 1:] >= 0).nonzero(as_tuple=True)  # M constrained positions
        sets = logit_masks.index[:, 1:][at]  # (M,)
        ids = logit_masks.token_ids[sets]  # (M, K), -1 padded
        listed = table[rows[at][:, None], ids.clamp(min=0)]  # (M, K)
        lp = lp.index_put(at, lp[at] - legal_log_mass(listed, ids >= 0, logit_masks.allow[sets]))
    return F.pad(lp, (1, 0))  # (B, T)


def _rows_of(pick: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rows of x (P, ...) chosen by the one-hot pick (b, P): (b, ...)."""
    return (pick @ x.reshape(len(x), -1)).view(len(pick), *x.shape[1:])


def shared_prefix_hidden(forward: LeanForward, batch: TokenBatch, plan: PrefixPlan,
                         buckets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct final-norm hidden states (N, H) of the prefix and continuation runs, and for every position
    of every row the index of its state in that table (B, T): `hidden[where]` is the plain forward's (B, T, H)."""
    P, S = plan.prefix_ids.shape
    T = batch.input_ids.shape[1]
    cols = torch.arange(max(S, T), device=batch.input_ids.device)
    layers = forward.weights()
    prefix_hidden, prefix_kv = forward(plan.prefix_ids, cols[:S].expand(P, S), plan.prefix_len,
                                       _causal_mask(torch.zeros_like(plan.prefix_len), S, 0), layers)  # (R, H)
    start = plan.prefix_len[plan.source]  # (B,) first position each row runs itself
    hiddens = [prefix_hidden]
    first_row = torch.cumsum(plan.prefix_len, 0) - plan.prefix_len  # (P,) each prefix's first row in the table
    where = first_row[plan.source, None] + cols[None, :T]  # (B, T); positions from `start` on are set below
    offset = len(prefix_hidden)
    for rows in buckets:
        own = plan.lengths[rows] - start[rows]  # (b,)
        q = int(own.max())
        positions = start[rows, None] + cols[None, :q]  # (b, q)
        ids = batch.input_ids[rows].gather(1, positions.clamp(max=T - 1))  # (b, q); past the end: not run
        # each row's prefix keys/values as a one-hot matmul: exact (one nonzero term; where matmuls round to TF32,
        # rounded as every other matmul is), and its backward, the sum over a group's rows, is one small matmul
        # where indexing's (an accumulating index_put) cost ~10x more on CPU
        pick = F.one_hot(plan.source[rows], P).to(prefix_kv[0][0].dtype)  # (b, P)
        past = [(_rows_of(pick, k), _rows_of(pick, v)) for k, v in prefix_kv]  # (b, kvh, S, d) per layer
        hidden, _ = forward(ids, positions, own, _causal_mask(start[rows], q, S), layers, past)  # (sum own, H)
        hiddens.append(hidden)
        t = cols[None, :T] - start[rows, None]  # (b, T) index into the row's continuation
        own_rows = offset + (torch.cumsum(own, 0) - own)[:, None] + torch.minimum(t.clamp(min=0), own[:, None] - 1)
        where[rows] = torch.where(t >= 0, own_rows, where[rows])
        offset += len(hidden)
    return torch.cat(hiddens), where  # (N, H), (B, T)
