"""`grt sweep FOLDER [overrides...]`: every recipe of a folder through `grt run` (tokenize reused -> train -> eval),
one after another, then one summary table.

The folder's recipes are its ``*.yaml`` files (not its subfolders), in name order; files starting with ``_`` are the
bases they inherit and do not run. Every run is tagged ``sweep=<folder name>`` in MLflow (over the recipe's own
``tracking.tags``), so ``grt compare --tag sweep=<folder name>`` shows the sweep as one table. A recipe that fails
is reported and the sweep goes on with the next; the exit status is 1 when any failed. A stop (Ctrl-C, SIGTERM)
stops the whole sweep after its summary: the same command later resumes the stopped run and reruns the rest.
A recipe with ``train.branch_budgets`` is a stable run followed by its decay branches, one row each
(:mod:`pipeline.studies.sweep_branches`); ``--dry-run`` also prints the planned cost
(:mod:`pipeline.studies.sweep_cost`).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from typing import Optional

from pipeline.eval.results import read_exits
from pipeline.eval.results import saved_val_loss
from pipeline.run.command import run_recipe
from pipeline.runtime.exit_status import FAILED
from pipeline.runtime.exit_status import OK
from pipeline.runtime.exit_status import TrainingStopped
from pipeline.studies.sweep_branches import branch_config
from pipeline.studies.sweep_branches import branch_name
from pipeline.studies.sweep_branches import describe_branch
from pipeline.studies.sweep_branches import points_of
from pipeline.studies.sweep_branches import run_branch
from pipeline.studies.sweep_cost import plan_configs
from pipeline.studies.sweep_cost import plan_line

# runner(recipe file, overrides, data recipe or None): trains and evaluates one recipe, raising when it fails
Runner = Callable[[str, list, Optional[str]], object]


@dataclass
class SweepRow:
    """One recipe of a sweep: ``status`` ok | done before (finished and evaluated by an earlier sweep, skipped) |
    failed | stopped | not run (after a stop) | dry run."""

    recipe: str
    name: str = "-"
    status: str = "not run"
    val_loss: Optional[float] = None
    seconds: Optional[float] = None
    error: str = ""


def sweep_recipes(folder: str | Path) -> list[Path]:
    """The recipes a sweep of ``folder`` runs: its ``*.yaml`` / ``*.yml`` files not starting with ``_``, by name."""
    folder = Path(folder)
    if not folder.is_dir():
        hint = " (a recipe file: run it with `grt run`)" if folder.is_file() else ""
        raise NotADirectoryError(f"grt sweep {folder}: not a folder{hint}; give a folder of recipes, e.g. "
                                 f"recipes/sweeps/toy-tau")
    found = sorted(p for p in folder.iterdir()
                   if p.is_file() and p.suffix in (".yaml", ".yml") and not p.name.startswith("_"))
    if not found:
        raise FileNotFoundError(f"grt sweep {folder}: no recipe in it (its *.yaml files not starting with '_')")
    return found


def sweep_tag(folder: str | Path) -> str:
    """The ``sweep`` tag of every run of the sweep: the folder's name."""
    return Path(folder).resolve().name


def tag_override(folder: str | Path) -> str:
    # JSON quoting, so that YAML reads the name as a string whatever it looks like (1.0, true, ...)
    return f"tracking.tags.sweep={json.dumps(sweep_tag(folder))}"


