"""`grt launch`: the rendered commands and files, checked with the launchers' own parsers and against golden files;
the plan checks; and, on this CPU, two simulated nodes on loopback for each launcher (slow):

- torchrun: `grt launch --nodes 2 --gpus-per-node 1 --node-rank 0|1` as two processes: fsdp losses equal a one-node
  `torchrun --nproc_per_node 2` run;
- deepspeed: the per-node `--no_ssh` form, ZeRO-3, the same losses;
- slurm: the sbatch script itself, run by bash with stand-ins for srun/scontrol (srun starts the script's command
  once per node with SLURM_NODEID set): SIGTERM to the batch shell -> every rank saves -> requeue -> the requeued
  script resumes and the losses equal the uninterrupted run's.

Golden files (tests/golden/launch/) hold the dry-run output for a fixed plan; regenerate them with
`GRT_UPDATE_GOLDEN=1 pytest tests/test_launch.py` and review the diff.
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from conftest import free_port
from conftest import launched_recipe
from conftest import step_losses
from conftest import subprocess_env
from conftest import tiny_recipe
from launch import render
from launch.plan import PORT_BASE
from launch.plan import PORT_SPAN
from launch.plan import PlanError
from launch.plan import job_port
from launch.plan import make_plan
from pipeline.cli import main
from pipeline.config import load_recipe

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "launch"
PAPER = "recipes/paper/grt-large-isoparam.yaml"
STEPS = 12
SLURM_JOB_ID = 11500 + PORT_SPAN  # -> port 20000 + 11500 = 31500 by the script's own formula


def check_golden(name: str, text: str) -> None:
    """Byte-for-byte against tests/golden/launch/NAME; GRT_UPDATE_GOLDEN=1 rewrites it instead."""
    path = GOLDEN / name
    if os.environ.get("GRT_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"{path} is missing: create it with GRT_UPDATE_GOLDEN=1 pytest tests/test_launch.py"
    want = path.read_text()
    diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "rendered"))
    assert text == want, f"rendered text differs from {path} (GRT_UPDATE_GOLDEN=1 rewrites it after review):\n{diff}"


def paper_plan(launcher: str, backend_overrides: list[str], **kw):
    """The fixed plan of the golden files: the paper's largest GRT on 2 nodes x 8 GPUs, nothing from the machine."""
    cfg = load_recipe(REPO / PAPER, backend_overrides)
    kw.setdefault("environ", {})
    return make_plan(launcher=launcher, nodes=2, gpus_per_node=8, recipe=PAPER, overrides=backend_overrides,
                     name=cfg.name, backend=cfg.train.backend, run_dir=str(cfg.run_dir), workdir="/work/grt",
                     setup="source /work/grt/.venv/bin/activate", **kw)


FSDP = ["train.backend=fsdp"]
ZERO3 = ["train.backend=deepspeed", "train.zero_stage=3"]
ENV = {"NCCL_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "8", "PYTHONPATH": "/opt/extra", "HOME": "/home/me",
       "SLURM_JOB_ID_NOT": "x", "CUDA_HOME": "/usr/local/cuda"}


# ---------------------------------------------------------------------------------------------------- rendering


def test_golden_dry_run_output():
    check_golden("torchrun.txt", render.describe(paper_plan("torchrun", FSDP, master_addr="10.0.0.1"), {}))
    check_golden("deepspeed-hostfile.txt",
                 render.describe(paper_plan("deepspeed", ZERO3, hosts=["gpu-a", "gpu-b"], environ=ENV), ENV))
    check_golden("deepspeed-no-ssh.txt",
                 render.describe(paper_plan("deepspeed", ZERO3, master_addr="10.0.0.1", node_rank=1), {}))
    slurm = paper_plan("slurm", FSDP, time="24:00:00", partition="gpu")
    check_golden("slurm.txt", render.describe(slurm, {}))
    check_golden("grt-large-isoparam.sbatch", render.sbatch_script(slurm))


