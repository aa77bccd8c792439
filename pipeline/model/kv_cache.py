"""Incremental-decoding KV cache, preallocated, with the recurrence-step sharing strategies of the GRT paper (§3.3,
Tables 3 and 4) and left-padded batches.

Protocol (every model in pipeline.model follows it): a forward over new tokens calls ``start = cache.begin(idx)``
once (the new tokens' first position, per row for a left-padded batch), ``cache_slot(cache, block)`` for each block
it runs, with the blocks of recurrence step r looked up through ``at_step(cache, r)``, so that the cache knows every
block execution as (layer = the block module, step), and ``cache.advance()`` at the end.

Strategies (``kv``) for a block run at steps 0..r-1 in a forward (blocks run once per forward, i.e. prelude, coda and
every dense layer, have one step, and for them all four coincide):
    full      one layer cache per (block, step): step s of a new token attends to the earlier tokens' step-s K/V
              (the exact model; memory (n_pre + n_core r + n_coda) layer caches)
    last      ONE layer cache per block, holding each token's K/V of the last step it ran
    first     ... of the first step it ran
    averaged  ... the mean of its K/V over the steps it ran
    (compact strategies: memory (n_pre + n_core + n_coda) layer caches whatever r)
Attention of a forward over T new tokens at (block, step s): the earlier tokens' cached K/V of that block (of step s
for ``full``) plus the new tokens' own step-s K/V, causally. The first forward over a prompt (prefill) therefore
attends step by step exactly as the uncached model does, decoding attends to the compacted past, and chunked prefill
and decoding are the same code. ``advance`` then compacts the new tokens' step-wise K/V into the layer cache. The
paper's reason for an uncompacted prefill: reusing compacted caches within the prompt costs accuracy.

Forwards of different depths (early exit at decode): under ``full``, a token that ran r' steps fills the slots of
the deeper steps r'..r-1 it did not run with its last computed step's K/V (step r'-1), and a forward deeper than the
cache has seen starts the new slots of the earlier tokens from their deepest slot, the same rule; the compact
strategies compact over the steps the token ran, so they need no rule.

Key masks (MoR's causal threshold routing): a caller that passes ``key_mask`` (which new tokens ran this step)
gets, per slot, which cached tokens are keys. ``full`` keeps each step's mask. The compact strategies compact each
token's K/V over the steps it was chosen at and count it as a key of the layer cache if it was chosen at any step:
every token is chosen at recursion 0, so every earlier token stays a key at every recursion, which is MoR's own
"recursive KV sharing" (the first recursion's K/V, in which every token is present, reused by all recursions).

Buffers are [B, H, max_len, hd] per layer cache, allocated at the first write and written in place; attention
reads views of them, so no decode step concatenates or reallocates the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

KV_STRATEGIES = ("full", "last", "first", "averaged")


class KVSlot:
    """One layer cache: keys and values [B, H, max_len, hd] of every cached position and, for callers that pass a
    key mask, which positions are keys [B, max_len] (bool); allocated at the first write, written in place."""

    def __init__(self, cache: "KVCache"):
        self.cache = cache
        self.k = self.v = self.key_mask = None
        self.masked: bool | None = None  # whether the caller passes key masks (decided by its first call)
        self._acc = None  # compact strategies: (K, V, steps ran) of the new tokens folded so far in this forward

    def update(self, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None):
        """Write the new tokens' K/V of this step ([B, H, T, hd]) at their positions; return (keys, values,
        key mask [B, keys] or None) to attend to: every cached position up to the last new token. ``key_mask``
        ([B, T] bool): which new tokens ran this step (MoR); left pads are never keys."""
        c = self.cache
        a, b = c.pos, c.pos + k.shape[2]
        if k.shape[2] != c.n_new:
            raise RuntimeError(f"{k.shape[2]} new tokens written to a cache told to expect {c.n_new}; call "
                               f"cache.begin(idx) once at the start of every forward")
        if self.masked is None:
            self.masked = key_mask is not None
            B, H, _, hd = k.shape
            self.k = k.new_zeros(B, H, c.max_len, hd)
            self.v = v.new_zeros(B, H, c.max_len, hd)
            if self.masked:
                self.key_mask = torch.zeros(B, c.max_len, dtype=torch.bool, device=k.device)
        elif self.masked != (key_mask is not None):
            raise ValueError("this cache slot was filled with(out) a key_mask; pass key_mask on every call or none")
        self.k[:, :, a:b] = k
        self.v[:, :, a:b] = v
        if self.masked:
            self.key_mask[:, a:b] = key_mask if c.valid is None else key_mask & c.valid[:, a:b]
            return self.k[:, :, :b], self.v[:, :, :b], self.key_mask[:, :b]
        return self.k[:, :, :b], self.v[:, :, :b], None if c.valid is None else c.valid[:, :b]

    # ---- compaction of the forward in progress (last | first | averaged)
    def _new(self) -> slice:
        return slice(self.cache.pos, self.cache.pos + self.cache.n_new)

    def fold(self) -> None:
        """Take the step now held at the new tokens' positions into the running compaction, per token over the
        steps it ran (all of them without a key mask)."""
        new, kv = self._new(), self.cache.kv
        k, v = self.k[:, :, new], self.v[:, :, new]
        ran = self.key_mask[:, new] if self.masked else torch.ones(k.shape[0], k.shape[2], dtype=torch.bool,
                                                                   device=k.device)
        if self._acc is None:
            acc_dtype = torch.promote_types(k.dtype, torch.float32)  # a mean of bf16 K/V summed in fp32
            self._acc = (torch.zeros_like(k, dtype=acc_dtype), torch.zeros_like(v, dtype=acc_dtype),
                         torch.zeros(ran.shape, dtype=torch.long, device=k.device))
        acc_k, acc_v, count = self._acc
        take = ran[:, None, :, None]
        if kv == "averaged":
            acc_k += torch.where(take, k, 0)
            acc_v += torch.where(take, v, 0)
        else:
            if kv == "first":
                take = take & (count == 0)[:, None, :, None]
            acc_k.copy_(torch.where(take, k, acc_k))
            acc_v.copy_(torch.where(take, v, acc_v))
        count += ran

    def finish(self, steps: int) -> None:
        """End of the forward: write the new tokens' compacted K/V (and key flags: ran any step) in place of the
        step-wise ones. One step, or ``last`` without key masks, is already compact where it stands."""
        if steps > 1 and (self.masked or self.cache.kv != "last"):
            self.fold()
            acc_k, acc_v, count = self._acc
            new, ran = self._new(), (count > 0)[:, None, :, None]
            div = count.clamp(min=1)[:, None, :, None] if self.cache.kv == "averaged" else 1
            # a token that ran no step (MoR: never chosen; pads) keeps its last K/V and is no key (flag below)
            self.k[:, :, new] = torch.where(ran, acc_k / div, self.k[:, :, new])
            self.v[:, :, new] = torch.where(ran, acc_v / div, self.v[:, :, new])
            if self.masked:
                self.key_mask[:, new] = count > 0
        self._acc = None

    # ---- full: slots of steps a forward did not run, or had not run before
    def fill_new_from(self, other: "KVSlot") -> None:
        """The new tokens' K/V (and key flags) copied from ``other``: the fill rule for steps they did not run."""
        new = self._new()
        self.k[:, :, new] = other.k[:, :, new]
        self.v[:, :, new] = other.v[:, :, new]
        if self.masked:
            self.key_mask[:, new] = other.key_mask[:, new]

    def copy_past_from(self, other: "KVSlot") -> None:
        """A new slot (a step deeper than the cached tokens ran) starting, for them, as ``other``: the fill rule."""
        self.masked = other.masked
        self.k, self.v = torch.zeros_like(other.k), torch.zeros_like(other.v)
        past = slice(0, self.cache.pos)
        self.k[:, :, past], self.v[:, :, past] = other.k[:, :, past], other.v[:, :, past]
        if other.masked:
            self.key_mask = torch.zeros_like(other.key_mask)
            self.key_mask[:, past] = other.key_mask[:, past]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.key_mask) if t is not None]


