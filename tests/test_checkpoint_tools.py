"""`grt checkpoint convert|verify` and what `grt eval` says about what it is given (issue #24, items 1, 5, 11):
convert replaces only a folder it wrote (never notes, a run, or a folder holding runs); `verify --adopt` reads every
file of a sharded or DeepSpeed checkpoint before indexing it; a recipe passed as a checkpoint is named a recipe; an
unfinished run is evaluated with a note saying so. Checkpoints are written by the training backend's own writer
(tests/test_export.py's save_run)."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import tiny_recipe
from pipeline.cli import main as grt
from test_export import save_run

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits on a loaded box

SMALL = {"type": "grt", "vocab_size": 64, "block_size": 16, "d_model": 16, "n_head": 2, "n_prelude": 1, "n_core": 1,
         "n_coda": 1, "n_recurrence": 2}


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones too) with the sha256 of its bytes: what 'left untouched' means."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_convert_out_replaces_only_a_folder_convert_wrote(tmp_path, capsys):
    runs = tmp_path / "runs"
    run = save_run(tmp_path, SMALL, "full", seed=0)[1].run_dir
    assert run.parent == runs
    shutil.move(save_run(tmp_path / "b", SMALL, "full", seed=1)[1].run_dir, runs / "sibling")  # a sibling run
    elsewhere = tmp_path / "lab"  # a folder holding two runs, neither the one converted
    shutil.copytree(runs, elsewhere)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.md").write_text("keep me\n")
    before = {p: snapshot(p) for p in (run, runs, notes, elsewhere)}

    refusals = {notes: "is not an earlier `grt checkpoint convert`", run: "holds the checkpoint being read",
                runs: "holds the checkpoint being read", elsewhere: "is not an earlier `grt checkpoint convert`",
                run / "checkpoints" / "step_00000005": "is the checkpoint being read"}
    for out, words in refusals.items():
        assert grt(["checkpoint", "convert", str(run), "--to", "full", "--out", str(out)]) != 0, out
        err = one_error_line(capsys)
        assert f"--out {out} " in err and words in err, err
    for p, files in before.items():
        assert snapshot(p) == files, p  # nothing deleted, nothing written
    assert not list(tmp_path.glob(".*.tmp")) and not list(runs.glob(".*.tmp"))

    # a folder convert wrote itself is replaced (the second conversion's format, nothing of the first left)
    out = tmp_path / "converted"
    assert grt(["checkpoint", "convert", str(run), "--to", "full", "--out", str(out)]) == 0
    assert (out / "state.pt").is_file()
    assert grt(["checkpoint", "convert", str(run), "--to", "safetensors", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["grt_convert.json", "index.json", "model.safetensors",
                                                     "recipe.yaml"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    # a symbolic link to it is refused in one line (replacing it would replace the link, or delete through it)
    link = tmp_path / "link"
    link.symlink_to(out)
    capsys.readouterr()
    assert grt(["checkpoint", "convert", str(run), "--to", "full", "--out", str(link)]) != 0
    assert "is a symbolic link" in one_error_line(capsys)
    assert link.is_symlink() and (out / "model.safetensors").is_file()
    # ... but not once a run was moved into it
    shutil.copytree(runs / "sibling", out / "sibling")
    assert grt(["checkpoint", "convert", str(run), "--to", "full", "--out", str(out)]) != 0
    assert "holds a run folder" in one_error_line(capsys)
    assert (out / "sibling" / "checkpoints" / "step_00000005" / "state.pt").is_file()


def truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])


def test_verify_adopt_reads_every_shard_of_a_sharded_checkpoint(tmp_path, capsys):
    _, cfg = save_run(tmp_path, SMALL, "sharded", seed=0)
    step = cfg.run_dir / "checkpoints" / "step_00000005"
    (step / "index.json").unlink()  # a checkpoint of a grt before indexes: what --adopt is for
    intact = tmp_path / "intact"
    shutil.copytree(cfg.run_dir, intact)
    shard = step / "model_optim" / "__0_0.distcp"
    truncate(shard)

    assert grt(["checkpoint", "verify", str(cfg.run_dir), "--adopt"]) == 1
    out = capsys.readouterr().out
    assert f"{step}: DAMAGED, not adopted: " in out and str(shard) in out and "truncated" in out, out
    assert not (step / "index.json").exists()
    # the control: the same checkpoint with its shard whole is adopted, and then verifies intact
    assert grt(["checkpoint", "verify", str(intact), "--adopt"]) == 0
    assert "indexed (adopted as it is now)" in capsys.readouterr().out
    assert (intact / "checkpoints" / "step_00000005" / "index.json").is_file()


def test_verify_adopt_reads_every_file_of_a_deepspeed_checkpoint(tmp_path, capsys):
    """The layout grt's DeepSpeed backend saves (state.pt + deepspeed/*.pt), without an index; one ZeRO file cut
    short is named and the checkpoint not adopted."""
    step = tmp_path / "runs" / "ds" / "checkpoints" / "step_00000003"
    (step / "deepspeed").mkdir(parents=True)
    torch.save({"step": 3, "checkpoint_format": "deepspeed"}, step / "state.pt")
    torch.save({"module": {"w": torch.randn(64, 64)}}, step / "deepspeed" / "mp_rank_00_model_states.pt")
    optim = step / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"m": torch.randn(256, 64)}}, optim)
    truncate(optim)
    assert grt(["checkpoint", "verify", str(step.parent.parent), "--adopt"]) == 1
    out = capsys.readouterr().out
    assert f"{step}: DAMAGED, not adopted: cannot read {optim}" in out, out
    assert not (step / "index.json").exists()


def test_a_recipe_passed_as_a_checkpoint_is_named_a_recipe(tmp_path, capsys):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path, tmp_path)))
    run = Path(tmp_path / "runs" / "tiny")
    for argv in (["eval", str(recipe)], ["checkpoint", "convert", str(recipe), "--to", "full"],
                 ["checkpoint", "verify", str(recipe)], ["export", str(recipe), "--out", str(tmp_path / "hf")]):
        assert grt(argv) == 1, argv
        err = one_error_line(capsys)
        assert f"{recipe} is a YAML recipe, not a checkpoint: pass the run folder it trains, {run}" in err, err
        assert "damaged" not in err and f"`grt train {recipe}`" in err, err
    # the recipe.yaml inside a checkpoint folder points at that folder
    _, cfg = save_run(tmp_path / "s", SMALL, "full", seed=0)
    step = cfg.run_dir / "checkpoints" / "step_00000005"
    assert grt(["eval", str(step / "recipe.yaml")]) == 1
    assert f"is the recipe of a checkpoint, not a checkpoint: pass its folder, {step}" in one_error_line(capsys)


def test_eval_of_an_unfinished_run_says_so_and_evaluates(tmp_path, corpus, capsys):
    from pipeline.config import from_dict
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    cfg = from_dict(tiny_recipe(tmp_path, corpus, {"d_model": 16}, eval={"diagnostics": False},
                                train={"max_steps": 4, "eval_interval": 100}))
    tokenize(cfg.data, quiet=True)
    Trainer(cfg).fit()
    ckpts = cfg.run_dir / "checkpoints"
    fast = ["eval.val_tokens=64"]
    assert grt(["eval", str(cfg.run_dir), *fast]) == 0  # finished: no note
    assert "note:" not in capsys.readouterr().err
    assert grt(["eval", str(ckpts / "step_00000002"), *fast]) == 0  # an earlier checkpoint picked by hand
    err = capsys.readouterr().err
    assert f"note: {ckpts / 'step_00000002'} is at step 2 of 4 (train.max_steps): this evaluates an earlier " \
           f"checkpoint; the run's newest is step_00000004" in err, err
    shutil.rmtree(ckpts / "step_00000004")  # as a job killed after its checkpoint at step 2 leaves it
    assert grt(["eval", str(cfg.run_dir), *fast]) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {ckpts / 'step_00000002'} is at step 2 of 4 (train.max_steps): this evaluates an "
                     f"unfinished run; the command that trained it (`grt train`, or `grt launch` on every node) "
                     f"resumes it"], captured.err
    assert (cfg.run_dir / "eval" / "exits.json").is_file()  # and it still evaluated
