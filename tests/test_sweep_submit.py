"""`grt sweep FOLDER --launcher slurm` and `grt sweep FOLDER --status`: a 3-recipe toy grid submitted to SLURM
stand-ins (sbatch records the jobs, a stand-in scheduler runs them in dependency order with test_launch.py's srun /
scontrol / scancel stand-ins), the runs train and evaluate, the dependent job prints the compare table; the status
before (queued) and after (finished, and the failed run with its error)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import subprocess_env
from conftest import tiny_recipe
from pipeline.cli import main
from pipeline.tokenize import tokenize
from test_launch import FAKE_SRUN
from test_launch import fake_slurm

REPO = Path(__file__).resolve().parents[1]

# sbatch stand-in: `sbatch --parsable [--dependency=afterany:A:B] SCRIPT` queues the job (one JSON line in
# $GRT_TEST_QUEUE), marks it PENDING for the squeue stand-in and prints its id
FAKE_SBATCH = """#!{python}
import json, os, sys
queue, states = os.environ["GRT_TEST_QUEUE"], os.environ["GRT_TEST_STATES"]
n = sum(1 for _ in open(queue)) if os.path.exists(queue) else 0
job, args = str(1000 + n), sys.argv[1:]
deps = [a.split("=", 1)[1].split(":") for a in args if a.startswith("--dependency=")]
with open(queue, "a") as f:
    f.write(json.dumps({{"job": job, "script": args[-1], "after": deps[0][1:] if deps else [],
                        "kind": deps[0][0] if deps else None}}) + "\\n")
