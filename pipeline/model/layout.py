"""Where the tokens of one forward sit: each token's position (restarting at every document under document masking),
which earlier tokens each query may attend to, and the rotary angles of those positions. A model builds one
:class:`TokenLayout` per forward and hands the same object to every block at every recurrence step, so the mask and
the angles are computed once, however deep the recurrence runs.

Document masking (``data.document_masking``): the loader gives each window ``docs`` [B, T], the index of the
document each token belongs to (non-decreasing along the window). A query attends only to earlier tokens of its own
document, and positions count from that document's first token in the window. Without it (``docs`` None), the
window is one sequence, as GPT-2 and the paper train.

The attention itself (:func:`pipeline.model.attention.causal_attention`) reads the mask in the form its kernel
takes: a boolean [B, 1, T, T] block-causal mask for SDPA, or FlexAttention's block mask, which lets a CUDA kernel
skip the blocks that lie wholly across documents (:func:`uses_flex` chooses). The layout builds that mask when it is
made, in the model's eager code before any block runs: a compiled or checkpointed block only reads it (no write into
an object from outside, which dynamo would refuse), and the mask is data, not a shape, so a compiled block does not
recompile when the document layout changes from batch to batch. The other form is built on first use (dropout or a
key mask with documents on CUDA take SDPA's).
"""
from __future__ import annotations

import copy

import torch

DOCUMENT_KERNEL = "auto"  # auto (flex on CUDA when torch has it, SDPA elsewhere) | sdpa | flex


def uses_flex(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether document-masked attention on ``q``'s device runs FlexAttention (else SDPA with a dense mask)."""
    if DOCUMENT_KERNEL == "sdpa" or dropout_p > 0:  # FlexAttention has no dropout
        return False
    if DOCUMENT_KERNEL == "flex":
        return True
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return q.is_cuda


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own document ([B, T] long): t minus the index of its document's first
    token in the window (``docs`` is non-decreasing along T)."""
    T = docs.shape[-1]
    t = torch.arange(T, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    return t - torch.where(starts, t, 0).cummax(dim=-1).values


def documents_from_starts(first: int, length: int, starts) -> torch.Tensor:
    """The document index of tokens ``first .. first+length-1`` of a shard whose documents start at the (sorted)
    offsets ``starts``: 0 for the document under way at ``first``, +1 at every start after it."""
    offsets = torch.arange(first, first + length, dtype=torch.int64)
    starts = torch.as_tensor(starts, dtype=torch.int64)
    return torch.searchsorted(starts, offsets, right=True) - int(torch.searchsorted(starts, torch.tensor(first),
                                                                                       right=True))


def documents_from_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document index of each token of ``tokens`` [..., T]: a new document starts after every ``eos_id`` (the
    end-of-document token belongs to the document it ends)."""
    ends = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(ends, dim=-1) - ends


class RotaryAngles:
    """cos and sin of the rotary angles of some positions, [B or 1, 1, T, head_dim/2] each, in fp32."""

    def __init__(self, positions: torch.Tensor, head_dim: int, theta: float):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64)
                                    / head_dim))
        angles = positions.to(torch.float64)[..., None] * inv_freq  # [B, T, hd/2], exact for positions < 2^53
        self.cos = angles.cos().to(torch.float32)[:, None]
        self.sin = angles.sin().to(torch.float32)[:, None]

    def gather(self, index: torch.Tensor) -> "RotaryAngles":
        """The angles of the tokens at ``index`` [B, k] (the same values: each angle depends on its position only)."""
        out = copy.copy(self)
        at = index[:, None, :, None].expand(-1, 1, -1, self.cos.shape[-1])
        out.cos = self.cos.expand(index.shape[0], -1, -1, -1).gather(2, at)
        out.sin = self.sin.expand(index.shape[0], -1, -1, -1).gather(2, at)
        return out


class TokenLayout:
    """The positions, the attention mask and the rotary angles of one forward's tokens (see the module doc).

    ``positions`` [B, T] (or [1, T]) long; ``docs`` [B, T] or None; ``rope`` the rotary angles (llama blocks)."""

    def __init__(self, positions: torch.Tensor, docs: torch.Tensor | None = None, rope: RotaryAngles | None = None):
        self.positions, self.docs, self.rope = positions, docs, rope
        self._dense_mask = self._block_mask = None
        if docs is not None:  # the kernel's mask, now (module doc)
            self.block_mask() if uses_flex(docs, 0.0) else self.dense_mask()

    @classmethod
    def build(cls, idx: torch.Tensor, start: int | torch.Tensor = 0, docs: torch.Tensor | None = None,
              rope: tuple[int, float] | None = None) -> "TokenLayout":
        """The layout of the tokens ``idx`` [B, T]: positions from ``start`` (an int, or per row [B] for a
        left-padded batch: negative for its pads, clamped to 0, never attended to) or, with ``docs``, from the
        start of each token's document; ``rope`` = (head_dim, theta) adds the rotary angles of those positions."""
        T = idx.shape[1]
        if docs is not None:
            if not (isinstance(start, int) and start == 0):
                raise ValueError("document masking applies to whole windows (training and scoring), not to cached "
                                 "decoding: pass docs only to a forward without a cache")
            if docs.shape != idx.shape:
                raise ValueError(f"docs has shape {tuple(docs.shape)}, the tokens {tuple(idx.shape)}: one document "
                                 f"index per token")
            docs = docs.to(idx.device)
            positions = document_positions(docs)
        elif isinstance(start, torch.Tensor):
            positions = (start[:, None] + torch.arange(T, device=idx.device)).clamp(min=0)
        else:
            positions = (start + torch.arange(T, device=idx.device))[None]
        angles = RotaryAngles(positions, *rope) if rope is not None else None
        return cls(positions, docs, angles)

    def select(self, index: torch.Tensor, real: torch.Tensor | None = None) -> "TokenLayout":
        """The layout of the tokens at ``index`` [B, k] (in causal order: MoR's chosen tokens): their positions,
        rotary angles and documents; the padding where ``real`` is False (at the end of a row) goes in a document of
        its own."""
        positions = self.positions.expand(index.shape[0], -1).gather(1, index)
        docs = None
        if self.docs is not None:
            docs = self.docs.gather(1, index)
            if real is not None:
                docs = torch.where(real, docs, self.docs.amax() + 1)
        return TokenLayout(positions, docs, None if self.rope is None else self.rope.gather(index))

    def dense_mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool: query t may attend to key s <= t of its own document (SDPA's attn_mask)."""
        if self._dense_mask is None:
            d = self.docs
            T = d.shape[-1]
            causal = torch.ones(T, T, dtype=torch.bool, device=d.device).tril()
            self._dense_mask = ((d[:, :, None] == d[:, None, :]) & causal)[:, None]
        return self._dense_mask

    def block_mask(self):
        """FlexAttention's BlockMask of the same rule, built once per forward (CUDA's kernel skips the blocks wholly
        across documents)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            docs = self.docs

            def same_document_causal(b, h, q, kv):
                return (kv <= q) & (docs[b, q] == docs[b, kv])

            B, T = docs.shape
            self._block_mask = create_block_mask(same_document_causal, B, None, T, T, device=docs.device)
        return self._block_mask
