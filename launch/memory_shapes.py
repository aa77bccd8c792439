"""Shapes and terms of the activation estimate: one micro-batch's dimensions and byte widths, and the tensors every
model type saves for backward (the pre-LN block, the embedding, the head). launch/memory_rows.py builds each model
type's rows from them; launch/memory.py turns them into a plan's estimate.

Activations (bytes saved for backward, one micro-batch of B sequences of T tokens, d = d_model, H heads, V vocab;
a = compute-dtype bytes, s = residual-stream bytes: 4 on every backend (the stream and the recurrent state stay fp32
under bf16: one precision for the state whatever the backend); in the GRT and Poisson cores the stream is in the
compute dtype since it starts as a Linear's output):

    pre-LN block          2 s BTd (LN inputs) + 14 a BTd (LN outputs, qkv 3, attention out, MLP 4 + 4)
                          + 4 (4BT LN statistics + BHT attention log-sum-exp)
    head (fused CE)       s BTd (final LN input) + 4 BTd (dL/dh, fp32) + 4 Vd (dL/dW, fp32)

Peak = saved + the largest checkpointed region's activations while it is recomputed in backward (its input is
already counted) — what tests/test_preflight.py measures on the CPU for every model type. The head adds a
workspace while everything is saved: the mean fused CE's forward (one chunk of fp32 logits and its softmax in the
compute dtype, the weight cast); Ouro's per-token CE, in its backward (once per loop): a recomputed chunk of logits,
dL/dW in fp32 with one chunk's product, dL/dh and the weight cast. The estimate takes the larger of the region and
the workspace (the workspace is not measured on the CPU). Framework overhead (CUDA context, NCCL buffers, allocator
fragmentation) is the margin in :func:`launch.memory.usable_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass

CUDA_CE_CHUNK_BYTES = 1 << 30  # ops/linear_cross_entropy.py: fp32 logits per chunk on CUDA
CHECKPOINTING_MODES = ("none", "core_step", "blocks")


@dataclass
class Activations:
    saved: float  # bytes saved for backward by one micro-batch at the depth of activation_depth()
    region: float  # the largest checkpointed region's activations during its recomputation (0: no checkpointing)
    head_workspace: float  # the head's working set beside the saved tensors (one chunk of logits, ...)

    @property
    def peak(self) -> float:
        """Measured-comparable peak: saved + one recomputed region."""
        return self.saved + self.region

    @property
    def total(self) -> float:
        """What the plan must hold: saved + the larger of a recomputed region and the head's workspace."""
        return self.saved + max(self.region, self.head_workspace)


def block_bytes(B: int, T: int, d: int, H: int, a: int, s: int) -> float:
    """Saved tensors of one pre-LN block (layers.Block, attention via scaled_dot_product_attention)."""
    return B * T * d * (2 * s + 14 * a) + 4 * (4 * B * T + B * H * T)


@dataclass
class Shapes:
    """One micro-batch's dimensions and byte widths, and the terms every model shares."""

    B: int
    T: int
    d: int
    H: int
    V: int
    a: int  # compute-dtype bytes
    s: int  # residual-stream bytes
    chunk_bytes: int

    @property
    def BT(self) -> int:
        return self.B * self.T

    @property
    def BTd(self) -> int:
        return self.B * self.T * self.d

    def block(self, stream: int, tokens: int | None = None) -> float:
        """A pre-LN block on ``tokens`` (default T) positions with its residual stream of ``stream`` bytes."""
        return block_bytes(self.B, self.T if tokens is None else tokens, self.d, self.H, self.a, stream)

    def ln_stats(self) -> int:
        return 8 * self.BT  # mean + rstd, fp32

    def embed(self) -> int:
        return 8 * self.BT + 8 * self.T  # token ids and positions (int64) for the embedding's backward

    def mean_head(self, stream: int) -> float:
        """Final LN (its input of ``stream`` bytes, statistics) + the mean fused CE's dL/dh and dL/dW (fp32)."""
        return stream * self.BTd + 4 * self.BTd + 4 * self.V * self.d + self.ln_stats()

    def chunk_rows(self) -> int:
        return min(self.BT, max(1, self.chunk_bytes // (4 * self.V)))

    def weight_cast(self) -> int:
        return self.V * self.d * self.a if self.a != self.s else 0

    def mean_head_workspace(self) -> float:
        """The mean fused CE's forward: fp32 logits + softmax in the compute dtype per chunk, the weight cast."""
        return self.chunk_rows() * self.V * (4 + self.a) + self.weight_cast()
