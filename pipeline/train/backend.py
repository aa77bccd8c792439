"""The seam between the trainer and how it is parallelised. ``train.backend`` picks one of

    single     one process
    ddp        torch DistributedDataParallel
    fsdp       FSDP2 (``fully_shard``), applied per block by :mod:`pipeline.train.parallelize`
    deepspeed  DeepSpeed ZeRO stage ``train.zero_stage`` (0..3), config generated from the recipe

Each knows its rank and world size, wraps the model and optimizer, runs backward and the optimizer step, and saves
and loads the model + optimizer part of a checkpoint. Launch: ``torchrun`` for all of them (and the ``deepspeed``
launcher for DeepSpeed); the process group is created from the launcher's environment.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from pipeline.config import TrainConfig
from pipeline.train.checkpoint import SHARDS_DIR
from pipeline.train.checkpoint import checkpoint_format_of
from pipeline.train.checkpoint import verify_checkpoint
from pipeline.train.checkpoint import write_index
from pipeline.train.peers import Heartbeat
from pipeline.train.peers import compare_job
from pipeline.train.peers import rank_list
from pipeline.train.peers import where


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of the process with this node-local rank. Where a scheduler gives each process its own GPUs
    (SLURM ``--gpus-per-task=1``, a per-rank ``CUDA_VISIBLE_DEVICES``) the process sees fewer devices than the node
    has ranks: the rank's device is its local rank modulo the devices it sees (one device: index 0)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but torch sees no CUDA device; use train.device=cpu or auto")
        visible = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if visible > 1 and local_world > visible:  # modulo would put two ranks on one GPU: NCCL refuses that
            raise ValueError(f"{local_world} processes on this node but each sees only {visible} CUDA devices "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch "
                             f"at most {visible} processes per node, or give each process its own GPU")
        index = local_rank % visible
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def shared_gpus(devices: list[tuple[str, str]]) -> str | None:
    """What is wrong when two ranks of ``devices`` ((host, GPU uuid) per rank, in rank order) share a GPU."""
    first: dict[tuple[str, str], int] = {}
    for rank, key in enumerate(devices):
        if key in first:
            return (f"ranks {first[key]} and {rank} both use GPU {key[1]} on {key[0]}: each rank needs a GPU of its "
                    f"own; launch as many processes per node as it has GPUs, and do not give every rank the same "
                    f"CUDA_VISIBLE_DEVICES")
        first[key] = rank
    return None


def autocast_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 autocast where the device does it natively (CUDA with bf16); fp32 elsewhere unless asked."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _global_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip (max_norm > 0) or just measure the global L2 norm of the gradients; works for DTensor (FSDP2) too."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


class SingleProcess:
    """One process, one device. Also the base of the distributed backends."""

    name = "single"
    can_skip = True  # a non-finite step can be dropped without touching the optimizer

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = pick_device(cfg.device)
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- model and optimizer
    def setup(self, model: nn.Module, optimizer_fn) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move/wrap the (already parallelized) model and build its optimizer."""
        model = model.to(self.device)
        return model, optimizer_fn(model)

    def no_sync(self, model, last_micro: bool):
        return contextlib.nullcontext()

    def backward(self, model, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        (loss / accum).backward()

    def step(self, model, optimizer) -> float:
        """Clip, step, zero; returns the gradient norm before clipping. Non-finite gradients: no step (the same
        decision on every rank, since the norm is global)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = _global_grad_norm(params, self.cfg.grad_clip)
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def skip_step(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def set_lr(self, optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # ---- collectives (no-ops in one process)
    def all_true(self, flag: bool, patient: bool = False) -> bool:
        return flag

    def reduce_mean(self, value: float) -> float:
        return value

    def reduce_max(self, value: float) -> float:
        return value

    def barrier(self, patient: bool = False) -> None:
        pass

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), by rank, on every rank (the patient group: file I/O may precede it)."""
        return [obj]

    def check_same_job(self, recipe: dict) -> None:
        """Refuse to start when the nodes were given different recipes or code (one process: nothing to compare)."""

    def lost_ranks(self) -> tuple[str, list[int], bool] | None:
        """After a failed collective: which ranks failed with an error or stopped answering (in words, their numbers,
        and whether they failed rather than fell silent); None when every rank still answers."""
        return None

    def watch_peers(self, timeout_s: float, on_lost) -> None:
        """While training: call ``on_lost(lost_ranks()-style tuple)`` from a background thread when another rank
        failed or fell silent for ``timeout_s`` (``on_lost`` ends the process). One process: nobody to watch."""

    def report_failure(self, line: str) -> None:
        """This rank's training ends with an error: tell the other ranks its one line."""

    def close(self, ok: bool = True) -> None:
        pass

    # ---- checkpoints. The torch backends (single, ddp, fsdp) share two formats, each loadable by all three at any
    # world size: "full" (model and optimizer gathered into rank 0's state.pt) and "sharded" (torch.distributed
    # .checkpoint: every rank writes its own shards into model_optim/, no full state dict anywhere; loading reshards).
    def checkpoint_group(self):
        """Process group of the checkpoint writes (a gloo one when async saves need a CPU backend)."""
        return None

    def save_model_optimizer(self, model, optimizer, folder: Path, state: dict):
        """Called on every rank. Returns a future while an async save is still writing, else None."""
        fmt = self.cfg.resolved_checkpoint_format()
        if fmt == "full":
            from torch.distributed.checkpoint.state_dict import StateDictOptions
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.unwrap(model), optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            self._write_state(folder, {**state, "checkpoint_format": "full", "model": msd, "optimizer": osd})
            return None
        import torch.distributed.checkpoint as dcp

        from pipeline.train.checkpoint import shard_writer

        error = None
        try:
            self._write_state(folder, {**state, "checkpoint_format": "sharded"})
        except Exception as e:  # noqa: BLE001 — raised below, on every rank
            error = e
        # rank 0 writes state.pt alone: the shards' collective writes start only if it did (a full disk), else the
        # others would wait in them for rank 0
        if not self.all_true(error is None, patient=True):
            raise error or OSError(f"rank 0 could not write {folder / 'state.pt'} (see its error)")
        shards, where = self._shards(model, optimizer, folder)
        where["storage_writer"] = shard_writer(folder / SHARDS_DIR)  # its full disk reaches every rank as ENOSPC
        if self.cfg.async_checkpoint:
            return dcp.async_save(shards, **where)
        dcp.save(shards, **where)
        return None

    def _shards(self, model, optimizer, folder: Path) -> tuple[dict, dict]:
        """The model + optimizer state dict as this rank holds it (sharded under FSDP, whole otherwise) and where DCP
        reads or writes it."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.unwrap(model), optimizer)
        return {"model": msd, "optimizer": osd}, dict(checkpoint_id=str(folder / SHARDS_DIR),
                                                       process_group=self.checkpoint_group(),
                                                       no_dist=not dist.is_initialized())

    def _write_state(self, folder: Path, state: dict) -> None:
        if self.is_main:
            with open(folder / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def load_model_optimizer(self, model, optimizer, folder: Path, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.checkpoint.state_dict import set_state_dict

        fmt = checkpoint_format_of(folder, state)
        if fmt == "deepspeed":
            raise ValueError(f"cannot resume {folder} with train.backend={self.name}: it was written by DeepSpeed; "
                             f"resume with train.backend=deepspeed, or convert it (`grt checkpoint convert "
                             f"{folder} --to full`) and start a new run from the converted weights")
        if fmt == "full" and state.get("optimizer") is None:
            raise ValueError(f"cannot resume {folder}: it holds model weights only (converted from another format), "
                             f"no optimizer state; evaluate or export it, or resume from the original checkpoint")
        if fmt == "full":
            # rank 0 holds the checkpoint's tensors and broadcasts them: the other ranks never touch their (memory-
            # mapped, see load_checkpoint) copy, so a node of 8 ranks does not hold 8 copies of model + optimizer
            broadcast = dist.is_initialized() and self.world_size > 1
            mine = not broadcast or self.is_main
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            # two calls, not set_state_dict: given an empty model dict it would skip the model on ranks > 0 and
            # leave rank 0 alone in the model's broadcast
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
            set_model_state_dict(self.unwrap(model), state["model"] if mine else {}, options=options)
            set_optimizer_state_dict(self.unwrap(model), optimizer, state["optimizer"] if mine else {},
                                     options=options)
            return
        import torch.distributed.checkpoint as dcp

        shards, where = self._shards(model, optimizer, folder)
        dcp.load(shards, **where)  # the pieces this rank holds now, whatever the world size that wrote them
        set_state_dict(self.unwrap(model), optimizer, model_state_dict=shards["model"],
                       optim_state_dict=shards["optimizer"])


class TorchDistributed(SingleProcess):
    """Common part of the distributed backends: rank and world size from the launcher's environment."""

    launch_hint = "torchrun --nproc_per_node N -m pipeline.cli train RECIPE"

    def __init__(self, cfg: TrainConfig):
        if "RANK" not in os.environ:
            raise RuntimeError(f"train.backend={cfg.backend} needs a launcher: run it under `{self.launch_hint}` "
                               f"(see docs/distributed.md)")
        self.cfg = cfg
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = pick_device(cfg.device, self.local_rank)
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)
        self._init_process_group(datetime.timedelta(seconds=cfg.collective_timeout_s))
        # for waiting on long work of some ranks (hashing a checkpoint or the dataset, a DeepSpeed conversion, rank 0
        # writing a full checkpoint to network storage): the training collectives' timeout (and NCCL's watchdog) is
        # for a rank that stopped answering, not for one that is writing or reading 100 GB
        self._patient_group = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
        # the checkpoint writes' coordination (torch.distributed.checkpoint's gathers and barriers): patient as well,
        # and a group of its own, since an async save coordinates from a background thread while the training runs
        # collectives on the others
        self._checkpoint_group = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
        self.nodes: list = [(None, "unknown")] * self.world_size  # (node rank, host) per rank: check_same_job
        self._heartbeat = Heartbeat.start(self.rank, self.world_size)
        if self.device.type == "cuda":
            self._refuse_shared_gpus()

    def _refuse_shared_gpus(self) -> None:
        """Two ranks on one GPU (every rank told CUDA_VISIBLE_DEVICES=0, or ranks without per-rank masks on a node
        with fewer GPUs than ranks): NCCL fails later with a traceback; here it is one line naming them."""
        import socket

        mine = (socket.gethostname(), str(torch.cuda.get_device_properties(self.device).uuid))
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._patient_group)
        problem = shared_gpus(everyone)
        if problem:
            raise ValueError(problem)

    def _init_process_group(self, timeout: datetime.timedelta) -> None:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout,
                                    device_id=self.device if self.device.type == "cuda" else None)

    def checkpoint_group(self):
        return self._checkpoint_group

    def check_same_job(self, recipe: dict) -> None:
        """Every rank compares a digest of the resolved recipe and of the code with the others' (before any model
        wrapper: a different d_model would otherwise surface as a DDP/FSDP traceback) and stops on a difference."""
        self.nodes = compare_job(recipe, self.rank, self.world_size, self._patient_group)

    def lost_ranks(self) -> tuple[str, list[int], bool] | None:
        hb = self._heartbeat
        if hb is None:
            return None
        if not hb.claim_report():  # the heartbeat thread is reporting the loss already, then ends the process
            threading.Event().wait()
        # a killed peer's sockets close one by one: the collective's may fail before the store's listening one is
        # gone, and torch's store client, asked then, prints a C++ stack trace before it raises
        time.sleep(2 * hb.interval)
        if not hb.store_up():
            return self._describe_lost(("store", None))
        try:
            failed = hb.failures()
        except Exception:  # noqa: BLE001 — the store went meanwhile: silent_ranks says so
            failed = {}
        if failed:
            return self._describe_lost(("failed", failed))
        silent = hb.silent_ranks()
        if silent is None:
            return self._describe_lost(("store", None))
        return self._describe_lost(("silent", silent)) if silent else None

    def _describe_lost(self, state) -> tuple[str, list[int], bool]:
        """What the heartbeat saw (peers.Heartbeat.watch's states), in words, for the one line of RankLost."""
        kind, detail = state
        if kind == "store":  # the store lives on node 0 (torchrun's agent there, or rank 0 itself)
            node0 = [r for r, n in enumerate(self.nodes) if n == self.nodes[0]]
            ranks = f"rank{'s' if len(node0) > 1 else ''} {rank_list(node0)}"
            return (f"node 0 (host {self.nodes[0][1]}, {ranks}) stopped answering (the launcher's store it hosts at "
                    f"{self._heartbeat.address} is gone)", node0, False)
        if kind == "failed":
            return "; ".join(f"rank {r} ({where(r, self.nodes)}) failed: {line}" for r, line in detail.items()), \
                sorted(detail), True
        return ", ".join(f"rank {r} ({where(r, self.nodes)})" for r in detail) + " stopped answering", detail, False

    def watch_peers(self, timeout_s: float, on_lost) -> None:
        if self._heartbeat is not None:
            self._heartbeat.watch(timeout_s, lambda state: on_lost(self._describe_lost(state)))

    def report_failure(self, line: str) -> None:
        if self._heartbeat is not None:
            self._heartbeat.fail(line)

    def all_true(self, flag: bool, patient: bool = False) -> bool:
        if patient:
            t = torch.tensor([0.0 if flag else 1.0])
            dist.all_reduce(t, group=self._patient_group)
        else:
            t = torch.tensor([0.0 if flag else 1.0], device=self.device)
            dist.all_reduce(t)
        return t.item() == 0.0

    def reduce_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def reduce_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._patient_group)
        return t.item()

    def barrier(self, patient: bool = False) -> None:
        dist.barrier(group=self._patient_group if patient else None)

    def gather(self, obj) -> list:
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self._patient_group)
        return everyone

    def close(self, ok: bool = True) -> None:
        """``ok``: every rank got here the same way (finished or stopped together), so they wait for each other
        before the group goes; after a failure of some ranks that barrier would pair with whatever collective the
        others are in, so the group is torn down at once (their collectives fail: the error they should see)."""
        if dist.is_initialized() and ok:
            try:
                dist.barrier()  # nobody tears the group down while a peer is still in a collective
            except Exception:  # a peer is gone: the error that brought us here is the one to report
                pass
        if self._heartbeat is not None:  # after the barrier: a rank waiting in it still beats for the others' watch
            self._heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


