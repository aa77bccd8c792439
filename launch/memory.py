"""Memory per rank of a training plan, from the model's own shapes (built on the meta device): model state
(parameters, gradients, AdamW state) as each backend lays it out, plus the activations of one micro-batch at the
maximum depth under ``train.activation_checkpointing``.

Accounting (P = unique parameters, N = ranks, c = bytes of the compute dtype: 2 for bf16, 4 for fp32):

    backend            parameters      gradients        AdamW (m, v) + fp32 master     extra
    single             4P (fp32)       4P               8P (the fp32 params are the master)   c<2: 2P_mm autocast copies
    ddp                4P              4P + 4P buckets  8P                                    c<2: 2P_mm autocast copies
    fsdp (FSDP2)       4P/N            4P/N             8P/N                                  gathered units, see below
    deepspeed zero 0   cP              cP (+4P bf16)    8P (+4P fp32 master with bf16)
    deepspeed zero 1   cP              cP               12P/N (+4P/N fp32 grad partition)
      bf16             2P              2P + 4P          12P/N   (BF16_Optimizer: a full fp32 gradient buffer)
    deepspeed zero 2   cP              cP/N + bucket    12P/N (+4P/N)
    deepspeed zero 3   cP/N            cP/N             12P/N (+4P/N)                         gathered units

FSDP2 reduce-scatters the gradients after every micro-step (pipeline/train/backend.py), so a rank never holds
more than its 4P/N gradient shard between micro-steps; within one backward the looped core's unsharded fp32
gradient is held (the last term of "gathered units"). DeepSpeed under bf16 accumulates and reduces gradients in fp32
(``data_types.grad_accum_dtype``, ``communication_data_type``), as the other backends do.

P_mm: matmul weights (autocast keeps their bf16 casts through forward and backward). "Gathered units" (FSDP2 and
ZeRO-3): the root (every parameter outside the blocks and the recurrence step: embeddings, final LN, Ouro's exit
gate) and the whole recurrence step (``model.recur``: GRT's W_proj and gate, Poisson's adapter, MoR's routers, RRT's
LoRAs, Ouro's loop norm, and the looped blocks: they stay gathered through the forward, ``reshard_after_forward=
False``) plus two other blocks (one prefetched; none when every block is in the step, as in Ouro) in the compute
dtype, and the step's unsharded fp32 gradients while they are reduce-scattered.

Activations (bytes saved for backward, one micro-batch of B sequences of T tokens, d = d_model, H heads, V vocab;
a = compute-dtype bytes, s = residual-stream bytes: 4 on every backend (the stream and the recurrent state stay fp32
under bf16: one precision for the state whatever the backend); in the GRT and Poisson cores the stream is in the
compute dtype since it starts as a Linear's output):

    pre-LN block          2 s BTd (LN inputs) + 14 a BTd (LN outputs, qkv 3, attention out, MLP 4 + 4)
                          + 4 (4BT LN statistics + BHT attention log-sum-exp)
    GRT step, no ckpt     n_core blocks + s BTd (state h) + 6 a BTd (noisy state, LN(h), f_g hidden x2, gate
                          logits, proposal) [one fewer without state noise]; once: LN(h_pre) (a) and h_pre (s);
                          without reinjection or state noise the first core block's input is h (one a BTd fewer);
                          h_pre (s) only when the gate or W_proj reads it and it is not step 1's saved state
    head (fused CE)       s BTd (final LN input) + 4 BTd (dL/dh, fp32) + 4 Vd (dL/dW, fp32)
    core_step             per step only its inputs: the state h; once: h_pre and the two anchor terms
    blocks                per block only its input; the gate, W_proj and noise are not checkpointed
    GRT backprop_steps k  the first R - k steps (k < R) run under no_grad and save nothing: k steps as above, and
                          h_pre is saved on its own (it is no longer step 1's state)
    GRT hyper_streams n   per step + (n_core (2n + 2) - n + 1) a BTd: per core block the n streams entering each
                          sublayer (the stream mixes' input; the first block's are its input, expanded) and each
                          sublayer's output (scaled by B); LN_1 reads a mix, not the input (+1 for the first block).
                          blocks: a core block after the first holds its n streams (n a BTd); region + (n + 2) a BTd

    The other recurrent-depth methods (Poisson, MoR, RRT, Ouro, RecurTrace) and the Recurrent Transformer: their
    rows are in launch/memory_methods.py.

Peak = saved + the largest checkpointed region's activations while it is recomputed in backward (its input is
already counted) — what tests/test_preflight.py measures on the CPU for every model type. The head adds a
workspace while everything is saved: the mean fused CE's forward (one chunk of fp32 logits and its softmax in the
compute dtype, the weight cast); Ouro's per-token CE, in its backward (once per loop): a recomputed chunk of logits,
dL/dW in fp32 with one chunk's product, dL/dh and the weight cast. The estimate takes the larger of the region and
the workspace (the workspace is not measured on the CPU). Framework overhead (CUDA context, NCCL buffers, allocator
fragmentation) is the margin in :func:`usable_bytes`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 1 << 30
MARGIN_FRACTION = 0.10  # allocator fragmentation and caching: keep 10% of the device free
OVERHEAD_BYTES = 2 * GiB  # CUDA context + NCCL communicator buffers + cuBLAS workspaces, per rank
CUDA_CE_CHUNK_BYTES = 1 << 30  # ops/linear_cross_entropy.py: fp32 logits per chunk on CUDA
CHECKPOINTING_MODES = ("none", "core_step", "blocks")


@dataclass
class ParamCounts:
    """Unique parameters by role, counted on the meta-device model."""

    total: int
    matmul: int  # Linear weights (autocast casts them)
    embed: int  # FSDP's root unit: everything outside the blocks and the step (wte = tied head, wpe, final LN, ...)
    block: int  # the largest block sharded as its own unit (prelude, coda, dense layers); 0 when all are in the step
    step: int  # recurrent models: one recurrence step ``model.recur`` (looped blocks + per-step parameters); dense: 0
    vocab: int
    d_model: int


def count_params(model_cfg) -> ParamCounts:
    """Build the model on ``meta`` (no memory) and count its parameters per role, the roles being FSDP's units
    (pipeline/train/parallelize.py): every block of ``blocks_of`` outside the step, ``model.recur``, the root."""
    import torch.nn as nn

    from pipeline.model import build_model
    from pipeline.model import count_params as unique_params
    from pipeline.train.parallelize import blocks_of

    model = build_model(model_cfg, device="meta")

    def n(module) -> int:
        return unique_params(module)["params"]

    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head)
    own_units = [n(b) for role, blocks in blocks_of(model).items() if role != "core" for b in blocks]
    step = n(model.recur) if hasattr(model, "recur") else 0
    total = n(model)
    return ParamCounts(total=total, matmul=matmul, embed=total - step - sum(own_units), block=max(own_units, default=0),
                       step=step, vocab=model_cfg.vocab_size, d_model=model_cfg.d_model)


# ------------------------------------------------------------------------------------------------ model state
def model_state_bytes(pc: ParamCounts, backend: str, zero_stage: int, world: int, bf16: bool) -> dict[str, float]:
    """Parameters, gradients, optimizer state and extras per rank (see the module docstring's table)."""
    P, N = pc.total, world
    c = 2 if bf16 else 4
    gathered = (pc.embed + pc.step + 2 * pc.block) * c + pc.step * 4  # FSDP2 / ZeRO-3 working set, see above
    if backend in ("single", "ddp"):
        out = {"parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P,
               "extra": (2 * pc.matmul if bf16 else 0) + (4 * P if backend == "ddp" else 0)}
    elif backend == "fsdp":  # the root (embeddings, tied head, final LN) is gathered in fp32 (one precision for the
        # stream), plus the fused head's transient compute-dtype copy of the tied weight under bf16
        root = pc.embed * (4 - c) + (2 * pc.embed if bf16 else 0)
        out = {"parameters": 4 * P / N, "gradients": 4 * P / N, "optimizer": 8 * P / N, "extra": gathered + root}
    elif zero_stage == 0:
        # bf16: DeepSpeed's mixed-precision optimizer keeps an fp32 master copy, its fp32 gradients at the step and
        # fp32 AdamW state beside the bf16 module (20P); fp32: the module's parameters are the master (16P)
        out = {"parameters": c * P, "gradients": c * P + (4 * P if bf16 else 0),
               "optimizer": 8 * P + (4 * P if bf16 else 0), "extra": 0}
    elif zero_stage == 1 and bf16:
        # bf16 with fp32 gradient accumulation (the other backends' precision) is DeepSpeed's BF16_Optimizer at
        # stage 1: a full, unpartitioned fp32 gradient buffer beside the bf16 gradients, the master and AdamW
        # state partitioned
        out = {"parameters": 2 * P, "gradients": 2 * P + 4 * P, "optimizer": 12 * P / N, "extra": 0}
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


def activation_depth(model_cfg) -> tuple[int, str]:
    """(depth, what it counts) at which :func:`activation_bytes` estimates each model type: its deepest training
    forward, or for Poisson (random depth p) the k steps that run with gradient whatever p is."""
    t, c = model_cfg.type, model_cfg
    if t == "gpt":
        return c.n_layer, "n_layer"
    if t == "grt":
        k = c.backprop_steps
        if k is not None and k < c.n_recurrence:
            return k, (f"k = model.backprop_steps grad steps of the largest sampled depth R = {c.n_recurrence}: its "
                       f"first R - k steps save nothing")
        return c.n_recurrence, "R, the largest sampled depth"
    if t == "poisson":
        return c.backprop_steps, (f"k = model.backprop_steps grad steps: the depth p is random (mean "
                                  f"{c.n_recurrence + 1}), its first max(p - k, 0) steps save nothing")
    if t == "mor":
        return c.n_recurrence, "N_r recursions, recursion r on (N_r - r)/N_r of the tokens"
    if t == "rrt":
        return c.n_recurrence, "N_r recursions"
    if t == "ouro":
        return c.n_recurrence, "T loops, a head and an exit gate at each"
    if t == "recurtrace":
        return c.n_recurrence, "R loops (training runs them all), each looped layer reading its earlier loops"
    if t == "recurrent_transformer":
        return c.n_layer, "n_layer self-KV layers, positions in order"
    raise ValueError(_unknown(t))


def _unknown(model_type: str) -> str:
    return (f"launch/memory.py has no activation model for model.type={model_type!r}; add one (derived from what "
            f"the model's forward saves for backward: a row of the module docstring's table, a case in "
            f"activation_depth / activation_bytes) and measure it in tests/test_preflight.py")


@dataclass
class _Shapes:
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


def activation_bytes(model_cfg, micro_batch: int, mode: str, a: int = 4, s: int = 4,
                     chunk_bytes: int = CUDA_CE_CHUNK_BYTES) -> Activations:
    """Activations of one micro-batch (``micro_batch`` x ``model.block_size``) at the depth of
    :func:`activation_depth` under activation checkpointing ``mode``; ``a``/``s``: compute / residual-stream
    bytes. One function per model type, each the module docstring's rows for it."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r}; use one of {CHECKPOINTING_MODES}")
    x = _Shapes(micro_batch, model_cfg.block_size, model_cfg.d_model, model_cfg.n_head, model_cfg.vocab_size, a, s,
                chunk_bytes)
    from launch import memory_methods as m

    per_type = {"gpt": _dense, "grt": _grt, "poisson": m.poisson, "mor": m.mor, "rrt": m.rrt, "ouro": m.ouro,
                "recurtrace": m.recurtrace, "recurrent_transformer": m.recurrent_transformer}
    if model_cfg.type not in per_type:
        raise ValueError(_unknown(model_cfg.type))
    return per_type[model_cfg.type](model_cfg, x, mode)


def _dense(c, x: _Shapes, mode: str) -> Activations:
    """GPT: n_layer blocks on the s stream (core_step does not apply to a dense model: counted as none)."""
    L, s = c.n_layer, x.s
    head, blk = x.embed() + x.mean_head(s), x.block(s)
    if mode == "blocks":
        return Activations(head + L * s * x.BTd, blk - s * x.BTd, x.mean_head_workspace())
    return Activations(head + L * blk, 0.0, x.mean_head_workspace())


def _grt(c, x: _Shapes, mode: str) -> Activations:
    a, s, BTd = x.a, x.s, x.BTd
    blk_s, blk_a, ln_stats = x.block(s), x.block(a), x.ln_stats()
    embed, head, head_ws = x.embed(), x.mean_head(s), x.mean_head_workspace()
    n_core, outer, n = c.n_core, c.n_prelude + c.n_coda, c.hyper_streams
    # truncated backprop: the steps before the last k run under no_grad and save nothing (activation_depth)
    R, free = activation_depth(c)[0], c.backprop_steps is not None and c.backprop_steps < c.n_recurrence
    noisy = c.state_noise == "every_step" and c.sigma_x > 0
    gate = c.gate == "elementwise"
    # One step's own tensors beside its blocks: W_proj's input (the noisy state, or its bf16 cast), and the gate's
    # state h, LN(h), f_g's hidden before and after SiLU, the logits z and the proposal o (saved by the update).
    step_extra = (a * BTd if c.reinject and (noisy or a != s or not gate) else 0)
    step_extra += (s + 5 * a) * BTd + ln_stats if gate else 0
    # hyper-connections (n streams): per core block the streams entering each sublayer (n each: the stream mixes'
    # input) and each sublayer's output (scaled by B); the first block's streams are its input expanded (one copy's
    # worth, no n), and its LN_1 reads a mix of them, not the input
    hyper = (n_core * (2 * n + 2) - n + 1) * a * BTd if n > 1 else 0
    # without reinjection or state noise the core's input is the state h itself, already counted with the gate's
    # tensors: the first core block does not save it again
    h_in_core = a * BTd if gate and not c.reinject and not noisy else 0
    # Once per forward: LN(h_pre) for f_g's anchor half; h_pre itself only when an anchor term reads it (the gate's
    # LN, W_proj's h_pre half) and step 1 does not already save it as its state (init_state=prelude, a grad step):
    # the gate's h, or without a gate and state noise W_proj's x half (reinject) or the first core block's input.
    without_gate_saves_h = not gate and not noisy  # without a gate the step's first consumer saves h itself
    # h^(0) = h_pre itself: init_state=prelude without the 'init' state noise (h_pre + eps, a tensor of its own)
    h0_is_pre = c.init_state == "prelude" and not (c.state_noise == "init" and c.sigma_x > 0)
    h_pre_is_state = h0_is_pre and not free and (gate or without_gate_saves_h)
    h_pre_own = 0 if h_pre_is_state or not (gate or c.reinject) else s * BTd
    anchor_once = (a * BTd + ln_stats if gate else 0) + h_pre_own
    if mode == "none":
        saved = embed + outer * blk_s + R * (n_core * blk_a + step_extra + hyper - h_in_core) + anchor_once + head
        return Activations(saved, 0.0, head_ws)
    if mode == "core_step":
        # The checkpoint holds each step's inputs: the state h (h_pre at step 1 when init_state=prelude), h_pre,
        # and the two anchor terms W_a h_pre + b and W1_a LN(h_pre) + b1 that step 1 returns to the others.
        anchors = ((a if c.reinject else 0) + (a if gate else 0)) * BTd
        h_pre_ckpt = 0 if h0_is_pre and not free else s * BTd
        saved = embed + outer * blk_s + R * s * BTd + h_pre_ckpt + anchors + head
        # Recomputing step 1 (the largest: it also computes the anchor terms); its inputs are counted above.
        # The step's input h is a checkpoint input: not new where the gate or (without one) its first consumer saves it
        region = (n_core * blk_a + step_extra + hyper - h_in_core - (s * BTd if gate else 0)
                  - (a * BTd if without_gate_saves_h else 0)
                  + (a * BTd + ln_stats if gate else 0))
        return Activations(saved, region, head_ws)
    # blocks: every block keeps only its input (a hyper-connected core block after the first: its n streams); W_proj,
    # the gate and the noise are not checkpointed
    core_inputs = (1 + (n_core - 1) * n) * a * BTd - h_in_core
    saved = embed + outer * s * BTd + R * (core_inputs + step_extra) + anchor_once + head
    core_region = blk_a - a * BTd if n == 1 else blk_a + (n + 2) * a * BTd  # its input (x or n streams) held
    region = max(blk_s - s * BTd if outer else 0, core_region)
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
    """Bytes per rank of ``plan``. The residual stream and the recurrent state are fp32 on every backend (FSDP2
    gathers blocks in bf16 without casting their inputs, the embedding's output is at least fp32 under autocast), so
    only the matmul-side tensors take the compute dtype."""
    a = 2 if plan.bf16 else 4
    s = 4
    return Estimate(plan, model_state_bytes(pc, plan.backend, plan.zero_stage, plan.world, plan.bf16),
                    activation_bytes(model_cfg, plan.micro_batch, plan.checkpointing, a, s))


def usable_bytes(gpu_bytes: float) -> float:
    """What a plan may use of a device: minus the margin and the fixed framework overhead."""
    return gpu_bytes * (1 - MARGIN_FRACTION) - OVERHEAD_BYTES


def alternatives(model_cfg, pc: ParamCounts, plan: Plan, gpu_bytes: float, limit: int = 3) -> list[Estimate]:
    """The first plans that fit, least disruptive first: checkpointing, then another backend / ZeRO stage, then a
    smaller micro-batch (with the accumulation that keeps the global batch), then combinations."""
    # core_step checkpoints one ``model.recur`` call: every recurrent type has one, a dense model does not
    modes = list(CHECKPOINTING_MODES) if pc.step else ["none", "blocks"]
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