def test_port_comes_from_the_job_then_the_run_name():
    port, source = job_port({"SLURM_JOB_ID": "123456"}, "any")
    assert port == 20000 + 123456 - 9 * 12768 == 28544 and "SLURM_JOB_ID" in source  # by hand
    a, _ = job_port({}, "run-a")
    assert a == job_port({}, "run-a")[0]  # every node computes the same port
    ports = {job_port({}, f"run-{i}")[0] for i in range(50)}
    assert len(ports) >= 49 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN <= 32768 for p in ports)  # below ephemeral
    # the sbatch script's bash formula gives the Python value for the same job id
    line = next(x for x in render.sbatch_script(paper_plan("slurm", FSDP)).splitlines() if "MASTER_PORT=" in x)
    out = subprocess.run(["bash", "-c", f"{line}; echo $MASTER_PORT"], env={"SLURM_JOB_ID": "123456"},
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == 28544


def test_torchrun_commands_parse_as_static_rendezvous():
    """torchrun's own parser reads each node's command: static rendezvous (c10d would ignore --node_rank)."""
    from torch.distributed.run import get_args_parser

    plan = paper_plan("torchrun", FSDP, master_addr="10.0.0.1", master_port=29999)
    cmds = render.per_node_commands(plan)
    assert [c.node for c in cmds] == [0, 1]
    for k, c in enumerate(cmds):
        assert c.argv[0] == "torchrun"
        a = get_args_parser().parse_args(c.argv[1:])
        assert (a.nnodes, a.nproc_per_node, a.node_rank, a.master_addr, a.master_port) == ("2", "8", k, "10.0.0.1",
                                                                                          29999)
        assert a.rdzv_backend == "static" and not a.standalone and a.module
        assert [a.training_script, *a.training_script_args] == ["pipeline.cli", "train", PAPER, *FSDP]


def test_deepspeed_commands_hostfile_and_env_file_as_deepspeed_reads_them(tmp_path, monkeypatch):
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import _parse_hostfile
    from deepspeed.launcher.runner import parse_args

    plan = paper_plan("deepspeed", ZERO3, hosts=["gpu-a", "gpu-b"], environ=ENV)
    (cmd,) = render.commands(plan)
    assert cmd.node is None and cmd.env == {"DS_ENV_FILE": "runs/grt-large-isoparam/launch/.deepspeed_env"}
    a = parse_args(cmd.argv[1:])
    assert (a.hostfile, a.num_nodes, a.num_gpus, a.no_ssh, a.module, a.user_script) == (
        "runs/grt-large-isoparam/launch/hostfile", 2, 8, False, True, "pipeline.cli")
    assert a.user_args == ["train", PAPER, *ZERO3]
    files = render.files(plan, ENV)
    assert dict(_parse_hostfile(files["runs/grt-large-isoparam/launch/hostfile"].splitlines())) == {"gpu-a": 8,
                                                                                                     "gpu-b": 8}
    # the env file as DeepSpeed 0.19.8's runner.main() consumes it: split at the first '=', runner.add_export
    runner = PDSHRunner(parse_args(cmd.argv[1:]), "world")
    for line in files["runs/grt-large-isoparam/launch/.deepspeed_env"].splitlines(True):
        key, val = line.split("=", maxsplit=1)
        runner.add_export(key, val)
    assert runner.exports == {"CUDA_HOME": "/usr/local/cuda", "NCCL_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "8",
                              "PYTHONPATH": "/work/grt:/opt/extra"}  # not HOME, SLURM_JOB_ID_NOT
    # DS_ENV_FILE=<relative path> is found where DeepSpeed looks: joined to ~ and to the working directory
    import importlib

    import deepspeed.launcher.runner as ds_runner

    env_file = tmp_path / cmd.env["DS_ENV_FILE"]
    env_file.parent.mkdir(parents=True)
    env_file.write_text("X=1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ENV_FILE", cmd.env["DS_ENV_FILE"])
    try:
        ds = importlib.reload(ds_runner)  # the name is read when the module is imported
        found = [os.path.join(p, ds.DEEPSPEED_ENVIRONMENT_NAME) for p in ds.DEEPSPEED_ENVIRONMENT_PATHS]
        assert any(os.path.isfile(f) and os.path.samefile(f, env_file) for f in found), found
    finally:
        monkeypatch.delenv("DS_ENV_FILE")
        importlib.reload(ds_runner)
    # without ssh: one command per node, the hostfile only labels the nodes
    plan = paper_plan("deepspeed", ZERO3, master_addr="10.0.0.1", node_rank=1)
    (cmd,) = render.commands(plan)
    a = parse_args(cmd.argv[1:])
    assert (a.no_ssh, a.node_rank, a.master_addr, a.num_nodes, a.num_gpus) == (True, 1, "10.0.0.1", 2, 8)
    assert ".deepspeed_env" not in "".join(render.files(plan, ENV))  # read only by the pdsh form


def test_sbatch_script_one_torchrun_per_node_signal_and_requeue():
    text = render.sbatch_script(paper_plan("slurm", FSDP, time="24:00:00"))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid bash
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert opts["nodes"] == "2" and opts["ntasks-per-node"] == "1" and opts["gres"] == "gpu:8"
    assert opts["signal"] == "B:TERM@300" and "requeue" in opts and opts["time"] == "24:00:00"
    assert "gpus-per-task" not in text and "ntasks=" not in text
    srun = [x for x in text.splitlines() if x.startswith("srun ")]
    assert len(srun) == 1 and srun[0].count("torchrun --nnodes 2 --nproc_per_node 8") == 1
    assert '--node_rank "$SLURM_NODEID"' in srun[0] and "--ntasks-per-node=1" in srun[0]
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    assert "trap on_term TERM" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text


def sbatch_directives(script: str) -> list[str]:
    """The options sbatch reads from a script: its ``#SBATCH`` lines before the first command (sbatch stops reading
    directives at the first line that is neither blank nor a comment)."""
    out = []
    for line in script.splitlines()[1:]:  # after the #! line
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            out.append(line.split(None, 1)[1])
    return out


@pytest.mark.parametrize("cpus, want", [(None, "--exclusive"), (96, "--cpus-per-task=96")])
def test_sbatch_script_asks_for_the_nodes_cpus(cpus, want):
    """One task per node runs every rank of the node: the job asks for whole nodes or for the CPUs given, among the
    directives sbatch reads (before the first command), and never for both."""
    opts = sbatch_directives(render.sbatch_script(paper_plan("slurm", FSDP, cpus_per_node=cpus)))
    assert want in opts and "--ntasks-per-node=1" in opts, opts
    assert len([o for o in opts if o == "--exclusive" or o.startswith("--cpus-per-task")]) == 1, opts


def test_deepspeed_env_reaches_the_other_nodes_through_deepspeeds_own_runner(tmp_path):
    """DeepSpeed's runner (its main(), over the files grt launch writes) starts the other nodes with pdsh; a pdsh
    stand-in runs the exports DeepSpeed prepends to the remote command in a shell that starts with none of node 0's
    environment, as an ssh login on another node does, and records what they set. The EFA / libfabric variables
    (FI_*, OFI_NCCL_*, RDMAV_*), UCX, NCCL, CUDA, HF and the pipeline's own arrive; per-node ones do not."""
    carried = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "OFI_NCCL_PROTOCOL": "RDMA",
               "RDMAV_FORK_SAFE": "1", "UCX_TLS": "rc,sm", "NCCL_DEBUG": "INFO", "CUDA_LAUNCH_BLOCKING": "1",
               "HF_HOME": "/data/hf", "GRT_DEBUG": "1", "TORCHINDUCTOR_CACHE_DIR": "/scratch/inductor"}
    local = {"CUDA_VISIBLE_DEVICES": "3", "FIRST_NOT_CARRIED": "x"}
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "pdsh").write_text(FAKE_PDSH.format(python=sys.executable))
    (bindir / "ssh").write_text("#!/bin/sh\n# ssh stand-in: DeepSpeed's reachability check of the first host\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    (tmp_path / "home").mkdir()
    environ = subprocess_env(**carried, **local, PATH=f"{bindir}:{os.environ['PATH']}", HOME=str(tmp_path / "home"),
                             GRT_TEST_REMOTE_ENV=str(tmp_path / "remote.env"))
    plan = make_plan(launcher="deepspeed", nodes=2, gpus_per_node=1, recipe="r.yaml", overrides=[], name="x",
                     backend="deepspeed", run_dir="runs/x", workdir=str(tmp_path), environ=environ,
                     hosts=["node-a", "node-b"], master_addr="10.0.0.1")
    for path, text in render.files(plan, environ).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (cmd,) = render.commands(plan)
    p = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", *cmd.argv[1:]], cwd=tmp_path,
                       env={**environ, **cmd.env}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    remote = dict(kv.split("=", 1) for kv in (tmp_path / "remote.env").read_text().split("\0") if "=" in kv)
    assert {k: remote.get(k) for k in carried} == carried
    assert remote["PYTHONPATH"].split(":")[0] == str(tmp_path)  # the working directory first, as DeepSpeed sets it
    assert not set(local) & set(remote), remote


def test_deepspeed_env_leaves_out_what_deepspeed_excludes_per_cluster():
    """DeepSpeed drops NCCL_IB_HCA and UCX_NET_DEVICES from its exports when AISC_JOB_NAME is set (each node has
    its own cards): the file must not put node 0's back."""
    plan = paper_plan("deepspeed", ZERO3, hosts=["gpu-a", "gpu-b"])
    env = {"NCCL_IB_HCA": "mlx5_0", "UCX_NET_DEVICES": "mlx5_0:1", "UCX_TLS": "rc"}
    assert "NCCL_IB_HCA=mlx5_0\n" in render.deepspeed_env_text(plan, env)
    text = render.deepspeed_env_text(plan, {**env, "AISC_JOB_NAME": "j"})
    assert "NCCL_IB_HCA" not in text and "UCX_NET_DEVICES" not in text and "UCX_TLS=rc\n" in text


@pytest.mark.parametrize("kw, fragment", [
    (dict(launcher="torchrun", nodes=2, backend="single", master_addr="h"), "train.backend=single"),
    (dict(launcher="torchrun", nodes=2), "--master-addr is needed"),
    (dict(launcher="deepspeed", nodes=2), "--hostfile FILE"),
    (dict(launcher="deepspeed", nodes=2, hosts=["a"]), "name at least 2"),
    (dict(launcher="torchrun", nodes=2, master_addr="h", node_rank=2), "--node-rank 2: must be in 0..1"),
    (dict(launcher="slurm", nodes=2, node_rank=0), "SLURM gives every node its rank"),
    (dict(launcher="torchrun", hosts=["a", "b"]), "are for --launcher deepspeed"),
    (dict(launcher="slurm", cpus_per_node=1), "--cpus-per-node 1 is fewer than --gpus-per-node 2"),
    (dict(launcher="torchrun", cpus_per_node=8), "--cpus-per-node is for --launcher slurm"),
])
def test_bad_plans_are_refused_naming_the_fix(kw, fragment):
    args = dict(launcher="torchrun", nodes=1, gpus_per_node=2, recipe="r.yaml", overrides=[], name="x",
                backend="fsdp", run_dir="runs/x", workdir="/w", environ={})
    with pytest.raises(PlanError) as e:
        make_plan(**{**args, **kw})
    assert fragment in str(e.value)


def test_hostfile_too_short_is_refused(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("# two nodes asked, one listed\nonly-one slots=4\n")
    with pytest.raises(PlanError) as e:
        make_plan(launcher="deepspeed", nodes=2, gpus_per_node=8, recipe="r.yaml", overrides=[], name="x",
                  backend="deepspeed", run_dir="runs/x", workdir="/w", environ={}, hostfile=str(hf))
    assert "lists 1 host(s) for --nodes 2" in str(e.value) and "only-one" in str(e.value)


def test_a_host_named_twice_is_refused_in_hosts_and_in_a_hostfile_alike(tmp_path):
    """DeepSpeed's own hostfile reader refuses the repeated host, so both ways of naming the hosts are refused before
    anything is written, with one problem line of the same form."""
    from deepspeed.launcher.runner import _parse_hostfile

    hf = tmp_path / "hostfile"
    hf.write_text("gpu-a slots=8\ngpu-b slots=8\ngpu-a slots=8\n")
    with pytest.raises(ValueError, match="multiple entries for gpu-a"):
        _parse_hostfile(hf.read_text().splitlines())  # the reference: what DeepSpeed's launcher does with it
    args = dict(launcher="deepspeed", nodes=2, gpus_per_node=8, recipe="r.yaml", overrides=[], name="x",
                backend="deepspeed", run_dir="runs/x", workdir="/w", environ={})
    problems = {}
    for source, kw in ((f"--hostfile {hf}", dict(hostfile=str(hf))), ("--hosts gpu-a,gpu-b,gpu-a",
                                                                      dict(hosts=["gpu-a", "gpu-b", "gpu-a"]))):
        with pytest.raises(PlanError) as e:
            make_plan(**args, **kw)
        (line,) = [q for q in e.value.problems if "twice" in q]
        assert line.startswith(f"{source}: gpu-a named twice"), line
        problems[source] = line[len(source):]
    assert len(set(problems.values())) == 1, problems  # the same check, the same words


# SLURM's --time (sbatch(1): "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours", ...; seconds rounded
# up to the minute; 0 / UNLIMITED: no limit), against the grace before it: (time, grace, refused)
@pytest.mark.parametrize("time_limit, grace, refused", [
    ("5", 300, True),  # a bare number is minutes: 300 s, equal to the grace -> TERM as the job starts
    ("5", 240, False),
    ("4:01", 300, True),  # minutes:seconds, 241 s rounded up to 300 s
    ("5:01", 300, False),  # 301 s -> 360 s
    ("4:30", 285, False),  # 270 s -> 300 s: SLURM's limit, not the written one
    ("0:05:00", 300, True),  # hours:minutes:seconds
    ("0:05:01", 300, False),
    ("0-0:5", 300, True),  # days-hours:minutes
    ("1-0", 86400, True),  # days-hours
    ("1-0", 86399, False),
    ("24:00:00", 3600, False),
    ("24:00:00", 86400, True),
    ("0", 10 ** 6, False),  # no limit
    ("UNLIMITED", 10 ** 6, False),
])
def test_grace_not_shorter_than_the_time_limit_is_refused(time_limit, grace, refused):
    args = dict(launcher="slurm", nodes=2, gpus_per_node=8, recipe="r.yaml", overrides=[], name="x",
                backend="fsdp", run_dir="runs/x", workdir="/w", environ={}, grace_s=grace, time=time_limit)
    if not refused:
        assert make_plan(**args).time == time_limit
        return
    with pytest.raises(PlanError) as e:
        make_plan(**args)
    (line,) = e.value.problems
    assert line.startswith(f"--grace {grace} s is not shorter than --time {time_limit} (") and "\n" not in line


def test_time_limit_sbatch_cannot_read_is_refused_and_other_launchers_ignore_it():
    args = dict(nodes=1, gpus_per_node=2, recipe="r.yaml", overrides=[], name="x", backend="fsdp", run_dir="runs/x",
                workdir="/w", environ={})
    for bad in ("60:", "1h", "-60:10", "1:2:3:4"):  # refused by Slurm's time_str2secs (its unit test) or no format
        with pytest.raises(PlanError, match=f"--time {bad}: not a SLURM time limit"):
            make_plan(launcher="slurm", time=bad, **args)
    assert make_plan(launcher="torchrun", time="1", **args).launcher == "torchrun"  # --time is for slurm only


# ------------------------------------------------------------------------------------------- the CLI (in-process)


@pytest.fixture
def small_recipe(tmp_path, corpus):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path, corpus, train={"backend": "fsdp"})))
    return path


