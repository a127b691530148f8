"""Incremental decoding for transformers causal LMs: one KV-cache row per sequence, reused across turns.

A multi-turn episode is one growing token sequence. `HFSession` keeps each sequence's keys and values in its own
row ("slot") of a preallocated cache, starting at position 0 (no padding inside a row), so a new turn only
prefills the observation ids appended since the last one instead of the whole prefix. Sequences join and leave
between decode steps (continuous batching): an episode waiting on a tool does not hold the others back.

Per step: one batched prefill forward for the sequences that were given new ids, one batched decode forward for
the sequences that are generating. Sampled ids and logprobs stay in tensors until a turn finishes.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Hashable, Sequence

import torch

from agentgrad.algos.sampling import counter_uniform, next_token_logprobs, sample_rows
from agentgrad.backends import native
from agentgrad.backends.base import Generation, LogitsProcessor, PauseFn, SamplingParams
from agentgrad.backends.lean import LeanStack, grouped_attention, layer_weights, linear_rows
from agentgrad.backends.lean import supports as lean_supports
from agentgrad.models.hf import model_parts


class SlotCache:
    """Keys/values of up to `num_slots` sequences: k[layer] is (S, kv_heads, capacity, head_dim).

    Duck-types the `Cache.update` call that transformers' attention layers make. Before each forward the caller
    sets `rows` (which slots the batch rows are; None = slots first..first+n-1 in order) and `write_pos` (B, q)
    (where each new token goes), and the layer gets back keys/values for positions 0..kv_len-1 of those slots.
    """

    is_compileable = False

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows: torch.Tensor | None = None  # (B,) long
        self.first = 0  # with rows None: the batch is slots first..first+B-1
        self.write_pos = torch.zeros((0, 1), dtype=torch.long, device=device)  # (B, q)
        self.kv_len = 0
        # Slot s's first alias_len[s] positions also sit, the same bits, in slot alias_src[s] (`share`): the
        # compiled attention reads them there, so a group of samples streams its prompt from memory once.
        self.alias_src = torch.arange(num_slots, device=device)  # (S,)
        self.alias_len = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def fits(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> bool:
        """Whether a new session of this shape can take this cache over (`reset`) instead of allocating one."""
        S, kvh, _, d = self.k[0].shape
        return (len(self.k) == num_layers and num_slots <= S <= 2 * num_slots and (kvh, d) == (kv_heads, head_dim)
                and self.k[0].dtype == dtype and self.k[0].device == device)

    def reset(self) -> SlotCache:
        """Empty, for the next session: zeroed in place (a fresh allocation's page faults cost ~4x the memset:
        14 of a 64-episode rollout's ~250 ms). Zeroed, not left stale: a masked position contributes exactly 0
        only while its value is finite."""
        with torch.inference_mode():  # `grow` ran in a step, under inference mode: its buffers are inference tensors
            for buf in (*self.k, *self.v):
                buf.zero_()
        self.rows, self.first, self.kv_len = None, 0, 0
        self.write_pos = self.write_pos[:0]
        self.alias_src = torch.arange(len(self.alias_src), device=self.alias_src.device)
        self.alias_len.zero_()
        return self

    def share(self, slot: int, src: int, n: int) -> None:
        """Copy positions 0..n-1 of slot `src` into `slot` (an identical prompt), and remember that they match."""
        for buf in (*self.k, *self.v):
            buf[slot, :, :n] = buf[src, :, :n]
        self.alias_src[slot], self.alias_len[slot] = src, n

    def forget(self, slot: int) -> None:
        """`slot` is free for another sequence: no slot reads its positions in its place any more."""
        mine = self.alias_src == slot  # (S,)
        self.alias_len[mine] = 0
        self.alias_src[mine] = torch.arange(len(mine), device=mine.device)[mine]
        self.alias_len[slot], self.alias_src[slot] = 0, slot

    def grow(self, capacity: int, limit: int | None = None) -> None:
        """Make room for `capacity` positions per slot: doubling, so growth is rare, but not past `limit` (the
        session's token budget) unless `capacity` itself is larger (padded prefill rows can reach past it)."""
        if capacity <= self.capacity:
            return
        new = max(capacity, min(2 * self.capacity, limit or 2 * self.capacity))
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                grown = t.new_zeros((t.shape[0], t.shape[1], new, t.shape[3]))
                grown[:, :, : t.shape[2]] = t
                buf[i] = grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        B = key_states.shape[0]
        rows = self.rows if self.rows is not None else torch.arange(self.first, self.first + B, device=k.device)
        # Advanced indices around a slice put the indexed dims first: the target is (B, q, kv_heads, head_dim).
        k[rows[:, None], :, self.write_pos] = key_states.transpose(1, 2)
        v[rows[:, None], :, self.write_pos] = value_states.transpose(1, 2)
        if self.rows is None:
            window = slice(self.first, self.first + B)
            return k[window, :, : self.kv_len], v[window, :, : self.kv_len]  # views: no copy on the decode path
        return k[rows, :, : self.kv_len], v[rows, :, : self.kv_len]

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.kv_len


class CachedAttention:
    """`LeanStack` attention for decoding: this step's keys/values are written into the slot cache at
    `write_pos` (B, q) of slots `rows` (None: slots first..first+B-1), and the queries attend to positions 0..kv_len-1
    of those slots under `bias` (B, 1, 1, q, L)."""

    linear = staticmethod(linear_rows)
    takes_projections = False

    def __init__(self, cache: SlotCache, write_pos: torch.Tensor, rows: torch.Tensor | None,
                 bias: torch.Tensor, first: int = 0) -> None:
        self.cache, self.write_pos, self.rows, self.bias = cache, write_pos, rows, bias
        B = write_pos.shape[0]
        self.window = slice(first, first + B)
        self.slot_rows = (rows if rows is not None else torch.arange(first, first + B, device=write_pos.device))[
            :, None]  # (B, 1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc, L = self.cache.k[layer], self.cache.v[layer], self.cache.kv_len
        kc[self.slot_rows, :, self.write_pos] = k
        vc[self.slot_rows, :, self.write_pos] = v
        if self.rows is None:
            K, V = kc[self.window, :, :L], vc[self.window, :, :L]  # (B, kvh, L, d) views
        else:
            K, V = kc[self.rows, :, :L], vc[self.rows, :, :L]
        return grouped_attention(q, K, V, self.bias)


class NativeAttention:
    """`LeanStack` attention through the compiled kernel (`native.py`): RoPE, the cache write at `write_pos`
    (B, q) of slots `rows` (None: first..first+B-1) and the attention in one call per layer; the same numbers as
    `CachedAttention` up to float rounding. The kernel takes one token at a time, in order, so a row's q new
    tokens are q consecutive entries (each written before the next attends over it), and each attends over its
    own row's positions 0..its own: no (B, q, L) mask, and no dependence on the other rows."""

    linear = staticmethod(linear_rows)
    takes_projections = True

    def __init__(self, fn, cache: SlotCache, write_pos: torch.Tensor, rows: torch.Tensor | None, first: int,
                 cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        B, q = write_pos.shape
        self.fn, self.cache, self.cos, self.sin, self.heads = fn, cache, cos, sin, heads
        slots = rows if rows is not None else torch.arange(first, first + B, device=write_pos.device)  # (B,)
        self.slots = slots.repeat_interleave(q) if q > 1 else slots  # (B*q,)
        self.positions = write_pos.reshape(-1)  # (B*q,)
        self.src, self.shared = cache.alias_src[self.slots], cache.alias_len[self.slots]  # (B*q,)
        self.scratch = cos.new_empty((heads // cache.k[0].shape[1], cache.capacity))

    def attend_projections(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        return native.decode_attention(self.fn, qkv, self.cos, self.sin, self.slots, self.positions,
                                       self.cache.k[layer], self.cache.v[layer], self.heads, self.scratch,
                                       self.src, self.shared)


class LeanDecoder:
    """`LeanStack` over a session's slot cache (`NativeAttention` where the compiled kernel runs, else
    `CachedAttention`). The weights are fused once per session, with the attention scale folded into the query
    rows, so a session must not outlive a weight update; RoPE rows are looked up in a table. Tests check logprobs
    against a full HF forward."""

    supports = staticmethod(lean_supports)

    def __init__(self, body: torch.nn.Module, max_positions: int, native_attention: bool = False) -> None:
        self.stack = LeanStack(body)
        with torch.no_grad():
            self.layers = layer_weights(body, query_scale=self.stack.head_dim ** -0.5)
        self.cos, self.sin = self.stack.rope_table(max_positions)  # (P, d)
        weight, stack = body.embed_tokens.weight, self.stack
        usable = native_attention and native.supports(stack.heads, stack.kv_heads, stack.head_dim, weight.dtype,
                                                      weight.device)
        self.native = native.kernel() if usable else None  # None: torch's ops (`CachedAttention`)

    def positions(self, needed: int) -> None:
        if needed > self.cos.shape[0]:
            self.cos, self.sin = self.stack.rope_table(2 * needed)

    def __call__(self, input_ids: torch.Tensor, write_pos: torch.Tensor, cache: SlotCache,
                 rows: torch.Tensor | None, first: int = 0) -> torch.Tensor:
        """Hidden states (B, q, H) after the final norm, writing new keys/values into `cache`."""
        B, q = input_ids.shape
        L = cache.kv_len
        self.positions(L)
        if self.native is not None:
            attention = NativeAttention(self.native, cache, write_pos, rows, first, self.cos, self.sin,
                                        self.stack.heads)
            return self.stack.hidden(input_ids, self.cos, self.sin, self.layers, attention)
        keys = torch.arange(L, device=input_ids.device)
        dtype = self.stack.body.embed_tokens.weight.dtype
        bias = torch.zeros((B, 1, 1, q, L), dtype=dtype, device=input_ids.device)  # broadcast over (kv head, group)
        bias.masked_fill_(keys > write_pos[:, None, None, :, None], float("-inf"))  # causal within each row
        return self.stack.hidden(input_ids, self.cos[write_pos], self.sin[write_pos], self.layers,
                                 CachedAttention(cache, write_pos, rows, bias, first))


class HFSession:
    """Continuous-batching generation over keyed sequences that live across turns.

    `submit(key, ids, max_new_tokens)` appends ids to a sequence's context (the prompt the first time, then the
    observation) and asks for one more turn; `step()` advances every sequence one token and returns the turns
    that finished; `release(key)` frees the sequence's slot. Row randomness is keyed by (seed, key, position).
    With `pause`, a turn can also end at a decision point (finish_reason "pause");
    `submit(key, ids, n)` writes ids in (e.g. a tool name an action head chose) and continues it.
    """

    def __init__(self, model: torch.nn.Module, sampling: SamplingParams, *, eos_token_ids: Sequence[int],
                 pad_token_id: int, cache_kw: str, max_sequences: int, max_tokens: int,
                 logits_processor: LogitsProcessor | None = None, pause: PauseFn | None = None,
                 batch_invariant: bool = False, max_batch: int | None = None, spare: SlotCache | None = None,
                 native_attention: bool = False) -> None:
        self.model, self.sampling, self.logits_processor = model, sampling, logits_processor
        # Fewer decoding than resident sequences (the rest wait on tools): the generating slots are a window
        # anywhere in the cache, so a dense decode starts at the first of them, not at slot 0.
        self.windowed = max_batch is not None and max_batch < max_sequences
        self.pause, self.batch_invariant = pause, batch_invariant
        self.body, self.head = model_parts(model)
        self.lean = (LeanDecoder(self.body, max_tokens + 1, native_attention) if LeanDecoder.supports(model)
                     else None)
        self.pad_token_id, self.cache_kw, self.max_tokens = pad_token_id, cache_kw, max_tokens
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        S = max(1, max_sequences)
        if spare is not None and spare.fits(cfg.num_hidden_layers, S, kv_heads, head_dim, dtype, device):
            self.cache = spare.reset()  # `spare`: the last session's cache (`HFPolicy.session`)
        else:
            self.cache = SlotCache(cfg.num_hidden_layers, S, kv_heads, head_dim, min(max_tokens + 1, 256), dtype,
                                   device)
        self.device = device
        self.seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.eos = torch.tensor(sorted(set(eos_token_ids)), device=device)  # (E,)
        max_new = sampling.max_new_tokens
        self.length = torch.zeros(S, dtype=torch.long, device=device)  # (S,) tokens in the cache per slot
        self.tail = torch.zeros(S, dtype=torch.long, device=device)  # (S,) last sampled id, not yet in the cache
        self.has_tail = [False] * S
        self.generating = torch.zeros(S, dtype=torch.bool, device=device)  # (S,)
        self.row_key = torch.zeros(S, dtype=torch.long, device=device)  # (S,) sampling key of each slot
        self.gen_ids = torch.zeros((S, max_new), dtype=torch.long, device=device)  # (S, N) this turn's ids
        self.gen_lps = torch.zeros((S, max_new), dtype=torch.float32, device=device)  # (S, N)
        self.gen_count = torch.zeros(S, dtype=torch.long, device=device)  # (S,)
        self.max_new = torch.zeros(S, dtype=torch.long, device=device)  # (S,)
        self._free = list(range(S))
        self._slot: dict[Hashable, int] = {}
        self._key_of: list[Hashable | None] = [None] * S
        self._queued: dict[int, list[int]] = {}  # slot -> ids to prefill
        self._prefix_ids: list[int] = []  # the prefix all prompts share, and its keys/values per layer
        self._prefix_k: list[torch.Tensor] = []
        self._prefix_v: list[torch.Tensor] = []

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._queued) or bool(self.generating.any())

    def submit(self, key: Hashable, new_ids: Sequence[int], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        slot = self._slot.get(key)
        if slot is None:
            if not new_ids:
                raise ValueError("cannot generate from an empty prompt")
            if not self._free:
                raise RuntimeError(f"all {len(self._key_of)} sequence slots are in use; release one first")
            slot = heapq.heappop(self._free)
            self._slot[key], self._key_of[slot] = slot, key
            self.length[slot] = 0
            self.has_tail[slot] = False
            self.row_key[slot] = key if isinstance(key, int) else hash(key)
        elif bool(self.generating[slot]) or slot in self._queued:
            raise RuntimeError(f"sequence {key!r} is still generating")
        ids = ([int(self.tail[slot])] if self.has_tail[slot] else []) + list(new_ids)
        self.has_tail[slot] = False
        self.max_new[slot] = min(max_new_tokens, self.gen_ids.shape[1])
        self._queued[slot] = ids

    def release(self, key: Hashable) -> None:
        slot = self._slot.pop(key)
        self._key_of[slot] = None
        self._queued.pop(slot, None)
        self.generating[slot] = False
        self.cache.forget(slot)
        heapq.heappush(self._free, slot)

    # ---- forward passes ------------------------------------------------------------------------------------

    def _hidden(self, input_ids: torch.Tensor, write_pos: torch.Tensor, rows: torch.Tensor | None,
                first: int = 0) -> torch.Tensor:
        """Run the decoder over new ids (B, q) written at `write_pos` (B, q) of slots `rows` (None: slots
        first..first+B-1); (B, q, H) out."""
        cache = self.cache
        # The attention reductions run over kv_len keys, and kernels round differently for other lengths; the
        # longest row sharing this step sets it, so a row's floats depend on its neighbours unless it is fixed.
        kv_len = self.max_tokens + 1 if self.batch_invariant else int(write_pos.max()) + 1
        cache.grow(kv_len, self.max_tokens + 1)
        cache.rows, cache.write_pos, cache.first = rows, write_pos, first
        cache.kv_len = kv_len
        if self.lean is not None:
            return self.lean(input_ids, write_pos, cache, rows, first)
        keys = torch.arange(cache.kv_len, device=self.device)  # (L,)
        mask = (keys[None, None, None, :] <= write_pos[:, None, :, None])  # (B, 1, q, L): causal within the row
        masks = {"full_attention": mask, "sliding_attention": mask}
        out = self.body(input_ids=input_ids, attention_mask=masks, position_ids=write_pos, use_cache=True,
                        **{self.cache_kw: cache})
        return out.last_hidden_state

    def _share_prompts(self, slots: list[int], seqs: list[list[int]]) -> tuple[list[int], dict[int, int]]:
        """Skip prompt work already done: a new prompt equal to another one in this batch (GRPO's group of
        samples) is computed once; a new prompt starting with the session's shared prefix (system prompt and
        tool list) gets that prefix's keys/values copied in. Returns the rows to compute and {dup row: row}."""
        first: dict[tuple[int, ...], int] = {}
        duplicates: dict[int, int] = {}
        compute = []
        for r, (slot, ids) in enumerate(zip(slots, seqs)):
            if self.length[slot] == 0:
                key = tuple(ids)
                if key in first:
                    duplicates[r] = first[key]
                    continue
                first[key] = r
                shared = len(os.path.commonprefix([self._prefix_ids, ids])) if self._prefix_ids else 0
                shared = min(shared, len(ids) - 1)  # the last prompt token must run: its logits start the turn
                if shared > 0:
                    for buf, pre in ((self.cache.k, self._prefix_k), (self.cache.v, self._prefix_v)):
                        for layer, saved in zip(buf, pre):
                            layer[slot, :, :shared] = saved[:, :shared]
                    self.length[slot] = shared
                    seqs[r] = ids[shared:]
            compute.append(r)
        return compute, duplicates

    def _compute_prefix(self, slots: list[int], seqs: list[list[int]]) -> None:
        """Run the prefix that this session's first distinct prompts share (system prompt, tool list) once, in
        one row, and keep its keys/values: `_share_prompts` then copies it into every new prompt's slot, this
        batch's and later admissions' alike, instead of each distinct prompt computing it again."""
        if self._prefix_ids:
            return
        fresh = list({tuple(ids): slot for slot, ids in zip(slots, seqs) if self.length[slot] == 0}.items())
        if not fresh:
            return
        prompts = [list(ids) for ids, _ in fresh]
        n = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
        if n < 4:
            return
        slot = fresh[0][1]
        self._hidden(torch.tensor([prompts[0][:n]], dtype=torch.long, device=self.device),
                     torch.arange(n, device=self.device)[None], torch.tensor([slot], device=self.device))
        self._prefix_ids = prompts[0][:n]
        self._prefix_k = [layer[slot, :, :n].clone() for layer in self.cache.k]
        self._prefix_v = [layer[slot, :, :n].clone() for layer in self.cache.v]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lean is not None and isinstance(self.head, torch.nn.Linear):
            return linear_rows(hidden, self.head.weight, self.head.bias).float()  # (R, V)
        return self.head(hidden).float()

    def _prefill(self) -> list[tuple[Hashable, Generation]]:
        slots = sorted(self._queued)
        seqs = [self._queued.pop(s) for s in slots]
        self._compute_prefix(slots, seqs)
        compute, duplicates = self._share_prompts(slots, seqs)
        c_slots = [slots[r] for r in compute]
        rows = torch.tensor(c_slots, dtype=torch.long, device=self.device)  # (R,)
        lens = torch.tensor([len(seqs[r]) for r in compute], dtype=torch.long, device=self.device)  # (R,)
        q = int(lens.max())
        input_ids = torch.full((len(compute), q), self.pad_token_id, dtype=torch.long, device=self.device)  # (R, q)
        for i, r in enumerate(compute):
            input_ids[i, : len(seqs[r])] = torch.tensor(seqs[r], dtype=torch.long)
        write_pos = self.length[rows][:, None] + torch.arange(q, device=self.device)[None, :]  # (R, q)
        hidden = self._hidden(input_ids, write_pos, rows)  # (R, q, H)
        last = hidden[torch.arange(len(compute), device=self.device), lens - 1]  # (R, H)
        self.length[rows] += lens
        logits = self._logits(last)  # (R, V)
        if duplicates:
            where = {r: i for i, r in enumerate(compute)}
            for dup, src in duplicates.items():
                n = int(self.length[slots[src]])
                self.cache.share(slots[dup], slots[src], n)
                self.length[slots[dup]] = n
            order = [where[duplicates.get(r, r)] for r in range(len(slots))]
            logits = logits[torch.tensor(order, device=self.device)]  # (len(slots), V)
        all_rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.gen_count[all_rows] = 0
        return self._sample_and_record(logits, all_rows)

    def _decode(self) -> list[tuple[Hashable, Generation]]:
        active = self.generating.nonzero().squeeze(-1)  # (A,)
        lo = int(active[0]) if self.windowed else 0
        hi = int(active[-1]) + 1
        if len(active) * 2 >= hi - lo:
            # Dense: run slots lo..hi-1 (idle ones compute a throwaway token at their next free position, which
            # the next real write there overwrites), so the cache is read through views, never gathered.
            rows, idx = None, active - lo
            input_ids = self.tail[lo:hi].masked_fill(~self.generating[lo:hi], self.pad_token_id)[:, None]  # (W, 1)
            write_pos = self.length[lo:hi][:, None]  # (W, 1)
        else:
            rows, idx = active, None
            input_ids = self.tail[active][:, None]  # (A, 1)
            write_pos = self.length[active][:, None]  # (A, 1)
        hidden = self._hidden(input_ids, write_pos, rows, lo)[:, 0]  # (B, H)
        if idx is not None:
            hidden = hidden[idx]
        self.length[active] += 1
        return self._sample_and_record(self._logits(hidden), active)

    # ---- sampling ------------------------------------------------------------------------------------------

    def _row_processor(self, slots: torch.Tensor):
        """The user's per-row logits processor as a batch function: row index = the sequence's key, generated
        ids = those of the current turn. A Python call per row and step, paid only when a processor is set."""
        if self.logits_processor is None:
            return None
        keys = [self._key_of[i] for i in slots.tolist()]
        counts = self.gen_count[slots].tolist()
        generated = self.gen_ids[slots, :max(counts, default=0)].tolist()  # one copy for all rows, not one a row

        def processor(row_logits: torch.Tensor) -> torch.Tensor:
            return torch.stack([self.logits_processor(k, ids[:c], row_logits[r])
                                for r, (k, ids, c) in enumerate(zip(keys, generated, counts))])

        return processor

    def _paused(self, slots: torch.Tensor) -> tuple[list[int], list[tuple[Hashable, Generation]]]:
        """Rows whose `pause` says stop before sampling; they come back as "pause" turns.
        Their last id is already in the cache (it was this step's input), so nothing is left to prefill."""
        if self.pause is None:
            return list(range(len(slots))), []
        keep, out = [], []
        for r, slot in enumerate(slots.tolist()):
            n = int(self.gen_count[slot])
            ids = tuple(self.gen_ids[slot, :n].tolist())
            if not self.pause(self._key_of[slot], ids):
                keep.append(r)
                continue
            self.generating[slot] = False
            gen = Generation(ids, tuple(self.gen_lps[slot, :n].tolist()), "pause")
            out.append((self._key_of[slot], gen))
        return keep, out

    def _sample_and_record(self, logits: torch.Tensor, slots: torch.Tensor) -> list[tuple[Hashable, Generation]]:
        """Sample one id per slot from logits (R, V); finished turns come back as Generations."""
        keep, paused = self._paused(slots)
        if paused:
            if not keep:
                return paused
            rows = torch.tensor(keep, device=self.device)
            logits, slots = logits[rows], slots[rows]
        return paused + self._sample(logits, slots)

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor) -> list[tuple[Hashable, Generation]]:
        s = self.sampling
        logp = next_token_logprobs(logits, s.temperature, s.top_p, self._row_processor(slots))  # (R, V)
        if s.temperature == 0:
            ids = logp.argmax(-1)  # (R,)
        else:
            ids = sample_rows(logp, counter_uniform(self.seed, self.row_key[slots], self.length[slots]))  # (R,)
        chosen = logp.gather(-1, ids[:, None]).squeeze(-1)  # (R,)
        count = self.gen_count[slots]  # (R,)
        self.gen_ids[slots, count] = ids
        self.gen_lps[slots, count] = chosen
        count = count + 1
        self.gen_count[slots] = count
        self.tail[slots] = ids
        stop = torch.isin(ids, self.eos)  # (R,)
        done = stop | (count >= self.max_new[slots])  # (R,)
        self.generating[slots] = ~done
        if not bool(done.any()):
            return []
        out = []
        for r in done.nonzero().squeeze(-1).tolist():
            slot = int(slots[r])
            n = int(count[r])
            self.has_tail[slot] = True
            gen = Generation(tuple(self.gen_ids[slot, :n].tolist()), tuple(self.gen_lps[slot, :n].tolist()),
                             "stop" if bool(stop[r]) else "length")
            out.append((self._key_of[slot], gen))
        return out

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Generation]]:
        """One prefill (of newly submitted ids) and one decode step (of sequences already generating)."""
        decoding = bool(self.generating.any())
        finished: list[tuple[Hashable, Generation]] = []
        if decoding:
            finished += self._decode()
        if self._queued:
            finished += self._prefill()
        return finished
