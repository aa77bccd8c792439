"""Mistakes a user makes end in one line naming the cause and the fix, with exit 2 for a recipe problem and 1 for the
rest — never a traceback, never work computed and then thrown away, never a file created as a side effect."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_corpus
from conftest import subprocess_env
from conftest import tiny_recipe
from pipeline.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "recipes" / "quickstart-grt.yaml")


def grt(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny GRT trained for 2 steps (d_model 32, n_head 2): its run folder."""
    from pipeline.config import from_dict
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("trained")
    recipe = tiny_recipe(tmp, make_corpus(tmp / "corpus"))
    recipe["train"].update(max_steps=2, checkpoint_interval=2, eval_interval=2)
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    Trainer(cfg).fit()
    return cfg.run_dir


# ----------------------------------------------------------------------------------- output under a regular file
def test_output_folders_under_a_regular_file_are_named(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    code, err = grt(capsys, "train", QUICK, f"out_dir={blocker}/runs")
    assert code == 2 and f"out_dir='{blocker}/runs': {blocker} is a file, not a folder" in err
    code, err = grt(capsys, "tokenize", QUICK, f"data.dataset_dir={blocker}/data/stdlib")
    assert code == 2 and f"data.dataset_dir='{blocker}/data/stdlib': {blocker} is a file" in err
    code, err = grt(capsys, "train", QUICK, f"out_dir={tmp_path}", "name=notes.txt")
    assert code == 2 and f"out_dir/name='{blocker}': {blocker} is a file" in err
    code, err = grt(capsys, "train", QUICK, f"tracking.uri=sqlite:///{blocker}/mlflow.db")
    assert code == 2 and f"tracking.uri='sqlite:///{blocker}/mlflow.db': {blocker} is a file" in err
    # every one at once, the shared file named once
    code, err = grt(capsys, "train", QUICK, f"out_dir={blocker}/runs", f"data.dataset_dir={blocker}/data")
    assert code == 2 and "2 problems" in err and err.count("move") == 2
    assert blocker.read_text() == "a file, not a folder"


def test_compare_out_under_a_regular_file(tmp_path, capsys):
    run = tmp_path / "runA"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "exits.json").write_text(json.dumps({
        "name": "runA", "type": "gpt", "shorthand": "2L", "params": 1e6, "step": 2, "tokens_trained": 512,
        "val_loss": 5.0, "exit": [1, 2], "loss": [5.5, 5.0], "kl": [0.1, 0.0], "top1": [0.9, 1.0],
        "exit_flops": [1e6, 2e6], "trained_depth": None}))
    blocker = tmp_path / "plots"
    blocker.write_text("")
    code, err = grt(capsys, "compare", run, "--out", blocker / "cmp")
    assert code == 1 and f"--out='{blocker}/cmp': {blocker} is a file, not a folder" in err


# ------------------------------------------------------------------------------------------- grt compare reading
def test_compare_names_a_missing_run_folder_and_creates_no_database(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "other" / "eval").mkdir(parents=True)
    (tmp_path / "runs" / "other" / "eval" / "exits.json").write_text("{}")
    code, err = grt(capsys, "compare", "runs/nope")
    assert code == 1 and "no run folder runs/nope" in err and "runs/other" in err and "MLflow" not in err
    (tmp_path / "runs" / "half").mkdir()
    code, err = grt(capsys, "compare", "runs/half")
    assert code == 1 and "runs/half holds no eval/exits.json" in err and "grt eval runs/half" in err
    code, err = grt(capsys, "compare", "nope")  # an MLflow name, but nothing was ever logged here
    assert code == 1 and "no runs evaluated yet" in err and f"{tmp_path}/mlflow.db does not exist" in err
    code, err = grt(capsys, "compare")
    assert code == 1 and "no runs evaluated yet" in err
    code, err = grt(capsys, "compare", "--tracking-uri", "file:./mlruns")
    assert code == 1 and "no runs evaluated yet" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no mlflow.db, no mlruns/