@pytest.fixture
def fake_preflight(monkeypatch):
    """Stand-in for launch/preflight.py (written elsewhere): records its call, reports what the test says."""
    calls = []

    def install(problems):
        def run_preflight(cfg, *, nodes, gpus_per_node, gpu_mem_gb, check_data):
            calls.append(dict(name=cfg.name, nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem_gb=gpu_mem_gb,
                              check_data=check_data))
            return types.SimpleNamespace(problems=problems, ok=not problems,
                                         render=lambda: "PREFLIGHT REPORT\n" + "\n".join(problems))
        monkeypatch.setitem(sys.modules, "launch.preflight", types.SimpleNamespace(run_preflight=run_preflight))
    install.calls = calls
    return install


def test_check_prints_the_preflight_and_exits_2_on_problems(small_recipe, fake_preflight, capsys):
    fake_preflight(["batch: grad_accum_steps=2 is not a multiple of world size 4 — set train.grad_accum_steps=4"])
    args = ["launch", str(small_recipe), "--nodes", "2", "--gpus-per-node", "2", "--master-addr", "h"]
    assert main(args + ["--check", "--gpu-mem", "80"]) == 2
    assert "grad_accum_steps=2" in capsys.readouterr().err
    assert fake_preflight.calls == [dict(name="tiny", nodes=2, gpus_per_node=2, gpu_mem_gb=80.0, check_data=True)]
    # a plain launch refuses before anything starts or is written
    assert main(args + ["--node-rank", "0"]) == 2
    assert "nothing was started" in capsys.readouterr().err
    assert not (small_recipe.parent / "runs").exists()


