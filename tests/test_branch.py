"""Learning-rate schedules (train.lr_schedule) against hand formulas, train.keep_steps against pruning, and decay
branches (`grt branch`): the stable run's weights at the branch step, the branch's own decay, a kill -9 inside it."""
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import step_losses
from conftest import step_values
from conftest import subprocess_env
from conftest import tiny_recipe
from pipeline import cli
from pipeline.config import TrainConfig
from pipeline.config import from_dict
from pipeline.studies.compare import format_results
from pipeline.tokenize import tokenize
from pipeline.train.branch import branch_recipe
from pipeline.train.branch import folder_family
from pipeline.train.callbacks import Callback
from pipeline.train.callbacks import ConsoleLogger
from pipeline.train.optim import lr_at
from pipeline.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
LR, MIN = 1e-3, 1e-4


def test_every_schedule_and_shape_by_hand():
    W, M = 3, 20
    base = dict(lr=LR, min_lr=MIN, warmup_steps=W, max_steps=M)
    warm = [LR * (s + 1) / (W + 1) for s in range(W)]
    # cosine, the default: the formula of every run before train.lr_schedule existed
    old = warm + [MIN + 0.5 * (1 + math.cos(math.pi * ((s - W) / (M - W)))) * (LR - MIN) for s in range(W, M)]
    old += [MIN]
    assert TrainConfig().lr_schedule == "cosine"
    assert [lr_at(s, TrainConfig(**base)) for s in range(M + 1)] == old  # bit for bit
    assert [lr_at(s, TrainConfig(**base, lr_schedule="constant")) for s in range(M + 1)] == warm + [LR] * (M - W + 1)
    # linear: after the warm-up, steps 3..19 fall by (LR - MIN) / 17 each, step 19 (the last) at MIN
    linear = warm + [MIN + (LR - MIN) * (1 - (s - W + 1) / (M - W)) for s in range(W, M)] + [MIN]
    assert [lr_at(s, TrainConfig(**base, lr_schedule="linear")) for s in range(M + 1)] == pytest.approx(linear, 1e-12)
    assert lr_at(M - 1, TrainConfig(**base, lr_schedule="linear")) == pytest.approx(MIN, abs=1e-15)
    # wsd, decay over the last 5 steps (15..19): x = 1/5 .. 5/5
    shapes = {"linear": lambda x: 1 - x, "cosine": lambda x: (1 + math.cos(math.pi * x)) / 2,
              "1-sqrt": lambda x: 1 - x ** 0.5, "sqrt": lambda x: (1 - x) ** 0.5}
    for shape, f in shapes.items():
        want = warm + [LR] * 12 + [MIN + (LR - MIN) * f(k / 5) for k in range(1, 6)] + [MIN]
        for decay in ({"decay_steps": 5}, {"decay_fraction": 0.25}):  # 0.25 * 20 = 5
            tc = TrainConfig(**base, lr_schedule="wsd", decay_shape=shape, **decay)
            assert not tc.validate()
            got = [lr_at(s, tc) for s in range(M + 1)]
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (shape, decay)
    # 1-sqrt (Hägele et al.) drops fast first: below linear at the decay's start; sqrt above it
    assert (lr_at(15, TrainConfig(**base, lr_schedule="wsd", decay_steps=5, decay_shape="1-sqrt"))
            < lr_at(15, TrainConfig(**base, lr_schedule="wsd", decay_steps=5))
            < lr_at(15, TrainConfig(**base, lr_schedule="wsd", decay_steps=5, decay_shape="sqrt")))


def test_schedule_keys_are_validated():
    def problems(**kw):
        return [p for p in TrainConfig(**kw).validate() if "decay" in p or "lr_schedule" in p or "keep_steps" in p]
    assert problems(lr_schedule="wsd") and "exactly one" in problems(lr_schedule="wsd")[0]
    assert "exactly one" in problems(lr_schedule="wsd", decay_steps=5, decay_fraction=0.1)[0]
    assert "exceed max_steps" in problems(lr_schedule="wsd", decay_steps=19000)[0]
    assert "only applies" in problems(decay_steps=5)[0]
    assert "is not one of" in problems(lr_schedule="wsd", decay_steps=5, decay_shape="square")[0]
    assert "keep_steps" in problems(keep_steps=[0])[0]
    assert not problems(lr_schedule="wsd", decay_fraction=0.2, keep_steps=[1000])
    # keys that would do nothing: a shape without wsd, a kept step the run never reaches, a budget without eval_exits
    assert "only applies" in problems(decay_shape="sqrt")[0]
    assert "only applies" in problems(lr_schedule="linear", decay_shape="cosine")[0]
    assert "past train.max_steps" in problems(max_steps=100, keep_steps=[50, 500])[0]
    assert any("eval_budget only applies" in p for p in TrainConfig(eval_budget=0.1).validate())
    assert not TrainConfig(eval_budget=0.1, eval_exits=True).validate()


