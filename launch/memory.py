"""The memory estimate: bytes per rank of a training plan, from the model's own shapes (built on the meta device):
model state (parameters, gradients, AdamW state) as each backend lays it out, plus the activations of one
micro-batch at the maximum depth under ``train.activation_checkpointing``.

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

Activations: launch/memory_shapes.py (the shared terms) and launch/memory_rows.py (what each model type saves).
Framework overhead (CUDA context, NCCL buffers, allocator fragmentation) is the margin in :func:`usable_bytes`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launch.memory_rows import activation_bytes
from launch.memory_shapes import CHECKPOINTING_MODES
from launch.memory_shapes import Activations

GiB = 1 << 30
MARGIN_FRACTION = 0.10  # allocator fragmentation and caching: keep 10% of the device free
OVERHEAD_BYTES = 2 * GiB  # CUDA context + NCCL communicator buffers + cuBLAS workspaces, per rank


@dataclass
class ParamCounts:
    """Unique parameters by role, counted on the meta-device model."""

    total: int
    matmul: int  # Linear weights (autocast casts them)
    embed: int  # FSDP's root unit: everything outside the blocks and the step (wte = tied head, wpe, final LN, ...)
    block: int  # the largest block sharded as its own unit (prelude, coda, dense layers); 0 when all are in the step
    step: int  # recurrent models: one recurrence step ``recurrent_core()`` (looped blocks + per-step params); dense: 0
    vocab: int
    d_model: int


def param_counts(model_cfg) -> ParamCounts:
    """Build the model on ``meta`` (no memory) and count its parameters per role, the roles being FSDP's units
    (pipeline/train/parallelize.py): every block of ``blocks_of`` outside the step, ``model.recurrent_core()``, the
    root."""
    import torch.nn as nn

    from pipeline.model import build_model
    from pipeline.model import count_params as unique_params
    from pipeline.train.parallelize import blocks_of

    model = build_model(model_cfg, device="meta")

    def n(module) -> int:
        return unique_params(module)["params"]

    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head)
    own_units = [n(b) for role, blocks in blocks_of(model).items() if role != "core" for b in blocks]
    core = model.recurrent_core()
    step = 0 if core is None else n(core)
    total = n(model)
    return ParamCounts(total=total, matmul=matmul, embed=total - step - sum(own_units), block=max(own_units, default=0),
                       step=step, vocab=model_cfg.vocab_size, d_model=model_cfg.d_model)


# ------------------------------------------------------------------------------------------------ model state
def model_state_bytes(pc: ParamCounts, backend: str, zero_stage: int, world: int, bf16: bool,
                      shard: int = 0) -> dict[str, float]:
    """Parameters, gradients, optimizer state and extras per rank (see the module docstring's table). ``shard``:
    FSDP's shard group size under HSDP (``train.fsdp_shard``; 0 = the world): the state divides by it, not by the
    world, and the replicas hold the same shards."""
    P, N = pc.total, ((shard or world) if backend == "fsdp" else world)
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



# ------------------------------------------------------------------------------------------------ the estimate
@dataclass
class MemoryPlan:
    """What the estimate depends on, so that alternatives are the same estimate with one field changed."""

    backend: str
    zero_stage: int
    checkpointing: str
    micro_batch: int
    grad_accum: int
    world: int
    bf16: bool
    document_masking: bool = False  # data.document_masking: SDPA's mask per block (launch/memory_shapes.py)
    shard: int = 0  # fsdp under HSDP (train.fsdp_shard): ranks per shard group; 0 = the world (flat FSDP)

    def label(self) -> str:
        b = f"deepspeed zero {self.zero_stage}" if self.backend == "deepspeed" else self.backend
        if self.backend == "fsdp" and self.shard and self.shard != self.world:
            b = f"fsdp HSDP (shard {self.shard} x replicate {self.world // self.shard})"
        return f"{b}, checkpointing {self.checkpointing}, micro-batch {self.micro_batch}"


@dataclass
class Estimate:
    plan: MemoryPlan
    state: dict[str, float]
    act: Activations

    @property
    def total(self) -> float:
        return sum(self.state.values()) + self.act.total


def estimate(model_cfg, pc: ParamCounts, plan: MemoryPlan) -> Estimate:
    """Bytes per rank of ``plan``. The residual stream and the recurrent state are fp32 on every backend (FSDP2
    gathers blocks in bf16 without casting their inputs, the embedding's output is at least fp32 under autocast), so
    only the matmul-side tensors take the compute dtype."""
    a = 2 if plan.bf16 else 4
    s = 4
    return Estimate(plan, model_state_bytes(pc, plan.backend, plan.zero_stage, plan.world, plan.bf16, plan.shard),
                    activation_bytes(model_cfg, plan.micro_batch, plan.checkpointing, a, s,
                                     document_masking=plan.document_masking))


def usable_bytes(gpu_bytes: float) -> float:
    """What a plan may use of a device: minus the margin and the fixed framework overhead."""
    return gpu_bytes * (1 - MARGIN_FRACTION) - OVERHEAD_BYTES


def alternatives(model_cfg, pc: ParamCounts, plan: MemoryPlan, gpu_bytes: float, limit: int = 3) -> list[Estimate]:
    """The first plans that fit, least disruptive first: checkpointing, then another backend / ZeRO stage, then a
    smaller micro-batch (with the accumulation that keeps the global batch), then combinations."""
    # core_step checkpoints one ``recurrent_core()`` call: every recurrent type has one, a dense model does not
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
                changes = (((be, zs) != (plan.backend, plan.zero_stage)) + (mode != plan.checkpointing)
                           + (mb != plan.micro_batch))
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
