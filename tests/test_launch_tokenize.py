"""`grt launch tokenize RECIPE --nodes N --launcher slurm`: the job array and its dependent merge, submitted through an
sbatch stand-in that records its arguments; the scripts it submitted, run by bash as SLURM would run them (each array
task with its SLURM_ARRAY_TASK_ID, then the merge), give the dataset of a one-node `grt tokenize`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.tokenize_array import TokenizePlan
from launch.tokenize_array import scripts
from pipeline.cli import main
from test_launch import check_golden
from test_launch import sbatch_directives
from test_tokenize_tasks import _corpus
from test_tokenize_tasks import tree

FAKE_SBATCH = """#!/bin/bash
# records each call's arguments, one line each; answers --parsable with a job id (100, 101, ...)
n=$(wc -l < "$GRT_TEST_SBATCH_LOG" 2>/dev/null || echo 0)
echo "$*" >> "$GRT_TEST_SBATCH_LOG"
echo "$((100 + n));cluster1"
"""


def test_golden_tokenize_array_and_merge_scripts():
    plan = TokenizePlan(name="web", tasks=4, recipe="recipes/web.yaml", overrides=["data.shard_tokens=4096"],
                        data=None, dataset_dir="data/web", launch_dir="runs/web/launch", workdir="/work",
                        setup="source /venv/bin/activate", cpus_per_node=32, time="04:00:00")
    text = scripts(plan)
    check_golden("tokenize_array.sbatch", text["tokenize_array.sbatch"])
    check_golden("tokenize_merge.sbatch", text["tokenize_merge.sbatch"])
    assert "--array=0-3" in sbatch_directives(text["tokenize_array.sbatch"])


@pytest.mark.multiprocess
def test_array_and_dependent_merge_submitted_and_run_equal_one_node(tmp_path, monkeypatch, capsys):
    data = _corpus(tmp_path / "corpus")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "tok", "out_dir": str(tmp_path / "runs"),
                                      "data": {**data, "dataset_dir": str(tmp_path / "multi")}}))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(FAKE_SBATCH)
    (bindir / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("GRT_TEST_SBATCH_LOG", str(log))
    monkeypatch.chdir(tmp_path)
    venv_bin = Path(sys.executable).parent  # where `grt` is installed
    assert main(["launch", "tokenize", str(recipe), "--nodes", "3", "--launcher", "slurm",
                 "--setup", f"export PATH={venv_bin}:$PATH"]) == 0
    out = capsys.readouterr().out
    assert "tokenize array job 100 (3 tasks) and merge job 101" in out, out
    launch = tmp_path / "runs" / "tok" / "launch"
    calls = log.read_text().splitlines()
    assert calls == [f"--parsable {launch}/tokenize_array.sbatch",
                     f"--parsable --dependency=afterok:100 {launch}/tokenize_merge.sbatch"]
    array = (launch / "tokenize_array.sbatch").read_text()
    assert "--array=0-2" in sbatch_directives(array) and "--exclusive" in sbatch_directives(array)

    env = {**os.environ, "SLURM_ARRAY_JOB_ID": "100"}
    for i in range(3):  # what SLURM runs: every array task, then (afterok) the merge
        subprocess.run(["bash", str(launch / "tokenize_array.sbatch")], env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                       check=True, capture_output=True, cwd=tmp_path)
    subprocess.run(["bash", str(launch / "tokenize_merge.sbatch")], env=env, check=True, capture_output=True,
                   cwd=tmp_path)
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"name": "tok", "data": {**data, "dataset_dir": str(tmp_path / "one")}}))
    assert main(["tokenize", str(one)]) == 0
    ref, got = tree(tmp_path / "one"), tree(tmp_path / "multi")
    assert sorted(got) == sorted(ref) and [n for n in ref if got[n] != ref[n]] == []


def test_launch_tokenize_refuses_other_launchers(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "tok", "data": {"dataset_dir": str(tmp_path / "d")}}))
    assert main(["launch", "tokenize", str(recipe), "--nodes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--launcher slurm" in err and "--tasks N --task-id I" in err, err