def finished(cfg) -> tuple[bool, str]:
    """(True, "") when `grt eval` last evaluated this run (runs/NAME/eval/exits.json) at the recipe's max_steps, from
    a checkpoint trained with exactly this recipe; else (False, why not) — a run evaluated earlier, or whose recipe
    changed since, is run again (it resumes from its checkpoint), so a stale result is never taken for this recipe's."""
    import yaml

    from pipeline.train.run_folder import recipe_changes

    try:
        exits = read_exits(cfg.run_dir)
        step, ckpt = int(exits["step"]), Path(exits["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return False, ""  # never evaluated
    if step != cfg.train.max_steps:
        return False, f"evaluated at step {step} of {cfg.train.max_steps}"
    try:
        saved = yaml.safe_load(((ckpt.parent if ckpt.is_file() else ckpt) / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False, f"the evaluated checkpoint's recipe is not readable ({ckpt})"
    changes = recipe_changes(saved if isinstance(saved, dict) else {}, cfg.to_dict())
    if changes:
        more = " ..." if len(changes) > 3 else ""
        return False, f"the recipe changed since its checkpoint ({'; '.join(changes[:3])}{more})"
    return True, ""


class SharedRunFolderError(ValueError):
    """Two recipes of a sweep train into one run folder: the second would resume the first's run and train nothing."""


def refuse_shared_run_folders(recipes: list[Path], cfgs: list, overrides: list) -> None:
    """Raise :class:`SharedRunFolderError` naming the first two recipes whose run folders (out_dir/name, resolved)
    are one; ``cfgs`` holds each recipe's config, or the exception it failed to load with (it cannot collide)."""
    seen: dict[Path, Path] = {}
    for path, cfg in zip(recipes, cfgs):
        if isinstance(cfg, BaseException):
            continue
        folder = cfg.run_dir.resolve()
        if folder in seen:
            fix = ("drop the name= override (it gives every recipe that name)" if any(
                str(o).startswith("name=") for o in overrides) else "give each recipe a distinct `name:`")
            raise SharedRunFolderError(
                f"grt sweep: {seen[folder]} and {path} both train into the run folder {folder}: the second would "
                f"resume the first's run, train nothing and report its val loss; {fix}. Nothing was run")
        seen[folder] = path


def _load(path: Path, overrides: list, data: Optional[str]):
    """The recipe's config, or the exception it fails to load with (reported in its turn, the others still run)."""
    from pipeline.config import load_recipe

    try:
        return load_recipe(path, overrides, data=data)
    except Exception as e:  # noqa: BLE001 (a broken recipe is reported in its row)
        return e


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def run_sweep(folder: str | Path, overrides: list | None = None, data: Optional[str] = None,
              dry_run: bool = False, runner: Runner = run_recipe, rerun: bool = False) -> list[SweepRow]:
    """Run every recipe of ``folder`` with ``overrides`` (after the sweep tag, so they may change it) and return one
    :class:`SweepRow` each. A run already trained to its max_steps and evaluated there is skipped ("done before")
    unless ``rerun``, so the same command continues an interrupted sweep. Failures are caught per recipe (printed
    as they happen); a stop (TrainingStopped, KeyboardInterrupt) is raised after the summary is printed, with the
    remaining recipes marked "not run". Two recipes with one run folder are refused (SharedRunFolderError) before
    anything runs, dry run included."""
    recipes = sweep_recipes(folder)
    overrides = [tag_override(folder), *(overrides or [])]
    cfgs = [_load(p, overrides, data) for p in recipes]  # every recipe first: a broken one fails here, before any run
    refuse_shared_run_folders(recipes, cfgs, overrides)
    own = [SweepRow(str(p)) for p in recipes]
    # train.branch_budgets: one row per decay branch, after its stable run's (sweep_branches.py)
    branches = [[SweepRow(f"{p} (budget {b.budget})") for b in points_of(c)] for p, c in zip(recipes, cfgs)]
    rows = [r for row, kids in zip(own, branches) for r in (row, *kids)]
    main = int(os.environ.get("RANK", "0")) == 0
    for i, (path, row, cfg) in enumerate(zip(recipes, own, cfgs), 1):
        t0 = time.time()
        try:
            if isinstance(cfg, BaseException):
                raise cfg
            row.name = cfg.name
            if dry_run:
                row.status = "dry run"
                print(f"{i}. {path} -> {cfg.name}: {_describe(cfg)}")
                for kid, point in zip(branches[i - 1], points_of(cfg)):
                    kid.name, kid.status = branch_name(cfg, point), "dry run"
                    print(describe_branch(cfg, point))
                continue
            done, why = finished(cfg) if not rerun else (False, "")
            if done:
                row.status, row.val_loss = "done before", saved_val_loss(cfg.run_dir)
                if main:
                    print(f"=== sweep {sweep_tag(folder)} [{i}/{len(recipes)}]: {cfg.name} trained and evaluated at "
                          f"step {cfg.train.max_steps} already ({cfg.run_dir}): skipped (--rerun runs it again)",
                          flush=True)
            else:
                if main:
                    again = f" ({why}: running it again)" if why else ""
                    print(f"\n=== sweep {sweep_tag(folder)} [{i}/{len(recipes)}]: {path} -> run {cfg.name}{again}",
                          flush=True)
                runner(str(path), overrides, data)
                row.status, row.val_loss = "ok", saved_val_loss(cfg.run_dir)
            row.seconds = round(time.time() - t0, 1)
            _run_branches(cfg, branches[i - 1], f"sweep {sweep_tag(folder)} [{i}/{len(recipes)}]", rerun, main)
        except (TrainingStopped, KeyboardInterrupt):
            if row.status not in ("ok", "done before"):  # (else one of its branches stopped: its row says so)
                row.status, row.seconds = "stopped", round(time.time() - t0, 1)
            if main:
                print(summary_table(rows, folder), flush=True)
            raise
        except Exception as e:  # noqa: BLE001 (any failure of one recipe: report it and go on with the next)
            row.status, row.error = "failed", _one_line(e)
            if main:
                print(f"sweep: {path} failed: {row.error}", file=sys.stderr, flush=True)
                if os.environ.get("GRT_DEBUG"):
                    traceback.print_exc()
        if not dry_run and row.seconds is None:
            row.seconds = round(time.time() - t0, 1)
    return rows


def _run_branches(cfg, kids: list[SweepRow], where: str, rerun: bool, main: bool) -> None:
    """Each decay branch of a stable run that trained (or was done before): skipped when trained and evaluated at its
    budget already (unless ``rerun``), else started or resumed, trained and evaluated. A failed branch is reported in
    its row and the next goes on; a stop is raised with the rows not run left so."""
    for kid, point in zip(kids, points_of(cfg)):
        t0 = time.time()
        kid.name = branch_name(cfg, point)
        try:
            bcfg = branch_config(cfg, point)
            done, why = finished(bcfg) if not rerun else (False, "")
            if done:
                kid.status, kid.val_loss = "done before", saved_val_loss(bcfg.run_dir)
                if main:
                    print(f"=== {where}: branch {kid.name} trained and evaluated at step {point.budget} already: "
                          f"skipped", flush=True)
                continue
            if main:
                again = f" ({why}: running it again)" if why else ""
                print(f"\n=== {where}: branch {kid.name} (budget {point.budget}: from step {point.at}, "
                      f"{point.decay} decay steps){again}", flush=True)
            run_branch(bcfg)
            kid.status, kid.val_loss = "ok", saved_val_loss(bcfg.run_dir)
        except (TrainingStopped, KeyboardInterrupt):
            kid.status, kid.seconds = "stopped", round(time.time() - t0, 1)
            raise
        except Exception as e:  # noqa: BLE001 (one branch failing: report it and go on with the next)
            kid.status, kid.error = "failed", _one_line(e)
            if main:
                print(f"sweep: branch {kid.name} failed: {kid.error}", file=sys.stderr, flush=True)
                if os.environ.get("GRT_DEBUG"):
                    traceback.print_exc()
        kid.seconds = round(time.time() - t0, 1)


def plan_sweep(folder: str | Path, overrides: list | None = None, data: Optional[str] = None) -> dict:
    """The planned cost of ``grt sweep folder`` (every run and branch, and the totals; nothing runs)."""
    from pipeline.config import load_recipe

    recipes = sweep_recipes(folder)
    return plan_configs([load_recipe(p, [tag_override(folder), *(overrides or [])], data=data) for p in recipes],
                        str(folder))


def _describe(cfg) -> str:
    """One line of what a recipe runs: model shorthand, steps, tokens, the tags it is logged with."""
    from pipeline.model import model_info

    info = model_info(cfg.model)
    tokens = cfg.train.max_steps * cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.model.block_size
    tags = ", ".join(f"{k}={v}" for k, v in cfg.tracking.tags.items()) or "none"
    amount = f"{tokens / 1e9:.2f}B" if tokens >= 1e8 else f"{tokens / 1e6:.3g}M"
    return (f"{cfg.model.type} {info['shorthand']} (d={cfg.model.d_model}), {cfg.train.max_steps:,} steps, "
            f"{amount} tokens; run folder {cfg.run_dir}; tags {tags}")


def summary_table(rows: list[SweepRow], folder: str | Path) -> str:
    """recipe | run | status | val loss | seconds, and the `grt compare` line that shows the runs."""
    head = ["recipe", "run", "status", "val loss", "seconds"]
    body = [[Path(r.recipe).name, r.name, r.status, "-" if r.val_loss is None else f"{r.val_loss:.4f}",
             "-" if r.seconds is None else f"{r.seconds:,.1f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 3 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    failed = [r for r in rows if r.status == "failed"]
    done = sum(r.status == "done before" for r in rows)
    out = [f"\nsweep {sweep_tag(folder)}: {sum(r.status == 'ok' for r in rows)} ok"
           + (f" (+{done} done before)" if done else "") + f", {len(failed)} failed, "
           f"{sum(r.status in ('stopped', 'not run') for r in rows)} not finished of {len(rows)}",
           line(head), "  ".join("-" * w for w in widths)] + [line(b) for b in body]
    out += [f"  {Path(r.recipe).name}: {r.error}" for r in failed]
    out.append("val loss: `grt eval`'s validation loss at the trained depth, nats/token. All runs: "
               f"grt compare --tag sweep={sweep_tag(folder)}")
    return "\n".join(out)


def sweep_command(folder: str, overrides: list, data: Optional[str] = None, dry_run: bool = False,
                  runner: Runner = run_recipe, rerun: bool = False) -> int:
    """`grt sweep`: run (or list, ``dry_run``) and print the summary; 0 when every recipe ran, 1 when any failed."""
    rows = run_sweep(folder, overrides, data, dry_run, runner, rerun)
    if dry_run:
        ready = sum(r.status == "dry run" for r in rows)
        print(f"{ready} of {len(rows)} recipe(s) would run, each tagged sweep={sweep_tag(folder)} (dry run: nothing "
              f"ran)" + ("; the others fail to load (above)" if ready < len(rows) else ""))
        if ready == len(rows):
            print(plan_line(plan_sweep(folder, overrides, data)))
        return OK if ready == len(rows) else FAILED
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_table(rows, folder))
    return FAILED if any(r.status == "failed" for r in rows) else OK