class WeightsAtStart(Callback):
    def on_train_start(self, trainer):
        self.step = trainer.step
        self.weights = {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}


@pytest.mark.slow
def test_stable_run_branches_and_resumes_exactly(tmp_path, corpus, capsys):
    """One stable wsd run (6 steps, decay at 6, branch point 4 kept), a branch at 4 decaying over 4 steps, a run
    from scratch with the branch's whole schedule, and the branch again killed at step 7 and resumed."""
    recipe = tiny_recipe(tmp_path, corpus)
    recipe["name"] = "stable"
    recipe["train"].update(max_steps=6, warmup_steps=1, lr=LR, min_lr=MIN, lr_schedule="wsd", decay_steps=1,
                           micro_batch_size=2, grad_accum_steps=1,
                           keep_steps=[4], checkpoint_interval=3, keep_checkpoints=1, eval_interval=100)
    stable_cfg = from_dict(recipe)
    tokenize(stable_cfg.data, quiet=True)
    Trainer(stable_cfg).fit()
    stable = stable_cfg.run_dir
    # saved at 3, 4 (keep_steps) and 6; keep_checkpoints=1 leaves the newest and the kept step
    assert sorted(p.name for p in (stable / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]
    assert step_values(stable, "lr") == pytest.approx({1: LR / 2, **{s: LR for s in range(2, 6)}, 6: MIN},
                                                      rel=1e-12)

    # refusals, one line each
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 5 \(it has: 4, 6\)"):
        branch_recipe(str(stable), 5, 4, None, [])
    with pytest.raises(ValueError, match="model cannot change"):
        branch_recipe(str(stable), 4, 4, None, ["model.d_model=64"])
    with pytest.raises(ValueError, match="not in a stable phase"):
        branch_recipe(str(stable), 6, 4, None, [])

    # the branch at 4: the stable run's weights at 4, bit for bit, then its own decay over steps 5..8
    (stable / "run.json").write_text(json.dumps({"mlflow_run_id": "0123abcd"}))  # as a tracked stable run leaves
    cfg = branch_recipe(str(stable), 4, 4, None, [])
    assert cfg.tracking.tags["branch.parent_run_id"] == cfg.tracking.tags["mlflow.parentRunId"] == "0123abcd"
    assert cfg.name == "stable-decay4@4" and cfg.train.max_steps == 8
    assert {k: cfg.tracking.tags[k] for k in ("branch.parent", "branch.step", "branch.decay_steps")} == {
        "branch.parent": "stable", "branch.step": 4, "branch.decay_steps": 4}
    start = WeightsAtStart()
    capsys.readouterr()
    Trainer(cfg, callbacks=[ConsoleLogger(1), start]).fit()
    assert "note: " not in capsys.readouterr().err  # what grt branch sets is no recipe change to warn of
    saved = torch.load(stable / "checkpoints" / "step_00000004" / "state.pt", map_location="cpu")["model"]
    assert start.step == 4 and start.weights.keys() == saved.keys()
    assert all(torch.equal(start.weights[k], saved[k]) for k in saved)
    branch = cfg.run_dir
    assert step_values(branch, "lr") == pytest.approx({s: MIN + (LR - MIN) * (1 - (s - 4) / 4) for s in range(5, 9)},
                                                      rel=1e-12)
    with pytest.raises(FileExistsError, match="exists"):
        branch_recipe(str(stable), 4, 4, None, [])
    assert folder_family(branch) == {"branch_parent": "stable", "branch_step": 4, "branch_decay_steps": 4}

    # from scratch with the branch's whole schedule: the same losses as stable up to 4 and as the branch after
    ref = tiny_recipe(tmp_path, corpus)
    ref["name"] = "reference"
    ref["train"].update({**recipe["train"], "max_steps": 8, "decay_steps": 4, "keep_steps": []})
    ref_cfg = from_dict(ref)
    Trainer(ref_cfg).fit()
    reference, losses = step_losses(ref_cfg.run_dir), step_losses(branch)
    assert [reference[s] for s in range(1, 5)] == [step_losses(stable)[s] for s in range(1, 5)]
    assert sorted(losses) == [5, 6, 7, 8] and all(losses[s] == reference[s] for s in losses), (losses, reference)

    # `grt branch` killed (kill -9) after step 7, its checkpoint at 6; the relaunch gives the uninterrupted losses
    cmd = [sys.executable, "-m", "pipeline.cli", "branch", str(stable), "--at", "4", "--decay-steps", "4", "--name",
           "killed", "train.eval_batches=3"]
    killed = subprocess.run(cmd, cwd=REPO, env=subprocess_env(GRT_FAULT_KILL_AT_STEP="7"), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    note = next(x for x in killed.stderr.splitlines() if x.startswith("note: the branch's recipe differs"))
    assert note.endswith("recipe.yaml): train.eval_batches: 2 -> 3"), note  # the override only
    again = cfg.run_dir.with_name("killed")
    assert sorted(p.name for p in (again / "checkpoints").glob("step_*")) == ["step_00000006"]
    capsys.readouterr()
    assert cli.main(["train", str(again / "recipe.yaml")]) == 0
    assert "resumed at step 6" in capsys.readouterr().out
    assert step_losses(again) == losses
    assert step_values(again, "lr") == step_values(branch, "lr")

    text = format_results([{**r, "exit": [1], "loss": [2.0]} for r in (
        {"name": "stable", "type": "grt", "shorthand": "x", "params": 1, "step": 6, "tokens_trained": 1},
        {"name": branch.name, "type": "grt", "shorthand": "x", "params": 1, "step": 8, "tokens_trained": 1,
         **folder_family(branch)})])
    assert "family of stable: stable-decay4@4 (from step 4, 4 decay steps)" in text


def test_branch_overrides_are_honoured_or_refused(tmp_path, corpus):
    """A branch's own train.keep_steps override is kept (the parent's branch points are not), and
    model.depth_schedule, a curriculum rather than the weights, may change; other model keys are refused."""
    import yaml

    recipe = tiny_recipe(tmp_path, corpus)
    recipe["train"].update(max_steps=10, warmup_steps=1, lr_schedule="wsd", decay_steps=2, keep_steps=[4, 6])
    step = tmp_path / "runs" / "tiny" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"")  # listed as published; branch_recipe reads only its recipe
    (step / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = str(tmp_path / "runs" / "tiny")
    assert branch_recipe(run, 4, 3, "b1", []).train.keep_steps == []
    assert branch_recipe(run, 4, 3, "b2", ["train.keep_steps=[5]"]).train.keep_steps == [5]
    cfg = branch_recipe(run, 4, 3, "b3", ["model.depth_schedule=[[5,2]]"])
    assert cfg.model.depth_schedule == [[5, 2]] and cfg.train.max_steps == 7
    with pytest.raises(ValueError, match="model cannot change"):
        branch_recipe(run, 4, 3, "b4", ["model.d_model=64"])
    # a start killed before it wrote anything leaves only the run lock: begun again; a started one is refused
    (tmp_path / "runs" / "b5").mkdir()
    (tmp_path / "runs" / "b5" / ".lock").write_text("")
    assert branch_recipe(run, 4, 3, "b5", []).name == "b5"
    (tmp_path / "runs" / "b5" / "recipe.yaml").write_text("")
    with pytest.raises(FileExistsError, match="was started already"):
        branch_recipe(run, 4, 3, "b5", [])


def test_the_stable_run_is_named_by_folder_or_by_name(tmp_path, corpus, monkeypatch):
    """`grt branch NAME` finds runs/NAME from the working folder as `grt compare` does; a name that is neither a run
    folder nor under runs/ is refused naming both places (not "no checkpoint at step S, it has none")."""
    import yaml

    recipe = tiny_recipe(tmp_path, corpus, out_dir="runs")
    recipe["train"].update(max_steps=10, warmup_steps=1, lr_schedule="wsd", decay_steps=2)
    step = tmp_path / "runs" / "tiny" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"")
    (step / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    cfg = branch_recipe("tiny", 4, 3, None, [])
    assert cfg.name == "tiny-decay3@4" and cfg.train.branch_from == str(step.resolve())
    with pytest.raises(FileNotFoundError, match=r"^tinny is not a run folder .* runs/tinny/checkpoints exists"):
        branch_recipe("tinny", 4, 3, None, [])


@pytest.mark.slow
def test_a_two_rank_fsdp_branch_continues_its_stable_run_exactly(tmp_path):
    """FSDP over gloo, 2 ranks (torchrun): `grt branch` from a sharded checkpoint restores the sharded weights,
    optimizer and data position: branched at the end of a wsd run's stable phase with that run's own decay, it
    trains the run's decay steps again with the same losses."""
    from conftest import free_port
    from conftest import launched_recipe

    recipe = launched_recipe(tmp_path, max_steps=7, grad_accum_steps=2, lr_schedule="wsd", decay_steps=3,
                             keep_steps=[4], checkpoint_interval=100, eval_interval=100, backend="fsdp")

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "pipeline.cli", *args]
        p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    torchrun("train", str(recipe), "name=reference")  # stable through step 4 (saved: keep_steps), decay 5..7
    torchrun("branch", str(tmp_path / "runs" / "reference"), "--at", "4", "--decay-steps", "3", "--name", "branch")
    branch, reference = step_losses(tmp_path / "runs" / "branch"), step_losses(tmp_path / "runs" / "reference")
    assert sorted(branch) == [5, 6, 7] and all(branch[s] == reference[s] for s in branch), (branch, reference)
    assert step_values(tmp_path / "runs" / "branch", "lr") == pytest.approx(
        {s: MIN + (LR - MIN) * (1 - (s - 4) / 3) for s in (5, 6, 7)}, rel=1e-12)
