"""`grt launch --max-restarts N`: two simulated nodes on loopback (two `grt launch --node-rank K` processes, gloo,
fsdp), one worker SIGKILLed after the step-2 checkpoint; torchrun's agents restart the group by themselves (c10d
rendezvous), it resumes from the checkpoint in the same MLflow run, finishes, and its per-step losses equal an
uninterrupted one-node run's. The pure parts (the relaunch rule read from the launcher's variables, the rendered
command, the deepspeed refusal) run in-process."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from conftest import launched_recipe
from conftest import step_losses
from conftest import subprocess_env
from launch.plan import PlanError
from launch.plan import make_plan
from launch.render import torchrun_command
from pipeline.train.relaunch import Relaunch
from pipeline.train.relaunch import relaunch_from_env
from test_launch import grt_launch
from test_launch import run_nodes

STEPS, KILL_AT, CKPT = 4, 3, 2


def test_relaunch_is_read_from_the_launchers_own_counts():
    assert relaunch_from_env({}) is None and relaunch_from_env({"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    r = relaunch_from_env({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert r == Relaunch("restart", 1, 3, "TORCHELASTIC_RESTART_COUNT=1")
    assert r.line(Path("runs/x/checkpoints/step_00000002"), 2) == \
        "restart 1 of 3: resumed from step_00000002 at step 2 (TORCHELASTIC_RESTART_COUNT=1)"
    q = relaunch_from_env({"SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert q == Relaunch("requeue", 2, None, "SLURM_RESTART_COUNT=2")
    assert q.line(None, 0) == "requeue 2: no checkpoint yet: started over from step 0 at step 0 (SLURM_RESTART_COUNT=2)"


def test_a_relaunch_resumes_its_own_checkpoints_whatever_train_resume_says(tiny, monkeypatch, capsys):
    """The one rule shared by the SLURM requeue and the torchrun restart: a relaunch resumes the run folder's newest
    intact checkpoint; train.resume=never refuses only a job's first start on a folder holding checkpoints."""
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    first = tiny(train={"max_steps": 2, "checkpoint_interval": 2, "eval_interval": 1000})
    tokenize(first.data, quiet=True)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    Trainer(first).fit()
    cfg = tiny(train={"max_steps": 3, "checkpoint_interval": 2, "eval_interval": 1000, "resume": "never"})
    with pytest.raises(FileExistsError, match="train.resume=never"):
        Trainer(cfg)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue's counters, but in another job
    monkeypatch.setenv("SLURM_JOB_ID", "5151")
    with pytest.raises(FileExistsError, match="relaunch .* of slurm job 5151, but .*step_00000002 was written by "
                                              "slurm job 4242"):
        Trainer(cfg)
    capsys.readouterr()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # the requeued job itself
    trainer = Trainer(cfg)
    assert trainer.step == 2
    want = "requeue 1: resumed from step_00000002 at step 2 (SLURM_RESTART_COUNT=1)"
    assert want in capsys.readouterr().out.splitlines()
    assert [json.loads(x)["line"] for x in (cfg.run_dir / "restarts.jsonl").read_text().splitlines()] == [want]
    trainer.fit()


def plan(**kw):
    args = dict(launcher="torchrun", nodes=2, gpus_per_node=4, recipe="r.yaml", overrides=[], name="run",
                backend="fsdp", run_dir="runs/run", workdir="/w", environ={}, master_addr="10.0.0.1",
                master_port=29400)
    return make_plan(**{**args, **kw})


def test_max_restarts_renders_the_c10d_rendezvous_and_deepspeed_refuses_it():
    import torch.distributed.run as tr

    static = tr.get_args_parser().parse_args(torchrun_command(plan(), 1).argv[1:])
    assert (static.rdzv_backend, static.max_restarts, static.node_rank) == ("static", 0, 1)
    cmd = torchrun_command(plan(max_restarts=3), 1)
    argv = cmd.argv
    assert cmd.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh store per round (see torchrun_command)
    a = tr.get_args_parser().parse_args(argv[1:])  # torchrun's own parser
    assert (a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id, a.max_restarts) == ("c10d", "10.0.0.1:29400", "run", 3)
    assert "--node_rank" not in argv  # c10d hands the node ranks out itself (and would ignore it)
    with pytest.raises(PlanError) as e:
        plan(launcher="deepspeed", backend="deepspeed", node_rank=0, max_restarts=1)
    assert "\n" not in str(e.value) and "--launcher torchrun" in str(e.value)