open(os.path.join(states, job), "w").write("PENDING")
print(job)
"""
# squeue stand-in: `squeue -h -j JOB -o %T` prints the job's state while it is queued or running, nothing after
FAKE_SQUEUE_JOBS = """#!/bin/bash
f="$GRT_TEST_STATES/$3"
[ -f "$f" ] && cat "$f" && echo
exit 0
"""


def run_queue(queue: Path, states: Path, bindir: Path, tmp: Path) -> dict[str, subprocess.CompletedProcess]:
    """The stand-in scheduler: run every queued job (bash SCRIPT, as SLURM's batch step) once all the jobs it depends
    on have ended, each with its own SLURM_JOB_ID; its output goes to the script's --output file (%j -> the id)."""
    jobs = [json.loads(x) for x in queue.read_text().splitlines()]
    ended, out = set(), {}
    while len(ended) < len(jobs):
        ready = [j for j in jobs if j["job"] not in ended and set(j["after"]) <= ended]
        assert ready, f"dependency never satisfied: {jobs}"
        j = ready[0]
        text = Path(j["script"]).read_text()
        log = next(x.split("=", 1)[1] for x in text.splitlines() if x.startswith("#SBATCH --output="))
        log = Path(log.replace("%j", j["job"]))
        nodes = next((int(x.split("=")[1]) for x in text.splitlines() if x.startswith("#SBATCH --nodes=")), 1)
        (states / j["job"]).write_text("RUNNING")
        env = subprocess_env(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID=j["job"],
                             SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST="fake1",
                             GRT_TEST_REQUEUED=str(tmp / "requeued"), GRT_TEST_SLURM_TASKS=str(tmp / "tasks"))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            out[j["job"]] = subprocess.run(["bash", j["script"]], cwd=REPO, env=env, stdout=f,
                                           stderr=subprocess.STDOUT, timeout=600)
        # squeue lists an ended job a while longer (SLURM's MinJobAge) in its final state
        (states / j["job"]).write_text("COMPLETED" if out[j["job"]].returncode == 0 else "FAILED")
        ended.add(j["job"])
    return out


@pytest.fixture
def grid(tmp_path, corpus):
    """toy-grid/: _base.yaml (a tiny recipe, 3 steps), a.yaml, b.yaml (lr differs) and c.yaml, whose data source
    does not exist (its job fails at tokenization); the base's dataset is tokenized beforehand."""
    base = tiny_recipe(tmp_path, corpus, train={"max_steps": 3, "checkpoint_interval": 3, "eval_interval": 3},
                       eval={"diagnostics": False})
    folder = tmp_path / "toy-grid"
    folder.mkdir()
    (folder / "_base.yaml").write_text(yaml.safe_dump(base))
    for name, extra in (("a", {}), ("b", {"train": {"lr": 2e-3}}),
                        ("c", {"data": {"sources": [{"kind": "files", "paths": [str(tmp_path / "missing.txt")]}],
                                        "dataset_dir": str(tmp_path / "dataset-c")}})):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({"base": "_base.yaml", "name": f"grid-{name}",
                                                             **extra}))
    from pipeline.config import load_recipe
    tokenize(load_recipe(folder / "a.yaml").data)
    bindir = fake_slurm(tmp_path / "bin", FAKE_SRUN.format(python=sys.executable))
    for name, text in (("sbatch", FAKE_SBATCH.format(python=sys.executable)), ("squeue", FAKE_SQUEUE_JOBS)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    (tmp_path / "states").mkdir()
    return folder, bindir


def stand_in_env(monkeypatch, tmp_path, bindir):
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("GRT_TEST_QUEUE", str(tmp_path / "queue"))
    monkeypatch.setenv("GRT_TEST_STATES", str(tmp_path / "states"))


def status_lines(capsys, folder) -> dict[str, list[str]]:
    capsys.readouterr()
    assert main(["sweep", str(folder), "--status"]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():  # shown with -s
        print(out)
    return {ln.split()[0]: ln.split(None, 4) for ln in out.splitlines()[3:]}


def test_a_failing_preflight_refuses_the_whole_grid(grid, tmp_path, monkeypatch, capsys):
    """c's dataset is not tokenized: the preflight's dataset check names it, nothing is submitted."""
    folder, bindir = grid
    stand_in_env(monkeypatch, tmp_path, bindir)
    assert main(["sweep", str(folder), "--launcher", "slurm", "--nodes", "1", "--gpus-per-node", "1"]) == 2
    err = capsys.readouterr().err
    problems = [x for x in err.splitlines() if x.startswith("error: ")]
    assert problems[-1].endswith("nothing was submitted") and len(problems) >= 2
    assert all(x.startswith("error: c.yaml: ") for x in problems[:-1]), problems
    assert not (tmp_path / "queue").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grid_runs_through_slurm_stand_ins_to_the_compare_table(grid, tmp_path, monkeypatch, capsys):
    folder, bindir = grid
    stand_in_env(monkeypatch, tmp_path, bindir)
    # without SLURM's jobs: nothing started
    assert [r[2] for r in status_lines(capsys, folder).values()] == ["not", "not", "not"]
    assert main(["sweep", str(folder), "--launcher", "slurm", "--nodes", "1", "--gpus-per-node", "1",
                 "--skip-data", "--time", "10:00"]) == 0
    out = capsys.readouterr().out
    queue = [json.loads(x) for x in (tmp_path / "queue").read_text().splitlines()]
    runs = tmp_path / "runs"
    assert [Path(j["script"]) for j in queue] == [runs / f"grid-{n}" / "launch" / f"grid-{n}.sbatch" for n in "abc"] + [
        runs / "sweeps" / "toy-grid" / "compare.sbatch"]
    assert queue[-1]["after"] == ["1000", "1001", "1002"] and queue[-1]["kind"] == "afterany"
    assert all(f"job {j['job']}" in out for j in queue)
    script = Path(queue[0]["script"]).read_text()
    assert "-m pipeline.cli run " in script and "#SBATCH --time=10:00" in script
    before = status_lines(capsys, folder)
    assert [r[2:] for r in before.values()] == [["queued", j, f"job {j} pending"] for j in ("1000", "1001", "1002")]
    t0 = time.time()
    results = run_queue(tmp_path / "queue", tmp_path / "states", bindir, tmp_path)
    print(f"grid jobs: {time.time() - t0:.1f} s")
    assert [results[j["job"]].returncode for j in queue] == [0, 0, 1, 0]
    after = status_lines(capsys, folder)
    for n in "ab":  # the val loss `grt eval` saved, as status shows it
        loss = json.loads((runs / f"grid-{n}" / "eval" / "exits.json").read_text())["val_loss"]
        assert after[f"{n}.yaml"][2] == "finished"
        assert after[f"{n}.yaml"][4] == f"step 3/3, val loss {loss:.4f}"
    assert after["c.yaml"][2] == "failed"
    log = (runs / "grid-c" / "launch" / "slurm-1002.out").read_text()
    last = [x for x in log.splitlines() if x.startswith("error:")][-1]
    assert after["c.yaml"][4].endswith(last) and "missing.txt" in last
    final = (runs / "sweeps" / "toy-grid" / "slurm-1003.out").read_text()
    print(final)
    # the status first (the failed run named), then grt compare's table: the two evaluated runs, their val losses
    assert final.index("c.yaml  grid-c  failed") < final.index("run     model")
    rows = [x.split() for x in final.splitlines() if x.startswith("grid-")]
    saved = {n: json.loads((runs / n / "eval" / "exits.json").read_text())["val_loss"] for n in ("grid-a", "grid-b")}
    assert {r[0]: float(r[6]) for r in rows} == {n: round(v, 4) for n, v in saved.items()}


def test_status_running_with_its_step_and_stopped_short(grid, tmp_path, capsys, monkeypatch):
    """A run whose folder lock is held is running, at its last metrics.jsonl step; without SLURM a folder trained part
    way and held by no one is failed (stopped short)."""
    import fcntl

    from pipeline.runtime.locking import FolderLock
    from pipeline.studies import sweep_status

    folder, _ = grid
    run = tmp_path / "runs" / "grid-a"
    run.mkdir(parents=True)

    def no_flock(*args):  # the probe must not take the lock, even for a moment (a run starting then would stop)
        raise AssertionError("grt sweep --status took a run folder's lock")

    monkeypatch.setattr(sweep_status, "fcntl", type("NoFlock", (), {"flock": no_flock, "LOCK_EX": fcntl.LOCK_EX,
                                                                     "LOCK_NB": fcntl.LOCK_NB}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.5}\n{"event": "eval"}\n')
    with FolderLock(run, "run folder"):
        assert status_lines(capsys, folder)["a.yaml"][2:] == ["running", "-", "step 2/3"]
    assert status_lines(capsys, folder)["a.yaml"][2] == "failed"


def test_status_reads_mlflow_for_run_folders_on_another_nodes_disk(grid, tmp_path, capsys):
    """With tracking on, MLflow's run (by name and sweep tag) gives each line its status and last logged step, and
    a run whose folder this node cannot see takes its state from there. The MLflow runs are written by hand here
    with MLflow's own client: grid-a RUNNING with losses at steps 1 and 2, grid-b FAILED at step 1, grid-c none,
    and a grid-a of another sweep (tag) at step 3, which must not be taken."""
    from mlflow.tracking import MlflowClient

    folder, _ = grid
    uri = f"sqlite:///{tmp_path / 'status-mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("status")
    for name, sweep, status, steps in (("grid-a", "toy-grid", "RUNNING", [1, 2]),
                                       ("grid-b", "toy-grid", "FAILED", [1]),
                                       ("grid-a", "other-grid", "FINISHED", [1, 2, 3])):  # the newest
        run = client.create_run(exp, run_name=name, tags={"sweep": sweep})
        for s in steps:
            client.log_metric(run.info.run_id, "loss", 9.0 - s, step=s)
        if status != "RUNNING":
            client.set_terminated(run.info.run_id, status)
    capsys.readouterr()
    assert main(["sweep", str(folder), "--status", "tracking.enabled=true", f"tracking.uri={uri}",
                 "tracking.experiment=status"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split(None, 4) for ln in out.splitlines()[3:]}
    assert lines["a.yaml"][2:] == ["running", "-", "step 2/3 (MLflow RUNNING at step 2; its run folder is not "
                                                   "visible here)"]
    assert lines["b.yaml"][2:] == ["failed", "-", "step 1/3 (MLflow FAILED at step 1; its run folder is not "
                                                  "visible here)"]
    assert [ln.split() for ln in out.splitlines() if ln.startswith("c.yaml")] == [["c.yaml", "grid-c", "not",
                                                                                  "started", "-", "-"]]
