"""`grt sweep FOLDER --launcher slurm --nodes N --gpus-per-node G`: the whole grid as one submission.

Every recipe gets the sbatch script `grt launch --launcher slurm` writes (its plan, its preflight), running `grt run`
(tokenize reused -> train -> eval, rank 0 evaluates) instead of `grt train`, so that each job ends with the
evaluation `grt compare` reads. Every preflight runs before anything is submitted: one failing refuses the whole
grid, one line per problem. Then the jobs are submitted, and a last job that depends on all of them
(``--dependency=afterany:ID1:ID2:...``) prints `grt sweep FOLDER --status`, then `grt compare --tag sweep=TAG` over
the runs that were evaluated and, for a paper folder (recipes/paper/...), `grt paper-table --table sweeps`.

afterany, not afterok: the table is wanted when some runs fail too (it shows the others, and --status names the
failures); with afterok one failed run would leave the final job pending forever (DependencyNeverSatisfied). A run
requeued at its time limit goes back to PENDING, not to an end state, so the final job still waits for it.

The job ids, run folders and logs are kept in ``OUT_DIR/sweeps/TAG/jobs.json`` for `grt sweep FOLDER --status`.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.runtime.exit_status import FAILED
from pipeline.runtime.exit_status import OK

JOBS = "jobs.json"


def sweep_dir(cfg, tag: str) -> Path:
    """Where a sweep's final script, its log, its compare output and jobs.json go: OUT_DIR/sweeps/TAG."""
    return Path(cfg.run_dir).parent / "sweeps" / tag


def is_paper_folder(folder: str | Path) -> bool:
    """A grid of the paper (recipes/paper/NAME): its final job also prints `grt paper-table --table sweeps`."""
    return Path(folder).resolve().parent.name == "paper"


def run_script(plan, template: str | None) -> str:
    """`grt launch`'s sbatch script of ``plan`` with `grt run` in place of `grt train`."""
    from launch.render import sbatch_script
    from launch.render import train_args

    text = sbatch_script(plan, template)
    train = shlex.join(["-m", *train_args(plan)])
    run = shlex.join(["-m", "pipeline.cli", "run", *train_args(plan)[2:]])
    if text.count(train) != 1:
        raise ValueError("grt sweep --launcher slurm: the sbatch template does not hold the training command "
                         "({{train_command}}) exactly once; keep that placeholder once in the template")
    return text.replace(train, run)


def final_script(tag: str, folder: str, overrides: list, data: str | None, cfgs: list, where: Path, workdir: str,
                 setup: str, options: list[str]) -> str:
    """The dependent job: the grid's status, then `grt compare` (and `grt paper-table` for a paper folder)."""
    py = "python -m pipeline.cli"
    status = shlex.join(["sweep", folder, *overrides, *(["--data", data] if data else []), "--status"])
    tracking = cfgs[0].tracking
    compare = ["--tag", f"sweep={tag}", "--out", str(where / "compare")]
    if all(c.tracking.enabled for c in cfgs):
        compare += ["--tracking-uri", tracking.uri]
        for e in dict.fromkeys(c.tracking.experiment for c in cfgs):
            compare += ["--experiment", e]
    lines = [
        "#!/bin/bash",
        f"# sweep {tag}: the table of its runs, after every run's job ended (written by `grt sweep --launcher slurm`)",
        f"#SBATCH --job-name=sweep-{tag}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --output={where}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
        *options,
        setup,
        "set -uo pipefail",
        f"{py} {status}",
        "runs=()  # the runs that were evaluated (a failed one has no eval/exits.json; --status above names it)",
        f"for d in {' '.join(shlex.quote(str(c.run_dir)) for c in cfgs)}; do",
        '    if [ -f "$d/eval/exits.json" ]; then runs+=("$d"); fi',
        "done",
        'if [ ${#runs[@]} -eq 0 ]; then',
        f'    echo "grt: no run of sweep {tag} was evaluated: nothing to compare (see the status above)"; exit 1',
        "fi",
        f'{py} compare "${{runs[@]}}" {shlex.join(compare)}',
        "rc=$?",
    ]
    if is_paper_folder(folder):
        lines += [f"{py} paper-table --table sweeps --tracking-uri {shlex.quote(tracking.uri)} || rc=1"]
    lines += ["exit $rc", ""]
    return "\n".join(lines)


def check_all(recipes: list[Path], cfgs: list, args) -> list[str]:
    """Every recipe's preflight on the grid's nodes; one line per problem, naming the recipe."""
    from launch.preflight import run_preflight

    problems = []
    for path, cfg in zip(recipes, cfgs):
        report = run_preflight(cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem,
                               check_data=not args.skip_data)
        problems += [f"{path.name}: {p}" for p in report.problems]
    return problems