def test_node_0_alone_hosts_the_c10d_store(monkeypatch):
    """torchrun's own path from the argv to the store's ``is_host`` (run.config_from_args, then the
    RendezvousParameters that launcher/api.py builds and c10d_rendezvous_backend reads): node 0 hosts, the other
    nodes connect, whatever their hostnames and addresses say."""
    import torch.distributed.run as tr
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it in this process otherwise

    def is_host(node: int):
        config, _, _ = tr.config_from_args(tr.get_args_parser().parse_args(
            torchrun_command(plan(nodes=3, max_restarts=2), node).argv[1:]))
        return RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
                                    config.max_nodes, **config.rdzv_configs).get_as_bool("is_host")

    assert [is_host(k) for k in range(3)] == [True, False, False]
    assert "--rdzv_conf" not in torchrun_command(plan(), 0).argv  # the static rendezvous: --node_rank says it


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_which_resumes_and_finishes_with_the_uninterrupted_losses(tmp_path):
    path = launched_recipe(tmp_path, max_steps=STEPS, checkpoint_interval=CKPT, eval_interval=1000,
                           grad_accum_steps=2, collective_timeout_s=30)
    runs = tmp_path / "runs"
    run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), "-m", "pipeline.cli", "train", str(path), "name=ref", "train.backend=fsdp"]],
              subprocess_env())
    t0 = time.time()
    port = free_port()
    env = subprocess_env(GRT_FAULT_KILL_AT_STEP=str(KILL_AT), GRT_FAULT_KILL_RANK="1")  # `kill -9`, first start only
    outs = run_nodes([grt_launch(path, "name=elastic", "train.backend=fsdp", "tracking.enabled=true", "--nodes", "2",
                                 "--gpus-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                 "--node-rank", str(k), "--max-restarts", "2", "--no-check") for k in (0, 1)], env)
    seconds = time.time() - t0
    lines = [ln for out in outs for ln in out.splitlines() if ln.startswith("restart ")]
    print(f"elastic run (2 simulated nodes, killed after step {KILL_AT}, restarted): {seconds:.1f} s")
    print("\n".join(lines))
    run = runs / "elastic"
    want = f"restart 1 of 2: resumed from step_{CKPT:08d} at step {CKPT} (TORCHELASTIC_RESTART_COUNT=1)"
    assert lines == [want], "\n".join(o[-3000:] for o in outs)
    logged = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert [(e["count"], e["resumed_from"], e["line"]) for e in logged] == [(1, f"step_{CKPT:08d}", want)]
    ref, got = step_losses(runs / "ref"), step_losses(run)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:  # exact, as the resume tests of tests/test_distributed.py (fp32 on CPU, the same world of 2)
        assert got[step] == ref[step], (step, got[step], ref[step])
    import yaml
    from mlflow.tracking import MlflowClient

    uri = yaml.safe_load(path.read_text())["tracking"]["uri"]
    client = MlflowClient(uri)
    runs_found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs_found) == 1, [r.info.run_id for r in runs_found]  # the restart continued the same MLflow run
    assert runs_found[0].info.run_id == json.loads((run / "run.json").read_text())["mlflow_run_id"]
    assert runs_found[0].data.tags["grt.restarts"] == "1" and runs_found[0].data.tags["grt.last_restart"] == want
    assert max(m.step for m in client.get_metric_history(runs_found[0].info.run_id, "loss")) == STEPS


@pytest.mark.multiprocess
def test_a_restart_before_the_first_checkpoint_starts_over_in_the_same_mlflow_run(tmp_path):
    """A worker killed before any checkpoint: the restarted group (torchrun's counters in its environment) starts
    over from step 0, says so, keeps the earlier history aside, continues the MLflow run that run.json names, and
    trains the losses of an uninterrupted run."""
    import subprocess

    import yaml
    from mlflow.tracking import MlflowClient

    path = launched_recipe(tmp_path, max_steps=3, checkpoint_interval=1000, eval_interval=1000)
    train = [sys.executable, "-m", "pipeline.cli", "train", str(path), "tracking.enabled=true"]
    killed = subprocess.run([*train, "name=elastic"], env=subprocess_env(GRT_FAULT_KILL_AT_STEP="2"),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run = tmp_path / "runs" / "elastic"
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*"))
    restarted = subprocess.run([*train, "name=elastic"], capture_output=True, text=True, timeout=300,
                               env=subprocess_env(GRT_FAULT_KILL_AT_STEP="2", TORCHELASTIC_RESTART_COUNT="1",
                                                  TORCHELASTIC_MAX_RESTARTS="2"))  # (the hook skips a restart)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    line = "restart 1 of 2: no checkpoint yet: started over from step 0 at step 0 (TORCHELASTIC_RESTART_COUNT=1)"
    assert line in restarted.stdout.splitlines()
    assert [json.loads(x)["line"] for x in (run / "restarts.jsonl").read_text().splitlines()] == [line]
    assert len(list(run.glob("metrics.before-*.jsonl"))) == 1  # the killed attempt's steps 1-2, kept aside
    clean = subprocess.run([*train, "name=clean", "tracking.enabled=false"], env=subprocess_env(),
                           capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert step_losses(run) == step_losses(tmp_path / "runs" / "clean")
    client = MlflowClient(yaml.safe_load(path.read_text())["tracking"]["uri"])
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(found) == 1 and found[0].info.run_id == json.loads((run / "run.json").read_text())["mlflow_run_id"]
    assert found[0].data.tags["grt.last_restart"] == line
