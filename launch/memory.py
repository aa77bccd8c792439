"""Memory per rank of a training plan, from the model's own shapes (built on the meta device): model state
(parameters, gradients, AdamW state) as each backend lays it out, plus the activations of one micro-batch at the
maximum depth under ``train.activation_checkpointing``.

Accounting (P = unique parameters, N = ranks, c = bytes of the compute dtype: 2 for bf16, 4 for fp32):

    backend            parameters      gradients        AdamW (m, v) + fp32 master     extra
    single             4P (fp32)       4P               8P (the fp32 params are the master)   c<2: 2P_mm autocast copies
    ddp                4P              4P + 4P buckets  8P                                    c<2: 2P_mm autocast copies
    fsdp (FSDP2)       4P/N            4P/N             8P/N                                  gathered units, see below
    deepspeed zero 0   cP              cP               2cP (bf16: Adam on the bf16 params)
    deepspeed zero 1   cP              cP               12P/N (+4P/N fp32 grad partition)
    deepspeed zero 2   cP              cP/N + bucket    12P/N (+4P/N)
    deepspeed zero 3   cP/N            cP/N             12P/N (+4P/N)                         gathered units

P_mm: matmul weights (autocast keeps their bf16 casts through forward and backward). "Gathered units" (FSDP2 and
ZeRO-3): the root (embeddings, final LN) and the whole recurrence step (W_proj, gate, the core's blocks: they stay
gathered through the forward, ``reshard_after_forward=False``) plus two other blocks (one prefetched) in the compute
dtype, and the step's unsharded fp32 gradients while they are reduce-scattered.

Activations (bytes saved for backward, one micro-batch of B sequences of T tokens, d = d_model, H heads; a =
compute-dtype bytes, s = residual-stream bytes: 4 with fp32 parameters, 2 with bf16 parameters (fsdp/deepspeed bf16);
in the GRT core the stream is in the compute dtype since it starts as W_proj's output):

    pre-LN block          2 s BTd (LN inputs) + 14 a BTd (LN outputs, qkv 3, attention out, MLP 4 + 4)
                          + 4 (4BT LN statistics + BHT attention log-sum-exp)
    GRT step, no ckpt     n_core blocks + s BTd (state h) + 6 a BTd (noisy state, LN(h), f_g hidden x2, gate
                          logits, proposal) [one fewer without state noise]; once: LN(h_pre) (a) and h_pre (s)
    head (fused CE)       s BTd (final LN input) + 4 BTd (dL/dh, fp32) + 4 Vd (dL/dW, fp32)
    core_step             per step only its inputs: the state h; once: h_pre and the two anchor terms
    blocks                per block only its input; the gate, W_proj and noise are not checkpointed

Peak = saved + the largest checkpointed region's activations while it is recomputed in backward (its input is
already counted) — what tests/test_preflight.py measures on the CPU. The head's forward adds a workspace (one chunk
of fp32 logits and its softmax in the compute dtype, the weight cast) while everything is saved; the estimate takes
the larger of the two. Framework overhead (CUDA context, NCCL buffers, allocator fragmentation) is the margin in
:func:`fits`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 1 << 30
MARGIN_FRACTION = 0.10  # allocator fragmentation and caching: keep 10% of the device free
OVERHEAD_BYTES = 2 * GiB  # CUDA context + NCCL communicator buffers + cuBLAS workspaces, per rank
CUDA_CE_CHUNK_BYTES = 1 << 30  # ops/linear_cross_entropy.py: fp32 logits per chunk on CUDA


@dataclass
class ParamCounts:
    """Unique parameters by role, counted on the meta-device model."""

    total: int
    matmul: int  # Linear weights (autocast casts them)
    embed: int  # wte (tied head) + wpe + final LN: FSDP's root unit
    block: int  # one transformer block
    step: int  # GRT: one recurrence step (core blocks + W_proj + gate); dense: 0
    vocab: int
    d_model: int


def count_params(model_cfg) -> ParamCounts:
    """Build the model on ``meta`` (no memory) and count its parameters per role."""
    import torch.nn as nn

    from pipeline.model import build_model
    from pipeline.model import count_params as unique_params
    from pipeline.train.parallelize import blocks_of

    model = build_model(model_cfg, device="meta")

    def n(module) -> int:
        return unique_params(module)["params"]

    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head)
    roles = blocks_of(model)
    return ParamCounts(total=n(model), matmul=matmul, embed=n(model.embed) + n(model.ln_f),
                       block=n((roles.get("core") or roles["layers"])[0]),
                       step=n(model.recur) if hasattr(model, "recur") else 0, vocab=model_cfg.vocab_size,
                       d_model=model_cfg.d_model)


# ------------------------------------------------------------------------------------------------ model state
def model_state_bytes(pc: ParamCounts, backend: str, zero_stage: int, world: int, bf16: bool) -> dict[str, float]:
    """Parameters, gradients, optimizer state and extras per rank (see the module docstring's table)."""
    P, N = pc.total, world
    c = 2 if bf16 else 4
    gathered = (pc.embed + pc.step + 2 * pc.block) * c + pc.step * 4  # FSDP2 / ZeRO-3 working set, see above
    if backend in ("single", "ddp"):
        out = {"parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P,
               "extra": (2 * pc.matmul if bf16 else 0) + (4 * P if backend == "ddp" else 0)}
    elif backend == "fsdp":
        out = {"parameters": 4 * P / N, "gradients": 4 * P / N, "optimizer": 8 * P / N, "extra": gathered}
    elif zero_stage == 0:
        out = {"parameters": c * P, "gradients": c * P, "optimizer": 2 * c * P, "extra": 0}
    else:
        sharded_opt = 12 * P / N + 4 * P / N  # fp32 master + m + v, and the fp32 gradient partition
        bucket = min(5e8, P) * c if zero_stage == 2 else 0  # reduce_bucket_size default 5e8 elements
        out = {"parameters": c * P / (N if zero_stage == 3 else 1),
               "gradients": c * P / (N if zero_stage >= 2 else 1), "optimizer": sharded_opt,
               "extra": gathered if zero_stage == 3 else bucket}
    return out


def checkpoint_bytes(pc: ParamCounts, backend: str, bf16: bool) -> float:
    """One checkpoint on disk, all ranks together: fp32 weights + AdamW m and v (DeepSpeed adds its own copy of the
    weights in the model dtype beside the fp32 master) + 1% for recipe, RNG and loader state."""
    P = pc.total
    body = 12 * P + ((2 if bf16 else 4) * P if backend == "deepspeed" else 0)
    return body * 1.01


# ------------------------------------------------------------------------------------------------ activations
@dataclass
class Activations:
    saved: float  # bytes saved for backward by one micro-batch at depth R
    region: float  # the largest checkpointed region's activations during its recomputation (0: no checkpointing)
    head_workspace: float  # the fused head's forward working set (one chunk of logits)

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


def activation_bytes(model_cfg, micro_batch: int, mode: str, a: int = 4, s: int = 4,
                     chunk_bytes: int = CUDA_CE_CHUNK_BYTES) -> Activations:
    """Activations of one micro-batch (``micro_batch`` x ``model.block_size``) at the maximum depth (R for GRT,
    n_layer for dense) under activation checkpointing ``mode``; ``a``/``s``: compute / residual-stream bytes."""
    B, T, d, H, V = micro_batch, model_cfg.block_size, model_cfg.d_model, model_cfg.n_head, model_cfg.vocab_size
    BTd, BT = B * T * d, B * T
    blk_s = block_bytes(B, T, d, H, a, s)  # a block on the fp32/bf16 residual stream (prelude, coda, dense layers)
    blk_a = block_bytes(B, T, d, H, a, a)  # a GRT core block (stream in the compute dtype)
    ln_stats = 8 * BT  # mean + rstd, fp32
    embed = 8 * BT + 8 * T  # token ids and positions (int64) for the embedding's backward
    head = s * BTd + 4 * BTd + 4 * V * d + ln_stats
    rows = min(BT, max(1, chunk_bytes // (4 * V)))
    head_ws = rows * V * (4 + a) + (V * d * a if a != s else 0)  # fp32 logits + softmax in compute dtype + W cast
    if model_cfg.type != "grt":
        L = model_cfg.n_layer
        if mode == "blocks":
            return Activations(embed + L * s * BTd + head, blk_s - s * BTd, head_ws)
        return Activations(embed + L * blk_s + head, 0.0, head_ws)

    c = model_cfg
    R, n_core, outer = c.n_recurrence, c.n_core, c.n_prelude + c.n_coda
    noisy = c.state_noise == "every_step" and c.sigma_x > 0
    gate = c.gate == "elementwise"
    # One step's own tensors beside its blocks: W_proj's input (the noisy state, or its bf16 cast), and the gate's
    # state h, LN(h), f_g's hidden before and after SiLU, the logits z and the proposal o (saved by the update).
    step_extra = (a * BTd if c.reinject and (noisy or a != s or not gate) else 0)
    step_extra += (s + 5 * a) * BTd + ln_stats if gate else 0
    # Once per forward: LN(h_pre) for f_g's anchor half; h_pre itself unless it is step 1's state (counted there).
    h_pre_own = 0 if (c.init_state == "prelude" and gate) else s * BTd
    anchor_once = (a * BTd + ln_stats if gate else 0) + h_pre_own
    if mode == "none":
        saved = embed + outer * blk_s + R * (n_core * blk_a + step_extra) + anchor_once + head
        return Activations(saved, 0.0, head_ws)
    if mode == "core_step":
        # The checkpoint holds each step's inputs: the state h (h_pre at step 1 when init_state=prelude), h_pre,
        # and the two anchor terms W_a h_pre + b and W1_a LN(h_pre) + b1 that step 1 returns to the others.
        anchors = ((a if c.reinject else 0) + (a if gate else 0)) * BTd
        h_pre_ckpt = 0 if c.init_state == "prelude" else s * BTd
        saved = embed + outer * blk_s + R * s * BTd + h_pre_ckpt + anchors + head
        # Recomputing step 1 (the largest: it also computes the anchor terms); its inputs are counted above.
        region = n_core * blk_a + step_extra - (s * BTd if gate else 0) + (a * BTd + ln_stats if gate else 0)
        return Activations(saved, region, head_ws)
    # blocks: every block keeps only its input; W_proj, the gate and the noise are not checkpointed
    saved = embed + outer * s * BTd + R * (n_core * a * BTd + step_extra) + anchor_once + head
    region = max(blk_s - s * BTd if outer else 0, blk_a - a * BTd)
    return Activations(saved, region, head_ws)


# ------------------------------------------------------------------------------------------------ the estimate
@dataclass
class Plan:
    """What the estimate depends on, so that alternatives are the same estimate with one field changed."""

    backend: str
    zero_stage: int
    checkpointing: str
    micro_batch: int
    grad_accum: int
    world: int
    bf16: bool

    def label(self) -> str:
        b = f"deepspeed zero {self.zero_stage}" if self.backend == "deepspeed" else self.backend
        return f"{b}, checkpointing {self.checkpointing}, micro-batch {self.micro_batch}"


@dataclass
class Estimate:
    plan: Plan
    state: dict[str, float]
    act: Activations

    @property
    def total(self) -> float:
        return sum(self.state.values()) + self.act.total


def estimate(model_cfg, pc: ParamCounts, plan: Plan) -> Estimate:
    """Bytes per rank of ``plan``. The residual stream is in bf16 when the parameters are (FSDP2's bf16
    param_dtype, DeepSpeed's bf16 engine); autocast alone keeps it fp32."""
    a = 2 if plan.bf16 else 4
    s = 2 if plan.bf16 and plan.backend in ("fsdp", "deepspeed") else 4
    return Estimate(plan, model_state_bytes(pc, plan.backend, plan.zero_stage, plan.world, plan.bf16),
                    activation_bytes(model_cfg, plan.micro_batch, plan.checkpointing, a, s))


def usable_bytes(gpu_bytes: float) -> float:
    """What a plan may use of a device: minus the margin and the fixed framework overhead."""
    return gpu_bytes * (1 - MARGIN_FRACTION) - OVERHEAD_BYTES


def alternatives(model_cfg, pc: ParamCounts, plan: Plan, gpu_bytes: float, limit: int = 3) -> list[Estimate]:
    """The first plans that fit, least disruptive first: checkpointing, then another backend / ZeRO stage, then a
    smaller micro-batch (with the accumulation that keeps the global batch), then combinations."""
    modes = ["none", "core_step", "blocks"] if model_cfg.type == "grt" else ["none", "blocks"]
    backends = [("ddp", 0), ("fsdp", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]
    if plan.world == 1:
        backends = [("single", 0)] + backends
    global_mb = plan.micro_batch * plan.grad_accum
    # the current micro-batch keeps its accumulation (a batch that does not divide is reported on its own)
    micro = [plan.micro_batch] + [m for m in range(plan.micro_batch - 1, 0, -1)
                                  if global_mb % m == 0 and (global_mb // m) % plan.world == 0]
    cands = []
    for mb in micro:
        for be, zs in backends:
            for mode in modes:
                p = dataclasses.replace(plan, backend=be, zero_stage=zs, checkpointing=mode, micro_batch=mb,
                                        grad_accum=global_mb // mb if mb != plan.micro_batch else plan.grad_accum)
                if p == plan:
                    continue
                changes = ((be, zs) != (plan.backend, plan.zero_stage)) + (mode != plan.checkpointing) + (mb != plan.micro_batch)
                cost = (changes, mb != plan.micro_batch, -mb, (be, zs) != (plan.backend, plan.zero_stage),
                        modes.index(mode))
                cands.append((cost, p))
    out = []
    for _, p in sorted(cands, key=lambda x: x[0]):
        e = estimate(model_cfg, pc, p)
        if e.total <= usable_bytes(gpu_bytes):
            out.append(e)
            if len(out) == limit:
                break
    return out
