"""`grt compare [RUNS...]`: evaluated runs side by side: an early-exit table, a downstream table (task x run at each
scored depth) and overlays of the early-exit curves against r and against inference FLOPs.

RUNS are MLflow run names or ids, or run folders (``runs/NAME``) holding ``eval/exits.json``. With no RUNS, every
evaluated run of the experiment(s) is taken. ``--tag key=value`` narrows both: an MLflow run by its tags, a run folder
by its recipe's. A name two runs share is refused with their ids, never settled by taking the newest. Figures come
from what ``grt eval`` measured and saved; nothing is recomputed here.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from pipeline.config import TrackingConfig
from pipeline.config.recipe_files import folder_problem
from pipeline.eval.analyses.plots import plot_exit_curves
from pipeline.eval.results import collect
from pipeline.eval.results import headline
from pipeline.train.branch import family_lines

FORMATS = ("table", "markdown", "csv", "json")


def exit_table(results: list[dict]) -> tuple[list[str], list[list[str]], str]:
    n_exits = max(len(r["exit"]) for r in results)
    dense = next((r for r in results if r["type"] == "gpt" and r.get("train_tokens_per_s")), None)
    head = ["run", "model", "shorthand", "params", "steps", "tokens", "val loss", "train tok/s"]
    head += ["vs dense"] if dense else []
    head += [f"@{i}" for i in range(1, n_exits + 1)]
    rows = []
    for r in results:
        val = f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-"
        rate = r.get("train_tokens_per_s")
        exits = {e: loss for e, loss in zip(r["exit"], r["loss"])}
        row = [r["name"], r["type"], r["shorthand"], f"{r['params'] / 1e6:.2f}M", str(r["step"]),
               f"{r['tokens_trained'] / 1e6:.2f}M", val, f"{rate:,.0f}" if rate else "-"]
        if dense:
            row.append(f"{rate / dense['train_tokens_per_s']:.2f}x" if rate else "-")
        rows.append(row + [f"{exits[i]:.3f}" if i in exits else "" for i in range(1, n_exits + 1)])
    notes = ("val loss: validation loss at the trained depth (recurrent: R steps / N_r recursions / T loops) or full "
             "depth (dense), nats/token; train tok/s: median training throughput logged by the run"
             + (f" (vs dense: ratio to {dense['name']}; runs on other machines or backends do not compare)"
                if dense else "")
             + "; @k: loss when exiting after recurrence step k (recurrent) or layer k (dense)"
             + ("; mor: expert-choice top-k as trained, not causal (its causal loss: `grt eval`'s MoR report)"
                if any(r["type"] == "mor" for r in results) else ""))
    return head, rows, notes


def downstream_table(results: list[dict]) -> tuple[list[str], list[list[str]], str] | None:
    """Rows: task and metric (acc_norm where lm-eval reports it, else acc; perplexity too for LAMBADA); columns:
    each run at each depth it was scored at (``name @depth``)."""
    cols, cells = [], {}
    for r in results:
        for depth, tasks in (r.get("downstream") or {}).get("depths", {}).items():
            col = f"{r['name']} @{depth}"
            cols.append(col)
            for task, row in tasks.items():
                metrics = [headline(row)[0]] + (["perplexity"] if "perplexity" in row else [])
                for m in metrics:
                    cells[(task, m, col)] = (row[m], row.get(f"{m}_stderr"), row["items"])
    if not cols:
        return None
    keys = list(dict.fromkeys((t, m) for t, m, _ in cells))
    head = ["task", "metric", "items"] + cols
    rows = []
    for task, metric in keys:
        items = next(v[2] for (t, m, _), v in cells.items() if (t, m) == (task, metric))
        row = [task, metric, f"{items:,}"]
        for col in cols:
            v = cells.get((task, metric, col))
            row.append("" if v is None else (f"{v[0]:.4f}" + (f" ± {v[1]:.4f}" if v[1] not in (None, 0.0) and
                                                                 metric != "perplexity" else "")))
        rows.append(row)
    notes = "downstream: lm-eval metrics (± standard error), zero-shot; @d: scored at recurrence depth / exit layer d"
    return head, rows, notes


def render(head: list[str], rows: list[list[str]], fmt: str, notes: str = "") -> str:
    if fmt == "csv":
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([head] + rows)
        return buf.getvalue().rstrip("\n")
    if fmt == "markdown":
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines + ([f"\n{notes}"] if notes else []))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(c.rjust(w) if i >= 3 or (head[0] == "task" and i >= 2) else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
                     + ([notes] if notes else []))


def format_results(results: list[dict], fmt: str = "table") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {list(FORMATS)}")
    if fmt == "json":
        keep = ("name", "type", "shorthand", "params", "step", "tokens_trained", "trained_depth", "val_loss", "exit",
                "loss", "kl", "top1", "exit_flops", "gate_mean", "train_tokens_per_s", "method", "downstream",
                "mlflow_run_id", "experiment", "branch_parent", "branch_step", "branch_decay_steps")
        return json.dumps([{k: r[k] for k in keep if k in r} for r in results], indent=2)
    head, rows, notes = exit_table(results)
    parts = [render(head, rows, fmt, notes)]
    if family_lines(results):  # decay branches (grt branch) and the runs they branch from
        parts.append("\n".join(family_lines(results)))
    down = downstream_table(results)
    if down:
        head, rows, notes = down
        parts.append(render(head, rows, fmt, notes))
    return "\n\n".join(parts)


def compare(runs: list[str], tracking: TrackingConfig, out: str | Path = "runs/compare", fmt: str = "table",
            experiments: list[str] | None = None, tags: dict[str, str] | None = None) -> tuple[str, Path]:
    results = collect(runs, tracking, experiments, tags)
    if not results:
        raise LookupError(f"no evaluated runs in MLflow experiment(s) {experiments or [tracking.experiment]}"
                          + (f" with tags {tags}" if tags else "") + "; run `grt eval` first")
    text = format_results(results, fmt)
    out = Path(out)
    problem = folder_problem("--out", out)
    if problem:
        raise NotADirectoryError(problem)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_exit_curves(results, out / "early_exit_overlay.png", title="Compared runs")
    ext = {"table": "txt", "markdown": "md", "csv": "csv", "json": "json"}[fmt]
    (out / f"table.{ext}").write_text(text + "\n")
    return text, plot
