"""`grt paper-table`: the paper's numbers (Table 1, Table 2, Figure 5 / Table 7, Appendix B sweeps; kept with their
sources in ``paper_results.yaml`` next to this file) beside the matching runs found in MLflow, with the deltas.

A row's run is the newest MLflow run named as the row's recipe (``run``, plus ``-STEM`` for runs trained with
``--data STEM.yaml``) whose logged params hold the row's ``params``, among the runs that logged its metric:

- ``eval.val_loss``: the validation loss `grt eval` logged at the trained depth (its step is the checkpoint's
  training step; the largest step is taken: the latest checkpoint evaluated);
- ``downstream.TASK``: `grt eval`'s ``downstream.TASK.acc_norm`` (else ``.acc``) logged at step = the run's trained
  depth (``model.n_recurrence``, dense: ``model.n_layer``), times the table's ``scale`` (fraction -> percent).

delta = run - paper: negative is better than the paper for a loss, positive for an accuracy.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).with_name("paper_results.yaml")
TABLES = ("table1", "table2", "figure5", "sweeps")


def load_results(path: str | Path = RESULTS) -> dict:
    """The tables of ``paper_results.yaml``; ValueError listing every malformed row (a typo here would print a wrong
    paper number as the paper's)."""
    import yaml

    tables = yaml.safe_load(Path(path).read_text())["tables"]
    problems = []
    for key, table in tables.items():
        for i, row in enumerate(table.get("rows", [])):
            where = f"{path}: {key}.rows[{i}] ({row.get('label', '?')})"
            problems += [f"{where}: no '{k}'" for k in ("label", "run", "source") if not row.get(k)]
            if not (row.get("metric") or table.get("metric")):
                problems.append(f"{where}: no metric (set it on the row or the table)")
            value = row.get("paper", "missing")
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                problems.append(f"{where}: paper must be a number or null, got {value!r}")
            if row.get("derived") and value is None:
                problems.append(f"{where}: 'derived' explains a number, but paper is null")
    if problems:
        raise ValueError("; ".join(problems))
    return tables


# ------------------------------------------------------------------------------------------------ MLflow side
@contextlib.contextmanager
def fetch_runs(tracking_uri: str, experiments: list[str]):
    """While open: (client or None, every run of ``experiments`` newest first, notes on what was not found). A local
    store that does not exist is not created (reading writes nothing): every row then says "no run". A server that
    does not answer, or a store error while open, is one TrackingUnavailableError (pipeline/tracking/server.py)."""
    from pipeline.eval.results import local_store
    from pipeline.tracking import reading_store
    from pipeline.tracking import resolve_uri

    uri = resolve_uri(tracking_uri)
    store = local_store(uri)
    if store is not None and not store.exists():
        yield None, [], [f"no MLflow store at {uri} ({store} does not exist): nothing logged there yet"]
        return
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with reading_store(uri, "point --tracking-uri at the store the runs were logged to") as client:
        ids, notes = [], []
        for name in experiments:
            exp = client.get_experiment_by_name(name)
            if exp is None:
                notes.append(f"no MLflow experiment '{name}' at {uri}")
            else:
                ids.append(exp.experiment_id)
        runs, token = [], None
        while ids:
            page = client.search_runs(ids, order_by=["attributes.start_time DESC"], max_results=1000,
                                      page_token=token)
            runs += list(page)
            token = page.token
            if not token:
                break
        yield client, runs, notes


def _candidates(row: dict, runs: list, data_stem: Optional[str]) -> list:
    """The runs named as the row's recipe (newest first) whose params hold the row's ``params``."""
    name = row["run"] + (f"-{data_stem}" if data_stem else "")
    want = {k: str(v) for k, v in (row.get("params") or {}).items()}
    return [r for r in runs if r.info.run_name == name and all(r.data.params.get(k) == v for k, v in want.items())]


def _latest(history: list, step: Optional[int] = None):
    """The metric entry at ``step`` (None: the largest step), the latest logged of equals."""
    rows = [m for m in history if step is None or m.step == step]
    return max(rows, key=lambda m: (m.step, m.timestamp)) if rows else None


def run_value(client, run, metric: str, scale: float = 1.0) -> tuple[Optional[float], Optional[int], str]:
    """(value, step, what was read) of ``metric`` for one run; value None when the run has not logged it, with why."""
    if metric.startswith("downstream."):
        name = next((f"{metric}.{m}" for m in ("acc_norm", "acc") if f"{metric}.{m}" in run.data.metrics), None)
        if name is None:
            return None, None, "not scored"
        p = run.data.params
        depth = p.get("model.n_recurrence") or p.get("model.n_layer")  # the trained depth (dense: every layer)
        if depth is None:
            return None, None, f"{name}: the run logged no model.n_recurrence / model.n_layer"
        entry = _latest(client.get_metric_history(run.info.run_id, name), int(depth))
        if entry is None:
            return None, None, f"not scored at depth {depth}"
        return entry.value * scale, entry.step, name
    if metric not in run.data.metrics:
        return None, None, "not evaluated"
    entry = _latest(client.get_metric_history(run.info.run_id, metric))
    return entry.value * scale, entry.step, metric


def paper_table(tables: dict, which: list[str], tracking_uri: str, experiments: list[str],
                data_stem: Optional[str] = None) -> dict:
    """{"tables": [{"key", "title", "unit", "notes", "rows": [{...row, "value", "delta", "status", "run_name",
    "run_id", "step", "read", "shape"}]}], "notes": [...], "tracking_uri", "experiments"}. ``status`` is "ok",
    "no run" (no run of that name), or why the matching runs give no value ("not evaluated", "not scored", ...)."""
    with fetch_runs(tracking_uri, experiments) as (client, runs, notes):
        out = [_table(key, tables[key], client, runs, data_stem) for key in which]
    return {"tables": out, "notes": notes, "tracking_uri": tracking_uri, "experiments": experiments}


def _table(key: str, table: dict, client, runs: list, data_stem: Optional[str]) -> dict:
    """One table of :func:`paper_table`: each row beside the newest matching run with a value."""
    rows = []
    for row in table["rows"]:
        metric = row.get("metric") or table["metric"]
        res = dict(row, metric=metric, value=None, delta=None, status="no run", run_name=None, run_id=None,
                   step=None, read=None, shape=None)
        for run in _candidates(row, runs, data_stem):
            value, step, read = run_value(client, run, metric, float(table.get("scale", 1.0)))
            if res["status"] == "no run":  # the newest run's reason, if none has a value
                res.update(status=read, run_name=run.info.run_name)
            if value is not None:
                res.update(value=value, step=step, read=read, status="ok", run_name=run.info.run_name,
                           run_id=run.info.run_id, shape=run.data.tags.get("shorthand"))
                if row.get("paper") is not None:
                    res["delta"] = value - row["paper"]
                break
        rows.append(res)
    return {"key": key, "title": table["title"], "unit": table["unit"], "notes": table.get("notes", ""),
            "lower_is_better": table.get("lower_is_better", True), "rows": rows}


# -------------------------------------------------------------------------------------------------- printing
def _number(x: Optional[float], digits: int, sign: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "-" if x is None else str(x)
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _as_printed(x: float) -> str:
    """A paper number with the decimals it was given (at least two): 3.3 -> 3.30, 3.154 -> 3.154."""
    text = f"{x:.6f}".rstrip("0")
    return text + "0" * max(0, 2 - len(text.split(".")[1]))


def _cells(table: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, rows and footnotes of one table: a derived paper number is "~x", its derivation a footnote."""
    digits = 2 if table["unit"].startswith("accuracy") else 3
    head = ["row", "paper config", "run", "run shape", "paper", "run value", "delta", "at step", "source"]
    rows, notes = [], []
    for r in table["rows"]:
        paper = "-" if r["paper"] is None else ("~" if r.get("derived") else "") + _as_printed(r["paper"])
        source = r["source"]
        for kind in ("derived", "note"):
            if r.get(kind):
                notes.append(f"[{len(notes) + 1}] {r['label']}: {kind + ': ' if kind == 'derived' else ''}"
                             f"{' '.join(str(r[kind]).split())}")
                source += f" [{len(notes)}]"
        value = _number(r["value"], digits) if r["status"] == "ok" else r["status"]
        rows.append([r["label"], str(r.get("config", "")), r["run_name"] or r["run"], r["shape"] or "-", paper,
                     value, _number(r["delta"], digits, sign=True), "-" if r["step"] is None else f"{r['step']:,}",
                     source])
    return head, rows, notes


def format_tables(result: dict, fmt: str = "table") -> str:
    """The tables as text (``table``), GitHub markdown (``markdown``) or JSON (``json``)."""
    if fmt == "json":
        return json.dumps(result, indent=2)
    parts = []
    for table in result["tables"]:
        head, rows, notes = _cells(table)
        better = "lower" if table["lower_is_better"] else "higher"
        intro = (f"{table['title']} [{table['unit']}; {better} is better; delta = run - paper]\n"
                 + " ".join(table["notes"].split()))
        if fmt == "markdown":
            lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
        else:
            widths = [max(len(x) for x in col) for col in zip(head, *rows)]
            right = {4, 5, 6, 7}  # the numbers
            line = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)  # noqa: E731
                                           for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
            lines = [line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
        found = sum(r["status"] == "ok" for r in table["rows"])
        parts.append("\n".join([intro, *lines, f"{found} of {len(rows)} rows have a run value.", *notes]))
    where = (f"runs: MLflow experiment(s) {', '.join(result['experiments'])} at {result['tracking_uri']}"
             + "".join(f"\nnote: {n}" for n in result["notes"]))
    return "\n\n".join(parts + [where])
