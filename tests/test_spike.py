"""train.spike, the loss-spike defence: the decision against a hand-computed window, and fault injection at a known
step (GRT_FAULT_SPIKE multiplies that step's loss by a factor: a finite spike).

- skip: the run equals a reference that drops the same step's update by another path (GRT_FAULT_NAN_STEPS, the
  non-finite skip): every other loss and the final weights, bit for bit; killed after a checkpoint and resumed, the
  spike is still caught (the window comes from the checkpoint) and the run still equals the reference;
- rollback: the second spike within the bound reloads the newest checkpoint, the replayed step equals the original,
  and the spiky steps' samples are skipped (the loader position counted by hand); stop names the step and checkpoint;
- 2-rank fsdp and ddp (torchrun, gloo) skip the same step as one process, with its losses; 2-rank DeepSpeed (which
  cannot skip) stops at that step.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import free_port
from conftest import launched_recipe
from conftest import step_losses
from conftest import subprocess_env
from pipeline.config.loading import from_dict
from pipeline.config.schema import SpikeConfig
from pipeline.train import faults
from pipeline.train.checkpoint import load_checkpoint
from pipeline.train.spike import LossSpikeError
from pipeline.train.spike import SpikeGuard
from pipeline.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SPIKE = {"window": 8, "min_steps": 3, "threshold": 4.0}

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_decision_against_a_hand_computed_window():
    g = SpikeGuard(SpikeConfig(action="rollback", window=4, min_steps=3, threshold=2.0, rollback_after=2,
                               rollback_within=3))
    losses = [5.0, 4.0, 4.5]
    assert [g.judge(i + 1, x, 0, 8) for i, x in enumerate(losses)] == [None] * 3  # warm-up: judged from 3 losses
    bar = statistics.mean(losses) + 2.0 * statistics.stdev(losses)  # 4.5 + 2 x 0.5 = 5.5
    assert bar == 5.5
    assert g.judge(4, 5.49, 24, 8) is None and list(g.window) == losses + [5.49]
    assert g.judge(5, 7.0, 32, 8) == "skip" and list(g.window) == losses + [5.49]  # a spike never enters the window
    window = [4.0, 4.5, 5.49, 4.2]
    assert g.judge(6, 4.2, 40, 8) is None and list(g.window) == window  # the oldest left (window=4)
    # the second spike 4 steps after the first: not within rollback_within=3 (steps 6..8), so a skip again
    assert g.judge(9, 9.0, 64, 8) == "skip" and g.judge(10, 9.0, 72, 8) == "rollback"
    assert g.recent == [(9, 64, 8), (10, 72, 8)]
    saved = {"window": [1.0, 2.0], "recent": [], "pending": [], "rollbacks": 0}
    g.rolled_back(saved)
    assert list(g.window) == [1.0, 2.0] and g.pending == [(9, 64, 8), (10, 72, 8)] and g.rollbacks == 1
    h = SpikeGuard(SpikeConfig(action="skip"))
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert h.state_dict() == g.state_dict()
    # max_consecutive spikes in a row stop a skip run (a taken step starts the count again), and a rollback keeps
    # the count: the loss that moved for good must not be skipped for ever
    k = SpikeGuard(SpikeConfig(action="skip", window=4, min_steps=3, threshold=2.0, max_consecutive=3))
    decisions = [k.judge(i + 1, x, 0, 8) for i, x in enumerate([5.0, 4.0, 4.5, 9.0, 9.0, 5.0, 9.0, 9.0, 9.0])]
    assert decisions == [None] * 3 + ["skip", "skip", None, "skip", "skip", "stop"]
    assert "3 spikes in a row (train.spike.max_consecutive=3): stopping" in k.line("stop", 9, 9.0)
    r = SpikeGuard(SpikeConfig(action="rollback", window=4, min_steps=3, threshold=2.0, rollback_after=2,
                               max_consecutive=3))
    assert [r.judge(i + 1, x, 0, 8) for i, x in enumerate([5.0, 4.0, 4.5, 9.0, 9.0])][3:] == ["skip", "rollback"]
    r.rolled_back({"window": [5.0, 4.0, 4.5], "in_a_row": 0})
    assert r.judge(4, 9.0, 0, 8) == "stop"
    # null means 20, so that a recipe saved before the key existed reads as unchanged on resume (and in grt sweep)
    from dataclasses import asdict

    from pipeline.train.run_folder import recipe_changes
    now = {"train": {"spike": asdict(SpikeConfig())}}
    before = {"train": {"spike": {k: v for k, v in now["train"]["spike"].items() if k != "max_consecutive"}}}
    assert recipe_changes(before, now) == [] and SpikeGuard(SpikeConfig()).max_consecutive == 20
    assert "would stop the run before any rollback" in " ".join(
        SpikeConfig(action="rollback", rollback_after=3, max_consecutive=3).validate("single"))
    # DeepSpeed cannot drop an update its engine has counted: skip and rollback refused, stop allowed
    assert [p.split(" with ")[0] for p in SpikeConfig(action="skip").validate("deepspeed")] == [
        "train.spike.action=skip"]
    assert SpikeConfig(action="stop").validate("deepspeed") == [] == SpikeConfig().validate("single")


def recipe(tmp_path, corpus, name, tracking=None, **train):
    from conftest import tiny_recipe

    r = tiny_recipe(tmp_path, corpus, train={"max_steps": 8, "checkpoint_interval": 4, "eval_interval": 100, **train})
    r["name"] = name
    r["tracking"].update(tracking or {})
    return from_dict(r)


def rows(cfg) -> list[dict]:
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(cfg) -> dict:
    return load_checkpoint(sorted((cfg.run_dir / "checkpoints").glob("step_*"))[-1])["model"]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, corpus):
    from pipeline.tokenize import tokenize

    tmp = tmp_path_factory.mktemp("spike")
    tokenize(recipe(tmp, corpus, "x").data, quiet=True)
    return tmp, corpus


def test_skip_equals_dropping_the_update_and_resumes_with_its_window(tokenized, monkeypatch, capsys):
    tmp, corpus = tokenized
    monkeypatch.setattr(faults, "FAULT_NAN_STEPS", {6})  # the reference: step 6's update dropped as non-finite
    ref = recipe(tmp, corpus, "ref")
    Trainer(ref).fit()
    monkeypatch.setattr(faults, "FAULT_NAN_STEPS", set())
    monkeypatch.setattr(faults, "FAULT_SPIKE_STEPS", {6})
    monkeypatch.setattr(faults, "FAULT_SPIKE_FACTOR", 3.0)
    monkeypatch.setattr(faults, "FAULT_RAISE_AT_STEP", (5, 0))  # killed after step 5: resumed from step 4's save
    cfg = recipe(tmp, corpus, "skip", spike={"action": "skip", **SPIKE})
    with pytest.raises(torch.OutOfMemoryError):
        Trainer(cfg).fit()
    saved = load_checkpoint(cfg.run_dir / "checkpoints" / "step_00000004")["spike"]
    assert len(saved["window"]) == 4  # resumed with a non-empty window: without it step 6 would not be judged
    monkeypatch.setattr(faults, "FAULT_RAISE_AT_STEP", (0, 0))
    Trainer(cfg).fit()
    out = capsys.readouterr().out
    assert out.count("spike: step 6 loss ") == 1 and "its update skipped" in out and "spike: step" in out
    got, want = step_losses(cfg.run_dir), step_losses(ref.run_dir)
    assert sorted(got) == list(range(1, 9)) and got[6] > 2.5 * got[5] and not math.isfinite(want[6])
    assert {s: got[s] for s in got if s != 6} == {s: want[s] for s in want if s != 6}  # bit for bit
    spikes = [r for r in rows(cfg) if "spike" in r]
    assert [(r["step"], r["spike"]) for r in spikes] == [(6, "skip")]
    assert [r["skipped_steps"] for r in rows(cfg) if r.get("step") in (5, 6, 8) and "loss" in r] == [0, 1, 1]
    w, v = weights(cfg), weights(ref)
    assert all(torch.equal(w[k], v[k]) for k in v)


def test_rollback_skips_the_spiky_data_and_stop_names_the_step(tokenized, monkeypatch, capsys):
    tmp, corpus = tokenized
    monkeypatch.setattr(faults, "FAULT_SPIKE_STEPS", {6, 7})
    monkeypatch.setattr(faults, "FAULT_SPIKE_FACTOR", 3.0)
    cfg = recipe(tmp, corpus, "rollback", spike={"action": "rollback", "rollback_after": 2, "rollback_within": 5,
                                                 **SPIKE}, tracking={"enabled": True})
    Trainer(cfg).fit()
    out = capsys.readouterr().out
    assert "spike: step 6 loss" in out and "its update skipped" in out
    assert "spike: step 7 loss" in out and "2 spikes within 5 steps: rolling back" in out
    assert f"rolled back from step 7 to {cfg.run_dir / 'checkpoints' / 'step_00000004'} (step 4)" in out
    # by hand: 8 samples a step (micro-batch 4 x 2), so step 6 drew samples 40..47 and step 7 48..55
    assert "skipped the 8 samples of step 6 (loader samples 40..47) at step 6" in out
    assert "skipped the 8 samples of step 7 (loader samples 48..55) at step 6" in out
    losses = [r for r in rows(cfg) if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # steps 5.. trained again after step 7
    assert losses[6]["loss"] == losses[4]["loss"]  # step 5 again: the same weights (step 4's) and the same samples
    assert losses[6]["spike_rollback"]["skip"] == [[6, 40, 8], [7, 48, 8]]
    # 4 steps before the rollback, 4 after it, and the 2 spiky steps' samples: 80 drawn by step 8
    assert sum(load_checkpoint(cfg.run_dir / "checkpoints" / "step_00000008")["loader"]["counts"]) == 10 * 8

    import mlflow  # every decision went to MLflow too: a tag with its line, the action (1 skip, 2 rollback) a metric

    client = mlflow.MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0]
    tags = {k for k in run.data.tags if k.startswith("spike.")}
    assert tags == {"spike.step_00000006.skip", "spike.step_00000007.rollback",
                    "spike.step_00000007.rolled_back.after_rollback_1",
                    "spike.step_00000006.skipped_data_of_step_6.after_rollback_1",
                    "spike.step_00000006.skipped_data_of_step_7.after_rollback_1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "spike_action")] == [(6, 1), (7, 2)]

    stop = recipe(tmp, corpus, "stop", spike={"action": "stop", **SPIKE})
    with pytest.raises(LossSpikeError, match=f"loss spike at step 6: .*Newest checkpoint: "
                                             f"{stop.run_dir / 'checkpoints' / 'step_00000004'}"):
        Trainer(stop).fit()
    # a branch (train.branch_from) that rolls back before its first save goes back to where it branched from
    start = stop.run_dir / "checkpoints" / "step_00000004"
    branch = recipe(tmp, corpus, "branch", spike={"action": "rollback", "rollback_after": 2, "rollback_within": 5,
                                                  **SPIKE}, branch_from=str(start), checkpoint_interval=100)
    Trainer(branch).fit()
    assert f"rolled back from step 7 to {start} (step 4)" in capsys.readouterr().out
    assert [r["step"] for r in rows(branch) if "loss" in r] == [5, 6, 5, 6, 7, 8]


@pytest.mark.slow
def test_two_rank_fsdp_and_ddp_skip_the_same_step_as_one_process_and_deepspeed_stops(tmp_path):
    path = launched_recipe(tmp_path, max_steps=8, checkpoint_interval=8, eval_interval=100, grad_accum_steps=2,
                           collective_timeout_s=30, spike={"action": "skip", **SPIKE})
    env = subprocess_env(GRT_FAULT_SPIKE="6:3")
    losses = {}
    for backend in ("single", "fsdp", "ddp"):
        launch = ([] if backend == "single" else
                  ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())])
        p = subprocess.run([sys.executable, *launch, "-m", "pipeline.cli", "train", str(path), f"name={backend}",
                            f"train.backend={backend}"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert p.stdout.count("spike: step ") == 1 and "spike: step 6 loss " in p.stdout  # rank 0 only, once
        run_dir = tmp_path / "runs" / backend
        assert [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if r.get("spike") == "skip"] == [6]
        losses[backend] = step_losses(run_dir)
    assert yaml.safe_load(path.read_text())["train"]["spike"]["action"] == "skip"
    for backend in ("fsdp", "ddp"):  # the tolerance of test_distributed's equivalence (fp32 sums in another order)
        assert losses[backend] == pytest.approx(losses["single"], rel=1e-5, abs=1e-5)
    # DeepSpeed cannot skip (refused by validate): with action=stop it stops at the same step, before its update
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "pipeline.cli", "train", str(path), "name=ds",
                        "train.backend=deepspeed", "train.spike.action=stop"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0 and "spike: step 6 loss " in p.stdout
    assert "error: loss spike at step 6: loss " in p.stderr and "Newest checkpoint: none" in p.stderr
    assert sorted(step_losses(tmp_path / "runs" / "ds")) == [1, 2, 3, 4, 5]  # stopped inside step 6
