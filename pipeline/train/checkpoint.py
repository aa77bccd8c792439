"""Checkpoints: one folder per step, written to a temporary name, synced, then renamed (never half-written).

``runs/NAME/checkpoints/step_00000100/{state.pt, recipe.yaml}``; the last ``keep`` are kept.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: Path, step: int, state: dict, recipe_yaml: str, keep: int) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp_step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    (tmp / "recipe.yaml").write_text(recipe_yaml)
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
