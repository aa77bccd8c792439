"""Checkpoints: one folder per step, written to a temporary name, synced, then renamed (never half-written).

``runs/NAME/checkpoints/step_00000100/{state.pt, recipe.yaml[, model_optim/ | deepspeed/], index.json}``; the last
``keep`` are kept. A job killed while saving leaves only the temporary folder, which is ignored: the previous
checkpoint stays loadable. ``index.json`` is written last: the size and sha256 of every other file of the checkpoint.
Resume and eval verify it, so a truncated or altered file (or a folder without its index) is never loaded: training
moves a damaged checkpoint aside (``damaged_step_...``) and falls back to the newest intact one; eval refuses it.
Formats (``state.pt``'s ``checkpoint_format``): ``full`` (model and optimizer inside state.pt), ``sharded``
(torch.distributed.checkpoint shards in ``model_optim/``), ``deepspeed`` (DeepSpeed's own files in ``deepspeed/``);
an export of ``grt checkpoint convert --to safetensors`` is a folder with ``model.safetensors`` and ``recipe.yaml``.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time
import zipfile
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(ckpt_root: Path, step: int) -> Path:
    """The temporary folder a checkpoint is written into before it is published (rank 0 creates it)."""
    return ckpt_root / f".tmp_step_{step:08d}"


def prepare_staging(ckpt_root: Path, step: int) -> Path:
    tmp = staging_dir(ckpt_root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left; the user's quota exceeded: the same remedy


def disk_full_cause(error: BaseException | None) -> OSError | None:
    """The "no space left" OSError behind a failed save, wherever the writer wrapped it: torch.save raises a
    RuntimeError of its own with it as the context; torch.distributed.checkpoint a CheckpointException holding every
    rank's error (see :func:`shard_writer`)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (error, traceback summary)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def shard_writer(path: Path):
    """torch.distributed.checkpoint's file writer, except that a shard write that ran out of space fails with that
    OSError itself: DCP sends each rank's error to the others pickled, which drops the OSError that torch.save's
    RuntimeError carries only as its context, and every rank must learn that the disk is full."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as e:
                cause = disk_full_cause(e)
                if cause is None:
                    raise
                raise OSError(cause.errno, cause.strerror, cause.filename) from e

    return Writer(path)


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _mb(n: float) -> str:
    return f"{n / 2**30:,.1f} GB" if n >= 2**30 else f"{n / 2**20:,.1f} MB"


def disk_full_message(ckpt_root: Path, step: int, cause: OSError | None, out_dir: Path) -> str:
    """One line once the save of ``step`` ran out of space and its staging folder is gone: the filesystem and its
    free space, the checkpoint the run resumes from, and the two fixes."""
    where = next(p for p in (ckpt_root, *ckpt_root.parents) if p.exists())
    usage, mount = shutil.disk_usage(where), _mount_point(where)
    published = list_checkpoints(ckpt_root)
    last = published[-1] if published else None
    try:
        size = sum(e["bytes"] for e in json.loads((last / INDEX).read_text())["files"].values()) if last else 0
    except (OSError, ValueError, KeyError, TypeError):
        size = 0
    need = f"; a checkpoint of this run takes {_mb(size)}" if size else ""
    resume = (f"the newest checkpoint, {last}, is intact: the run resumes from it" if last else
              "no checkpoint of this run was written before: the run starts over")
    what = ("another rank's write found no space left" if cause is None else
            f"{cause.strerror}: {cause.filename}" if cause.filename else str(cause))
    tmp = staging_dir(ckpt_root, step).name
    return (f"disk full: the checkpoint of step {step} did not fit under {ckpt_root} (filesystem {mount}: "
            f"{_mb(usage.free)} free of {_mb(usage.total)} now that its unfinished {tmp} is removed{need}; {what}). "
            f"{resume[0].upper()}{resume[1:]}. Free space on {mount}, or move the run "
            f"folder to a filesystem with room and pass out_dir= of its new parent (now {out_dir}); then run the "
            f"same command again")


def disk_full_while_training(cause: OSError, step: int, run_dir: Path, newest: Path | None) -> str:
    """One line for a disk that filled outside a save (a log or metrics file while training): the file, the
    filesystem and its free space, the checkpoint the run resumes from, and the fix."""
    target = Path(cause.filename) if cause.filename else run_dir
    where = next(p for p in (target, *target.parents) if p.exists())
    usage, mount = shutil.disk_usage(where), _mount_point(where)
    resume = f"the newest checkpoint, {newest}, is intact" if newest else "no checkpoint was written yet"
    return (f"disk full at step {step}: no space left to write {cause.filename or 'a file of ' + str(run_dir)} "
            f"(filesystem {mount}: {_mb(usage.free)} free of {_mb(usage.total)}); {resume}. Free space on {mount} "
            f"and run the same command again: it resumes from there")


INDEX = "index.json"  # a checkpoint's integrity index, written last
INDEX_VERSION = 1


def size_problem(name: str, actual: int, size: int) -> str:
    """A file of a checkpoint whose size is not the index's, in words."""
    return (f"{name} has {actual:,} bytes, the index says {size:,} ("
            f"{'truncated' if actual < size else 'grown'} after the save)")