def test_check_exits_0_when_the_preflight_passes(small_recipe, fake_preflight, capsys):
    fake_preflight([])
    assert main(["launch", str(small_recipe), "--gpus-per-node", "2", "--check"]) == 0
    assert "PREFLIGHT REPORT" in capsys.readouterr().out


def test_torchrun_without_node_rank_prints_every_node_and_starts_nothing(small_recipe, capsys):
    assert main(["launch", str(small_recipe), "--nodes", "2", "--master-addr", "10.1.1.1", "--no-check"]) == 2
    out = capsys.readouterr()
    assert "--node_rank 0" in out.out and "--node_rank 1" in out.out
    assert "torchrun cannot start processes on other nodes" in out.err


def test_data_recipe_is_forwarded_to_every_rank(small_recipe, tmp_path, capsys):
    """--data reaches each node's training command, and `grt train`'s own parser reads it back."""
    from pipeline.cli import build_parser

    data = tmp_path / "web.yaml"
    data.write_text(yaml.safe_dump({"data": {"sources": [{"kind": "stdlib"}], "dataset_dir": str(tmp_path / "d")}}))
    assert main(["launch", str(small_recipe), "--data", str(data), "--nodes", "2", "--master-addr", "h",
                 "--dry-run", "train.max_steps=3"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("torchrun ")]
    assert len(lines) == 2
    for line in lines:
        argv = shlex.split(line)
        a = build_parser().parse_args(argv[argv.index("-m") + 2:])  # after `-m pipeline.cli`
        assert (a.command, a.recipe, a.data, a.overrides) == ("train", str(small_recipe), str(data),
                                                              ["train.max_steps=3"])


def test_launch_files_from_the_cli_cpus_and_a_private_env_file(small_recipe, monkeypatch, capsys):
    """`grt launch --cpus-per-node` reaches the sbatch script; .deepspeed_env (node 0's HF_* / MLFLOW_* tokens
    included) is written readable by its owner only, and carries the EFA variables."""
    runs = small_recipe.parent / "runs" / "tiny" / "launch"
    assert main(["launch", str(small_recipe), "--nodes", "2", "--gpus-per-node", "4", "--launcher", "slurm",
                 "--cpus-per-node", "48", "--dry-run"]) == 0
    assert "--cpus-per-task=48" in sbatch_directives((runs / "tiny.sbatch").read_text())
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert main(["launch", str(small_recipe), "train.backend=deepspeed", "--nodes", "2", "--launcher", "deepspeed",
                 "--hosts", "a,b", "--dry-run"]) == 0
    env_file = runs / ".deepspeed_env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert {"FI_PROVIDER=efa", "HF_TOKEN=hf_secret"} <= set(env_file.read_text().splitlines())
    capsys.readouterr()


def test_slurm_without_sbatch_names_the_script_to_submit(small_recipe, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["launch", str(small_recipe), "--nodes", "2", "--launcher", "slurm", "--no-check"]) == 1
    script = small_recipe.parent / "runs" / "tiny" / "launch" / "tiny.sbatch"
    assert script.is_file() and f"sbatch {script}" in capsys.readouterr().err


# ------------------------------------------------------------------------- simulated nodes on loopback (slow)






def grt_launch(recipe: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "launch", str(recipe), *args]


def run_nodes(cmds: list[list[str]], environ: dict, timeout: int = 600) -> list[str]:
    """Start every node's command at once (as on a cluster), wait for all, return their outputs."""
    procs = [subprocess.Popen(c, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


FAKE_SRUN = """#!{python}
# srun stand-in: start the command once per node with SLURM_NODEID set (task pids recorded for scancel); a TERM to srun
# itself kills its tasks outright, as a real srun terminating its step would: the script must not rely on srun
import os, signal, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(k), SLURM_PROCID=str(k)))
         for k in range(int(os.environ["SLURM_JOB_NUM_NODES"]))]
with open(os.environ["GRT_TEST_SLURM_TASKS"], "a") as f:
    f.write("".join(f"{{p.pid}}\\n" for p in procs))
signal.signal(signal.SIGTERM, lambda *_: [p.kill() for p in procs])
sys.exit(max(abs(p.wait()) for p in procs))
"""
FAKE_PDSH = """#!{python}
# pdsh stand-in: DeepSpeed's remote command starts with its exports ("export K=V; ..."), then "cd DIR;" and the
# launcher. Run the exports in a shell with an empty environment (a login on another node inherits nothing from
# node 0) and record the environment they give, NUL-separated, in $GRT_TEST_REMOTE_ENV.
import os, subprocess, sys
args = sys.argv[1:]
exports = args[args.index("-w") + 2]
assert exports.startswith("export ") and args[args.index("-w") + 3].startswith("cd "), args
env = subprocess.run(["env", "-i", "bash", "-c", exports + " exec env -0"], capture_output=True, check=True).stdout
with open(os.environ["GRT_TEST_REMOTE_ENV"], "wb") as f:
    f.write(env)
"""
FAKE_SCANCEL = """#!/bin/bash
# scancel stand-in: `scancel --signal=TERM JOB` sends TERM to the tasks of the job's steps (not to srun, not to the
# batch shell)
[ "$1" = --signal=TERM ] || exit 1
while read -r pid; do kill -TERM "$pid" 2>/dev/null; done < "$GRT_TEST_SLURM_TASKS"
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol stand-in: `show hostnames` -> this host once per node; `requeue` is recorded
if [ "$1" = show ]; then for ((k=0; k<SLURM_JOB_NUM_NODES; k++)); do echo 127.0.0.1; done; fi
if [ "$1" = requeue ]; then echo "$*" >> "$GRT_TEST_REQUEUED"; fi
"""
FAKE_SQUEUE = """#!/bin/bash
# squeue stand-in: the job's state (-o %T)
echo "${GRT_TEST_STATE:-RUNNING}"
"""


def fake_slurm(bindir: Path, srun: str) -> Path:
    bindir.mkdir()
    for name, text in (("srun", srun), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL),
                       ("squeue", FAKE_SQUEUE)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


@pytest.mark.parametrize("state, requeued", [("RUNNING", True), ("CANCELLED", False)])
def test_sbatch_trap_forwards_term_and_requeues_only_a_running_job(tmp_path, state, requeued):
    """The script's own trap, with an srun that only waits for its TERM: the time-limit signal (job RUNNING)
    requeues, a `scancel` (job CANCELLED) does not."""
    log = tmp_path / "srun.log"
    # srun here is its own single task: it records its pid for scancel and logs the TERM that reaches it
    bindir = fake_slurm(tmp_path / "bin", "#!/bin/bash\ntrap 'echo TERM >> \"$GRT_TEST_SRUN_LOG\"; exit 0' TERM\n"
                                          "echo $$ >> \"$GRT_TEST_SLURM_TASKS\"\n"
                                          "echo started >> \"$GRT_TEST_SRUN_LOG\"\nwhile true; do sleep 0.05; done\n")
    plan = make_plan(launcher="slurm", nodes=2, gpus_per_node=1, recipe="r.yaml", overrides=[], name="x",
                     backend="fsdp", run_dir="runs/x", workdir=str(tmp_path), environ={}, setup="")
    script = tmp_path / "x.sbatch"
    script.write_text(render.sbatch_script(plan))
    environ = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="2",
                   SLURM_JOB_NODELIST="n[1-2]", GRT_TEST_REQUEUED=str(tmp_path / "requeued"),
                   GRT_TEST_SRUN_LOG=str(log), GRT_TEST_STATE=state, GRT_TEST_SLURM_TASKS=str(tmp_path / "tasks"))
    job = subprocess.Popen(["bash", str(script)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.time() + 30
    while not (log.is_file() and "started" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 0, out
    assert log.read_text().split() == ["started", "TERM"]  # the task got the TERM
    assert (tmp_path / "requeued").is_file() == requeued, out
    if requeued:
        assert (tmp_path / "requeued").read_text().split() == ["requeue", "77"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    path = launched_recipe(tmp, max_steps=STEPS, checkpoint_interval=1000, eval_interval=1000, grad_accum_steps=4,
                           collective_timeout_s=60)
    runs, timings = tmp / "runs", {}

    t0 = time.time()  # the reference: one node, two processes
    run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()),
                "-m", "pipeline.cli", "train", str(path), "name=ref", "train.backend=fsdp"]], subprocess_env())
    timings["reference"] = time.time() - t0

    t0 = time.time()
    port_torchrun, port_deepspeed = free_port(), free_port()  # one rendezvous port shared by both simulated nodes
    two = ["--nodes", "2", "--gpus-per-node", "1", "--master-addr", "127.0.0.1"]  # each node runs the preflight
    tr_outs = run_nodes([grt_launch(path, "name=torchrun", "train.backend=fsdp", *two, "--launcher", "torchrun",
                          "--master-port", str(port_torchrun), "--node-rank", str(k)) for k in (0, 1)],
                         subprocess_env())
    timings["torchrun"] = time.time() - t0

    t0 = time.time()
    ds_outs = run_nodes([grt_launch(path, "name=deepspeed", "train.backend=deepspeed", "train.zero_stage=3", *two,
                                    "--launcher", "deepspeed", "--master-port", str(port_deepspeed), "--node-rank",
                                    str(k)) for k in (0, 1)], subprocess_env())
    timings["deepspeed"] = time.time() - t0

    # SLURM: the script written by grt launch, run by bash with srun/scontrol stand-ins
    bindir = fake_slurm(tmp / "fakebin", FAKE_SRUN.format(python=sys.executable))
    subprocess.run(grt_launch(path, "name=slurm", "train.backend=fsdp", "--nodes", "2", "--gpus-per-node", "1",
                              "--launcher", "slurm", "--grace", "90", "--dry-run"), cwd=REPO, env=subprocess_env(),
                   check=True, capture_output=True)
    script = runs / "slurm" / "launch" / "slurm.sbatch"
    requeued = tmp / "requeued"
    senv = subprocess_env(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID=str(SLURM_JOB_ID),
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="fake[1-2]", GRT_TEST_REQUEUED=str(requeued),
               GRT_TEST_SLURM_TASKS=str(tmp / "slurm-tasks"))
    t0 = time.time()
    job = subprocess.Popen(["bash", str(script)], cwd=REPO, env=senv, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    metrics = runs / "slurm" / "metrics.jsonl"
    while job.poll() is None and not (metrics.is_file() and len(step_losses(runs / "slurm")) >= 2):
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)  # what SLURM does --grace seconds before the time limit (B: the batch shell)
    first, _ = job.communicate(timeout=300)
    assert metrics.is_file(), first[-4000:]
    interrupted_at = max(step_losses(runs / "slurm"))
    second = subprocess.run(["bash", str(script)], cwd=REPO, env=dict(senv, SLURM_RESTART_COUNT="1"),
                            capture_output=True, text=True, timeout=600)  # the requeued job
    timings["slurm"] = time.time() - t0
    print("simulated-node timings (s):", {k: round(v, 1) for k, v in timings.items()})
    return dict(runs=runs, ds_out=ds_outs[0], deepspeed_out=ds_outs[1], torchrun_out=tr_outs[1], first=first,
                first_rc=job.returncode, interrupted_at=interrupted_at,
                second=second, requeued=requeued, script=script)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torchrun", "deepspeed"])
def test_two_simulated_nodes_give_the_one_node_losses(nodes, name):
    """fsdp over torchrun and ZeRO-3 over the deepspeed launcher, 2 nodes x 1 rank == 1 node x 2 ranks."""
    ref, got = step_losses(nodes["runs"] / "ref"), step_losses(nodes["runs"] / name)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    print(f"{name}: max relative difference to the one-node run "
          f"{max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref):.2e}")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])
    if name == "deepspeed":  # the launcher ran the --no_ssh per-node form with a world of 2 nodes
        assert "--no_ssh" in nodes["ds_out"] and "dist_world_size=2" in nodes["ds_out"]
    assert "grt launch: preflight passed" in nodes[f"{name}_out"]  # each node ran the preflight first


