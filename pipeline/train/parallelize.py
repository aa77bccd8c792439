"""Parallelism applied to a built model from the outside (the model files know nothing of it): activation
checkpointing, torch.compile and FSDP2 sharding, per block. Every recurrent model exposes the same parts
(:class:`pipeline.model.interface.LanguageModel`): ``prelude`` and ``coda`` blocks, and ``recurrent_core()``, one
recurrence step as a module with its looped blocks in ``.blocks``. The recurrent core is checkpointed per recurrence
step and its blocks stay gathered through the forward (``reshard_after_forward=False``) and the backward
(:func:`gathered_through_backward`), so the looped core is all-gathered once per micro-step, not once per recurrence
step."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pipeline.config import TrainConfig
from pipeline.model.interface import LanguageModel


def checkpoint_module(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward instead of storing its activations. Non-reentrant checkpointing
    restores the RNG state before recomputing, so the recomputation draws the same noise as the forward. The
    module keeps its name and parameters (checkpoints stay interchangeable)."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward


def blocks_of(model: LanguageModel) -> dict[str, list[nn.Module]]:
    """The model's blocks by role; GPT has only ``layers``."""
    core = model.recurrent_core()
    if core is not None:
        return {"prelude": list(model.prelude), "core": list(core.blocks), "coda": list(model.coda)}
    return {"layers": list(model.blocks)}


def apply_activation_checkpointing(model: LanguageModel, mode: str) -> None:
    if mode == "none":
        return
    if mode == "core_step":
        core = model.recurrent_core()
        if core is None:
            raise ValueError("train.activation_checkpointing=core_step needs a recurrent model; use 'blocks' for "
                             f"model.type={model.cfg.type}")
        checkpoint_module(core)  # W_proj + core + gate: one recurrence step
        return
    for blocks in blocks_of(model).values():
        for block in blocks:
            checkpoint_module(block)


def apply_fsdp(model: LanguageModel, amp_dtype: torch.dtype, mesh=None) -> None:
    """FSDP2 per block, then the recurrence step, then the root, with the precision of single and DDP (fp32
    parameters under autocast). The blocks and the step are gathered in ``amp_dtype`` (half the all-gather bytes;
    autocast casts their matmul weights to it anyway), but FSDP casts no module's inputs (``cast_forward_inputs=
    False``): the residual stream and the recurrent state stay fp32 across module boundaries and the gate updates
    them in fp32. (A near-copy gate, g ~ 0.98, adds ~2% of o - h per step: a few of a bf16 state's rounding steps,
    2^-8 of h, so in bf16 much of each update is rounded away.) The root (embeddings, the tied head, the final LN)
    keeps fp32 parameters: the stream starts from the fp32 embedding as under DDP, and the embedding's gradient (the
    rows of every token plus the head's) accumulates in fp32. The cost: the root is gathered in fp32 (it stays
    gathered from the forward to its backward), 2 more bytes per root parameter than a bf16 gather.
    ``mesh`` (HSDP, ``train.fsdp_shard``): every unit shards over the mesh's shard dimension and replicates over the
    other; the looped core is still gathered once per micro-step, inside its shard group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard

    mp = MixedPrecisionPolicy(param_dtype=amp_dtype if amp_dtype != torch.float32 else None,
                              reduce_dtype=torch.float32, cast_forward_inputs=False)
    for role, blocks in blocks_of(model).items():
        for block in blocks:
            # the shared core runs R times per forward: keep it gathered between its calls
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=role != "core")
    if model.recurrent_core() is not None:
        # W_proj and the gate
        fully_shard(model.recurrent_core(), mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False))  # fp32: see above


def looped_modules(model: LanguageModel) -> list[nn.Module]:
    """The FSDP2 units that run R times per forward: the looped core's blocks and the recurrence step."""
    core = model.recurrent_core()
    return [*core.blocks, core] if core is not None else []


@contextlib.contextmanager
def gathered_through_backward(modules: list[nn.Module]):
    """One backward in which the FSDP2 units ``modules`` (the looped core) stay gathered from the forward to the end
    of the backward, then reshard. ``reshard_after_forward=False`` covers the forward only: by default each of the
    R backward passes through a unit reshards it at its end, so the next pass all-gathers it again (R - 1 extra
    all-gathers per unit and micro-step; counted in tests/test_gpu_paths.py)."""
    for m in modules:
        m.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()


def compile_targets(model: LanguageModel) -> list[nn.Module]:
    """What ``train.compile`` compiles: each prelude/coda block and the recurrence step as a whole (GRT), each
    layer (dense). The loop over r stays eager, so a new depth r reuses the step's compiled graphs."""
    core = model.recurrent_core()
    if core is not None:
        return [*model.prelude, core, *model.coda]
    # a block that runs its positions one after another in Python (the Recurrent Transformer's self-KV attention)
    # would be unrolled over every position by dynamo: its per-position MLP is compiled, the loop stays eager
    return [b.mlp if b.positions_in_order else b for b in model.blocks]


def apply_compile(model: LanguageModel, backend: str = "inductor") -> None:
    import torch._dynamo

    # A step that takes its recursion index (MoR's router and capacity, RRT's LoRA) compiles one graph per index and
    # mode (training, evaluation, MoR's threshold routing): raise dynamo's recompile limit (8 in torch 2.13) above
    # that, or the recursions past the limit would silently run uncompiled.
    depth = type(model).recurrence_depth(model.cfg) or 0
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 3 * depth + 2)
    for module in compile_targets(model):
        module.compile(backend=backend)


def parallelize(model: LanguageModel, cfg: TrainConfig, amp_dtype: torch.dtype, device: torch.device,
                mesh=None) -> nn.Module:
    """torchtitan's order: activation checkpointing, then compile, then FSDP (flat, or HSDP on ``mesh``: the
    2-D (replicate, shard) mesh of ``train.fsdp_shard``, :mod:`pipeline.train.mesh`)."""
    model.to(device)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if cfg.backend == "fsdp":
        apply_fsdp(model, amp_dtype, mesh)
    return model