def sha256_and_size(f: Path, sync: bool = False) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
            size += len(block)
        if sync:
            os.fsync(fh.fileno())
    return h.hexdigest(), size


def _parallel(fn, items: list) -> list:
    """``fn`` over ``items`` in threads (hashlib and file reads release the GIL): the files of a sharded checkpoint are
    hashed side by side."""
    if len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))


INDEX_PARTS = ".index_parts"  # in a staged checkpoint: each rank's digests of its share of the files


UNINDEXED_PARTS = (INDEX_PARTS, "deepspeed_universal", ".deepspeed_universal.tmp")  # not the save's own files


def _files_of(folder: Path) -> list[Path]:
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and f.name != INDEX
            and not any(part in f.relative_to(folder).parts for part in UNINDEXED_PARTS)]


def hash_share(folder: Path, rank: int, world: int) -> None:
    """Every rank of a save: sync and hash its share of the staged files (every ``world``-th, from ``rank``) and leave
    the digests for rank 0's index, so that no rank reads the whole checkpoint alone."""
    mine = _files_of(folder)[rank::world]
    digests = _parallel(lambda f: sha256_and_size(f, sync=True), mine)
    parts = folder / INDEX_PARTS
    parts.mkdir(exist_ok=True)
    out = {f.relative_to(folder).as_posix(): {"bytes": size, "sha256": sha} for f, (sha, size) in zip(mine, digests)}
    (parts / f"rank_{rank}.json").write_text(json.dumps(out))


