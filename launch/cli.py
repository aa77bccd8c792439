"""`grt launch RECIPE [overrides] --nodes N --gpus-per-node G [--launcher ...]`: check, render, start.

Order: load the recipe -> check the plan -> preflight (``--check`` stops here) -> write the launch files ->
``--dry-run`` prints and stops -> run this node's command (or submit the sbatch script).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from launch.plan import LAUNCHERS
from launch.plan import PlanError
from launch.plan import make_plan
from launch.render import commands
from launch.render import describe
from launch.render import files
from launch.rendezvous import DEFAULT_TIMEOUT_S
from launch.rendezvous import meet
from launch.rendezvous import needs_meeting

# The programs of the rendered commands, run with this Python so that the ranks use the environment grt runs in.
PROGRAMS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
            "deepspeed": [sys.executable, "-m", "deepspeed.launcher.runner"]}


def add_launch_parser(sub) -> None:
    s = sub.add_parser("launch", help="render and run the multi-node commands of a recipe (torchrun, deepspeed, slurm)",
                       description="Check the plan (preflight), write the launch files into runs/NAME/launch/ and "
                                   "start this node's command (or submit the SLURM job). See docs/multi-node.md.")
    s.add_argument("recipe", help="YAML recipe (recipes/...)")
    s.add_argument("overrides", nargs="*", help="recipe overrides key.sub=value, forwarded to every rank")
    s.add_argument("--nodes", type=int, default=1)
    s.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node (GPUs; CPU processes on a CPU)")
    s.add_argument("--launcher", default="torchrun", choices=LAUNCHERS)
    s.add_argument("--data", default=None, metavar="DATA_RECIPE", help="data recipe put over the recipe's data "
                                                                        "(forwarded to every rank)")
    s.add_argument("--master-addr", default=None, help="node 0's address (needed for --nodes > 1)")
    s.add_argument("--master-port", type=int, default=None,
                   help="default: derived from SLURM_JOB_ID, else from the run name (docs/multi-node.md)")
    s.add_argument("--node-rank", type=int, default=None,
                   help="run only this node's command (torchrun; deepspeed without ssh)")
    s.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="with --node-rank: seconds to wait for every node to meet before the launcher starts "
                        f"(default {DEFAULT_TIMEOUT_S}); a node missing then is named, with the likely cause")
    s.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="torchrun: restart the worker group up to N times when a worker dies (c10d rendezvous); "
                        "it resumes from the latest intact checkpoint, same MLflow run (docs/multi-node.md)")
    s.add_argument("--hostfile", default=None, help="deepspeed: hostfile (`host slots=G` lines)")
    s.add_argument("--hosts", default=None, help="deepspeed: comma-separated host names; a hostfile is written")
    s.add_argument("--gpu-mem", type=float, default=None, metavar="GB",
                   help="memory per GPU for the preflight (default: the local device's)")
    s.add_argument("--check", action="store_true", help="run the preflight only: exit 2 on problems, else 0")
    s.add_argument("--no-check", action="store_true", help="start without the preflight")
    s.add_argument("--skip-data", action="store_true",
                   help="preflight without the dataset checks (e.g. planning before the data is tokenized)")
    s.add_argument("--dry-run", action="store_true", help="write the launch files, print the commands, start nothing")
    s.add_argument("--setup", default=None, help="slurm: shell line(s) every node runs first (default: activate the "
                                                 "virtual environment grt runs in)")
    s.add_argument("--template", default=None, help="slurm: your own sbatch template (default "
                                                    "launch/templates/sbatch.sh)")
    s.add_argument("--grace", type=int, default=300, help="slurm: seconds between SIGTERM and the time limit "
                                                           "(at least 90, less than --time)")
    s.add_argument("--cpus-per-node", type=int, default=None, metavar="N",
                   help="slurm: CPUs for each node's G ranks together (sbatch --cpus-per-task, one task per node); "
                        "default: whole nodes (--exclusive)")
    s.add_argument("--time", default=None, help="slurm: --time as sbatch reads it: MM, MM:SS, HH:MM:SS, D-HH, "
                                                 "D-HH:MM, D-HH:MM:SS (e.g. 24:00:00)")
    s.add_argument("--partition", default=None, help="slurm: --partition")
    s.add_argument("--account", default=None, help="slurm: --account")
    s.set_defaults(fn=cmd_launch)


def default_setup() -> str:
    """Activate the virtual environment grt runs from, so every SLURM node runs the same Python."""
    if sys.prefix != sys.base_prefix:
        return f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    return "# (grt runs outside a virtual environment: the job inherits the submitting shell's PATH)"


def preflight(cfg, args) -> int | None:
    """Run the preflight; its report is printed. Returns an exit code to stop with, or None to go on."""
    if args.no_check:
        return None
    from launch.preflight import run_preflight

    report = run_preflight(cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem,
                           check_data=not args.skip_data)
    print(report.render(), file=sys.stdout if report.ok else sys.stderr, flush=True)
    if not report.ok:
        print(f"error: the preflight found {len(report.problems)} problem(s); nothing was started",
              file=sys.stderr)
        return 2
    if args.check:
        return 0
    print("grt launch: preflight passed", flush=True)
    return None


# Files only the user may read: .deepspeed_env copies node 0's HF_* and MLFLOW_* variables, tokens included, onto a
# filesystem the nodes share (DeepSpeed reads it on node 0 only, as the user)
PRIVATE = {".deepspeed_env"}


def write_files(paths: dict[str, str]) -> None:
    """Write atomically: on a shared filesystem every node of a per-node launch writes the same file."""
    for path, text in paths.items():
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if p.name in PRIVATE else 0o666)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, p)


def cmd_launch(args) -> int:
    from pipeline.config import load_recipe

    if args.recipe == "tokenize" and not Path("tokenize").is_file():  # `grt launch tokenize RECIPE`: a job array
        from launch.tokenize_array import cmd_launch_tokenize

        return cmd_launch_tokenize(args, default_setup, write_files)
    cfg = load_recipe(args.recipe, args.overrides, data=args.data)
    template = Path(args.template).read_text() if args.template else None
    try:
        plan = make_plan(launcher=args.launcher, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         recipe=args.recipe, overrides=args.overrides, name=cfg.name, backend=cfg.train.backend,
                         # a run on object storage: the launch files (SLURM log, hostfile) in the shared working
                         # folder the job starts in, not in a node's copy of the run
                         run_dir=str(Path("grt-launch") / cfg.name if cfg.run_url else cfg.run_dir),
                         workdir=os.getcwd(), environ=dict(os.environ),
                         master_addr=args.master_addr, master_port=args.master_port, node_rank=args.node_rank,
                         data=args.data, hostfile=args.hostfile, hosts=args.hosts.split(",") if args.hosts else None,
                         setup=args.setup if args.setup is not None else default_setup(), grace_s=args.grace,
                         time=args.time, partition=args.partition, account=args.account,
                         cpus_per_node=args.cpus_per_node, max_restarts=args.max_restarts)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check and args.no_check:
        print("error: --check and --no-check contradict each other; keep one", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    if not args.dry_run and not args.check:
        blocked = cannot_start(plan, args, environ, template)
        if blocked:
            return blocked
    if not args.dry_run or args.check:
        stop = preflight(cfg, args)
        if stop is not None:
            return stop
    write_files(files(plan, environ, template))
    if args.dry_run:
        print(describe(plan, environ, template), end="")
        return 0
    if plan.launcher == "slurm":
        return submit(commands(plan)[0].argv[1])
    cmd = commands(plan)[0]
    if needs_meeting(plan):  # a node sent to another port (another name=) is named, not waited for in silence
        print(f"grt launch: node {plan.node_rank} of {plan.nodes} waiting for the others at {plan.master_addr}:"
              f"{plan.master_port} (at most {args.rendezvous_timeout:g} s)", flush=True)
        meet(plan, args.rendezvous_timeout)
    print(f"grt launch: {cmd.text()}", flush=True)
    argv = PROGRAMS.get(cmd.argv[0], cmd.argv[:1]) + cmd.argv[1:]
    os.execvpe(argv[0], argv, {**os.environ, **cmd.env})  # the launcher takes this process: signals, exit code


def cannot_start(plan, args, environ: dict, template: str | None) -> int | None:
    """Plans this node cannot start by itself: print every node's command, say why, return the exit code."""
    if plan.launcher == "torchrun" and plan.nodes > 1 and plan.node_rank is None:
        why = (f"torchrun cannot start processes on other nodes: run the command above on each node (or "
               f"`grt launch {args.recipe} ... --node-rank K` there); or use --launcher slurm, or --launcher "
               f"deepspeed --hostfile F (ssh)")
    elif plan.launcher == "deepspeed" and not plan.per_node and plan.nodes > 1 and not shutil.which("pdsh"):
        why = ("the deepspeed launcher starts the other nodes with pdsh, which is not installed here: install pdsh "
               "(and passwordless ssh between the nodes), or run the per-node form on every node: "
               "`grt launch ... --node-rank K --master-addr NODE0` (no ssh)")
    else:
        return None
    print(describe(plan, environ, template), end="")
    print(f"error: {why}. Nothing was started.", file=sys.stderr)
    return 2


def submit(script: str) -> int:
    if not shutil.which("sbatch"):
        print(f"error: sbatch is not on PATH (not a SLURM login node?): the job script is written; submit it from "
              f"a login node with `sbatch {script}`", file=sys.stderr)
        return 1
    p = subprocess.run(["sbatch", script], capture_output=True, text=True)
    print(p.stdout, end="")
    print(p.stderr, end="", file=sys.stderr)
    if p.returncode == 0:
        print(f"grt launch: submitted {script}; its log: {Path(script).parent}/slurm-JOBID.out")
    return p.returncode
