"""Checkpoints: one folder per step, written to a temporary name, synced, then renamed (never half-written).

``runs/NAME/checkpoints/step_00000100/{state.pt, recipe.yaml[, deepspeed/]}``; the last ``keep`` are kept. A job
killed while saving leaves only the temporary folder, which is ignored: the previous checkpoint stays loadable.
"""
from __future__ import annotations

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
    if (p / "state.pt").is_file():
        return p / "state.pt"
    raise FileNotFoundError(f"no checkpoint under {p}: expected a run folder (runs/NAME), a step folder or a "
                            f"state.pt file; train first with `grt train RECIPE`")


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    return torch.load(resolve_checkpoint(path), map_location=map_location, weights_only=False)
