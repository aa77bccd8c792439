"""`grt sweep` with train.branch_budgets: the branch-point rule and its checks, the planned cost of the independent
and the branched phi sweeps against a hand count, and one tiny real stable run + branch through the sweep."""
import json
from pathlib import Path

import pytest
import yaml

from conftest import tiny_recipe
from pipeline.config import RecipeError
from pipeline.config import load_recipe
from pipeline.studies import sweep as sweep_module
from pipeline.studies.sweep import plan_sweep
from pipeline.studies.sweep import run_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "recipes" / "sweeps"
WSD = ["train.lr_schedule=wsd", "train.max_steps=180", "train.warmup_steps=10"]


def load(*overrides):
    return load_recipe(SWEEPS / "phi" / "phi-r2-d64-s60.yaml", [*WSD, *overrides])


def test_branch_points_join_keep_steps_and_impossible_budgets_are_refused():
    # decay_fraction 0.2: decay(60) = round(12.0) = 12 -> branch at 48; decay(30) = 6 -> 24; the user's 100 kept
    tc = load("train.decay_fraction=0.2", "train.branch_budgets=[60, 30]", "train.keep_steps=[100]").train
    assert tc.keep_steps == [24, 48, 100]
    # decay_steps 20: every budget decays 20 steps -> 60 branches at 40
    assert load("train.decay_steps=20", "train.branch_budgets=[60]").train.keep_steps == [40]
    cases = {("train.decay_fraction=0.2", "train.branch_budgets=[180]"): "not below train.max_steps=180",
             # decay(11) = round(2.2) = 2 -> step 9, before the warm-up's end (10)
             ("train.decay_fraction=0.2", "train.branch_budgets=[11]"): "branch at step 9",
             # decay 150 of 180: stable until 30; budget 170 -> step 20 fine, budget 175 -> 25 fine; 179 -> 29 fine;
             # decay_steps 150 with budget 60 -> step -90
             ("train.decay_steps=150", "train.branch_budgets=[60]"): "branch at step -90",
             ("train.decay_fraction=0.2", "train.branch_budgets=[60, 60]"): "lists a budget twice",
             ("train.decay_fraction=0.2", "train.branch_budgets=sixty"): "must be a list of step counts"}
    for overrides, said in cases.items():
        with pytest.raises(RecipeError, match=said):
            load(*overrides)
    with pytest.raises(RecipeError, match="branch_budgets needs train.lr_schedule=wsd"):
        load_recipe(SWEEPS / "phi" / "phi-r2-d64-s60.yaml", ["train.branch_budgets=[30]"])  # cosine
    with pytest.raises(RecipeError, match="unknown key"):
        load("train.decay_fraction=0.2", "train.branch_budget=[30]")


