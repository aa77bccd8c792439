"""Checkpoints: one folder per step, written to a temporary name, synced, then renamed (never half-written).

``runs/NAME/checkpoints/step_00000100/{state.pt, recipe.yaml[, model_optim/ | deepspeed/]}``; the last ``keep`` are
kept. A job killed while saving leaves only the temporary folder, which is ignored: the previous checkpoint stays
loadable. Formats (``state.pt``'s ``checkpoint_format``): ``full`` (model and optimizer inside state.pt), ``sharded``
(torch.distributed.checkpoint shards in ``model_optim/``), ``deepspeed`` (DeepSpeed's own files in ``deepspeed/``);
an export of ``grt checkpoint convert --to safetensors`` is a folder with ``model.safetensors`` and ``recipe.yaml``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
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


def publish(ckpt_root: Path, step: int, recipe_yaml: str, keep: int) -> Path:
    """Sync the staged folder, rename it to ``step_XXXXXXXX`` and drop all but the last ``keep``."""
    tmp, final = staging_dir(ckpt_root, step), ckpt_root / f"step_{step:08d}"
    (tmp / "recipe.yaml").write_text(recipe_yaml)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".tmp_step_*"):  # saves a kill interrupted: never loadable, only taking space
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder, a checkpoints folder, a step folder or a state.pt file -> the state.pt to load."""
    p = Path(path)
    if p.is_file():
        return p
    for root in (p / "checkpoints", p):
        found = list_checkpoints(root)
        if found:
            return found[-1] / "state.pt"
    for name in ("state.pt", SAFETENSORS):
        if (p / name).is_file():
            return p / name
    raise FileNotFoundError(f"no checkpoint under {p}: expected a run folder (runs/NAME), a step folder, a state.pt "
                            f"file or an exported {SAFETENSORS}; train first with `grt train RECIPE`")


SAFETENSORS = "model.safetensors"
SAFETENSORS_META = "grt"  # the safetensors metadata key holding the recipe, step and info as JSON


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """The checkpoint's ``state.pt``: step, loader, recipe, ... — and the weights only in the ``full`` format
    (:func:`full_model_state` reads them from any format)."""
    f = resolve_checkpoint(path)
    if f.name == SAFETENSORS:
        from safetensors import safe_open

        with safe_open(str(f), "pt") as sf:
            meta = (sf.metadata() or {}).get(SAFETENSORS_META)
        if meta is None:
            raise ValueError(f"{f} has no '{SAFETENSORS_META}' metadata: it was not written by `grt checkpoint "
                             f"convert`, so its recipe is unknown")
        return {**json.loads(meta), "checkpoint_format": "safetensors"}
    return torch.load(f, map_location=map_location, weights_only=False)


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

    model = build_model(from_dict(recipe, "checkpoint recipe").model, device="meta")
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
