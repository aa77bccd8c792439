"""`grt eval RUN_OR_CHECKPOINT`: the early-exit curve and gate means on the validation split, saved as JSON and PNG
in the run folder and logged to the run's MLflow run."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pipeline.config import apply_overrides, from_dict
from pipeline.model import build_model, model_info
from pipeline.tracking import open_tracker
from pipeline.train.backend import pick_device
from pipeline.train.checkpoint import load_checkpoint, resolve_checkpoint
from pipeline.train.data import TokenShards, validation_batches
from pipeline.eval.exits import exit_curve, exit_flops
from pipeline.eval.plots import plot_exit_curves


def load_trained(path: str | Path, overrides: list[str] | None = None, device: str = "auto"):
    """(model in eval mode, recipe, checkpoint state) from a run folder or checkpoint."""
    ckpt = resolve_checkpoint(path)
    state = load_checkpoint(ckpt)
    data, problems = apply_overrides(state["recipe"], list(overrides or []))
    cfg = from_dict(data, f"{ckpt} recipe")
    if problems:
        raise ValueError("; ".join(problems))
    dev = pick_device(device)
    model = build_model(cfg.model)
    model.load_state_dict(model_weights(ckpt, state))
    return model.to(dev).eval(), cfg, state, ckpt


def model_weights(ckpt: Path, state: dict) -> dict:
    """The full model state dict of a checkpoint: stored as is (single, ddp, fsdp), or consolidated from the
    DeepSpeed ZeRO shards in the step folder."""
    if "model" in state:
        return state["model"]
    if (ckpt.parent / "deepspeed").is_dir():
        import logging

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag="deepspeed")
        if "lm_head.weight" not in weights and "embed.wte.weight" in weights:
            weights["lm_head.weight"] = weights["embed.wte.weight"]  # tied: DeepSpeed stores it once
        return weights
    raise ValueError(f"{ckpt} holds no model weights and no DeepSpeed shards beside it")


def run_dir_of(ckpt: Path) -> Path:
    """runs/NAME/checkpoints/step_X/state.pt -> runs/NAME (else the checkpoint's folder)."""
    if ckpt.parent.parent.name == "checkpoints":
        return ckpt.parent.parent.parent
    return ckpt.parent


def evaluate(path: str | Path, overrides: list[str] | None = None, quiet: bool = False) -> dict:
    t0 = time.time()
    model, cfg, state, ckpt = load_trained(path, overrides)
    device = next(model.parameters()).device
    info = model_info(cfg.model)
    trained_depth = getattr(cfg.model, "n_recurrence", None)
    if cfg.model.type == "gpt":
        n_max = cfg.eval.max_steps or cfg.model.n_layer
    else:
        n_max = cfg.eval.max_steps or 2 * trained_depth
    val = TokenShards(cfg.data.training_datasets()[0][0], "val")
    batches = validation_batches(val, cfg.model.block_size, cfg.eval.batch_size, max_tokens=cfg.eval.val_tokens)
    curve = exit_curve(model, batches, n_max, device)
    full_exit = trained_depth if trained_depth is not None else cfg.model.n_layer
    result = {
        "name": cfg.name, "type": cfg.model.type, "shorthand": info["shorthand"], "params": info["params"],
        "checkpoint": str(ckpt), "step": state["step"],
        "tokens_trained": state["step"] * cfg.train.micro_batch_size * cfg.train.grad_accum_steps
        * cfg.model.block_size,
        "trained_depth": trained_depth, "val_loss": curve["loss"][curve["exit"].index(full_exit)]
        if full_exit in curve["exit"] else None,
        **curve, "exit_flops": exit_flops(cfg.model, curve["exit"]),
        "dataset_dir": cfg.data.dataset_dir, "seconds": None,
    }
    out_dir = run_dir_of(ckpt) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "recurrence step r" if cfg.model.type != "gpt" else "layer"
    plot = plot_exit_curves([result], out_dir / "early_exit.png", title=f"{cfg.name} ({info['shorthand']})")
    result["seconds"] = round(time.time() - t0, 2)
    result["plot"] = str(plot)
    (out_dir / "exits.json").write_text(json.dumps(result, indent=2))
    run_id = state.get("mlflow_run_id")
    if cfg.tracking.enabled:
        tracker = open_tracker(cfg.tracking, cfg.name, run_id)
        for e, loss in zip(curve["exit"], curve["loss"]):
            tracker.log_metrics({"eval.exit_loss": loss}, step=e)
        for e, g in zip(curve["exit"], curve.get("gate_mean") or []):
            tracker.log_metrics({"eval.gate_mean": g}, step=e)
        if result["val_loss"] is not None:
            tracker.log_metrics({"eval.val_loss": result["val_loss"]}, step=state["step"])
        tracker.log_artifact(out_dir / "exits.json", "eval")
        tracker.log_artifact(plot, "eval")
        tracker.close()
        result["mlflow_run_id"] = tracker.run_id
    if not quiet:
        print(f"eval: {cfg.name} ({info['shorthand']}) step {state['step']}, {curve['val_tokens']:,} val tokens, "
              f"noise off, {result['seconds']:.1f} s")
        gates = curve.get("gate_mean") or [None] * len(curve["exit"])
        for e, loss, g in zip(curve["exit"], curve["loss"], gates):
            mark = "  <- trained depth" if e == trained_depth else ""
            gate = f"  gate mean {g:.3f}" if g is not None else ""
            print(f"  {kind} {e:>2}: loss {loss:.4f}{gate}{mark}")
        print(f"  saved {out_dir / 'exits.json'} and {plot}")
    return result