class DDP(TorchDistributed):
    name = "ddp"

    def setup(self, model, optimizer_fn):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        # the process's own device, which is not cuda:LOCAL_RANK where each process sees only its GPU (pick_device)
        ddp = DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None)
        return ddp, optimizer_fn(model)

    def no_sync(self, model, last_micro: bool):
        return contextlib.nullcontext() if last_micro else model.no_sync()  # all-reduce once per step

    def unwrap(self, model):
        return model.module


class FSDP(TorchDistributed):
    """FSDP2: the per-block ``fully_shard`` calls happen in :func:`pipeline.train.parallelize.parallelize`."""

    name = "fsdp"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        from pipeline.train.mesh import build_mesh

        per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        # None: flat FSDP over the world; else the (replicate, shard) mesh of HSDP
        self.mesh = build_mesh(cfg.fsdp_shard, self.world_size, per_node, self.device.type)

    def setup(self, model, optimizer_fn):
        from pipeline.train.parallelize import looped_modules

        self._looped = looped_modules(model)
        return model, optimizer_fn(model)

    # no_sync stays the base's no-op: every micro-step reduce-scatters its gradients (as torchtitan does). Turning
    # the sync off between micro-steps would make FSDP2 keep a full, unsharded fp32 gradient of every parameter
    # (4P bytes per rank instead of 4P/N) until the last one: an out-of-memory the preflight would not predict.

    def backward(self, model, loss, accum, last_micro) -> None:
        from pipeline.train.parallelize import gathered_through_backward

        with gathered_through_backward(self._looped):
            (loss / accum).backward()


