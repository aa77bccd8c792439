"""`grt compare [RUNS...]`: one table of runs side by side and an overlay of their early-exit curves.

RUNS are MLflow run names or ids in the recipe's experiment (default: every run there with an evaluation), or run
folders (``runs/NAME``) holding ``eval/exits.json``. Figures come from what ``grt eval`` measured and logged.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pipeline.config import TrackingConfig
from pipeline.eval.plots import plot_exit_curves
from pipeline.tracking import resolve_uri


def _from_folder(path: Path) -> dict | None:
    f = path / "eval" / "exits.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _from_mlflow(tracking: TrackingConfig, names: list[str]) -> list[dict]:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=resolve_uri(tracking.uri))
    exp = client.get_experiment_by_name(tracking.experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=500)
    out, taken = [], set()
    for run in runs:
        name = run.info.run_name
        if names and name not in names and run.info.run_id not in names:
            continue
        if name in taken:  # newest run of each name
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = client.download_artifacts(run.info.run_id, "eval/exits.json", tmp)
            except Exception:
                continue  # not evaluated yet
            res = json.loads(Path(local).read_text())
        res["mlflow_run_id"] = run.info.run_id
        out.append(res)
        taken.add(name)
    return out


def collect(runs: list[str], tracking: TrackingConfig) -> list[dict]:
    found, names = [], []
    for r in runs:
        res = _from_folder(Path(r)) if Path(r).is_dir() else None
        (found.append(res) if res else names.append(r))
    if names or not runs:
        by_mlflow = _from_mlflow(tracking, names)
        missing = [n for n in names if not any(n in (m["name"], m.get("mlflow_run_id")) for m in by_mlflow)]
        if missing:
            raise LookupError(f"no evaluated run named {missing} in MLflow experiment '{tracking.experiment}' at "
                              f"{resolve_uri(tracking.uri)} (nor a run folder with eval/exits.json); run "
                              f"`grt eval runs/NAME` first")
        found += by_mlflow
    order = {name: i for i, name in enumerate(runs)}  # the order the user asked for
    return sorted(found, key=lambda r: order.get(r["name"], order.get(r.get("mlflow_run_id"), len(order))))


def format_table(results: list[dict]) -> str:
    n_exits = max(len(r["exit"]) for r in results)
    head = ["run", "model", "shorthand", "params", "steps", "tokens", "val loss"] + [f"@{i}" for i in
                                                                                     range(1, n_exits + 1)]
    rows = []
    for r in results:
        val = f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-"
        exits = {e: loss for e, loss in zip(r["exit"], r["loss"])}
        rows.append([r["name"], r["type"], r["shorthand"], f"{r['params'] / 1e6:.2f}M", str(r["step"]),
                     f"{r['tokens_trained'] / 1e6:.2f}M", val]
                    + [f"{exits[i]:.3f}" if i in exits else "" for i in range(1, n_exits + 1)])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells,
                                                                                                          widths)))
    sep = "  ".join("-" * w for w in widths)
    notes = ("val loss: validation loss at the trained depth (GRT: R recurrence steps) / full depth (dense), "
             "nats/token; @k: loss when exiting after recurrence step k (GRT) or layer k (dense)")
    return "\n".join([line(head), sep] + [line(r) for r in rows] + [notes])


def compare(runs: list[str], tracking: TrackingConfig, out: str | Path = "runs/compare") -> tuple[str, Path]:
    results = collect(runs, tracking)
    if not results:
        raise LookupError(f"no evaluated runs in MLflow experiment '{tracking.experiment}'; run `grt eval` first")
    table = format_table(results)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_exit_curves(results, out / "early_exit_overlay.png", title="Compared runs")
    (out / "table.txt").write_text(table + "\n")
    table += "".join(f"\nearly-exit plot of {r['name']}: {r['plot']}" for r in results if r.get("plot"))
    return table, plot