# ----------------------------------------------------------------------------------------------- grt eval inputs
def test_eval_refuses_overrides_a_checkpoint_cannot_take(trained, capsys):
    code, err = grt(capsys, "eval", trained, "model.d_model=96", "model.n_head=4", "train.lr=0.5")
    assert code == 2 and "3 problems" in err
    assert "model.d_model=96: the checkpoint was trained with model.d_model=32" in err
    assert "model.n_head=4: the checkpoint was trained with model.n_head=2" in err
    assert "train.lr=0.5: the checkpoint was trained with train.lr=0.001" in err
    assert "only eval.*, tracking.*, train.device and data.dataset_dir / data.mixture" in err
    code, err = grt(capsys, "eval", trained, "eval.max_step=3")  # a typo in a key eval takes: named as in recipes
    assert code == 2 and "did you mean 'eval.max_steps'" in err
    code, err = grt(capsys, "eval", trained, "model.type=gpt", "model.n_layer=3")
    assert code == 2 and "model.type=gpt: the checkpoint was trained with model.type='grt'" in err
    assert "model.n_layer=3: the checkpoint's recipe has no model.n_layer" in err
    code, err = grt(capsys, "eval", trained, "model.d_model=32", "eval.diagnostics=false", "eval.val_tokens=64",
                    "train.device=cpu")  # the value it has: nothing changes, so it evaluates
    assert code == 0 and json.loads((trained / "eval" / "exits.json").read_text())["val_tokens"] == 64, err


def test_eval_checks_its_inputs_before_computing(trained, capsys, monkeypatch, tmp_path):
    import pipeline.eval.stage as stage

    def computed(*a, **k):
        raise AssertionError("the exit curve was computed before the inputs were checked")

    monkeypatch.setattr(stage, "exit_curve", computed)
    monkeypatch.delenv("GRT_EVAL_DATA", raising=False)
    code, err = grt(capsys, "eval", trained, "eval.tasks=[piqa]", f"eval.task_data_dir={tmp_path}/nowhere")
    assert code == 1 and f"task data directory {tmp_path}/nowhere" in err and "does not exist" in err
    (tmp_path / "tasks" / "piqa" / "original").mkdir(parents=True)
    (tmp_path / "tasks" / "piqa" / "original" / "valid.jsonl").write_text("")
    code, err = grt(capsys, "eval", trained, "eval.tasks=[piqa,boolq]", f"eval.task_data_dir={tmp_path}/tasks")
    assert code == 1 and "lacks 2 file(s)" in err
    assert "piqa: piqa/original/valid-labels.lst" in err and "boolq: boolq/hf_olmo/validation.jsonl" in err
    code, err = grt(capsys, "eval", trained, f"eval.baseline={tmp_path}/runs/dense")
    assert code == 1 and f"no run folder {tmp_path}/runs/dense" in err
    code, err = grt(capsys, "eval", trained, "tracking.enabled=true", f"tracking.uri=sqlite:///{tmp_path}/tasks/"
                    f"piqa/original/valid.jsonl/mlflow.db")  # would fail only when logging, after everything
    assert code == 1 and f"{tmp_path}/tasks/piqa/original/valid.jsonl is a file, not a folder" in err
    shutil.rmtree(trained / "eval", ignore_errors=True)
    (trained / "eval").write_text("")  # the eval folder's name taken by a file
    try:
        code, err = grt(capsys, "eval", trained)
        assert code == 1 and f"{trained}/eval is a file, not a folder, so the results cannot be written" in err
    finally:
        (trained / "eval").unlink()
    if not torch.cuda.is_available():
        code, err = grt(capsys, "eval", trained, "train.device=cuda")
        assert code == 1 and "train.device=cuda but torch sees no CUDA device" in err


def test_recipe_errors_from_a_fresh_process():
    """The same one-line errors through the `grt` entry point in a new interpreter (what a user runs)."""
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "info", QUICK, "model.n_head=0", "train.lr=.nan",
                          "model.dropout=inf"], capture_output=True, text=True, cwd=REPO, env=subprocess_env(),
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "3 problems" in out.stderr and "model.n_head must be >= 1, got 0" in out.stderr
    assert "train.lr must be a finite number, got nan" in out.stderr
    assert "model.dropout must be a finite number, got inf" in out.stderr


def test_recipe_file_with_a_list_at_the_top(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump([{"model": {"d_model": 64}}]))
    code, err = grt(capsys, "info", path)
    assert code == 2 and "the top level must be a mapping of sections" in err and "got a list" in err
