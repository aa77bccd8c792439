"""Curricula (pipeline/train/curriculum.py): train.batch_ramp and model.depth_schedule.

- the scheduled values at every step, the tokens summed and the depth draws against formulas written here;
- the recipe refuses what cannot run (a type without a sampled depth, DeepSpeed's fixed accumulation, bad stages),
  the preflight a ramp the world size does not divide;
- one training run with both: each step's micro-batches, tokens, depth and metrics by hand, then a SIGTERM at a
  ramp boundary and a resume give the uninterrupted run's losses exactly;
- `grt info` and `grt launch --check` list the stages;
- one 2-rank FSDP run (slow): every rank runs the ramp's share of micro-batches at the same scheduled depths, with
  one process's losses.

Run as a script (under torchrun) it is that run's worker: ``python tests/test_curriculum.py RECIPE RECORD_DIR``.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import tiny_recipe
from pipeline.config import RecipeError
from pipeline.config import from_dict
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import PoissonConfig
from pipeline.train import curriculum
from test_depth_granularity import grt_depth
from test_depth_granularity import poisson_depth
from test_depth_granularity import tiny

RAMP = [[2, 1], [3, 2]]  # steps 1-2: 1 micro-batch, step 3: 2, then grad_accum_steps (4)
ACCUM_BY_HAND = [1, 1, 2, 4, 4]  # steps 1..5
DEPTHS = [[2, 1]]  # steps 1-2: depth 1, then r ~ U{1..3}


def test_schedules_at_every_step_by_hand():
    cfg = from_dict({"train": {"grad_accum_steps": 6, "batch_ramp": [[3, 2], [5, 4]], "max_steps": 9,
                               "micro_batch_size": 3}, "model": {"block_size": 16}})
    accum = [2, 2, 2, 4, 4, 6, 6, 6, 6]
    assert [curriculum.accum_at(cfg.train, s) for s in range(1, 10)] == accum
    for step in range(10):  # tokens of steps 1..step: a running sum of micro-batches x 3 x 16
        assert curriculum.tokens_through(cfg, step) == sum(accum[:step]) * 3 * 16, step
    no_ramp = from_dict({"train": {"grad_accum_steps": 6, "micro_batch_size": 3}, "model": {"block_size": 16}})
    assert curriculum.tokens_through(no_ramp, 7) == 7 * 6 * 3 * 16
    assert [curriculum.accum_at(no_ramp.train, s) for s in (1, 50)] == [6, 6]

    grt, poisson = tiny(GRTConfig, n_recurrence=4), tiny(PoissonConfig, n_recurrence=4, depth_sigma=0.5)
    fixed = tiny(GRTConfig, n_recurrence=4, depth_sampling="fixed")
    schedule = [[4, 1], [8, 2], [12, 3]]
    bounds = [1] * 4 + [2] * 4 + [3] * 4 + [4] * 8  # steps 1..20
    m = GRTConfig(n_recurrence=4, depth_schedule=schedule)
    assert [curriculum.depth_bound_at(m, s) for s in range(1, 21)] == bounds
    assert curriculum.depth_bound_at(GRTConfig(n_recurrence=4), 3) is None
    for step in range(20):  # the trainer's step index is 0-based: optimizer step step + 1
        kw = curriculum.depth_kwargs(m, step + 1)
        assert grt.train_depth(11, step, **kw) == grt_depth(11, step, bounds[step]), step
        assert grt.train_depth(11, step, 2, **kw) == grt_depth(11, step, bounds[step], 2), step
        assert poisson.train_depth(11, step, **kw) == poisson_depth(11, step, bounds[step], 0.5), step
        assert fixed.train_depth(11, step, **kw) == bounds[step]
    draws = [grt.train_depth(5, s, depth=2) for s in range(200)]
    assert set(draws) == {1, 2}  # bounded by the schedule, U{1..2}


def test_sampled_depth_types_are_those_whose_train_depth_draws():
    """curriculum.SAMPLED_DEPTH is written out (the recipe is torch-free): it must match the model classes."""
    for name, cls in MODEL_CONFIGS.items():
        kw = {"lora_rank": 2} if name == "rrt" else {}
        if name == "recurrent_transformer":
            kw = {"tile": 4}
        model = tiny(cls, **kw)
        assert (model.train_depth(1, 2) is not None) == (name in curriculum.SAMPLED_DEPTH), name


def test_the_recipe_refuses_what_cannot_run():
    def problems(**sections) -> str:
        try:
            from_dict(sections)
        except RecipeError as e:
            return str(e)
        return ""

    for t in ("gpt", "ouro", "rrt", "mor", "recurtrace"):
        p = problems(model={"type": t, "depth_schedule": [[10, 1]]})
        assert f"model.depth_schedule with model.type={t}: this type trains every step at its full depth" in p, p
    p = problems(model={"type": "grt", "n_recurrence": 3, "depth_schedule": [[10, 4]]})
    assert "model.depth_schedule: values [4] must be in 1..3" in p
    assert "until_steps [5, 5] must rise strictly" in problems(train={"batch_ramp": [[5, 1], [5, 2]]})
    assert "must be a list of [until_step, value] pairs" in problems(train={"batch_ramp": [4, 8]})
    assert "values [0] must be >= 1" in problems(train={"batch_ramp": [[5, 0]]})
    p = problems(train={"backend": "deepspeed", "batch_ramp": [[5, 2]]})
    assert "train.batch_ramp with train.backend=deepspeed" in p
    assert problems(train={"batch_ramp": [[5, 2]]}, model={"type": "poisson", "depth_schedule": [[5, 2]]}) == ""
    assert curriculum.world_size_problems(from_dict({"train": {"batch_ramp": [[5, 2], [9, 3]]}}).train, 2) == [
        "train.batch_ramp: grad_accum_steps [3] count micro-batches over all 2 ranks and are not multiples of the "
        "world size 2; use multiples of 2 (e.g. [4])"]


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_rows(run_dir):
    return {r["step"]: r for r in metrics_rows(run_dir) if "loss" in r}


def test_ramp_and_depth_schedule_train_by_hand_and_resume_exactly(tmp_path, corpus, monkeypatch, capsys):
    """Both curricula in one 5-step run: what each step ran, by hand; SIGTERM after step 3 (the last step of a ramp
    stage) and a resume at step 4 give the uninterrupted run's losses and tokens exactly. Seed 1: its draws at the
    steps next to the depth stage's end differ from 1, so a schedule read one step off shows."""
    from pipeline.runtime.exit_status import TrainingStopped
    from pipeline.tokenize import tokenize
    from pipeline.train import faults
    from pipeline.train.trainer import Trainer

    recipe = tiny_recipe(tmp_path, corpus, {"depth_schedule": DEPTHS}, seed=1, train={
        "grad_accum_steps": 4, "batch_ramp": RAMP, "micro_batch_size": 2, "max_steps": 5, "eval_interval": 100,
        "checkpoint_interval": 100})
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    ran = []
    trainer = Trainer(cfg)
    trainer.raw_model.register_forward_pre_hook(
        lambda mod, args, kwargs: ran.append(kwargs.get("n_steps")) if mod.training else None, with_kwargs=True)
    trainer.fit()
    full = step_rows(cfg.run_dir)
    assert sorted(full) == [1, 2, 3, 4, 5]
    depths = [1, 1] + [grt_depth(1, s, 3) for s in (2, 3, 4)]  # steps 1..5 (train_depth keys the 0-based step)
    assert depths == [1, 1, 3, 1, 3]
    assert ran == [d for d, a in zip(depths, ACCUM_BY_HAND) for _ in range(a)]  # one forward per micro-batch
    tokens = [a * 2 * 32 for a in ACCUM_BY_HAND]
    for step in range(1, 6):
        row = full[step]
        assert row["grad_accum_steps"] == ACCUM_BY_HAND[step - 1] and row["depth_bound"] == (1 if step <= 2 else 3)
        assert row["depth"] == depths[step - 1]
        assert row["tokens_seen"] == sum(tokens[:step])
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(tokens[step - 1], rel=1e-9)
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train: "))
    assert f"; {tokens[0]:,} (ramped to {4 * 2 * 32:,} by train.batch_ramp) tokens/step;" in start  # step 1's
    # the loader handed out exactly the ramp's micro-batches: sum(accum) x micro_batch_size samples
    assert trainer.loader.counts == [sum(ACCUM_BY_HAND) * 2]

    stopped = from_dict(dict(recipe, name="stopped"))
    monkeypatch.setattr(faults, "FAULT_SIGNAL_AT_STEP", (3, signal.SIGTERM))
    with pytest.raises(TrainingStopped):
        Trainer(stopped).fit()
    monkeypatch.setattr(faults, "FAULT_SIGNAL_AT_STEP", (0, signal.SIGTERM))
    resumed = Trainer(stopped)
    assert resumed.step == 3 and resumed.tokens_seen == sum(tokens[:3])
    resumed.fit()
    again = step_rows(stopped.run_dir)
    assert sorted(again) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert again[step]["loss"] == full[step]["loss"], step  # exact: same micro-batches, depths and noise
        assert again[step]["tokens_seen"] == full[step]["tokens_seen"]
    state = torch.load(stopped.run_dir / "checkpoints" / "step_00000005" / "state.pt", weights_only=False)
    assert state["tokens_seen"] == sum(tokens)
    # grt eval reports the tokens the ramp trained, not max_steps x the recipe's final accumulation (what grt compare
    # and grt fit-phi put on their token axis)
    from pipeline.eval.stage import evaluate

    result = evaluate(stopped.run_dir, ["eval.diagnostics=false", "eval.val_tokens=64", "eval.analyses=[]"],
                      quiet=True)
    assert result["tokens_trained"] == sum(tokens) != 5 * 4 * 2 * 32