def write_index(folder: Path) -> dict:
    """Sync every file of ``folder`` and record its size and sha256 in ``folder/index.json`` (written last). Digests
    the ranks left with :func:`hash_share` are used for the files they cover (those still at that size); the rest are
    hashed here."""
    known: dict = {}
    parts = folder / INDEX_PARTS
    if parts.is_dir():
        for f in parts.glob("rank_*.json"):
            known.update(json.loads(f.read_text()))
        shutil.rmtree(parts)
    paths = _files_of(folder)
    for _ in range(10):  # a shared filesystem may list another node's new file a little late
        unseen = set(known) - {f.relative_to(folder).as_posix() for f in paths}
        if not unseen:
            break
        time.sleep(1)
        paths = _files_of(folder)
    else:
        raise FileNotFoundError(f"{folder}: files the other ranks wrote and hashed are not visible here "
                                f"({', '.join(sorted(unseen)[:5])}): the checkpoint folder must be on a filesystem "
                                f"every rank shares")
    todo = [f for f in paths if known.get(f.relative_to(folder).as_posix(), {}).get("bytes") != f.stat().st_size]
    for f, (sha, size) in zip(todo, _parallel(lambda f: sha256_and_size(f, sync=True), todo)):
        known[f.relative_to(folder).as_posix()] = {"bytes": size, "sha256": sha}
    files = {f.relative_to(folder).as_posix(): known[f.relative_to(folder).as_posix()] for f in paths}
    index = {"version": INDEX_VERSION, "files": files}
    with open(folder / INDEX, "w") as fh:
        json.dump(index, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(folder)
    return index


MISSING_INDEX = (f"{INDEX} is missing (the file was removed, or the checkpoint was written before grt indexed "
                 f"checkpoints: if you trust it, `grt checkpoint verify RUN --adopt` indexes it as it is now)")


def verify_checkpoint(folder: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with a checkpoint folder against its index (empty: intact). ``checksums=False`` compares sizes
    only; ``share=(rank, world)`` hashes only every world-th file from rank (the ranks of a job split the reading;
    sizes are always all checked). Files added after the save (DeepSpeed's universal conversion, which has an index of
    its own) are not checked here."""
    path = folder / INDEX
    if not path.is_file():
        return [MISSING_INDEX]
    try:
        index = json.loads(path.read_text())
        files = index["files"]
        entries = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{INDEX} is unreadable ({type(e).__name__}: {e})"]
    problems, to_hash = [], []
    rank, world = share
    for i, (name, size, sha) in enumerate(entries):
        f = folder / name
        if not f.is_file():
            problems.append(f"{name} is missing")
            continue
        actual = f.stat().st_size
        if actual != size:
            problems.append(size_problem(name, actual, size))
        elif checksums and i % world == rank:
            to_hash.append((name, f, sha))
    for (name, _, sha), (actual_sha, _) in zip(to_hash, _parallel(lambda e: sha256_and_size(e[1]), to_hash)):
        if actual_sha != sha:
            problems.append(f"{name}'s sha256 differs from the index (its bytes changed after the save)")
    return problems


class DamagedCheckpointError(ValueError):
    pass


def set_aside_names(*roots: Path) -> list[str]:
    """The checkpoints set aside as damaged in these folders (``damaged_step_*``), by name."""
    return sorted(q.name for root in roots if root.is_dir() for q in root.glob("damaged_step_*"))


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint out of the way (kept for inspection, never loaded, never counted by ``keep``)."""
    target = folder.with_name(f"damaged_{folder.name}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"damaged_{folder.name}.{n}")
    os.replace(folder, target)
    return target


def publish(ckpt_root: Path, step: int, recipe_yaml: str, keep: int, keep_steps=()) -> Path:
    """Sync the staged folder and index it, rename it to ``step_XXXXXXXX`` and drop all but the last ``keep``; the
    steps in ``keep_steps`` (train.keep_steps: branch points) are never dropped, nor counted in ``keep``."""
    tmp, final = staging_dir(ckpt_root, step), ckpt_root / f"step_{step:08d}"
    (tmp / "recipe.yaml").write_text(recipe_yaml)
    write_index(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    # the last `keep` up to this one (a newer folder, never made by this run, is not this save's to prune)
    steps = {c: int(STEP_DIR.match(c.name).group(1)) for c in list_checkpoints(ckpt_root)}
    for old in [c for c, n in steps.items() if n <= step and n not in keep_steps][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".tmp_step_*"):  # saves a kill interrupted: never loadable, only taking space
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """The published checkpoints (``step_XXXXXXXX`` with a state.pt or an index: one that lost its state.pt is listed,
    to be found damaged), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)
             and ((p / "state.pt").is_file() or (p / INDEX).is_file())]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def needs_index(folder: Path) -> bool:
    """Checkpoints of a run (step_XXXXXXXX) and exports (RUN/exports/*) always carry an index."""
    return bool(STEP_DIR.match(folder.name)) or folder.parent.name == "exports" or (folder / INDEX).is_file()


def check_intact(folder: Path, checksums: bool = True) -> None:
    """Raise :class:`DamagedCheckpointError` naming the checkpoint, what is wrong and the newest intact
    one beside it."""
    problems = verify_checkpoint(folder, checksums) if needs_index(folder) else []
    if not problems:
        return
    other = next((c for c in reversed(list_checkpoints(folder.parent))
                  if c != folder and not verify_checkpoint(c, checksums=False)), None)
    alt = (f"the newest checkpoint beside it of intact size is {other}: pass that folder explicitly"
           if other else "no intact checkpoint is beside it")
    raise DamagedCheckpointError(f"checkpoint {folder} is damaged: {'; '.join(problems)}. Refusing to load it; "
                                 f"{alt} (`grt train` on the run falls back to it by itself)")


def resolve_checkpoint(path: str | Path, verify: bool = True) -> Path:
    """A run folder, a checkpoints folder, a step folder or a state.pt file -> the state.pt to load; with ``verify``
    the checkpoint must match its integrity index (:func:`check_intact`)."""
    p = Path(path)
    found_file = None
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        raise ValueError(not_a_checkpoint(p))
    if p.is_file():
        found_file = p
    else:
        for root in (p / "checkpoints", p):
            found = list_checkpoints(root)
            if found:
                found_file = found[-1] / "state.pt"
                break
        else:
            for name in ("state.pt", SAFETENSORS):
                if (p / name).is_file():
                    found_file = p / name
                    break
    if found_file is not None:
        if verify:
            check_intact(found_file.parent)
        return found_file
    aside = set_aside_names(p / "checkpoints", p)
    if aside:
        raise DamagedCheckpointError(f"no intact checkpoint under {p}: the only ones there were set aside as damaged "
                                     f"({', '.join(aside)}); train the run again (`grt train RECIPE`)")
    raise FileNotFoundError(f"no checkpoint under {p}: expected a run folder (runs/NAME), a step folder, a state.pt "
                            f"file or an exported {SAFETENSORS}; train first with `grt train RECIPE`")


def not_a_checkpoint(recipe: Path) -> str:
    """What to pass instead of a YAML recipe where a checkpoint is expected: the checkpoint folder it lies in, or the
    run folder the recipe trains."""
    if (recipe.parent / "state.pt").is_file() or (recipe.parent / SAFETENSORS).is_file():
        return f"{recipe} is the recipe of a checkpoint, not a checkpoint: pass its folder, {recipe.parent}"
    try:
        from pipeline.config import load_recipe

        run = load_recipe(recipe).run_dir
    except Exception:  # noqa: BLE001 — any recipe problem: the generic advice below
        return (f"{recipe} is a YAML recipe, not a checkpoint: pass the run folder it trained (runs/NAME), a step "
                f"folder or a state.pt")
    trained = "" if list_checkpoints(run / "checkpoints") else f"; it has no checkpoint yet: `grt train {recipe}`"
    return f"{recipe} is a YAML recipe, not a checkpoint: pass the run folder it trains, {run}{trained}"


SAFETENSORS = "model.safetensors"
SAFETENSORS_META = "grt"  # the safetensors metadata key holding the recipe, step and info as JSON


def load_checkpoint(path: str | Path, map_location="cpu", verify: bool = True) -> dict:
    """The checkpoint's ``state.pt``: step, loader, recipe, ... — and the weights only in the ``full`` format
    (:func:`full_model_state` reads them from any format)."""
    f = resolve_checkpoint(path, verify)
    if f.name == SAFETENSORS:
        from safetensors import safe_open

        with unreadable_as_damage(f):
            with safe_open(str(f), "pt") as sf:
                meta = (sf.metadata() or {}).get(SAFETENSORS_META)
        if meta is None:
            raise ValueError(f"{f} has no '{SAFETENSORS_META}' metadata: it was not written by `grt checkpoint "
                             f"convert`, so its recipe is unknown")
        return {**json.loads(meta), "checkpoint_format": "safetensors"}
    with unreadable_as_damage(f):
        # memory-mapped: a tensor's bytes are read when it is used, so a rank that takes only the step, the loader
        # and the recipe (the others of a resume, which get the weights broadcast from rank 0) never reads them
        return torch.load(f, map_location=map_location, weights_only=False, mmap=zipfile.is_zipfile(f))


@contextlib.contextmanager
def unreadable_as_damage(f: Path):
    """Whatever a damaged file makes a reader raise (a zip cut short, a bad pickle, a safetensors header) becomes one
    line naming the file, never a traceback from inside the reader."""
    try:
        yield
    except DamagedCheckpointError:
        raise
    except (ImportError, AttributeError) as e:  # a pickled class this environment lacks: not damage
        raise ValueError(f"cannot load {f}: {type(e).__name__}: {e}. It refers to code this environment does not "
                         f"have: it was saved with other versions of grt, torch or numpy; load it with those") from e
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{f} disappeared while being read (a running training pruned it?): {e}") from e
    except Exception as e:  # noqa: BLE001 — the readers raise many types for one cause
        first = (str(e).splitlines() or [""])[0][:200]
        raise DamagedCheckpointError(f"cannot read {f}: {type(e).__name__}: {first}. The file is damaged; use "
                                     f"another checkpoint of the run (`grt checkpoint verify RUN` lists them)") from e


def checkpoint_format_of(folder: Path, state: dict) -> str:
    """full | sharded | deepspeed | safetensors: from the state (recorded since sharded checkpoints exist) or the
    folder's contents (older checkpoints)."""
    if "checkpoint_format" in state:
        return state["checkpoint_format"]
    if "model" in state:
        return "full"
    return "deepspeed" if (folder / "deepspeed").is_dir() else "sharded"


SHARDS_DIR = "model_optim"  # the torch.distributed.checkpoint folder of a sharded checkpoint


def tied_names(recipe: dict) -> dict[str, str]:
    """{alias: first name} of the parameters the recipe's model shares between modules (the tied LM head), read off
    the model built on the meta device."""
    from pipeline.config import from_dict
    from pipeline.model import build_model

    model = build_model(from_dict(recipe, "checkpoint recipe", saved=True).model, device="meta")
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def retie(weights: dict, recipe: dict) -> dict:
    """Formats that store a tied tensor once (DeepSpeed, safetensors) -> the full state dict with every name."""
    for alias, name in tied_names(recipe).items():
        if alias not in weights and name in weights:
            weights[alias] = weights[name]
    return weights


def full_model_state(ckpt_file: Path, state: dict) -> dict:
    """The full (unsharded) model state dict of a checkpoint of any format, on the CPU of this one process — for
    eval, export and conversion, never for training (which loads only its own shards)."""
    folder = ckpt_file.parent
    fmt = checkpoint_format_of(folder, state)
    if fmt == "full":
        return state["model"]
    if fmt == "safetensors":
        from safetensors.torch import load_file

        with unreadable_as_damage(ckpt_file):
            return retie(load_file(str(ckpt_file)), state["recipe"])
    if fmt == "sharded":
        return _read_shards("model", folder)
    if (folder / "deepspeed").is_dir():
        import logging

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        return retie(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="deepspeed"), state["recipe"])
    raise ValueError(f"{ckpt_file} holds no model weights and no DeepSpeed shards beside it")


def full_optimizer_state(ckpt_file: Path, state: dict) -> dict | None:
    """The full optimizer state dict (parameter names as keys) of a full or sharded checkpoint; None for formats
    that do not keep it in that form (DeepSpeed, safetensors)."""
    fmt = checkpoint_format_of(ckpt_file.parent, state)
    if fmt == "full":
        return state.get("optimizer")
    if fmt == "sharded":
        return _read_shards("optimizer", ckpt_file.parent)
    return None


def _read_shards(key: str, folder: Path) -> dict:
    """One entry of a sharded checkpoint, whole, in this process (no process group: DCP reads every rank's shards
    and assembles the tensors)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        return _load_state_dict_from_keys(key, checkpoint_id=str(folder / SHARDS_DIR))[key]


def check_loadable(folder: Path) -> None:
    """Read every file of the checkpoint at ``folder`` the way its format's reader does, in full: state.pt (and every
    DeepSpeed ``.pt``) unpickled without memory-mapping; a sharded checkpoint's ``.distcp`` files against the byte
    ranges its ``.metadata`` records, then its whole state assembled on the CPU. Raise
    :class:`DamagedCheckpointError` naming the first file that does not read. For a checkpoint without an index (what
    ``grt checkpoint verify --adopt`` indexes): a shard cut short must not be taken as it is."""
    for f in _files_of(folder):  # an I/O error anywhere; the bytes are then in the page cache for the readers below
        with unreadable_as_damage(f), open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    state_pt = folder / "state.pt"
    if not state_pt.is_file():
        raise DamagedCheckpointError(f"{folder} has no state.pt: not a checkpoint grt wrote (or it lost that file)")
    with unreadable_as_damage(state_pt):
        fmt = checkpoint_format_of(folder, torch.load(state_pt, map_location="cpu", weights_only=False))
    for f in sorted((folder / "deepspeed").rglob("*.pt")):
        with unreadable_as_damage(f):
            torch.load(f, map_location="cpu", weights_only=False)
    if fmt == "sharded":
        _check_shards(folder / SHARDS_DIR)
    elif fmt == "deepspeed" and not any((folder / "deepspeed").rglob("*.pt")):
        raise DamagedCheckpointError(f"{folder}/deepspeed holds no DeepSpeed files: its weights are gone")


def _check_shards(shards: Path) -> None:
    """Every byte range the DCP metadata lists lies inside its ``.distcp`` file, and the whole state reads."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = shards / ".metadata"
    if not meta_file.is_file():
        raise DamagedCheckpointError(f"{meta_file} is missing: the sharded checkpoint's table of contents is gone")
    with unreadable_as_damage(meta_file):
        storage = FileSystemReader(str(shards)).read_metadata().storage_data
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        f = shards / name
        if not f.is_file():
            raise DamagedCheckpointError(f"{f} is missing (the shard's .metadata lists it)")
        if f.stat().st_size < end:
            raise DamagedCheckpointError(f"{f} has {f.stat().st_size:,} bytes, the shards' .metadata places data up "
                                         f"to byte {end:,}: truncated")
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with unreadable_as_damage(shards), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or uninitialized")
        _load_state_dict_from_keys(checkpoint_id=str(shards))  # every key: model and optimizer
