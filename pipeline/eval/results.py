"""What `grt eval` saved, read back: a run folder's ``eval/exits.json``, an MLflow run's ``eval/exits.json`` artifact,
the runs a RUNS argument of `grt compare` / `grt fit-phi` (or ``eval.baseline``) names, and the metric a table shows
for a downstream task. Nothing here computes a figure."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from urllib.parse import unquote
from urllib.parse import urlparse

from pipeline.config import TrackingConfig
from pipeline.config.recipe_files import sqlite_file
from pipeline.tracking import reading_store
from pipeline.tracking import resolve_uri
from pipeline.train.branch import family_of
from pipeline.train.branch import folder_family


def read_exits(run_dir: Path) -> dict | None:
    """The results `grt eval` saved in a run folder (``eval/exits.json``), None when it saved none."""
    f = Path(run_dir) / "eval" / "exits.json"
    return json.loads(f.read_text()) if f.is_file() else None


def saved_val_loss(run_dir: Path) -> float | None:
    """The validation loss `grt eval` saved for the run (runs/NAME/eval/exits.json), None when it saved none."""
    try:
        return float(read_exits(run_dir)["val_loss"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_path(run: str) -> bool:
    """A RUN argument written as a path (runs/NAME, ./NAME, ~/NAME): it means a folder, never an MLflow name."""
    return "/" in run or os.sep in run or run.startswith((".", "~"))


def _missing_folder(run: str) -> str:
    path = Path(run).expanduser()
    if path.is_dir():
        return f"{run} holds no eval/exits.json: evaluate it first with `grt eval {run}`"
    parent = path.parent
    evaluated = sorted(str(p) for p in parent.glob("*/eval/exits.json"))[:8] if parent.is_dir() else []
    there = (f"; evaluated run folders in {parent}: {', '.join(str(Path(p).parent.parent) for p in evaluated)}"
             if evaluated else f"; {parent} holds no evaluated run" if parent.is_dir() else
             f" ({parent} does not exist either)")
    return f"no run folder {run}{there}"


def local_store(uri: str) -> Path | None:
    """The file or folder of an MLflow store on this machine (sqlite database, file store); None for a server."""
    if sqlite_file(uri) is not None:
        return sqlite_file(uri)
    if uri.startswith("file:"):
        return Path(unquote(urlparse(uri).path))
    return None if "://" in uri else Path(uri)


# the tags the tracker sets itself (pipeline/tracking/tracker.py run_tags): a run folder does not record them
TRACKER_TAGS = ("git_sha", "mlflow.source.git.commit", "hosts", "nodes", "world_size", "launcher", "slurm_job_id")
READ_FIX = ("point --tracking-uri at the store that holds the runs, or compare run folders (`grt compare "
            "runs/NAME ...`)")


def _folder_tags(run: str, path: Path, res: dict, tags: dict[str, str]) -> None:
    """Hold a run folder to ``--tag`` as MLflow holds its run: the tags its run was logged with are its recipe's
    ``tracking.tags``, ``model.type``, ``shorthand`` and ``run_dir`` (pipeline/train/callbacks.py); a tag the tracker
    sets itself (git SHA, hosts, ...) is not in the folder, so it is refused, not guessed."""
    if not tags:
        return
    import yaml

    recipe = path / "recipe.yaml"
    cfg = yaml.safe_load(recipe.read_text()) if recipe.is_file() else None
    if not isinstance(cfg, dict):
        raise FileNotFoundError(f"--tag: run folder {run} holds no recipe.yaml to read its tags from; name the run "
                                f"by its MLflow name or id instead, or drop --tag")
    have = {k: str(v) for k, v in ((cfg.get("tracking") or {}).get("tags") or {}).items()}
    have.update({"model.type": str((cfg.get("model") or {}).get("type")), "shorthand": str(res.get("shorthand")),
                 "run_dir": str(path.resolve())})
    unknown = next((k for k in tags if k in TRACKER_TAGS and k not in have), None)
    if unknown:
        raise ValueError(f"--tag {unknown}={tags[unknown]}: run folder {run} does not record its run's {unknown!r} "
                         f"tag (only {sorted(have)}); name the run by its MLflow name or id instead")
    wrong = [k for k, v in tags.items() if have.get(k) != v]
    if wrong:
        gives = ", ".join(f"{k}={have[k]}" if k in have else f"no {k!r} tag" for k in wrong)
        raise LookupError(f"run folder {run} does not carry --tag {', '.join(f'{k}={tags[k]}' for k in wrong)} (its "
                          f"recipe.yaml gives {gives}); drop the folder or the --tag")


def _describe(run, evaluated: bool | None = None) -> str:
    import datetime

    when = datetime.datetime.fromtimestamp(run.info.start_time / 1000).strftime("%Y-%m-%d %H:%M")
    state = "" if evaluated is None else ", evaluated" if evaluated else ", not evaluated"
    return f"{run.info.run_id} (started {when}{state})"


def _matching(runs: list, name: str) -> list:
    """The runs ``name`` means: the run with that id, else the runs named so now, else the runs trained under that
    name and renamed since in the MLflow UI (the recipe's ``name`` is a logged param)."""
    return ([r for r in runs if r.info.run_id == name] or [r for r in runs if r.info.run_name == name]
            or [r for r in runs if r.data.params.get("name") == name])


def _from_mlflow(tracking: TrackingConfig, names: list[str], experiments: list[str], tags: dict[str, str]) -> list:
    """The evaluated runs ``names`` mean (one each, in that order), or every evaluated run of ``experiments`` when
    none is named. A name of two runs is refused with their ids, not settled by taking the newest."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = resolve_uri(tracking.uri)
    store = local_store(uri)
    if store is not None and not store.exists():  # opening it would create an empty store: reading writes nothing
        asked = f"no run folder or MLflow run named {names}: " if names else ""
        raise LookupError(f"{asked}no runs evaluated yet with tracking.uri={tracking.uri} ({store} does not exist); "
                          f"`grt run RECIPE` (or `grt eval runs/NAME`) evaluates a run and logs it there, or pass "
                          f"--tracking-uri / run folders")
    where = f"MLflow experiment(s) {experiments} at {uri}" + (f" with tags {tags}" if tags else "")
    with reading_store(uri, READ_FIX) as client:
        ids = []
        for name in experiments:
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise LookupError(f"no MLflow experiment '{name}' at {uri}")
            ids.append(exp.experiment_id)
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = client.search_runs(ids, filter_string=query, order_by=["attributes.start_time DESC"],
                                  max_results=1000)

        def evaluated(run) -> bool:
            return any(a.path == "eval/exits.json" for a in client.list_artifacts(run.info.run_id, "eval"))

        if names:
            chosen = []
            for name in names:
                found = _matching(runs, name)
                if not found:
                    raise LookupError(f"no run named {name!r} in {where}, nor a run folder {name}; the names there: "
                                      f"{', '.join(sorted({r.info.run_name for r in runs})[:12]) or 'none'}")
                done = [evaluated(r) for r in found]
                if len(found) > 1:
                    raise LookupError(f"{len(found)} runs are named {name!r} in {where}: "
                                      f"{'; '.join(_describe(r, e) for r, e in zip(found, done))}; pass the run id "
                                      f"of the one you mean instead of its name")
                if not done[0]:
                    run_dir = found[0].data.tags.get("run_dir", f"runs/{found[0].data.params.get('name', name)}")
                    raise LookupError(f"MLflow run {name!r} ({found[0].info.run_id}) is not evaluated yet: run "
                                      f"`grt eval {run_dir}` first")
                chosen.append(found[0])
        else:
            chosen = [r for r in runs if evaluated(r)]
            shared = {}
            for r in chosen:
                shared.setdefault(r.info.run_name, []).append(r)
            shared = {n: rs for n, rs in shared.items() if len(rs) > 1}
            if shared:
                raise LookupError(f"evaluated runs share a name in {where}: "
                                  + "; ".join(f"{n!r}: {', '.join(_describe(r) for r in rs)}"
                                              for n, rs in shared.items())
                                  + "; pass the run ids of the runs to compare (`grt compare ID ...`), or rename one "
                                    "in the MLflow UI")
        out = []
        for run in chosen:
            with tempfile.TemporaryDirectory() as tmp:
                res = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/exits.json", tmp)).read_text())
            res["name"] = run.info.run_name  # its name now (renamed in the UI: not the recipe's any more)
            res["mlflow_run_id"] = run.info.run_id
            res.update(family_of(run.data.tags))  # a decay branch: its parent and step (grt branch)
            res["experiment"] = next(e for e, i in zip(experiments, ids) if i == run.info.experiment_id)
            out.append(res)
    return out


def collect(runs: list[str], tracking: TrackingConfig, experiments: list[str] | None = None,
            tags: dict[str, str] | None = None) -> list[dict]:
    """The evaluated runs ``runs`` name (run folders, MLflow run names or ids), in that order; with none, every
    evaluated run of ``experiments``. ``tags`` (--tag) narrow both: a run folder is held to its recipe's tags."""
    experiments, tags = experiments or [tracking.experiment], tags or {}
    folders, names = {}, []
    for r in runs:
        path = Path(r).expanduser()
        res = read_exits(path) if path.is_dir() else None
        if res is None and _is_path(r):
            raise FileNotFoundError(_missing_folder(r))
        if res is None:
            names.append(r)
        else:
            _folder_tags(r, path, res, tags)
            res.update(folder_family(path))
            folders[r] = res
    names = list(dict.fromkeys(names))
    if runs and not names:
        return [folders[r] for r in dict.fromkeys(runs)]
    by_mlflow = _from_mlflow(tracking, names, experiments, tags)
    if not runs:
        return by_mlflow
    asked = dict(zip(names, by_mlflow))
    return [folders[r] if r in folders else asked[r] for r in dict.fromkeys(runs)]


def headline(metrics: dict) -> tuple[str, float]:
    """The metric a table shows for a task: acc_norm where lm-eval reports it, else acc."""
    for name in ("acc_norm", "acc"):
        if name in metrics:
            return name, metrics[name]
    name = next(k for k in metrics if k != "items" and not k.endswith("_stderr"))
    return name, metrics[name]
