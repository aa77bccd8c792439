"""`grt launch tokenize RECIPE --nodes N --launcher slurm`: `grt tokenize` as a SLURM job array of N tasks, each
running ``grt tokenize RECIPE --tasks N --task-id $SLURM_ARRAY_TASK_ID``, and the merge as a job that depends on it
(``sbatch --dependency=afterok:ARRAY_JOB``). The scripts come from ``launch/templates/tokenize_{array,merge}.sh`` and
are written into ``runs/NAME/launch/``; ``--dry-run`` prints them and submits nothing."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launch.render import TEMPLATES
from launch.render import fill

ARRAY = "tokenize_array.sbatch"
MERGE = "tokenize_merge.sbatch"


@dataclass
class TokenizePlan:
    name: str
    tasks: int
    recipe: str
    overrides: list[str]
    data: str | None
    dataset_dir: str
    launch_dir: str
    workdir: str
    setup: str
    cpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None


def _options(plan: TokenizePlan, cpus: bool) -> str:
    opts = ([("exclusive" if plan.cpus_per_node is None else f"cpus-per-task={plan.cpus_per_node}")] if cpus else [])
    opts += [f"{k}={v}" for k, v in (("time", plan.time), ("partition", plan.partition), ("account", plan.account))
             if v]
    return "\n".join(f"#SBATCH --{o}" for o in opts)


def scripts(plan: TokenizePlan) -> dict[str, str]:
    """File name -> text of the array script and the merge script."""
    data = ["--data", plan.data] if plan.data else []  # after the overrides: argparse ends `overrides` at an option
    values = {"name": plan.name, "tasks": plan.tasks, "last_task": plan.tasks - 1, "launch_dir": plan.launch_dir,
              "workdir": plan.workdir, "setup": plan.setup, "dataset_dir": plan.dataset_dir,
              "sbatch_options": _options(plan, cpus=True), "merge_options": _options(plan, cpus=False),
              "tokenize_command": shlex.join(["grt", "tokenize", plan.recipe, *plan.overrides, *data]),
              "merge_command": shlex.join(["grt", "tokenize", "merge", plan.dataset_dir])}
    return {name: fill((TEMPLATES / template).read_text(), values)
            for name, template in ((ARRAY, "tokenize_array.sh"), (MERGE, "tokenize_merge.sh"))}


def _sbatch(args: list[str]) -> str:
    """Submit; the job id (``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``)."""
    p = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(f"sbatch {' '.join(args)} failed (exit {p.returncode}): "
                      f"{(p.stderr or p.stdout).strip().splitlines()[-1:] or ['no output']}")
    return p.stdout.strip().split(";")[0]


def cmd_launch_tokenize(args, default_setup, write_files) -> int:
    """``default_setup`` and ``write_files``: launch/cli.py's (passed in: that module imports this one)."""
    from pipeline.config import load_recipe

    if not args.overrides:
        print("error: usage: grt launch tokenize RECIPE [overrides] --nodes N --launcher slurm", file=sys.stderr)
        return 2
    if args.launcher != "slurm":
        print(f"error: grt launch tokenize submits a SLURM job array: give --launcher slurm (not {args.launcher}); "
              f"elsewhere run `grt tokenize RECIPE --tasks N --task-id I` on each machine, then `grt tokenize "
              f"merge DATASET_DIR`", file=sys.stderr)
        return 2
    if args.nodes < 1:
        print(f"error: --nodes {args.nodes}: give at least 1", file=sys.stderr)
        return 2
    recipe, overrides = args.overrides[0], args.overrides[1:]
    cfg = load_recipe(recipe, overrides, data=args.data)
    workdir = os.getcwd()
    launch_dir = str(cfg.run_dir / "launch")
    plan = TokenizePlan(name=cfg.name, tasks=args.nodes, recipe=recipe, overrides=overrides, data=args.data,
                        dataset_dir=cfg.data.dataset_dir, launch_dir=launch_dir, workdir=workdir,
                        setup=args.setup if args.setup is not None else default_setup(),
                        cpus_per_node=args.cpus_per_node, time=args.time, partition=args.partition,
                        account=args.account)
    texts = scripts(plan)
    paths = {name: str(Path(workdir) / launch_dir / name) for name in texts}
    write_files({paths[n]: t for n, t in texts.items()})
    if args.dry_run:
        for name, text in texts.items():
            print(f"# ---- {paths[name]}\n{text}", end="")
        print(f"# submit: sbatch {paths[ARRAY]}; then sbatch --dependency=afterok:ARRAY_JOB_ID {paths[MERGE]}")
        return 0
    if not shutil.which("sbatch"):
        print(f"error: sbatch is not on PATH (not a SLURM login node?): the scripts are written; submit them from a "
              f"login node: `sbatch {paths[ARRAY]}`, then `sbatch --dependency=afterok:ARRAY_JOB_ID "
              f"{paths[MERGE]}`", file=sys.stderr)
        return 1
    array = _sbatch([paths[ARRAY]])
    merge = _sbatch([f"--dependency=afterok:{array}", paths[MERGE]])
    print(f"grt launch: submitted tokenize array job {array} ({plan.tasks} tasks) and merge job {merge} (starts "
          f"when every task has succeeded); logs: {launch_dir}/tokenize-{array}_*.out, "
          f"{launch_dir}/tokenize-merge-{merge}.out")
    return 0
