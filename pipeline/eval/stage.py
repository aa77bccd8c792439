"""`grt eval RUN_OR_CHECKPOINT`: early-exit curves, recurrence diagnostics and downstream tasks of a checkpoint, saved
as JSON and PNG in the run folder and logged to the run's MLflow run."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from pipeline.config import RecipeError
from pipeline.config import RunConfig
from pipeline.config.recipe_files import file_in_the_way
from pipeline.config.recipe_files import folder_problem
from pipeline.config.recipe_files import sqlite_file
from pipeline.eval.analyses.methods import method_metrics
from pipeline.eval.analyses.methods import method_report
from pipeline.eval.analyses.methods import print_method_report
from pipeline.eval.analyses.methods import routing
from pipeline.eval.analyses.plots import plot_diagnostics
from pipeline.eval.analyses.plots import plot_exit_curves
from pipeline.eval.analyses.plots import plot_gate_heatmaps
from pipeline.eval.analyses.suite import analysis_metrics
from pipeline.eval.analyses.suite import analysis_plots
from pipeline.eval.analyses.suite import print_analyses
from pipeline.eval.analyses.suite import run_analyses
from pipeline.eval.exit_losses import exit_curve
from pipeline.eval.exit_losses import exit_flops
from pipeline.eval.exit_losses import exit_range
from pipeline.eval.results import collect
from pipeline.eval.results import headline
from pipeline.infer.precision import inference_precision
from pipeline.model import exits_are_layers
from pipeline.model import model_class
from pipeline.model import model_info
from pipeline.model.registry import NOISY_TYPES
from pipeline.runtime import storage
from pipeline.tokenize.dataset_cache import local_dataset
from pipeline.tokenize.tokenizers import trained_tokenizer
from pipeline.tracking import open_tracker
from pipeline.train.backend import autocast_dtype
from pipeline.train.checkpoint import list_checkpoints
from pipeline.train.curriculum import tokens_through
from pipeline.train.data import TokenShards
from pipeline.train.data import check_shards
from pipeline.train.data import validation_batches
from pipeline.train.data import window_problems
from pipeline.train.data_match import check_dataset_matches_model
from pipeline.train.run_store import push_results
from pipeline.train.trained import load_trained


def run_dir_of(ckpt: Path) -> Path:
    """runs/NAME/checkpoints/step_X/state.pt -> runs/NAME (else the checkpoint's folder)."""
    if ckpt.parent.parent.name == "checkpoints":
        return ckpt.parent.parent.parent
    return ckpt.parent


def unfinished_note(ckpt: Path, state: dict, max_steps: int) -> str | None:
    """One line when the checkpoint evaluated is short of its recipe's train.max_steps (a run stopped by a signal,
    killed, or still training; or an earlier checkpoint of a finished run), else None."""
    step, stopped = state["step"], run_dir_of(ckpt) / "stopped.json"
    if step >= max_steps:
        return None
    newest = list_checkpoints(ckpt.parent.parent)[-1:]
    if newest and newest[0] != ckpt.parent:  # picked by hand: say which one is the run's latest
        return (f"note: {ckpt.parent} is at step {step} of {max_steps} (train.max_steps): this evaluates an "
                f"earlier checkpoint; the run's newest is {newest[0].name}")
    why = ""
    if stopped.is_file():
        with contextlib.suppress(OSError, ValueError):
            why = f", stopped by {json.loads(stopped.read_text()).get('signal')} ({stopped})"
    return (f"note: {ckpt.parent} is at step {step} of {max_steps} (train.max_steps){why}: this evaluates an "
            f"unfinished run; the command that trained it (`grt train`, or `grt launch` on every node) resumes it")


def evaluate(path: str | Path, overrides: list[str] | None = None, quiet: bool = False,
             store: str | None = None) -> dict:
    """Early-exit curve (+ KL / top-1 to the trained depth), diagnostics and downstream tasks of a checkpoint, saved
    under runs/NAME/eval/ and logged to the run's MLflow run. A run on object storage (``path`` an ``s3://`` URL, or
    ``store`` its URL when ``path`` is this node's copy): the results go to the store too."""
    t0 = time.time()
    model, cfg, state, ckpt = load_trained(path, overrides)
    if not quiet:
        note = unfinished_note(ckpt, state, cfg.train.max_steps)
        if note:
            print(note, file=sys.stderr)
    device = next(model.parameters()).device
    info = model_info(cfg.model)
    ev = cfg.eval
    recurrent = not exits_are_layers(cfg.model.type)
    trained_depth = model_class(cfg.model.type).recurrence_depth(cfg.model)
    ref = model_class(cfg.model.type).full_depth(cfg.model)
    exits = exit_range(cfg)  # the in-loop eval (train.eval_exits) scores the same
    n_max = exits[-1]
    val = TokenShards(local_dataset(cfg.data.training_datasets()[0][0]), "val")  # s3://: the node cache's copy
    check_dataset_matches_model(val.manifest, cfg, f"the dataset at {val.dir}", trained_tokenizer(cfg, ckpt).identity())
    seq_len = ev.block_size or cfg.model.block_size  # eval.block_size: score at another context than trained
    lengths = sorted({cfg.model.block_size, *ev.context_lengths}) if ev.context_lengths else []
    problems = check_shards(val, cfg.model.vocab_size) + [
        why for n in sorted({seq_len, *lengths}) for why in window_problems(val, n, "tokenize more validation text")]
    if problems:
        raise ValueError(" | ".join(problems))
    out_dir = run_dir_of(ckpt) / results_folder(ev.noise, seq_len, cfg.model.block_size)
    if ev.noise and cfg.model.type not in NOISY_TYPES:
        raise RecipeError([f"eval.noise=true: model type {cfg.model.type!r} draws no noise (the types with training "
                           f"noise are {list(NOISY_TYPES)}); set eval.noise=false"], f"grt eval {path}")
    baseline = check_inputs(cfg, out_dir)  # everything that could fail after the curves, before computing them

    def batches(length: int = seq_len):
        return validation_batches(val, length, ev.batch_size, max_tokens=ev.val_tokens,
                                  vocab_size=cfg.model.vocab_size, document_masking=cfg.data.document_masking)

    torch.manual_seed(cfg.seed)  # eval.noise draws from the global RNG: the same noise on every rerun
    with routing(model, "topk"):  # MoR: its exit curve as trained (method_report adds the causal routing)
        curve = exit_curve(model, batches(), exits, ref, device, keep_tokens=ev.diagnostics, noise=ev.noise,
                           dtype=ev.dtype)
    shown = [i for i, e in enumerate(curve["exit"]) if e >= 1]  # r = 0 is reported apart, as loss_r0
    pick = lambda key: [curve[key][i] for i in shown]  # noqa: E731
    result = {
        "name": cfg.name, "type": cfg.model.type, "shorthand": info["shorthand"], "params": info["params"],
        "checkpoint": str(ckpt), "step": state["step"],
        # the checkpoint's own count (train.batch_ramp changes a step's tokens); older checkpoints: the recipe's
        "tokens_trained": state.get("tokens_seen") or tokens_through(cfg, state["step"]),
        "trained_depth": trained_depth, "ref_exit": ref, "val_tokens": curve["val_tokens"], "block_size": seq_len,
        "exit": pick("exit"), "loss": pick("loss"), "kl": pick("kl"), "top1": pick("top1"),
        "dataset_dir": cfg.data.dataset_dir, "noise": ev.noise, "seconds": None,
        "dtype": str(autocast_dtype(ev.dtype, device)).removeprefix("torch."),
    }
    result["val_loss"] = result["loss"][result["exit"].index(ref)]
    if recurrent:
        result["loss_r0"] = curve["loss"][0]
    if "gate_mean" in curve:
        result["gate_mean"] = pick("gate_mean")
    if lengths:
        with routing(model, "topk"):
            result["context"] = context_losses(model, batches, lengths, seq_len,
                                               (result["val_loss"], result["val_tokens"]), ref, device, ev)
        result["context"]["trained_block_size"] = cfg.model.block_size
    result["exit_flops"] = exit_flops(cfg.model, result["exit"])
    result["train_tokens_per_s"] = training_throughput(run_dir_of(ckpt))
    report = method_report(model, cfg, batches, device)
    if report:
        result["method"] = report
    if ev.diagnostics:
        base_model, note = baseline_model(cfg, baseline, device)
        result["diagnostics"] = run_analyses(model, cfg, curve, batches, n_max, ref, device, base_model, note)
        del base_model
    if ev.tasks:
        from pipeline.eval.lm_eval.downstream import run_tasks

        depths = ev.task_depths or [ref]
        with inference_precision(ev.dtype, device):  # the forwards; their log-probabilities are taken in fp32
            result["downstream"] = run_tasks(model, cfg, list(ev.tasks), depths, ev.task_batch_size,
                                             ev.task_data_dir, ev.task_limit, quiet=quiet)

    out_dir.mkdir(parents=True, exist_ok=True)
    overlay = [result] + [r for r in baseline if r["name"] != cfg.name]
    plots = [plot_exit_curves(overlay, out_dir / "early_exit.png", title=f"{cfg.name} ({info['shorthand']})")]
    if ev.diagnostics:
        plots.append(plot_diagnostics(result, out_dir / "diagnostics.png"))
        if result["diagnostics"].get("gate_heatmaps"):
            plots.append(plot_gate_heatmaps(result["diagnostics"]["gate_heatmaps"], out_dir / "gate_heatmap.png"))
        plots += analysis_plots(result, out_dir)
    result["seconds"] = round(time.time() - t0, 2)
    result["plots"] = [str(p) for p in plots]
    (out_dir / "exits.json").write_text(json.dumps(result, indent=2))
    if ev.tasks:
        (out_dir / "downstream.json").write_text(json.dumps(result["downstream"], indent=2))
    if cfg.tracking.enabled:
        result["mlflow_run_id"] = log_to_mlflow(cfg, state, result, out_dir, plots)
    store = store or (str(path) if storage.is_remote(path) else None)
    if store:  # a run on object storage: its results beside it on the store
        result["stored"] = push_results(store, run_dir_of(ckpt), out_dir)
    if not quiet:
        print_report(result)
    return result


def results_folder(noise: bool, seq_len: int, trained_block_size: int) -> str:
    """Where a run's results go, and their metrics' prefix: ``eval`` for the run's own figures (the trained context,
    noise off), which grt sweep, paper-table and compare read; eval.noise and an eval.block_size other than the
    trained one write beside them, never over them: ``eval_noise``, ``eval_ctx2048``, ``eval_noise_ctx2048``."""
    return "eval" + ("_noise" if noise else "") + (f"_ctx{seq_len}" if seq_len != trained_block_size else "")


def context_losses(model, batches, lengths: list[int], seq_len: int, own: tuple, ref: int, device, ev) -> dict:
    """Loss against context length: the loss at the trained depth ``ref`` on the validation windows of each length
    (the same token budget, eval.val_tokens, at each); the exit curve's own length (``seq_len``, its loss and tokens
    ``own``) is not scored twice."""
    rows: dict = {"block_size": [], "loss": [], "val_tokens": []}
    for n in lengths:
        if n == seq_len:
            loss, tokens = own
        else:
            torch.manual_seed(0)  # eval.noise: the same draws on every rerun
            curve = exit_curve(model, batches(n), [ref], ref, device, noise=ev.noise, dtype=ev.dtype)
            loss, tokens = curve["loss"][0], curve["val_tokens"]
        rows["block_size"].append(n)
        rows["loss"].append(loss)
        rows["val_tokens"].append(tokens)
    return rows


def training_throughput(run_dir: Path) -> float | None:
    """Median training tokens/s over the run's logged steps after the first two (compilation, warm-up), from
    ``metrics.jsonl``; None when the run folder has none (a checkpoint copied elsewhere)."""
    import statistics

    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return None
    rates = []
    for line in f.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if row.get("tokens_per_s") and row.get("step", 0) > 2:
            rates.append(row["tokens_per_s"])
    return statistics.median(rates) if rates else None


def check_inputs(cfg: RunConfig, out_dir: Path) -> list[dict]:
    """Raise now, naming the input, for what would otherwise fail only after the exit curves and diagnostics were
    computed: the output folder, the downstream tasks' data and lm-eval, the baseline run. Returns the baseline's
    results (empty without one)."""
    blocker = file_in_the_way(out_dir)
    if blocker is not None:
        raise NotADirectoryError(f"{blocker} is a file, not a folder, so the results cannot be written to {out_dir}; "
                                 f"move {blocker} away")
    uri = cfg.tracking.uri
    if cfg.tracking.enabled and sqlite_file(uri) is not None:
        problem = folder_problem("tracking.uri", sqlite_file(uri).parent, uri)
        if problem:
            raise NotADirectoryError(problem)
    if cfg.eval.tasks:
        from pipeline.eval.lm_eval.downstream import check_task_inputs

        check_task_inputs(list(cfg.eval.tasks), cfg.eval.task_data_dir)
    if cfg.eval.baseline:
        return collect([cfg.eval.baseline], cfg.tracking)
    return []


def baseline_model(cfg: RunConfig, baseline: list[dict], device) -> tuple[object | None, str | None]:
    """The dense model of ``eval.baseline`` for cross-model CKA (E.4), when ``eval.analyses`` has ``cka``: (model,
    None), or (None, why not)."""
    from pipeline.eval.analyses.suite import resolve

    if "cka" not in resolve(list(cfg.eval.analyses), cfg.model.type, True)[0]:
        return None, None
    if not cfg.eval.baseline:
        return None, "no eval.baseline: set eval.baseline=runs/DENSE to compare the steps with a dense model's layers"
    dense = [r for r in baseline if r.get("type") == "gpt" and r.get("checkpoint")]
    if not dense:
        return None, f"eval.baseline={cfg.eval.baseline} is not an evaluated dense (gpt) run with a checkpoint"
    ckpt = Path(dense[0]["checkpoint"])
    if not ckpt.exists():
        return None, f"the baseline's checkpoint {ckpt} is gone (moved or pruned); evaluate the baseline again"
    model, bcfg, _, _ = load_trained(ckpt, device=str(device.type))
    if bcfg.model.vocab_size != cfg.model.vocab_size or bcfg.model.block_size < cfg.model.block_size:
        return None, (f"the baseline {bcfg.name} reads other inputs (vocab {bcfg.model.vocab_size}, block "
                      f"{bcfg.model.block_size}) than this model (vocab {cfg.model.vocab_size}, block "
                      f"{cfg.model.block_size})")
    return model, None


def log_to_mlflow(cfg, state: dict, result: dict, out_dir: Path, plots: list[Path]) -> str:
    """Metrics with step = exit / recurrence step / depth, so MLflow draws them as curves; the JSON and plots as
    artifacts under the results folder, whose name is also the metrics' prefix (eval.*; eval_noise.* with
    ``eval.noise``, eval_ctxN.* at another ``eval.block_size``: :func:`results_folder`)."""
    tracker = open_tracker(cfg.tracking, cfg.name, state.get("mlflow_run_id"), run_dir=out_dir.parent)
    plain = tracker.log_metrics
    prefix = out_dir.name + "."

    def log(metrics: dict, step: int) -> None:  # beside the run's own eval.* metrics, never over them
        plain({(prefix + k[5:] if k.startswith("eval.") else k): v for k, v in metrics.items()}, step=step)

    for i, e in enumerate(result["exit"]):
        m = {"eval.exit_loss": result["loss"][i], "eval.exit_kl": result["kl"][i], "eval.exit_top1": result["top1"][i]}
        if result.get("gate_mean"):
            m["eval.gate_mean"] = result["gate_mean"][i]
        log(m, step=e)
    log({"eval.val_loss": result["val_loss"]}, step=state["step"])
    ctx = result.get("context") or {"block_size": [], "loss": []}
    for n, loss in zip(ctx["block_size"], ctx["loss"]):
        log({"eval.context_loss": loss}, step=n)  # step = the context length, so MLflow draws loss against it
    for metrics, step in method_metrics(result.get("method") or {}):
        log(metrics, step=step)
    diag = result.get("diagnostics", {})
    steps = diag.get("steps", {})
    for i, r in enumerate(steps.get("step", [])):
        log({f"eval.{k}": steps[k][i] for k in ("gate_mean", "gate_std", "gate_frac_above_095", "gate_frac_below_005",
                                                "rho", "delta_fp", "update_over_proposal", "proposal_norm",
                                                "update_norm")
             if steps.get(k) and steps[k][i] is not None}, step=r)
    if diag.get("bands"):
        for j, e in enumerate(diag["bands"]["exit"]):
            log({f"eval.band_loss.{name}": row["loss"][j]
                 for name, row in diag["bands"]["bands"].items() if row["loss"]}, step=e)
    if diag.get("anchor_ablation"):
        log({f"eval.anchor_loss.{k}": v for k, v in diag["anchor_ablation"]["loss"].items()},
            step=diag["anchor_ablation"]["depth"])
    for metrics, step in analysis_metrics(diag):
        log(metrics, step=step)
    for depth, tasks in result.get("downstream", {}).get("depths", {}).items():
        log({f"downstream.{task}.{metric}": value for task, row in tasks.items() for metric, value in row.items()},
            step=int(depth))
    if result.get("downstream"):
        tracker.log_artifact(out_dir / "downstream.json", out_dir.name)
    tracker.log_artifact(out_dir / "exits.json", out_dir.name)
    for p in plots:
        tracker.log_artifact(p, out_dir.name)
    tracker.close()
    return tracker.run_id


def print_report(result: dict) -> None:
    recurrent = not exits_are_layers(result["type"])
    kind = "layer" if not recurrent else {"mor": "recursion", "rrt": "recursion", "ouro": "loop",
                                          "recurtrace": "loop"}.get(result["type"], "recurrence step r")
    noise = (", noise ON (eval.noise)" if result.get("noise") else ", noise off") if result["type"] in NOISY_TYPES \
        else ""
    arithmetic = f", {result['dtype']} forward" if result.get("dtype") else ""
    print(f"eval: {result['name']} ({result['shorthand']}) step {result['step']}, {result['val_tokens']:,} val "
          f"tokens{noise}{arithmetic}, {result['seconds']:.1f} s")
    if recurrent:
        print(f"  before any {kind.removesuffix(' r')} (exit 0): loss {result['loss_r0']:.4f}")
    gates = result.get("gate_mean") or [None] * len(result["exit"])
    for e, loss, kl, top1, g in zip(result["exit"], result["loss"], result["kl"], result["top1"], gates):
        mark = "  <- trained depth" if recurrent and e == result["trained_depth"] else ""
        gate = f"  gate mean {g:.3f}" if g is not None else ""
        print(f"  {kind} {e:>2}: loss {loss:.4f}  KL to {result['ref_exit']} {kl:.4f}  top-1 agree {top1:.3f}"
              f"{gate}{mark}")
    ctx = result.get("context")
    if ctx:
        print(f"  loss against context length (trained at {ctx['trained_block_size']}, depth {result['ref_exit']}):")
        for n, loss, tokens in zip(ctx["block_size"], ctx["loss"], ctx["val_tokens"]):
            mark = "  <- trained" if n == ctx["trained_block_size"] else ""
            print(f"    context {n:>6}: loss {loss:.4f}  ({tokens:,} val tokens){mark}")
    if result.get("method"):
        print_method_report(result["method"])
    steps = result.get("diagnostics", {}).get("steps")
    if steps:
        print("  step   rho    |Δh|/|o|  delta_fp  |o|      |update|" + ("  gate std  g>0.95  g<0.05"
                                                                       if steps.get("gate_std") else ""))
        for i, r in enumerate(steps["step"]):
            cell = lambda key, w=6: "-".rjust(w) if steps[key][i] is None else f"{steps[key][i]:.4f}"  # noqa: E731
            line = (f"  {r:>4}  {cell('rho')}  {cell('update_over_proposal')}    {cell('delta_fp')}    "
                    f"{steps['proposal_norm'][i]:7.3f}  {steps['update_norm'][i]:7.3f}")
            if steps.get("gate_std"):
                line += (f"   {steps['gate_std'][i]:.4f}   {steps['gate_frac_above_095'][i]:.3f}"
                         f"   {steps['gate_frac_below_005'][i]:.4f}")
            print(line)
    ab = result.get("diagnostics", {}).get("anchor_ablation")
    if ab:
        print(f"  anchor ablation at r={ab['depth']}: " + ", ".join(f"{ab['what'][k]} {v:.4f}"
                                                                for k, v in ab["loss"].items()))
    print_analyses(result.get("diagnostics", {}))
    ds = result.get("downstream")
    if ds:
        print(f"  downstream ({ds['seconds']:.0f} s):")
        for depth, tasks in ds["depths"].items():
            cells = []
            for task, row in tasks.items():
                metric, value = headline(row)
                cells.append(f"{task} {metric} {value:.4f} (n={row['items']:,})")
            print(f"    depth {depth}: " + "; ".join(cells))
    saved = ["exits.json"] + (["downstream.json"] if ds else []) + [Path(p).name for p in result["plots"]]
    stored = f" (uploaded to {result['stored']}/)" if result.get("stored") else ""
    print(f"  saved {Path(result['plots'][0]).parent}/{stored}: " + ", ".join(saved))

