"""Hugging Face transformers backend: `HFPolicy` (batched KV-cache sampling) and `TorchLearner` (AdamW)."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from agentgrad.backends.base import Generation, LogitsProcessor, PauseFn, SamplingParams
from agentgrad.backends.hf_engine import HFSession, SlotCache
from agentgrad.backends.precision import FP32, ComputeDtype
from agentgrad.backends.scoring import token_logprobs, token_logprobs_and_hidden, with_head_decisions
from agentgrad.backends.shared_prefix import (
    LeanForward,
    PrefixPlan,
    plan_shared_prefixes,
    shared_prefix_scores,
)
from agentgrad.batch import TokenBatch
from agentgrad.models.hf import hidden_states, model_parts


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; accept both so users' pinned versions work."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFPolicy:
    """Samples from a causal LM with a KV cache. Returned logprobs are those of the distribution actually
    sampled from (after temperature, the logits processor and top-p).

    `session()` opens an incremental engine (`HFSession`): one cache row per sequence, reused across turns, with
    sequences joining and leaving between decode steps. `generate` is a one-turn session over its prompts.
    """

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 tool_head: torch.nn.Module | None = None, batch_invariant: bool = False,
                 native_attention: bool = True) -> None:
        self.model = model
        self.batch_invariant = batch_invariant  # rollout.batch_invariant: see HFSession._hidden
        self.native_attention = native_attention  # rollout.native_attention: see backends/native.py
        self.tool_head = tool_head  # a factored action head the agent loop asks (rollout.action_head=factored)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._cache_kw = _cache_kwarg(model)
        self._spare_cache: SlotCache | None = None  # the last session's, taken over by the next one of its shape

    @contextlib.contextmanager
    def session(self, sampling: SamplingParams, logits_processor: LogitsProcessor | None = None, *,
                max_sequences: int, max_tokens: int, pause: PauseFn | None = None,
                max_batch: int | None = None) -> Iterator[HFSession]:
        was_training = self.model.training
        self.model.eval()
        spare, self._spare_cache = self._spare_cache, None  # a session nested in this one allocates its own
        try:
            session = HFSession(self.model, sampling, eos_token_ids=self.eos_token_ids,
                                pad_token_id=self.pad_token_id, cache_kw=self._cache_kw, max_sequences=max_sequences,
                                max_tokens=max_tokens, logits_processor=logits_processor, pause=pause,
                                batch_invariant=self.batch_invariant, max_batch=max_batch, spare=spare,
                                native_attention=self.native_attention)
            yield session
            if session.cache.k[0].device.type == "cpu":  # a GPU's caching allocator already reuses the memory
                self._spare_cache = session.cache
        finally:
            if was_training:
                self.model.train()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> list[Generation]:
        """One turn per prompt. Row b's randomness is keyed by (sampling.seed, b, position), and the logits
        processor sees row index b and the ids generated so far in that row."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        out: dict[int, Generation] = {}
        longest = max(len(p) for p in prompts)
        with self.session(sampling, logits_processor, max_sequences=len(prompts),
                          max_tokens=longest + sampling.max_new_tokens) as s:
            for b, p in enumerate(prompts):
                s.submit(b, p, sampling.max_new_tokens)
            while s.has_work:
                out.update(s.step())
        return [out[b] for b in range(len(prompts))]

    @torch.inference_mode()
    def context_states(self, ids: Sequence[int]) -> torch.Tensor:
        """The final hidden states (L, H) of a sequence's ids, from the forward the learner scores with
        (`models.hf.hidden_states`): what a factored head reads at a decision (rollout/factored.py)."""
        body, _ = model_parts(self.model)
        x = torch.tensor([list(ids)], dtype=torch.long, device=next(self.model.parameters()).device)  # (1, L)
        return hidden_states(body, x, torch.ones_like(x))[0].float()  # (L, H)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        if all(own[k].data_ptr() == v.data_ptr() for k, v in state.items() if k in own):
            return  # colocated with the learner: already the same tensors
        self.model.load_state_dict(state)


