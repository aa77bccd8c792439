"""A trained checkpoint loaded back: its model in eval mode and its recipe, with the overrides that may change
(:data:`EVAL_KEYS`). Shared by `grt eval`, `grt generate`, `grt export` and lm-eval's ``grt`` model."""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.config import RecipeError
from pipeline.config import RunConfig
from pipeline.config import from_dict
from pipeline.config.recipe_files import apply_overrides
from pipeline.model import build_model
from pipeline.runtime import storage
from pipeline.train.backend import pick_device
from pipeline.train.checkpoint import full_model_state
from pipeline.train.checkpoint import load_checkpoint
from pipeline.train.checkpoint import resolve_checkpoint
from pipeline.train.run_store import fetch_run

# What an override may change in a trained checkpoint's recipe: how it is evaluated, where that is logged, the device
# it runs on, where its tokenized dataset now lies (checked against the model's tokenizer). Every other key describes
# the trained model or how it was trained (eval reports tokens_trained from train.*), so changing it would evaluate
# something else or mislabel the result.
EVAL_KEYS = ("eval.", "tracking.", "train.device", "data.dataset_dir", "data.mixture")


def eval_recipe(recipe: dict, overrides: list[str], source: str) -> RunConfig:
    """The checkpoint's recipe with ``overrides`` applied; :class:`RecipeError` (exit 2) naming every override that
    would change anything but :data:`EVAL_KEYS`, with the checkpoint's value."""
    trained = from_dict(recipe, source, saved=True).flat()
    refused = []
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        key = key.strip()
        if not sep or key.startswith(EVAL_KEYS):
            continue
        try:  # harmless when it leaves the whole recipe as it was (e.g. the value the checkpoint has)
            if from_dict(apply_overrides(recipe, [ov])[0], source, saved=True).flat() == trained:
                continue
        except RecipeError:
            pass
        if key in trained:
            refused.append(f"{key}={raw}: the checkpoint was trained with {key}={trained[key]!r}")
        elif any(k.startswith(key + ".") for k in trained):  # a whole section, e.g. model={...}
            refused.append(f"{key}={raw}: not the {key} section the checkpoint was trained with")
        else:
            refused.append(f"{key}={raw}: the checkpoint's recipe has no {key}")
    if refused:
        raise RecipeError(refused, f"{source} (a trained checkpoint takes only eval.*, tracking.*, train.device and "
                                   f"data.dataset_dir / data.mixture overrides; to change the model or its training, "
                                   f"train a new run)")
    data, problems = apply_overrides(recipe, overrides)
    if problems:
        raise RecipeError(problems, source)
    return from_dict(data, source, saved=True)


def load_trained(path: str | Path, overrides: list[str] | None = None, device: str = "auto"):
    """(model in eval mode, recipe, checkpoint state, checkpoint file) from a run folder or checkpoint;
    ``train.device=...`` among the overrides picks the device."""
    if storage.is_remote(path):  # a run on object storage: this node's checked copy (pipeline/train/run_store.py)
        path = fetch_run(str(path))
    ckpt = resolve_checkpoint(path)
    state = load_checkpoint(ckpt, verify=False)  # verified by resolve_checkpoint
    overrides = list(overrides or [])
    cfg = eval_recipe(state["recipe"], overrides, f"grt eval {path}")
    if any(ov.split("=", 1)[0].strip() == "train.device" for ov in overrides):
        device = cfg.train.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but torch sees no CUDA device here; evaluate with train.device=cpu")
    dev = pick_device(device)
    model = build_model(cfg.model)
    model.load_state_dict(full_model_state(ckpt, state))
    return model.to(dev).eval(), cfg, state, ckpt
