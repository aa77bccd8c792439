"""Build the model the trainer trains without any rank ever holding all of it (torchtitan's order for FSDP2).

    fsdp              build on ``meta`` -> parallelize (checkpointing, compile, ``fully_shard``) -> ``to_empty`` on
                      the device -> initialise shard by shard
    deepspeed ZeRO-3  build under ``deepspeed.zero.Init`` (each module is partitioned as soon as it is constructed)
                      -> initialise one gathered parameter at a time -> parallelize
    others            build whole on the CPU, initialise, parallelize (every rank holds a full replica anyway)

Every path writes the same values: each parameter is drawn in full on the CPU from its own generator seeded by
(seed, parameter name) (:func:`pipeline.model.layers.init_gpt2_weights`), and :func:`assign_local` keeps what this
rank holds of it. So the same seed gives the same initial weights whichever backend and world size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from pipeline.config import RunConfig
from pipeline.model import build_model
from pipeline.model import model_class
from pipeline.model.layers import copy_full
from pipeline.train.parallelize import parallelize


def assign_local(param: nn.Parameter, make) -> None:
    """Write one parameter's initial value ``make(full_shape)`` keeping only this rank's part: the local shard of an
    FSDP2 DTensor, the partition of a ZeRO-3 parameter (gathered, written on rank 0, re-partitioned on exit), or the
    whole of a plain tensor. At most one full parameter exists at a time."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank made the same full value, so each slices its own shard (no communication)
        param.copy_(distribute_tensor(make(param.shape), param.device_mesh, param.placements, src_data_rank=None))
    elif hasattr(param, "ds_id"):  # partitioned by deepspeed.zero.Init
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:  # rank 0's value is broadcast to the others on exit
                param.copy_(make(param.ds_shape))
    else:
        copy_full(param, make)


def _check_materialized(model: nn.Module, n_unique_before: int) -> None:
    """``to_empty`` leaves buffers uninitialised and may replace parameter objects: refuse both silently going wrong."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise RuntimeError(f"buffers {buffers} are uninitialised after to_empty; recompute them in the model's "
                           f"init_weights after materialisation")
    n_unique = len(list(model.parameters()))
    if n_unique != n_unique_before:
        raise RuntimeError(f"materialisation untied parameters ({n_unique_before} unique before, {n_unique} after): "
                           f"tie them before sharding and materialise with a module-level to_empty")


def build_for_training(cfg: RunConfig, backend) -> nn.Module:
    """The model the trainer trains, built for ``backend`` (its ``device``, ``amp_dtype`` and, for ZeRO-3,
    ``ds_config()``): parallelized as ``cfg.train`` asks, on the device, with the initial weights of ``cfg.seed``.
    Unwrapped: the backend's ``setup`` wraps it."""
    tc = cfg.train
    if tc.backend == "fsdp":
        model = build_model(cfg.model, device="meta")
        n_unique = len(list(model.parameters()))
        # sharded while nothing is allocated
        parallelize(model, tc, backend.amp_dtype, torch.device("meta"), backend.mesh)
        model.to_empty(device=backend.device)  # each rank allocates its shards only
        _check_materialized(model, n_unique)
        model.init_weights(cfg.seed, assign_local)
        return model
    if tc.backend == "deepspeed" and tc.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=backend.ds_config()):
            model = model_class(cfg.model.type)(cfg.model)
        model.init_weights(cfg.seed, assign_local)
        return parallelize(model, tc, backend.amp_dtype, backend.device)
    model = build_model(cfg.model, seed=cfg.seed)
    return parallelize(model, tc, backend.amp_dtype, backend.device)