def test_info_and_preflight_list_the_stages(tmp_path, corpus, capsys):
    from launch.preflight import run_preflight
    from pipeline.cli import main

    recipe = tiny_recipe(tmp_path, corpus, {"depth_schedule": DEPTHS}, train={
        "grad_accum_steps": 4, "batch_ramp": RAMP, "micro_batch_size": 2, "max_steps": 5})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    # 2 x 32 tokens a micro-batch; 64 + 64 + 128 + 256 + 256 tokens
    table = [line.split() for line in out.splitlines()]
    at = table.index("batch ramp (train.batch_ramp): grad_accum_steps over all ranks, tokens per step".split())
    assert table[at + 1:at + 5] == [["steps", "1-2", "1", "64"], ["step", "3", "2", "128"],
                                    ["steps", "4-5", "4", "256"], "5 steps = 768 tokens".split()], out
    at = table.index("depth schedule (model.depth_schedule: the upper bound of r ~ U{1..value}); memory sized for "
                     "the largest, 3".split())
    assert table[at + 1:at + 3] == [["steps", "1-2", "1"], ["steps", "3-5", "3"]], out
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["batch_ramp"] == [[1, 2, 1], [3, 3, 2], [4, 5, 4]] and info["tokens_total"] == 768
    assert info["depth_schedule"] == [[1, 2, 1], [3, 5, 3]]

    cfg = from_dict(dict(recipe, train={**recipe["train"], "batch_ramp": [[2, 1], [3, 2]], "backend": "ddp"}))
    rep = run_preflight(cfg, gpus_per_node=2, check_data=False, check_tracking=False)
    table = [line.split() for line in dict(rep.sections)["curriculum"]]
    assert table[1:4] == [["steps", "1-2", "1", "(0.5)", "64"], ["step", "3", "2", "(1)", "128"],
                          ["steps", "4-5", "4", "(2)", "256"]], table
    assert ["steps", "3-5", "3"] in table
    assert ("batch: train.batch_ramp: grad_accum_steps [1] count micro-batches over all 2 ranks and are not "
            "multiples of the world size 2; use multiples of 2 (e.g. [2])") in rep.problems
    ok = run_preflight(from_dict(dict(recipe, train={**recipe["train"], "batch_ramp": [[2, 2]]})), gpus_per_node=2,
                       check_data=False, check_tracking=False)
    assert not [p for p in ok.problems if "batch_ramp" in p]