def sbatch(argv: list[str]) -> str:
    """Submit; the job id (`sbatch --parsable` prints ID or ID;CLUSTER). Raises RuntimeError with sbatch's error."""
    p = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True, text=True)
    job = p.stdout.strip().split(";")[0]
    if p.returncode != 0 or not job.isdigit():
        said = [x.strip() for x in (p.stderr or p.stdout).splitlines() if x.strip()]  # its last line: one line
        raise RuntimeError(f"sbatch {' '.join(argv)} failed: {said[-1] if said else f'exit status {p.returncode}'}")
    return job


def submit_sweep(args) -> int:
    """`grt sweep FOLDER --launcher slurm ...`: write every script (after every preflight), submit, print the ids."""
    from launch.cli import default_setup
    from launch.cli import write_files
    from launch.plan import PlanError
    from launch.plan import make_plan
    from pipeline.studies.sweep import _load
    from pipeline.studies.sweep import refuse_shared_run_folders
    from pipeline.studies.sweep import sweep_recipes
    from pipeline.studies.sweep import sweep_tag
    from pipeline.studies.sweep import tag_override

    folder, tag = args.folder, sweep_tag(args.folder)
    recipes = sweep_recipes(folder)
    overrides = [tag_override(folder), *args.overrides]
    cfgs = [_load(p, overrides, args.data) for p in recipes]
    broken = [f"{p.name}: {c}" for p, c in zip(recipes, cfgs) if isinstance(c, BaseException)]
    if broken:
        print("\n".join(f"error: {b}" for b in broken), file=sys.stderr)
        print(f"error: {len(broken)} recipe(s) of {folder} do not load; fix them. Nothing was submitted",
              file=sys.stderr)
        return 2
    refuse_shared_run_folders(recipes, cfgs, overrides)
    template = Path(args.template).read_text() if args.template else None
    setup = args.setup if args.setup is not None else default_setup()
    plans, problems = [], []
    for path, cfg in zip(recipes, cfgs):
        try:
            plans.append(make_plan(
                launcher="slurm", nodes=args.nodes, gpus_per_node=args.gpus_per_node, recipe=str(path),
                overrides=overrides, name=cfg.name, backend=cfg.train.backend, run_dir=str(cfg.run_dir),
                workdir=os.getcwd(), environ=dict(os.environ), data=args.data, setup=setup, grace_s=args.grace,
                time=args.time, partition=args.partition, account=args.account, cpus_per_node=args.cpus_per_node))
        except PlanError as e:
            problems += [f"{path.name}: {p}" for p in e.problems]
    if not problems and not args.no_check:
        problems = check_all(recipes, cfgs, args)
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        print(f"error: {len(problems)} problem(s) in the grid {folder} (above; --skip-data leaves the dataset checks "
              f"out, --no-check the preflight); nothing was submitted", file=sys.stderr)
        return 2
    from launch.render import sbatch_path

    where = sweep_dir(cfgs[0], tag)
    options = [f"#SBATCH --{k}={v}" for k, v in (("time", args.time), ("partition", args.partition),
                                                           ("account", args.account)) if v]
    scripts = {sbatch_path(plan): run_script(plan, template) for plan in plans}
    final = str(where / "compare.sbatch")
    scripts[final] = final_script(tag, str(folder), list(args.overrides), args.data, cfgs, where, os.getcwd(),
                                  setup, options)
    write_files(scripts)
    print(f"sweep {tag}: {len(plans)} job script(s), {args.nodes} node(s) x {args.gpus_per_node} GPU(s) each:")
    for plan in plans:
        print(f"  {sbatch_path(plan)}")
    print(f"  {final} (after every run's job: status, grt compare --tag sweep={tag}"
          + (", grt paper-table)" if is_paper_folder(folder) else ")"))
    if args.dry_run:
        print("dry run: nothing was submitted (submit with the same command without --dry-run)")
        return OK
    if not shutil.which("sbatch"):
        print(f"error: sbatch is not on PATH (not a SLURM login node?): the scripts are written in {where.parent} "
              f"and the run folders; run the same command on a login node", file=sys.stderr)
        return FAILED
    jobs = {"tag": tag, "folder": str(folder), "runs": {}, "final": None}
    try:
        for plan in plans:
            job = sbatch([sbatch_path(plan)])
            jobs["runs"][plan.name] = {"job": job, "run_dir": plan.run_dir,
                                       "log": f"{plan.launch_dir}/slurm-{job}.out"}
            print(f"submitted {plan.name}: job {job} (log {plan.launch_dir}/slurm-{job}.out)", flush=True)
        ids = ":".join(r["job"] for r in jobs["runs"].values())
        jobs["final"] = sbatch([f"--dependency=afterany:{ids}", final])
    except RuntimeError as e:
        print(f"error: {e}; the jobs submitted so far are in {where / JOBS} (cancel them with scancel, or keep them)",
              file=sys.stderr)
        return FAILED
    finally:
        write_files({str(where / JOBS): json.dumps(jobs, indent=1) + "\n"})
    print(f"submitted the final table: job {jobs['final']} (after {ids}; log {where}/slurm-{jobs['final']}.out)")
    print(f"follow the grid with `grt sweep {folder} --status`")
    return OK