def skip_shared_memory_op(deepspeed) -> None:
    """Keep DeepSpeed's communication init from JIT-building its shared-memory all-reduce op (`deepspeed_shm_comm`).

    That op serves only ``inference_all_reduce`` (tensor-parallel inference on CPU), never training, yet the init
    builds it with the host C++ compiler on first use (1-2 min) under a torch-extensions lock file; a run killed
    while holding that lock (pre-emption, kill -9, a timeout) leaves it behind and every later DeepSpeed run waits
    on it forever, silently. DeepSpeed reads the op's availability from ``deepspeed.ops.__compatible_ops__``, a
    dict it caches so that edits persist; marking the op unavailable takes its own fall-back path (plain
    ``torch.distributed.all_reduce``)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeed(TorchDistributed):
    """DeepSpeed ZeRO 0..3 with ``torch.optim.AdamW`` as the client optimizer. The engine does accumulation,
    clipping and the step; checkpoints use DeepSpeed's own (sharded) format inside the step folder."""

    name = "deepspeed"
    can_skip = False  # the engine's accumulation window cannot be abandoned half-way
    launch_hint = ("torchrun --nproc_per_node N -m pipeline.cli train RECIPE` or `deepspeed --num_gpus N "
                   "--module pipeline.cli train RECIPE")

    def _init_process_group(self, timeout: datetime.timedelta) -> None:
        import deepspeed

        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_shared_memory_op(deepspeed)
        deepspeed.init_distributed("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout)

    def ds_config(self) -> dict:
        """The DeepSpeed config generated from the recipe; ``train.deepspeed`` is merged over it (escape hatch)."""
        from pipeline.config.recipe_files import deep_merge

        c = self.cfg
        bf16 = self.amp_dtype == torch.bfloat16
        accum = c.grad_accum_steps // self.world_size
        raw = c.deepspeed or {}
        stage = (raw.get("zero_optimization") or {}).get("stage", c.zero_stage)
        asked = (raw.get("data_types") or {}).get("grad_accum_dtype")
        if bf16 and stage == 0 and accum > 1 and asked not in ("bf16", "bfloat16"):
            raise ValueError(f"ZeRO stage 0 with train.dtype=bfloat16 and {accum} micro-steps per rank: DeepSpeed "
                             f"{_deepspeed_version()} accumulates stage 0's gradients in bf16 (it refuses fp32 "
                             f"accumulation there), so this run would not train what the other backends train; use "
                             f"train.zero_stage=2 (fp32 accumulation, sharded gradients) or train.backend=ddp, or "
                             f"accept bf16 accumulation with train.deepspeed.data_types.grad_accum_dtype=bf16")
        config = {
            "train_micro_batch_size_per_gpu": c.micro_batch_size,
            "gradient_accumulation_steps": c.grad_accum_steps // self.world_size,
            "gradient_clipping": c.grad_clip,
            "zero_optimization": {"stage": c.zero_stage},
            "bf16": {"enabled": bf16},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True,
        }
        if bf16:
            # the precision of the other backends' gradients: accumulated over micro-steps and reduced over ranks
            # in fp32 (DeepSpeed's bf16 default is bf16 for both). At stage 0 the accumulation dtype must equal the
            # model's (checked above: one micro-step per rank, nothing to accumulate)
            config["communication_data_type"] = "fp32"
            if stage > 0:
                config["data_types"] = {"grad_accum_dtype": "fp32"}
        return deep_merge(config, raw)

    def setup(self, model, optimizer_fn):
        import deepspeed

        model = model.to(self.device)
        # A block that runs its positions one after another (the recurrent transformer's self-KV layers) calls its
        # submodules once per position: as a ZeRO-3 leaf it gathers its parameters once per forward, not T times.
        leaves = sorted({type(m) for m in model.modules() if getattr(m, "positions_in_order", False)}, key=str)
        if self.cfg.zero_stage == 3 and leaves:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, leaves)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_fn(model),
                                                       config=self.ds_config())
        self._engine = engine
        return engine, optimizer

    def backward(self, model, loss, accum, last_micro) -> None:
        model.backward(loss)  # the engine scales by 1/accumulation itself
        if not last_micro:
            model.step()  # counts the micro-step; the optimizer only steps at the accumulation boundary

    def step(self, model, optimizer) -> float:
        model.step()
        norm = model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def unwrap(self, model):
        return model.module

    def save_model_optimizer(self, model, optimizer, folder: Path, state: dict):
        with self._patient_barriers():
            model.save_checkpoint(str(folder), tag="deepspeed", save_latest=False)
        self._write_state(folder, {**state, "checkpoint_format": "deepspeed"})
        return None

    @contextlib.contextmanager
    def _patient_barriers(self):
        """DeepSpeed's save_checkpoint waits for the ranks' file writes in plain ``deepspeed.comm.barrier()`` calls on
        the training group (collective_timeout_s, NCCL's watchdog): during the save those go to the patient group."""
        from deepspeed import comm

        barrier = comm.barrier

        def patient(group=None, *args, **kwargs):
            if group is None:
                return dist.barrier(group=self._patient_group)
            return barrier(group, *args, **kwargs)

        comm.barrier = patient
        try:
            yield
        finally:
            comm.barrier = barrier

    def load_model_optimizer(self, model, optimizer, folder, state) -> None:
        if checkpoint_format_of(folder, state) != "deepspeed":
            raise ValueError(f"cannot resume {folder} with train.backend=deepspeed: it was written by "
                             f"train.backend={state['recipe']['train']['backend']} (a torch checkpoint); resume with "
                             f"that backend")
        saved_stage = state["recipe"]["train"]["zero_stage"]
        if saved_stage != self.cfg.zero_stage:
            raise ValueError(f"cannot resume {folder} with train.zero_stage={self.cfg.zero_stage}: it was written "
                             f"with ZeRO-{saved_stage}, and DeepSpeed loads its ZeRO files into the same stage only. "
                             f"Resume with train.zero_stage={saved_stage}, or convert the weights (`grt checkpoint "
                             f"convert {folder} --to full`) and start a new run from them")
        # checkpoints written before the world size was recorded: one optimizer partition file per rank
        saved_world = (state.get("world_size")
                       or len(list((folder / "deepspeed").glob("*zero_pp_rank_*optim_states.pt"))))
        tag = "deepspeed"
        if saved_world and saved_world != self.world_size:
            tag = self._universal(folder, saved_world)
        path, _ = model.load_checkpoint(str(folder), tag=tag, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint (tag '{tag}') inside")

    def _universal(self, folder: Path, saved_world: int) -> str:
        """A world-size change: DeepSpeed's own ZeRO checkpoints load only into the world size that wrote them,
        so rank 0 converts to DeepSpeed's universal format (``ds_to_universal``) and every rank loads that."""
        import deepspeed

        if self.cfg.zero_stage == 3:
            # measured with DeepSpeed 0.19.8 (2 -> 1 ranks, this check bypassed, the flag also set before
            # deepspeed.initialize): ds_to_universal converts a ZeRO-3 checkpoint and it loads, the first step after
            # it equals the uninterrupted run's, then the losses drift (2e-4 relative at the second step, 1.2e-3 at
            # the eighth): the weights are restored, the optimizer state is not. ZeRO-1 resumes to 1e-7.
            raise ValueError(
                f"cannot resume {folder} on {self.world_size} ranks: it was written by {saved_world} ranks with "
                f"ZeRO-3, and DeepSpeed {deepspeed.__version__}'s universal checkpoint does not restore ZeRO-3 "
                f"optimizer state correctly. Resume on {saved_world} ranks, or use ZeRO-1/2 (which reshard through "
                f"the universal checkpoint), or convert the weights (`grt checkpoint convert {folder} --to full`) "
                f"and start a new run from them")
        out = folder / "deepspeed_universal"
        if self.is_main and out.is_dir() and verify_checkpoint(out):  # damaged since: converted again
            print(f"{out} does not match its index: converting again", flush=True)
            shutil.rmtree(out)
        if self.is_main and not out.is_dir():
            import argparse

            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            print(f"DeepSpeed checkpoint {folder} was written by {saved_world} ranks, this run has "
                  f"{self.world_size}: converting it to DeepSpeed's universal checkpoint (once)", flush=True)
            tmp = folder / ".deepspeed_universal.tmp"  # a kill during the conversion leaves no half-converted tag
            shutil.rmtree(tmp, ignore_errors=True)
            ds_to_universal(argparse.Namespace(
                input_folder=str(folder / "deepspeed"), output_folder=str(tmp), num_extract_workers=4,
                num_merge_workers=2, keep_temp_folder=False, strict=True, inject_missing_state=True))
            write_index(tmp)  # checked before it is reused
            os.replace(tmp, out)
        # the others wait for rank 0's check or conversion on the patient group: it may outlast the collective timeout
        self.barrier(patient=True)
        self._engine._config.load_universal_checkpoint = True  # read at load time (the flag is a config entry)
        return "deepspeed_universal"


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


PATIENT_TIMEOUT = datetime.timedelta(hours=6)

BACKENDS = {"single": SingleProcess, "ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}


def build_backend(cfg: TrainConfig):
    return BACKENDS[cfg.backend](cfg)
