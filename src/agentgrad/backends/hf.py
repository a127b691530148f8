"""Hugging Face transformers backend: `HFPolicy` (batched KV-cache sampling) and `TorchLearner` (AdamW)."""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from agentgrad.algos.constrained import masked_token_logprobs
from agentgrad.backends.base import Generation, LogitsProcessor, SamplingParams
from agentgrad.batch import LogitMasks, TokenBatch


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; accept both so users' pinned versions work."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of ids whose probability reaches top_p."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)  # (B, V)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the id that crosses top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class HFPolicy:
    """Samples from a causal LM with a KV cache. Returned logprobs are those of the distribution actually
    sampled from (after temperature, top-p and the logits processor)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._cache_kw = _cache_kwarg(model)

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()  # (B, V)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> list[Generation]:
        from transformers import DynamicCache

        if not prompts:
            return []
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        B, L = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long, device=device)  # (B, L) left-padded
        attention_mask = torch.zeros((B, L), dtype=torch.long, device=device)  # (B, L)
        for b, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError("cannot generate from an empty prompt")
            input_ids[b, L - len(p):] = torch.tensor(list(p), dtype=torch.long)
            attention_mask[b, L - len(p):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        eos = torch.tensor(self.eos_token_ids, device=device)
        cache = DynamicCache()
        logits = self._forward(input_ids, attention_mask, position_ids, cache)  # (B, V)
        next_pos = position_ids[:, -1:] + 1  # (B, 1)
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lps: list[list[float]] = [[] for _ in range(B)]
        finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        for step in range(sampling.max_new_tokens):
            if sampling.temperature > 0:
                logits = logits / sampling.temperature
            if logits_processor is not None:
                logits = torch.stack([logits_processor(b, out_ids[b], logits[b]) for b in range(B)])
            if sampling.temperature > 0 and sampling.top_p < 1.0:
                logits = _top_p_filter(logits, sampling.top_p)
            logp = torch.log_softmax(logits, dim=-1)  # (B, V)
            if sampling.temperature == 0:
                next_ids = logp.argmax(-1)  # (B,)
            else:
                next_ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)  # (B,)
            chosen = logp.gather(-1, next_ids[:, None]).squeeze(-1)  # (B,)
            ids_list, lp_list = next_ids.tolist(), chosen.tolist()
            for b in range(B):
                if not finished[b]:
                    out_ids[b].append(ids_list[b])
                    out_lps[b].append(lp_list[b])
            finished |= torch.isin(next_ids, eos)
            if bool(finished.all()) or step == sampling.max_new_tokens - 1:
                break
            next_ids = next_ids.masked_fill(finished, self.pad_token_id)
            attention_mask = torch.cat([attention_mask, torch.ones((B, 1), dtype=torch.long, device=device)], 1)
            logits = self._forward(next_ids[:, None], attention_mask, next_pos, cache)
            next_pos = next_pos + 1
        if was_training:
            self.model.train()
        eos_set = set(self.eos_token_ids)
        return [Generation(tuple(ids), tuple(lps), "stop" if ids and ids[-1] in eos_set else "length")
                for ids, lps in zip(out_ids, out_lps)]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        if all(own[k].data_ptr() == v.data_ptr() for k, v in state.items() if k in own):
            return  # colocated with the learner: already the same tensors
        self.model.load_state_dict(state)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, logit_masks: LogitMasks | None = None) -> torch.Tensor:
    """log p(token t | tokens < t) for every position; position 0 gets 0. Right-padded input. Tokens sampled
    under constrained decoding (`logit_masks`) are scored over their legal set, as they were sampled."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    logits = logits[:, :-1, :].float()  # (B, T-1, V) predicts tokens 1..T-1
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]  # (B, T-1)
    if logit_masks is not None:  # align with the shifted targets: position t of `lp` is token t + 1
        logit_masks = LogitMasks(logit_masks.index[:, 1:], logit_masks.token_ids, logit_masks.allow)
    lp = masked_token_logprobs(logits, targets, logit_masks)  # (B, T-1)
    return F.pad(lp, (1, 0))  # (B, T)


class TorchLearner:
    """AdamW on a (colocated) model. `step` skips updates whose gradients are not finite and says so."""

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999)) -> None:
        self.model = model
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)

    def logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor:
        self.model.train()
        return token_logprobs(self.model, batch.input_ids, batch.attention_mask, temperature,
                              batch.logit_masks)  # (B, T)

    def step(self, loss: torch.Tensor | None = None) -> dict[str, float]:
        if loss is not None:
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        skipped = not torch.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": float(grad_norm), "train/skipped_steps": float(skipped)}

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