def test_planned_cost_of_both_phi_sweeps_against_a_hand_count(capsys):
    from pipeline.cli import main

    assert main(["sweep", str(SWEEPS / "phi-branched"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = [ln.split()[2].rstrip(":") for ln in out.splitlines() if ln.startswith("   + branch ")]
    assert listed == [f"phi-branched-r{r}-d{d}-decay12@48" for r in (1, 2, 4, 8) for d in (128, 64)]
    assert "planned: 8 run(s) + 8 branch(es), 1,536 training steps" in out
    ind, br = plan_sweep(SWEEPS / "phi"), plan_sweep(SWEEPS / "phi-branched")
    tokens_per_step = 8 * 1 * 128  # quickstart-grt: micro_batch_size 8 x grad_accum_steps 1 x block_size 128
    assert ind["total"]["steps"] == 8 * (60 + 180) and ind["total"]["runs"] == 16 and ind["total"]["branches"] == 0
    assert br["total"]["steps"] == 8 * (180 + 12) and br["total"]["runs"] == 8 and br["total"]["branches"] == 8
    assert br["total"]["tokens"] == 8 * 192 * tokens_per_step and ind["total"]["tokens"] == 1920 * tokens_per_step
    # one model by hand, paper Eq. 1: r 2, d 64, S 128, V 50257, 1 + 4 x 2 + 1 blocks; training = 3 x forward
    d, S, V, r = 64, 128, 50257, 2
    forward = (1 + 4 * r + 1) * (24 * d * d + 4 * S * d) + r * 10 * d * d + 2 * d * V
    row = next(x for x in br["runs"] if x["name"] == "phi-branched-r2-d64-decay12@48")
    assert row["steps"] == 12 and row["train_flops"] == 12 * tokens_per_step * 3 * forward
    stable = next(x for x in br["runs"] if x["name"] == "phi-branched-r2-d64")
    assert stable["train_flops"] == 180 * tokens_per_step * 3 * forward and stable["checkpoints"] == 2  # 48 and 180
    # a batch ramp: each stage's tokens (by hand: accumulation 2 for steps 1-10, then quickstart's 1)
    from pipeline.studies.sweep_cost import run_cost

    ramp = load("train.decay_fraction=0.2", "train.batch_ramp=[[10, 2]]")
    assert run_cost(ramp, "ramp", 0, 180, "run")["tokens"] == (10 * 2 + 170 * 1) * 8 * 128
    assert run_cost(ramp, "ramp", 48, 60, "branch")["tokens"] == 12 * 8 * 128
    # the same 16 evaluations and final validations either way
    assert ind["total"]["evaluations"] == br["total"]["evaluations"] == 16
    assert ind["total"]["validations"] == br["total"]["validations"] == 16


def test_a_tiny_stable_run_and_its_branch_through_grt_sweep(tmp_path, corpus, monkeypatch, capsys):
    from pipeline.config.schema import TrackingConfig
    from pipeline.eval.results import collect
    from pipeline.eval.results import read_exits
    from pipeline.studies.phi import runs_from_results

    folder = tmp_path / "tiny-sweep"
    folder.mkdir()
    # a stable wsd run to 8 steps (decay 2: stable until 6), budget 5 -> a 2-step branch from step 3; one checkpoint
    # kept and none on the interval, so only keep_steps can save step 3 from pruning
    base = tiny_recipe(tmp_path, corpus, model={"depth_sampling": "fixed", "n_recurrence": 2},
                       train={"max_steps": 8, "lr_schedule": "wsd", "decay_steps": 2, "branch_budgets": [5],
                              "checkpoint_interval": 100, "keep_checkpoints": 1, "eval_interval": 100},
                       eval={"diagnostics": False})
    (folder / "_base.yaml").write_text(yaml.safe_dump(base))
    (folder / "tiny.yaml").write_text("base: _base.yaml\n")
    rows = run_sweep(folder)
    assert [(r.name, r.status) for r in rows] == [("tiny", "ok"), ("tiny-decay2@3", "ok")], capsys.readouterr()
    runs = tmp_path / "runs"
    kept = sorted(p.name for p in (runs / "tiny" / "checkpoints").glob("step_*"))
    assert kept == ["step_00000003", "step_00000008"]
    branch = runs / "tiny-decay2@3"
    saved = yaml.safe_load((branch / "recipe.yaml").read_text())
    assert Path(saved["train"]["branch_from"]) == (runs / "tiny" / "checkpoints" / "step_00000003").resolve()
    assert saved["train"]["max_steps"] == 5 and saved["train"]["branch_budgets"] is None
    tags = saved["tracking"]["tags"]
    assert (tags["branch.parent"], tags["branch.step"], tags["branch.decay_steps"], tags["sweep"]) == (
        "tiny", 3, 2, "tiny-sweep")
    steps = [json.loads(ln)["step"] for ln in (branch / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in ln and '"val_loss"' not in ln]
    assert steps[0] == 4 and steps[-1] == 5  # trained steps 4 and 5 only: it started from step 3
    assert read_exits(branch)["step"] == 5 and read_exits(runs / "tiny")["step"] == 8
    # grt fit-phi's reading of the runs: the branch is a point labelled with its stable run and step
    results = collect([str(runs / "tiny"), str(branch)], TrackingConfig(uri=base["tracking"]["uri"]))
    assert [(x.name, x.branch_of, x.tokens) for x in runs_from_results(results)] == [
        ("tiny", "", 8 * 8 * 32), ("tiny-decay2@3", "tiny@3", 5 * 8 * 32)]

    def never(*args):
        raise AssertionError(f"a finished run was run again: {args}")

    monkeypatch.setattr(sweep_module, "run_branch", never)
    again = run_sweep(folder, runner=never)
    assert [r.status for r in again] == ["done before", "done before"]