@pytest.mark.slow
def test_slurm_script_saves_on_sigterm_requeues_and_resumes(nodes):
    first, second = nodes["first"], nodes["second"]
    assert nodes["first_rc"] == 0, first[-4000:]
    assert "SIGTERM: saved step" in first, first[-4000:]
    assert nodes["requeued"].read_text().split() == ["requeue", str(SLURM_JOB_ID)]
    assert f"rendezvous 127.0.0.1:{PORT_BASE + SLURM_JOB_ID % PORT_SPAN}" in first  # 31500, by the bash formula
    assert nodes["interrupted_at"] < STEPS, "the run ended before SIGTERM arrived: nothing was interrupted"
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    # the resume rule of torchrun's restarts too (pipeline/train/relaunch.py; tests/test_elastic_restart.py)
    assert f"requeue 1: resumed from step_{nodes['interrupted_at']:08d}" in second.stdout, second.stdout[-4000:]
    ckpts = sorted(p.name for p in (nodes["runs"] / "slurm" / "checkpoints").iterdir())
    assert f"step_{nodes['interrupted_at']:08d}" in ckpts  # the SIGTERM checkpoint (the interval is 1000)
    ref, got = step_losses(nodes["runs"] / "ref"), step_losses(nodes["runs"] / "slurm")
    assert sorted(got) == list(range(1, STEPS + 1))
    print(f"slurm (interrupted after step {nodes['interrupted_at']}, resumed): max relative difference to the "
          f"one-node run {max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref):.2e}")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])


def test_check_with_the_real_preflight_names_every_problem_of_a_bad_plan(tmp_path, corpus, capsys):
    """No fake: an indivisible batch, a dataset that was never tokenized and a tracking server nobody runs, all
    named at once by `grt launch --check`; --skip-data drops the dataset problem only."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recipe = tiny_recipe(tmp_path, corpus, train={"backend": "fsdp", "grad_accum_steps": 3},
                         tracking={"enabled": True, "uri": f"http://127.0.0.1:{port}"})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    args = ["launch", str(path), "--gpus-per-node", "2", "--gpu-mem", "8", "--check"]
    def problems() -> list[str]:
        err = capsys.readouterr().err
        return [line for line in err.split(" problems\n", 1)[1].splitlines() if line.startswith("  - ")]

    assert main(args) == 2
    found = problems()
    assert len(found) == 3, found
    assert "grad_accum_steps=3" in found[0] and str(tmp_path / "dataset") in found[1], found
    assert f"127.0.0.1:{port}: no MLflow server answers" in found[2], found
    assert main(args + ["--skip-data"]) == 2
    found = problems()
    assert len(found) == 2 and str(tmp_path / "dataset") not in "".join(found), found