@pytest.mark.slow
def test_two_fsdp_ranks_follow_the_curricula_together(tmp_path):
    """FSDP over gloo, 2 ranks: each rank records its training forwards; the same depths on both (a rank on another
    depth would call other modules), half the step's micro-batches each, and the single process's losses."""
    from conftest import free_port
    from conftest import launched_recipe
    from conftest import step_losses
    from conftest import subprocess_env
    from pipeline.config import load_recipe
    from pipeline.train.trainer import Trainer

    recipe = launched_recipe(tmp_path, max_steps=5, grad_accum_steps=4, batch_ramp=[[2, 2]], eval_interval=100,
                             checkpoint_interval=100)
    data = yaml.safe_load(recipe.read_text())
    data["model"]["depth_schedule"] = [[3, 2]]
    recipe.write_text(yaml.safe_dump(data))
    record = tmp_path / "record"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), str(recipe), str(record)]
    p = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=subprocess_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    accum = [2, 2, 4, 4, 4]  # over both ranks: steps 1-2 ramped, then grad_accum_steps
    bounds = [2, 2, 2, 3, 3]
    for rank in (0, 1):
        ran = [json.loads(line)["ran"] for line in (record / f"rank{rank}.jsonl").read_text().splitlines()]
        assert ran == [[grt_depth(7, s, bounds[s])] * (accum[s] // 2) for s in range(5)], rank
    single = Trainer(load_recipe(str(recipe), ["name=single"]))
    single.fit()
    fsdp = step_losses(tmp_path / "runs" / "fsdp")
    for step, loss in step_losses(tmp_path / "runs" / "single").items():
        assert fsdp[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step  # fp32 sums in another order


if __name__ == "__main__":
    from test_depth_granularity import train_recording_depths

    train_recording_depths(sys.argv[1], sys.argv[2], ["name=fsdp", "train.backend=fsdp"])