class KVCache:
    """The cache of one batch: ``max_len`` positions (columns; left pads included), strategy ``kv``, and for a
    left-padded batch the number of pads of each row (``n_pad``; row b's first real token gets position 0)."""

    def __init__(self, max_len: int, kv: str = "full", n_pad: Sequence[int] | None = None):
        if kv not in KV_STRATEGIES:
            raise ValueError(f"kv={kv!r} is not a KV-cache strategy; choose one of {', '.join(KV_STRATEGIES)}")
        self.max_len, self.kv = int(max_len), kv
        self.n_pad = [int(p) for p in n_pad] if n_pad is not None and any(n_pad) else None
        self.pos = 0  # columns already cached
        self.n_new = 0  # tokens of the forward in progress
        self.valid: torch.Tensor | None = None  # [B, max_len] bool: not a left pad (None without pads)
        self.layers: dict[nn.Module, list[KVSlot]] = {}  # per block: its slot per step (full) or its one slot
        self._steps: dict[nn.Module, int] = {}  # steps each block ran in the forward in progress
        self._start: torch.Tensor | None = None

    @classmethod
    def left_padded(cls, prompts: Sequence[Sequence[int]], max_len: int, kv: str = "full", pad_id: int = 0,
                    device=None) -> tuple["KVCache", torch.Tensor]:
        """(cache, idx [B, T]): ``prompts`` of any lengths >= 1 left-padded with ``pad_id`` into one batch, and a
        cache that gives each row positions from 0 at its first token and never attends to its pads."""
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token (a BOS/EOT token for an empty one)")
        T = max(len(p) for p in prompts)
        n_pad = [T - len(p) for p in prompts]
        idx = torch.tensor([[pad_id] * n + list(p) for n, p in zip(n_pad, prompts)], dtype=torch.long, device=device)
        return cls(max_len, kv, n_pad), idx

    def begin(self, idx: torch.Tensor) -> int | torch.Tensor:
        """Start a forward over the new tokens ``idx`` [B, T]; returns their first position: an int, or per row
        ([B] long, pos - n_pad: negative for a row's left pads) in a left-padded batch."""
        B, T = idx.shape
        if self.pos + T > self.max_len:
            raise ValueError(f"{self.pos} cached + {T} new positions exceed the cache's max_len={self.max_len}; "
                             f"start a new cache from the recent tokens or build it with a larger max_len")
        if self.n_pad is not None and self.valid is None:
            if len(self.n_pad) != B:
                raise ValueError(f"the cache has pads for {len(self.n_pad)} rows, the batch has {B}")
            n_pad = torch.tensor(self.n_pad, device=idx.device)
            self._start = -n_pad
            self.valid = torch.arange(self.max_len, device=idx.device)[None, :] >= n_pad[:, None]
        self.n_new, self._steps = T, {}
        for slots in self.layers.values():
            for slot in slots:
                slot._acc = None  # a forward that raised midway leaves nothing behind
        return self.pos if self._start is None else self._start + self.pos

    def at_step(self, step: int) -> "KVCacheAtStep":
        """The cache as seen by the blocks of recurrence step ``step`` (0-based) of this forward."""
        return KVCacheAtStep(self, step)

    def slot(self, layer: nn.Module, step: int = 0) -> KVSlot:
        """The layer cache of block ``layer`` at ``step`` (0 for blocks run once per forward). A forward runs each
        block's steps 0, 1, 2, ... in order; repeating the current step (e.g. a coda run again to read an exit)
        overwrites it."""
        ran = self._steps.get(layer, 0)
        if not 0 <= step <= ran:
            raise RuntimeError(f"step {step} of a {type(layer).__name__} asked for after {ran} step(s) of it in this "
                               f"forward; run a block's steps 0, 1, 2, ... in order")
        slots = self.layers.get(layer)
        if slots is None:
            if self.pos > 0:
                raise RuntimeError(f"a {type(layer).__name__} that the {self.pos} cached positions never ran: decode "
                                   f"with the blocks the prompt ran (n_steps at least 1, the same exit layer)")
            slots = self.layers[layer] = []
        if self.kv == "full":
            if step == len(slots):  # deeper than any earlier forward: the cached tokens' fill rule
                slots.append(KVSlot(self))
                if self.pos > 0:
                    slots[-1].copy_past_from(slots[-2])
            slot = slots[step]
        else:
            if not slots:
                slots.append(KVSlot(self))
            slot = slots[0]
            if 0 < step == ran and (slot.masked or self.kv != "last"):
                slot.fold()  # the previous step's K/V, before this step overwrites them
        self._steps[layer] = max(ran, step + 1)
        return slot

    def advance(self) -> None:
        """End the forward: compact (or, for ``full``, fill the steps it did not run) and move past its tokens."""
        for layer, slots in self.layers.items():
            ran = self._steps.get(layer, 0)
            if ran == 0:
                raise RuntimeError(f"this forward did not run a {type(layer).__name__} whose keys the cache holds for "
                                   f"the earlier tokens; every forward must run every cached block at least once")
            if self.kv == "full":
                for slot in slots[ran:]:  # fill rule: steps ran..deepest get the last computed step's K/V
                    slot.fill_new_from(slots[ran - 1])
            else:
                slots[0].finish(ran)
        self.pos += self.n_new
        self.n_new, self._steps = 0, {}

    def n_layer_caches(self) -> int:
        """Layer caches held: n_pre + n_core r + n_coda (full), n_pre + n_core + n_coda (compact)."""
        return sum(len(slots) for slots in self.layers.values())

    def nbytes(self) -> int:
        """Bytes of the preallocated K, V (and key-mask) buffers, all ``max_len`` positions."""
        return sum(t.numel() * t.element_size() for slots in self.layers.values() for s in slots for t in s.tensors())


class KVCacheAtStep:
    """A view of a :class:`KVCache` for the blocks of one recurrence step: ``slot(block)`` is the cache's
    ``slot(block, step)``."""

    def __init__(self, cache: KVCache, step: int):
        self.cache, self.step = cache, step

    def slot(self, layer: nn.Module) -> KVSlot:
        return self.cache.slot(layer, self.step)


def cache_slot(cache: KVCache | KVCacheAtStep | None, layer: nn.Module) -> KVSlot | None:
    """``layer``'s slot in ``cache`` (a whole cache: step 0, a block run once per forward), or None without one."""
    return cache.slot(layer) if cache is not None else None


def at_step(cache: KVCache | None, step: int) -> KVCacheAtStep | None:
    """The cache of recurrence step ``step`` for the blocks inside it, or None without a cache."""
    return cache.at_step(step) if cache is not None else None
