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
    llama block           2 n (RMSNorms) + a BT(3d + 2 d_kv) (rotated q, k; v; attention out; o_proj input)
                          + 4 a BTf (SwiGLU: gate, silu, up, product) + 4 (2BT rsqrt + BHT log-sum-exp),
                          n = (8 + a) BTd on the fp32 stream (its input, fp32 normalised, the matmul cast) or
                          (4 + s + a) BTd on a compute-dtype stream; QK-norm + (4 + a) BT(d + d_kv) + 4 BT(H + H_kv);
                          d_kv = n_kv_head x head size, f the SwiGLU hidden size. Once per forward: the rotary
                          angles, 2 x 4 T hd/2 (B T hd with document masking), and no position ids; the final
                          RMSNorm saves s BTd + 4 BTd + 4 BT in place of the LN's s BTd + 8 BT
    (either block)        with document masking the position ids are per row, 8 BT; the layout's bool mask
                          (B T^2 bytes, once per forward, not saved by autograd) is not counted
    document masking      the SDPA path (CPU, and CUDA with dropout or a key mask): every block's attention saves
                          the mask as an fp32 additive [B, 1, T, T] (4 BTT per block; the estimate counts this).
                          CUDA's FlexAttention saves no mask (its block mask, B T^2 / 128^2 ints, is held once):
                          there the estimate is high by 4 BTT per block

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


def llama_block_bytes(B: int, T: int, d: int, H: int, a: int, s: int, d_kv: int, H_kv: int, f: int,
                      qk_norm: bool) -> float:
    """Saved tensors of one llama block (layers.LlamaBlock, attention via scaled_dot_product_attention)."""
    BT = B * T
    norm = (8 + a if s == 4 else 4 + s + a) * BT * d + 4 * BT
    qk = (4 + a) * BT * (d + d_kv) + 4 * BT * (H + H_kv) if qk_norm else 0
    return 2 * norm + a * BT * (3 * d + 2 * d_kv) + 4 * a * BT * f + 4 * B * H * T + qk


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
    llama: tuple[int, int, int, bool] | None = None  # (d_kv, H_kv, SwiGLU hidden f, QK-norm): the llama block
    docs: bool = False  # document masking: SDPA's [B, 1, T, T] mask per block

    @property
    def BT(self) -> int:
        return self.B * self.T

    @property
    def BTd(self) -> int:
        return self.B * self.T * self.d

    def block(self, stream: int, tokens: int | None = None) -> float:
        """A block of ``cfg.block`` on ``tokens`` (default T) positions with its residual stream of ``stream`` bytes."""
        T = self.T if tokens is None else tokens
        mask = 4 * self.B * T * T if self.docs else 0
        if self.llama is None:
            return block_bytes(self.B, T, self.d, self.H, self.a, stream) + mask
        return llama_block_bytes(self.B, T, self.d, self.H, self.a, stream, *self.llama) + mask

    def ln_stats(self) -> int:
        return 8 * self.BT  # mean + rstd, fp32

    def norm_stats(self) -> int:
        """What the model's norm (``layers.norm_layer``) saves besides its input: LN's statistics, or RMSNorm's
        fp32 normalised input and rsqrt."""
        return self.ln_stats() if self.llama is None else 4 * self.BTd + 4 * self.BT

    def embed(self) -> int:
        """Token ids (int64) for the embedding's backward, and position ids (gpt2 block) or the rotary angles."""
        rows = self.B if self.docs else 1  # per-row positions restart at every document
        if self.llama is None:
            return 8 * self.BT + 8 * rows * self.T
        return 8 * self.BT + 4 * rows * self.T * (self.d // self.H)

    def mean_head(self, stream: int) -> float:
        """Final norm (its input of ``stream`` bytes, statistics; RMSNorm its fp32 normalised input) + the mean fused
        CE's dL/dh and dL/dW (fp32)."""
        return stream * self.BTd + 4 * self.BTd + 4 * self.V * self.d + self.norm_stats()

    def chunk_rows(self) -> int:
        return min(self.BT, max(1, self.chunk_bytes // (4 * self.V)))

    def weight_cast(self) -> int:
        return self.V * self.d * self.a if self.a != self.s else 0

    def mean_head_workspace(self) -> float:
        """The mean fused CE's forward: fp32 logits + softmax in the compute dtype per chunk, the weight cast."""
        return self.chunk_rows() * self.V * (4 + self.a) + self.weight_cast()