# What one more forward (and its backward) is taken to cost, in padded token slots (per-op overhead of ~20 ops per
# layer). Rough on purpose: 0, 64 and 256 gave the same update speed within noise (docs/benchmarks.md, "What
# changed for these numbers"); it only keeps near-equal lengths from being split into separate forwards.
FORWARD_OVERHEAD_TOKENS = 64
# A plain forward runs padded rows through transformers' modules, whose per-call cost (~11 ms at the tiny width)
# makes runs of few rows dear. The shared-prefix path runs every per-token op on real tokens only, so a run's row
# count shapes only its attention: there a long continuation may run alone rather than pad 7 short ones to its
# length (benchmark c's batch: 8 rows at 152 queries for 438 real tokens; its update ~1.05x faster, docs/benchmarks.md).
MIN_BUCKET_ROWS = 8
MIN_PREFIX_BUCKET_ROWS = 1


def length_buckets(lengths: torch.Tensor, max_buckets: int, *, min_rows: int = MIN_BUCKET_ROWS,
                   overhead_tokens: int = FORWARD_OVERHEAD_TOKENS) -> list[torch.Tensor]:
    """Split rows (lengths (B,)) into at most `max_buckets` runs of similar length, each of at least `min_rows`
    rows: the split of the sorted lengths that minimises padded token slots plus `overhead_tokens` per run
    (dynamic programming over split points; a run costs its rows x its longest row). Equal-count chunks left
    a third of a rollout minibatch's slots as padding (measured, benchmark c), since episode lengths cluster
    by turn count rather than spreading evenly."""
    order = torch.argsort(lengths, stable=True)  # (B,)
    B = len(order)
    min_rows = max(1, min_rows)
    k_max = max(1, min(max_buckets, B // min_rows))
    if k_max == 1:
        return [order]
    sorted_len = lengths[order].to(torch.float64).cpu()  # (B,)
    ends = torch.arange(B + 1, dtype=torch.float64)  # (B+1,) a run covers sorted rows [i, j)
    # span[i, j]: slots of a run over sorted rows [i, j) = (j - i) * length of row j - 1; inf when shorter
    # than min_rows (or empty)
    span = (ends[None, :] - ends[:, None]) * F.pad(sorted_len, (1, 0))[None, :]  # (B+1, B+1)
    span = span.masked_fill(ends[None, :] - ends[:, None] < min_rows, math.inf)
    best = span[0].clone()  # (B+1,) one run over [0, j)
    cuts = [torch.zeros(B + 1, dtype=torch.long)]  # per run count: where the last run starts, for each end j
    totals = [float(best[B])]
    for _ in range(1, k_max):
        cand = best[:, None] + span  # (B+1, B+1) runs over [0, i) then [i, j)
        best, start = cand.min(0)  # (B+1,)
        cuts.append(start)
        totals.append(float(best[B]))
    k = min(range(k_max), key=lambda n: totals[n] + overhead_tokens * n)  # n + 1 runs
    bounds, j = [B], B
    for n in range(k, 0, -1):
        j = int(cuts[n][j])
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]  # every run has >= min_rows rows


class TorchLearner:
    """AdamW on a (colocated) model. `step` skips updates whose gradients are not finite and says so."""

    compute = FP32  # the forward's autocast (model.compute_dtype); subclasses that skip __init__ keep fp32

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), max_buckets: int = 4,
                 tool_head: torch.nn.Module | None = None, head_detached: bool = True,
                 compute: ComputeDtype | None = None) -> None:
        """`tool_head` (a factored action head) scores the head decisions of batches that carry them
        (`TokenBatch.head`). It is trained by the same AdamW but clipped on its own: under one global clip a
        fresh head's gradient (2.7x the LM's at the start of BC, measured) shrank the LM's step.
        `head_detached`: the head reads the LM's hidden states without passing its gradient into the LM (a probe;
        bc.head_grad), in BC (`logprobs_and_hidden`) and in RL alike. `compute`: the forward's autocast
        (`model.compute_dtype`; None: fp32)."""
        self.model = model
        self.compute = compute or FP32
        self.tool_head = tool_head
        self.head_detached = head_detached
        self.max_buckets = max_buckets
        self.lean = LeanForward(model) if LeanForward.supports(model) else None
        self.grad_clip = grad_clip
        # Frozen parameters (a LoRA run's base weights) stay out of the optimizer and the gradient clip.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.head_params = [p for p in tool_head.parameters() if p.requires_grad] if tool_head is not None else []
        groups = [{"params": self.params}] + ([{"params": self.head_params}] if self.head_params else [])
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas)

    def logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """Per-token logprobs (B, T). Rows are run in length buckets (`length_buckets`): a rollout batch mixes
        short and long episodes, and one padded forward wasted ~40% of its tokens on padding (measured).
        Rows of one group (`group_index`) that share a prefix (GRPO's samples of one prompt) run it once
        (`backends.shared_prefix`); batches without such rows (BC) take the plain forward. Under
        `model.compute_dtype=bf16` the forward (and so the backward) autocasts; logprobs come back fp32."""
        self.model.train()
        with self.compute.autocast():
            return self._logprobs(batch, temperature)

    def _logprobs(self, batch: TokenBatch, temperature: float) -> torch.Tensor:
        if batch.head is not None and self.tool_head is not None:
            return self._logprobs_with_head(batch, temperature)
        plan = plan_shared_prefixes(batch) if self.lean is not None else None
        if plan is not None:
            return self._shared_prefix_scores(batch, plan, temperature)[0]  # (B, T)
        lengths = batch.attention_mask.sum(1)  # (B,)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)  # (B, T)
        for rows in length_buckets(lengths, self.max_buckets):
            width = int(lengths[rows].max())
            masks = batch.logit_masks.select(rows, width) if batch.logit_masks is not None else None
            lp = token_logprobs(self.model, batch.input_ids[rows, :width], batch.attention_mask[rows, :width],
                                temperature, masks)  # (b, width)
            out = out.index_put((rows,), F.pad(lp, (0, out.shape[1] - width)))
        return out

    def _logprobs_with_head(self, batch: TokenBatch, temperature: float) -> torch.Tensor:
        """Token logprobs (B, T) with each head decision's log p(category) + log p(tool | category) (tempered as
        at sampling) at its score position, recomputed from the hidden states the head read. One forward."""
        lp, hidden = self._logprobs_and_states(batch, temperature)  # (B, T), (B, T, H)
        return with_head_decisions(lp, hidden.detach() if self.head_detached else hidden, self.tool_head, batch,
                                   temperature)

    def logprobs_and_hidden(self, batch: TokenBatch, *, temperature: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs (B, T) and the final hidden states (B, T, H) a factored head reads (detached under
        `head_detached`), from one forward (BC of a factored head)."""
        self.model.train()
        with self.compute.autocast():
            lp, hidden = self._logprobs_and_states(batch, temperature)
        hidden = hidden.float()  # (B, T, H)
        return lp, hidden.detach() if self.head_detached else hidden

    def _logprobs_and_states(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs (B, T) and final hidden states (B, T, H) from one forward: the shared-prefix one when rows of
        a group share a prefix (each runs once: a GRPO group's prompt, BC's system prompt), else the plain one."""
        plan = plan_shared_prefixes(batch) if self.lean is not None else None
        if plan is None:
            return token_logprobs_and_hidden(self.model, batch.input_ids, batch.attention_mask, temperature,
                                             batch.logit_masks)
        lp, hidden, where = self._shared_prefix_scores(batch, plan, temperature)
        return lp, hidden[where]  # (B, T), (B, T, H)

    def continuation_buckets(self, plan: PrefixPlan) -> list[torch.Tensor]:
        """The runs of rows whose continuations (past their group's shared prefix) run together."""
        return length_buckets(plan.lengths - plan.prefix_len[plan.source], self.max_buckets,
                              min_rows=MIN_PREFIX_BUCKET_ROWS)

    def _shared_prefix_scores(self, batch: TokenBatch, plan: PrefixPlan, temperature: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buckets = self.continuation_buckets(plan)
        return shared_prefix_scores(self.lean, batch, plan, buckets, temperature)  # (B, T), (N, H), (B, T)

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        if loss is not None:
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or math.inf)
        head = {}
        if self.head_params:
            head_norm = torch.nn.utils.clip_grad_norm_(self.head_params, self.grad_clip or math.inf)
            head = {"train/head_grad_norm": float(head_norm)}
        skipped = not (torch.isfinite(grad_norm) and (not head or math.isfinite(head["train/head_grad_norm"])))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": float(grad_norm), "train/skipped_steps": float(skipped), **head}

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
