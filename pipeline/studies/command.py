"""`grt compare`, `grt sweep`, `grt fit-phi` and `grt paper-table`: the commands over many runs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.config import TrackingConfig


def register(sub) -> None:
    s = sub.add_parser("compare", help="early-exit and downstream tables + early-exit overlays of evaluated runs")
    add_run_selection(s, "only runs with this MLflow tag (repeatable; set them with tracking.tags in the recipe; a "
                         "run folder is held to its recipe.yaml's)")
    s.add_argument("--format", default="table", choices=["table", "markdown", "csv", "json"])
    s.add_argument("--out", default="runs/compare", help="folder for the overlay plot and the table file")
    s.set_defaults(fn=cmd_compare)
    s = sub.add_parser("sweep", help="grt run on every recipe of a folder (files starting with _ skipped), in "
                                     "name order, each tagged sweep=FOLDER_NAME in MLflow; a failure does not stop "
                                     "the others; a summary table at the end")
    s.add_argument("folder", help="a folder of recipes, e.g. recipes/sweeps/toy-tau or recipes/paper/b6-gate-bias")
    s.add_argument("overrides", nargs="*", help="overrides for every recipe of the folder, e.g. train.max_steps=100")
    s.add_argument("--data", metavar="DATA_RECIPE", default=None,
                   help="a data recipe whose data: section replaces every recipe's (as grt run --data)")
    s.add_argument("--dry-run", action="store_true", help="list the recipes, their models and tags; run nothing")
    s.add_argument("--rerun", action="store_true",
                   help="also run the recipes whose run is already trained to max_steps and evaluated (skipped "
                        "otherwise, so the same command continues an interrupted sweep)")
    add_cluster_arguments(s)
    s.set_defaults(fn=cmd_sweep)
    s = sub.add_parser("fit-phi", help="the recurrence-equivalence exponent phi of L = E + A (N_once + r^phi "
                                       "N_rec)^-alpha + B D^-beta over evaluated runs (docs/related.md)")
    add_run_selection(s, "only runs with this MLflow tag (repeatable; e.g. sweep=phi, set by grt sweep)")
    s.add_argument("--boot", type=int, default=200, help="bootstrap refits for the confidence intervals")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--with-embeddings", action="store_true",
                   help="count the embeddings in N_once (default: non-embedding parameters)")
    s.add_argument("--out", default="runs/phi", help="folder for phi.json and phi.png")
    s.set_defaults(fn=cmd_fit_phi)
    s = sub.add_parser("paper-table", help="the paper's Table 1 / Table 2 / Figure 5 (and Appendix B sweep) numbers "
                                           "beside the matching MLflow runs, with the deltas")
    s.add_argument("--tracking-uri", default=TrackingConfig.uri)
    s.add_argument("--experiment", action="append", default=None,
                   help=f"MLflow experiment to search (repeatable; default {TrackingConfig.experiment})")
    s.add_argument("--table", default="all", choices=["table1", "table2", "figure5", "sweeps", "all"])
    s.add_argument("--data", metavar="DATA_RECIPE", default=None,
                   help="match the runs trained with grt run --data DATA_RECIPE (named RECIPE-STEM)")
    s.add_argument("--format", default="table", choices=["table", "markdown", "json"])
    s.set_defaults(fn=cmd_paper_table)


def add_run_selection(s: argparse.ArgumentParser, tag_help: str) -> None:
    """The runs a command reads from MLflow: names/ids or folders, the tracking URI, experiments and tags."""
    s.add_argument("runs", nargs="*", help="MLflow run names/ids or run folders (default: all evaluated runs)")
    s.add_argument("--tracking-uri", default=TrackingConfig.uri)
    s.add_argument("--experiment", action="append", default=None,
                   help=f"MLflow experiment to search (repeatable; default {TrackingConfig.experiment})")
    s.add_argument("--tag", action="append", default=None, metavar="KEY=VALUE", help=tag_help)


def add_cluster_arguments(s: argparse.ArgumentParser) -> None:
    """`grt sweep --status` and `grt sweep --launcher slurm ...` (pipeline/studies/sweep_submit.py)."""
    s.add_argument("--status", action="store_true", help="show each run's state (queued, running at step N, finished, "
                                                         "failed with its last error); run nothing")
    s.add_argument("--launcher", default=None, choices=["slurm"],
                   help="submit every recipe as a SLURM job (grt launch's script and preflight) and a final job "
                        "printing the table when all ended (docs/experiments.md, On a cluster)")
    s.add_argument("--nodes", type=int, default=1, help="--launcher slurm: nodes per run")
    s.add_argument("--gpus-per-node", type=int, default=1, help="--launcher slurm: ranks per node")
    s.add_argument("--gpu-mem", type=float, default=None, metavar="GB", help="memory per GPU for the preflight")
    s.add_argument("--no-check", action="store_true", help="--launcher slurm: submit without the preflights")
    s.add_argument("--skip-data", action="store_true", help="--launcher slurm: preflights without the dataset checks")
    for opt, what in (("--time", "--time of each job (e.g. 24:00:00)"), ("--partition", "--partition"),
                      ("--account", "--account"), ("--setup", "shell line(s) every node runs first (default: "
                                                              "activate grt's virtual environment)"),
                      ("--template", "your own sbatch template (as grt launch)")):
        s.add_argument(opt, default=None, help=f"--launcher slurm: {what}")
    s.add_argument("--grace", type=int, default=300, help="--launcher slurm: seconds between SIGTERM and the limit")
    s.add_argument("--cpus-per-node", type=int, default=None, metavar="N", help="--launcher slurm: CPUs per node")


def parse_tags(given: list[str] | None) -> dict[str, str]:
    tags = {}
    for t in given or []:
        key, sep, value = t.partition("=")
        if not sep or not key:
            raise ValueError(f"--tag {t!r}: write it as key=value")
        tags[key] = value
    return tags


def cmd_compare(args) -> int:
    from pipeline.studies.compare import compare
    from pipeline.tracking import is_http
    from pipeline.tracking import resolve_uri

    tags = parse_tags(args.tag)
    experiments = args.experiment or [TrackingConfig.experiment]
    tracking = TrackingConfig(uri=args.tracking_uri, experiment=experiments[0])
    text, plot = compare(args.runs, tracking, args.out, args.format, experiments, tags)
    print(text)
    if args.format in ("table", "markdown"):
        print(f"\nearly-exit overlay (loss vs r and vs inference FLOPs): {plot}")
        uri, where = resolve_uri(tracking.uri), f"experiment(s) {', '.join(experiments)}"
        print(f"MLflow UI: open {uri} ({where})" if is_http(uri) else  # a server serves its own UI
              f"MLflow UI: `.venv/bin/mlflow ui --backend-store-uri {uri}` then open http://127.0.0.1:5000 ({where})")
    return 0


def cmd_sweep(args) -> int:
    """`grt run` on every recipe of a folder (pipeline/studies/sweep.py), then a summary table."""
    from pipeline.studies.sweep import sweep_command

    if args.status:
        from pipeline.studies.sweep_status import status_command

        return status_command(args.folder, args.overrides, args.data)
    if args.launcher == "slurm":
        from pipeline.studies.sweep_submit import submit_sweep

        return submit_sweep(args)
    if args.nodes != 1 or args.gpus_per_node != 1:
        print("error: grt sweep runs its recipes in this process, on one device: --nodes/--gpus-per-node need "
              "--launcher slurm", file=sys.stderr)
        return 2
    return sweep_command(args.folder, args.overrides, args.data, args.dry_run, rerun=args.rerun)


def cmd_fit_phi(args) -> int:
    """Fit the recurrence-equivalence law over evaluated runs: phi with its bootstrap interval, JSON and a plot."""
    from pipeline.eval.results import collect
    from pipeline.studies.phi import fit_phi
    from pipeline.studies.phi import plot_fit
    from pipeline.studies.phi import runs_from_results

    experiments = args.experiment or [TrackingConfig.experiment]
    tracking = TrackingConfig(uri=args.tracking_uri, experiment=experiments[0])
    runs = runs_from_results(collect(args.runs, tracking, experiments, parse_tags(args.tag)), args.with_embeddings)
    fit = fit_phi(runs, n_boot=args.boot, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [vars(x) for x in runs]
    (out / "phi.json").write_text(json.dumps({"params": fit.params, "ci95": fit.ci, "n_boot": fit.n_boot,
                                              "objective": fit.objective, "runs": rows,
                                              "with_embeddings": args.with_embeddings}, indent=1))
    plot_fit(fit, runs, out / "phi.png")
    lo, hi = fit.ci.get("phi", (float("nan"), float("nan")))
    print(f"phi = {fit.params['phi']:.3f} (95% bootstrap CI {lo:.3f} to {hi:.3f}, {fit.n_boot} refits) over "
          f"{len(runs)} runs, r in {sorted({x.r for x in runs})}")
    branches = [x for x in runs if x.branch_of]
    if branches:  # budgets of one stable run share its trajectory: points of the law, but not independent ones
        stable = {x.branch_of.rsplit("@", 1)[0] for x in branches}
        listed = ", ".join(f"{x.name} ({x.branch_of})" for x in branches)
        print(f"  {len(branches)} of them decay branches (grt branch) of {len(stable)} stable run(s): {listed}")
    print("  " + ", ".join(f"{k} {v:.4g}" for k, v in fit.params.items() if k != "phi"))
    print(f"  saved {out / 'phi.json'}, {out / 'phi.png'}")
    return 0


def cmd_paper_table(args) -> int:
    """The paper's numbers (pipeline/studies/paper_results.yaml) beside the matching MLflow runs, with the deltas."""
    from pipeline.studies.paper_table import TABLES
    from pipeline.studies.paper_table import format_tables
    from pipeline.studies.paper_table import load_results
    from pipeline.studies.paper_table import paper_table

    which = list(TABLES) if args.table == "all" else [args.table]
    result = paper_table(load_results(), which, args.tracking_uri, args.experiment or [TrackingConfig.experiment],
                         Path(args.data).stem if args.data else None)
    print(format_tables(result, args.format))
    return 0
