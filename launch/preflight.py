"""The preflight: everything about a training plan that can be checked before any process starts, every problem
listed at once with its fix (``grt launch RECIPE --check`` exits 2 when ``report.ok`` is false).

    batch       train.grad_accum_steps divisible by the world size (the trainer would refuse it at start-up), and
                every grad_accum_steps of train.batch_ramp (its stages listed under "curriculum")
    memory      per rank, for the backend / ZeRO stage / activation checkpointing (launch/memory.py), every model
                type at the depth that bounds its activations (R, N_r, T loops, Poisson's k grad steps), against
                the GPU's memory; when it does not fit, the first changes that make it fit
    data        manifest present and consistent, tokenizer identity, enough tokens for max_steps (or the epochs);
                an s3:// dataset: its manifest read from the store and its objects' sizes from one listing
    tracking    the MLflow URI reachable (http) or writable (sqlite)
    disk        free space under out_dir for keep_checkpoints + 1 checkpoints
    env         the NCCL / gloo / rendezvous variables that are set and those that are not
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from launch import memory
from launch.memory import GiB
from launch.memory import MemoryPlan
from launch.memory_rows import activation_depth
from pipeline.train.curriculum import describe as describe_curriculum
from pipeline.train.curriculum import tokens_through
from pipeline.train.curriculum import world_size_problems
from pipeline.train.mesh import fsdp_shard_size

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_DEBUG",
            "NCCL_P2P_DISABLE", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GLOO_SOCKET_IFNAME",
            "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "SLURM_JOB_ID")
FULL_VERIFY_LIMIT = 1 << 30  # datasets up to 1 GiB get every sha256 rechecked; larger ones sizes + manifest only


@dataclass
class Report:
    """What :func:`run_preflight` found: ``sections`` (title, lines) in order, and the ``problems`` (each with its
    fix). ``ok`` when there are none."""

    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        out = []
        for title, lines in self.sections:
            out.append(f"== {title}")
            out += [f"  {ln}" for ln in lines]
        if self.problems:
            out.append(f"== {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}")
            out += [f"  - {p}" for p in self.problems]
        else:
            out.append("== no problems found")
        return "\n".join(out)


def gb(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def run_preflight(cfg, nodes: int = 1, gpus_per_node: int = 1, gpu_mem_gb: float | None = None,
                  check_data: bool = True, check_tracking: bool = True) -> Report:
    """Check the plan of ``cfg`` (a :class:`pipeline.config.RunConfig`) on ``nodes`` x ``gpus_per_node`` ranks with
    ``gpu_mem_gb`` GiB per device (an "80 GB" A100/H100 has 80 GiB) (None: the local CUDA device's, when there is one).
    ``check_data=False`` skips the dataset (e.g. before it is tokenized on the cluster)."""
    rep = Report()
    world = nodes * gpus_per_node
    tc = cfg.train
    bf16 = _resolves_to_bf16(tc)
    tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * cfg.model.block_size
    rep.sections.append(("plan", [
        f"{nodes} node(s) x {gpus_per_node} rank(s) = world size {world}; backend {tc.backend}"
        + (f" (ZeRO stage {tc.zero_stage})" if tc.backend == "deepspeed" else ""),
        f"micro-batch {tc.micro_batch_size} x {cfg.model.block_size} tokens, grad_accum_steps {tc.grad_accum_steps} "
        f"over all ranks ({tc.grad_accum_steps / world:g} per rank) = {tokens_per_step:,} tokens per step",
        f"dtype {tc.dtype} -> {'bfloat16' if bf16 else 'float32'}; activation_checkpointing "
        f"{tc.activation_checkpointing}; {tc.max_steps:,} steps = {tokens_through(cfg, tc.max_steps) / 1e9:.3f}B "
        f"tokens"]))
    _check_batch(cfg, world, rep)
    if describe_curriculum(cfg, world):  # train.batch_ramp / model.depth_schedule, each stage
        rep.sections.append(("curriculum", describe_curriculum(cfg, world)))
    rep.problems += [f"batch: {p}" for p in world_size_problems(tc, world)]
    pc = _check_memory(cfg, world, gpu_mem_gb, bf16, rep, gpus_per_node)
    if check_data:
        _check_data(cfg, tokens_per_step, rep)
    else:
        rep.sections.append(("data", ["not checked (check_data=False / --skip-data)"]))
    if check_tracking:
        _check_tracking(cfg, rep)
    _check_disk(cfg, pc, bf16, rep)
    _env_section(rep)
    return rep


def _resolves_to_bf16(tc) -> bool:
    """train.dtype auto means bf16 on a GPU that has it (Ampere and newer): a launch plan targets GPUs, so auto ->
    bf16 unless the recipe pins the CPU."""
    if tc.dtype != "auto":
        return tc.dtype == "bfloat16"
    return tc.device != "cpu"


# ------------------------------------------------------------------------------------------------ batch
def _check_batch(cfg, world: int, rep: Report) -> None:
    ga = cfg.train.grad_accum_steps
    if ga % world == 0:
        return
    lower, upper = (ga // world) * world, (ga // world + 1) * world
    near = " or ".join(f"train.grad_accum_steps={v} ({v * cfg.train.micro_batch_size * cfg.model.block_size:,} "
                       f"tokens per step)" for v in (lower, upper) if v > 0)
    rep.problems.append(f"batch: train.grad_accum_steps={ga} counts micro-batches over all {world} ranks and is not "
                        f"a multiple of the world size {world}; set {near}, or use a world size that divides {ga}")


# ------------------------------------------------------------------------------------------------ memory
def _local_gpu_gb() -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GiB


def _table(est: memory.Estimate) -> list[str]:
    s, a = est.state, est.act
    rows = [("parameters", s["parameters"]), ("gradients", s["gradients"]),
            ("optimizer (AdamW m, v, fp32 master)", s["optimizer"]),
            ("extra (autocast copies / DDP buckets / gathered units)", s["extra"]),
            ("activations saved (1 micro-batch, at that depth)", a.saved),
            ("recomputed region in backward", a.region),
            ("LM-head workspace (Ouro: its per-loop backward)", a.head_workspace)]
    lines = [f"{name:<55} {gb(v):>10}" for name, v in rows]
    lines.append(f"{'total per rank (saved + max(region, head workspace))':<55} {gb(est.total):>10}")
    return lines


def _check_memory(cfg, world: int, gpu_mem_gb: float | None, bf16: bool, rep: Report, gpus_per_node: int = 1):
    tc = cfg.train
    pc = memory.param_counts(cfg.model)
    backend = tc.backend
    if backend == "single" and world > 1:
        rep.problems.append(f"backend: train.backend=single runs one process, but the plan has {world} ranks; set "
                            f"train.backend=ddp, fsdp or deepspeed (estimated below as ddp)")
        backend = "ddp"
    if tc.activation_checkpointing == "core_step" and not pc.step:
        rep.problems.append(f"checkpointing: train.activation_checkpointing=core_step checkpoints one recurrence step "
                            f"(model.recur) and model.type={cfg.model.type} has none; set "
                            f"train.activation_checkpointing=blocks (estimated below as none)")
    shard, problem = fsdp_shard_size(tc.fsdp_shard, world, gpus_per_node) if backend == "fsdp" else (0, None)
    if problem:
        rep.problems.append(f"mesh: {problem} (estimated below as fsdp_shard=world)")
    plan = MemoryPlan(backend, tc.zero_stage if backend == "deepspeed" else 0, tc.activation_checkpointing,
                      tc.micro_batch_size, tc.grad_accum_steps, world, bf16, cfg.data.document_masking,
                      shard=0 if shard == world else shard)
    est = memory.estimate(cfg.model, pc, plan)
    depth, counts = activation_depth(cfg.model)
    lines = [f"{pc.total / 1e6:,.1f}M unique parameters; activations of model.type={cfg.model.type} at depth "
             f"{depth} ({counts}) for {plan.label()}", *_table(est)]
    source = "--gpu-mem"
    if gpu_mem_gb is None:
        gpu_mem_gb, source = _local_gpu_gb(), "the local CUDA device"
    if gpu_mem_gb is None:
        lines.append("no GPU here and no --gpu-mem given: the estimate is not compared with a device "
                     "(pass --gpu-mem GiB)")
        rep.sections.append(("memory per rank", lines))
        return pc
    usable = memory.usable_bytes(gpu_mem_gb * GiB)
    lines.append(f"device {gpu_mem_gb:g} GiB ({source}); usable {gb(usable)} after a {memory.MARGIN_FRACTION:.0%} "
                 f"margin and {gb(memory.OVERHEAD_BYTES)} framework overhead -> "
                 + ("fits" if est.total <= usable else "DOES NOT FIT"))
    if est.total > usable:
        alts = memory.alternatives(cfg.model, pc, plan, gpu_mem_gb * GiB)
        if alts:
            fixes = "; ".join(f"{_overrides(plan, e.plan)} ({gb(e.total)})" for e in alts)
            lines.append("plans that fit: " + fixes)
            fix = f"use one of: {fixes}"
        else:
            fix = ("no backend, ZeRO stage, checkpointing mode or micro-batch fits it on this many devices: use more "
                   "GPUs (more nodes shard the model state further under fsdp / ZeRO-3) or larger ones")
        rep.problems.append(f"memory: {plan.label()} needs {gb(est.total)} per rank, more than the usable "
                            f"{gb(usable)} of a {gpu_mem_gb:g} GiB device; {fix}")
    rep.sections.append(("memory per rank", lines))
    return pc


def _overrides(old: MemoryPlan, new: MemoryPlan) -> str:
    out = []
    if (new.backend, new.zero_stage) != (old.backend, old.zero_stage):
        out.append(f"train.backend={new.backend}")
        if new.backend == "deepspeed":
            out.append(f"train.zero_stage={new.zero_stage}")
    if new.checkpointing != old.checkpointing:
        out.append(f"train.activation_checkpointing={new.checkpointing}")
    if new.micro_batch != old.micro_batch:
        out += [f"train.micro_batch_size={new.micro_batch}", f"train.grad_accum_steps={new.grad_accum}"]
    return " ".join(out)


# ------------------------------------------------------------------------------------------------ data
def _check_data(cfg, tokens_per_step: int, rep: Report) -> None:
    from pipeline.runtime import storage
    from pipeline.tokenize.dataset_cache import read_remote_manifest
    from pipeline.tokenize.writer import read_manifest
    from pipeline.tokenize.writer import verify_dataset
    from pipeline.train.data_match import check_dataset_matches_model

    dirs, _ = cfg.data.training_datasets()
    lines, train_tokens, ok = [], 0, True
    for d in dirs:
        key = "data.dataset_dir" if not cfg.data.mixture else f"data.mixture[{dirs.index(d)}].dataset_dir"
        remote = storage.is_remote(d)
        try:  # s3://: the manifest is read from the store, nothing else is downloaded
            manifest = read_remote_manifest(str(d).rstrip("/"))[1] if remote else read_manifest(d)
        except (OSError, ValueError) as e:
            rep.problems.append(f"data: {key}={d}: {e}")
            ok = False
            continue
        try:
            check_dataset_matches_model(manifest, cfg, f"the dataset at {d}")
        except (OSError, ValueError) as e:  # OSError: an s3:// dataset's tokenizer copy could not be read
            rep.problems.append(f"data: {e}")
            ok = False
        size = sum(sh["tokens"] * _itemsize(manifest) for info in manifest["splits"].values()
                   for sh in info["shards"])
        full = size <= FULL_VERIFY_LIMIT and not remote
        try:
            bad = _remote_file_problems(d, manifest) if remote else verify_dataset(d, checksums=full)
        except (OSError, storage.StorageError) as e:
            rep.problems.append(f"data: {key}={d}: {e}")
            ok = False
            continue
        how = ("every shard's sha256, size and index rechecked" if full else
               "every file the manifest names is in the store with the size it gives (sha256 is checked as each "
               "node downloads the files into its dataset cache)" if remote else
               f"sizes and indexes checked against the manifest ({gb(size)}: sha256 not rechecked, run "
               f"`grt data verify {d}`)")
        for b in bad:
            rep.problems.append(f"data: {d}: {b}; re-tokenize it (grt tokenize RECIPE --force) or restore the file")
            ok = False
        n = manifest["splits"].get("train", {}).get("tokens", 0)
        train_tokens += n
        lines.append(f"{d}: {n:,} training tokens; {how}")
    if ok and dirs:
        need = tokens_through(cfg, cfg.train.max_steps)  # train.batch_ramp's stages summed
        epochs = need / max(train_tokens, 1)
        per = f"{tokens_per_step:,} tokens" if cfg.train.batch_ramp is None else "the batch ramp's tokens"
        lines.append(f"{cfg.train.max_steps:,} steps x {per} = {need:,} tokens = "
                     f"{epochs:.2f} epoch(s) of {train_tokens:,}" + (" (repeats data)" if epochs > 1 else ""))
    rep.sections.append(("data", lines))


def _remote_file_problems(url: str, m: dict) -> list[str]:
    """What is wrong with the files of a dataset on the store against its manifest ``m``, from one listing: a missing
    file, or a shard or index whose size is not what the manifest's tokens and documents give."""
    from pipeline.runtime import storage
    from pipeline.tokenize.writer import shard_size_problem

    sizes = storage.sizes_under(url)
    tok = m["tokenizer"].get("file")
    out = [f"tokenizer: {tok} is missing"] if tok and tok not in sizes else []
    for split, info in m["splits"].items():
        for sh in info["shards"]:
            data, index = sizes.get(sh["file"]), sizes.get(sh["index_file"])
            wrong = [shard_size_problem(sh["file"], data, sh["tokens"], _itemsize(m)) if data is not None
                     else f"{sh['file']} is missing"]
            if index is None:
                wrong.append(f"{sh['index_file']} is missing")
            elif index != sh["documents"] * 4:
                wrong.append(f"{sh['index_file']} holds {index:,} bytes, not the {sh['documents']:,} document "
                             f"offsets of 4 bytes the manifest gives")
            out += [f"{split}: {w}" for w in wrong if w]
    return out


def _itemsize(manifest: dict) -> int:
    import numpy as np

    return np.dtype(manifest["dtype"]).itemsize


# ------------------------------------------------------------------------------------------------ tracking
def _check_tracking(cfg, rep: Report) -> None:
    from pipeline.tracking import resolve_uri

    t = cfg.tracking
    if not t.enabled:
        rep.sections.append(("tracking", ["tracking.enabled=false: nothing to reach"]))
        return
    uri = resolve_uri(t.uri)
    if uri.startswith(("http://", "https://")):
        from pipeline.tracking import TrackingUnavailableError
        from pipeline.tracking import check_server

        try:  # the trainer's own check: /health and one API call (a server may answer one and refuse the other)
            check_server(uri)
        except TrackingUnavailableError as e:
            rep.problems.append(f"tracking: {e}")
            rep.sections.append(("tracking", [f"{uri}: not reachable"]))
            return
        rep.sections.append(("tracking", [f"{uri}: an MLflow server answers"]))
    elif uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///"):]).parent
        existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
        if not os.access(existing, os.W_OK):
            rep.problems.append(f"tracking: {uri}: folder {existing} is not writable; point tracking.uri at a "
                                f"writable folder, use an http:// server, or set tracking.enabled=false")
        rep.sections.append(("tracking", [f"{uri}: sqlite in {folder} "
                                          f"({'writable' if os.access(existing, os.W_OK) else 'NOT writable'})"]))
    else:
        rep.sections.append(("tracking", [f"{uri}: not checked (only http(s):// and sqlite:/// are)"]))


# ------------------------------------------------------------------------------------------------ disk
def _check_disk(cfg, pc, bf16: bool, rep: Report) -> None:
    # a run on object storage: each node's copy (GRT_RUN_CACHE) holds the kept checkpoints too, not only the one
    # being written
    out = cfg.run_dir.resolve() if cfg.run_url else Path(cfg.out_dir).resolve()
    existing = next((p for p in (out, *out.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    one = memory.checkpoint_bytes(pc, cfg.train.backend, bf16)
    # the one being written beside the kept ones, and the branch points train.keep_steps never prunes
    n = cfg.train.keep_checkpoints + 1 + len(cfg.train.keep_steps)
    need = n * one
    rep.sections.append(("checkpoints", [f"{gb(one)} per checkpoint (fp32 weights + AdamW state); "
                                         f"{n} x = {gb(need)} needed, {gb(free)} free under {existing}"]))
    if need > free:
        fit = int(free // one) - 1
        rep.problems.append(f"disk: {n} checkpoints of {gb(one)} (train.keep_checkpoints={cfg.train.keep_checkpoints} "
                            f"+ the one being written) need {gb(need)}, only {gb(free)} free under {existing}; free "
                            f"space, point out_dir at a larger disk"
                            + (f", or set train.keep_checkpoints={fit}" if fit >= 1 else ""))


# ------------------------------------------------------------------------------------------------ env
def _env_section(rep: Report) -> None:
    set_ = [f"{k}={os.environ[k]}" for k in ENV_VARS if k in os.environ]
    unset = [k for k in ENV_VARS if k not in os.environ]
    rep.sections.append(("environment (NCCL / gloo / rendezvous)", [
        "set: " + (", ".join(set_) if set_ else "none"), "not set: " + (", ".join(unset) if unset else "none")]))
