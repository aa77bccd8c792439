"""Nothing lost, nothing corrupted (issue #11), training side: one job per run folder, damaged checkpoints found and
skipped, Ctrl-C and SIGTERM that save and say so with their own exit status, one metrics history per run, and a
failed start that leaves nothing behind."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import single_thread
from conftest import step_losses
from conftest import subprocess_env
from conftest import tiny_recipe
from pipeline.cli import main as grt
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train.checkpoint import DamagedCheckpointError
from pipeline.train.checkpoint import resolve_checkpoint
from pipeline.train.trainer import SIGINT_REPEAT_S
from pipeline.train.trainer import Trainer
from resume_check import assert_resumed

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def recipe(tmp_path, corpus):
    r = tiny_recipe(tmp_path, corpus)
    r["train"].update(max_steps=6, keep_checkpoints=3)
    tokenize(from_dict(r).data, quiet=True)
    return r


def history(run_dir: Path) -> list[int]:
    """The step of every training line of metrics.jsonl, in file order (one history: 1, 2, 3, ... once each)."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def write_recipe(tmp_path: Path, recipe: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


# ------------------------------------------------------------------------------------------ damaged checkpoints
def truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])


def flip(f: Path) -> None:
    """Flip one byte in the middle: the size stays, the contents do not (a zip archive may still load)."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (lambda d: truncate(d / "state.pt"), "state.pt has"),
    "bytes_flipped": (lambda d: flip(d / "state.pt"), "state.pt's sha256 differs"),
    "index_missing": (lambda d: (d / "index.json").unlink(), "index.json is missing"),
    "shard_flipped": (lambda d: flip(next((d / "model_optim").glob("*.distcp"))), ".distcp's sha256 differs"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(recipe, tmp_path, damage,
                                                                                         capsys):
    if damage == "shard_flipped":
        recipe["train"]["checkpoint_format"] = "sharded"
    reference = from_dict({**recipe, "name": "reference"})
    Trainer(reference).fit()
    cfg = from_dict(recipe)
    Trainer(cfg).fit()
    ckpts = cfg.run_dir / "checkpoints"
    newest = ckpts / "step_00000006"
    do, words = DAMAGE[damage]
    do(newest)

    # eval refuses it, naming the damage and the intact checkpoint beside it
    with pytest.raises(DamagedCheckpointError) as e:
        resolve_checkpoint(cfg.run_dir)
    assert str(newest) in str(e.value) and words in str(e.value) and "step_00000004" in str(e.value)
    assert grt(["eval", str(cfg.run_dir)]) == 1
    assert "is damaged" in capsys.readouterr().err
    assert grt(["checkpoint", "verify", str(cfg.run_dir)]) == 1
    assert f"{newest}: DAMAGED: " in capsys.readouterr().out

    capsys.readouterr()
    t = Trainer(cfg)
    err = capsys.readouterr().err
    assert t.step == 4, "the resume did not fall back to the newest intact checkpoint"
    assert f"checkpoint {newest} is damaged" in err and words in err
    if damage == "index_missing":  # perhaps a trusted checkpoint of an older grt: kept, out of the way of new saves
        assert (ckpts / "unindexed_step_00000006").is_dir() and not (ckpts / "damaged_step_00000006").exists()
        assert "renamed" in err and "--adopt" in err
    else:
        assert (ckpts / "damaged_step_00000006").is_dir() and not newest.exists()  # kept for inspection, aside
    t.fit()
    resumed, full = step_losses(cfg.run_dir), step_losses(reference.run_dir)
    for step in (5, 6):
        assert resumed[step] == full[step]  # exact: the retrained steps equal the uninterrupted run's
    assert history(cfg.run_dir) == [1, 2, 3, 4, 5, 6]  # the first 5, 6 were cut: one history
    assert resolve_checkpoint(cfg.run_dir).parent.name == "step_00000006"  # the new one is intact


def test_every_checkpoint_damaged_is_an_error_naming_them(recipe):
    cfg = from_dict(recipe)
    Trainer(cfg).fit()
    for d in (cfg.run_dir / "checkpoints").glob("step_*"):
        truncate(d / "state.pt")
    with pytest.raises(ValueError, match="every checkpoint under .* is damaged"):
        Trainer(cfg)
    assert sorted(d.name for d in (cfg.run_dir / "checkpoints").iterdir()) == [
        "damaged_step_00000002", "damaged_step_00000004", "damaged_step_00000006"]
    with pytest.raises(DamagedCheckpointError, match="set aside as damaged"):
        resolve_checkpoint(cfg.run_dir)


def test_checkpoints_without_an_index_are_kept_and_adopt_indexes_them(recipe, capsys):
    """What a run of a grt before indexes looks like: resume refuses to guess, names --adopt, renames nothing."""
    cfg = from_dict(recipe)
    Trainer(cfg).fit()
    for d in (cfg.run_dir / "checkpoints").glob("step_*"):
        (d / "index.json").unlink()
    with pytest.raises(ValueError, match="3 have no index.json .* --adopt"):
        Trainer(cfg)
    assert sorted(d.name for d in (cfg.run_dir / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004", "step_00000006"]
    assert grt(["checkpoint", "verify", str(cfg.run_dir)]) == 1
    assert grt(["checkpoint", "verify", str(cfg.run_dir), "--adopt"]) == 0
    assert capsys.readouterr().out.count("indexed (adopted") == 3
    assert Trainer(cfg).step == 6


# ------------------------------------------------------------------------------------------ one job per folder
def test_a_second_training_on_the_same_run_folder_exits_at_once_naming_the_first(recipe, tmp_path):
    recipe["train"].update(max_steps=100000, checkpoint_interval=100000, eval_interval=100000)
    path = write_recipe(tmp_path, recipe)
    run_dir = from_dict(recipe).run_dir
    first = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", str(path)], cwd=REPO,
                             env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((run_dir / "metrics.jsonl").is_file() and step_losses(run_dir)):
            time.sleep(0.05)
        t0 = time.time()
        second = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(path), "train.lr=0.002"],
                                cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stderr[-2000:]
        assert time.time() - t0 < 60
        assert f"run folder {run_dir.resolve()} is in use by another job: pid {first.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first goes on
    finally:
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 143, out[-2000:]
    assert history(run_dir) == list(range(1, len(history(run_dir)) + 1))  # one history, the first job's
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["train"]["lr"] == recipe["train"]["lr"]


def test_a_lock_left_by_a_dead_job_is_taken_over_with_a_message(recipe, tmp_path):
    run_dir = from_dict(recipe).run_dir
    code = ("import os, sys; from pipeline.runtime.locking import FolderLock; "
            f"FolderLock({str(run_dir)!r}, 'run folder').acquire(); os._exit(9)")
    dead = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env())
    assert dead.returncode == 9 and (run_dir / ".lock").stat().st_size > 0
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(write_recipe(tmp_path, recipe))],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "took over the run folder" in p.stderr and "ended without releasing it" in p.stderr


# --------------------------------------------------------------------------------------------- signals
def test_sigint_at_a_known_step_saves_exits_130_and_resumes_exactly(recipe, tmp_path):
    path = write_recipe(tmp_path, recipe)
    with single_thread():  # the uninterrupted reference, in this process, on one thread as the launched runs
        Trainer(from_dict({**recipe, "name": "ref"})).fit()
    cmd = [sys.executable, "-m", "pipeline.cli", "train", str(path)]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(GRT_FAULT_SIGNAL_AT_STEP="3:SIGINT"), capture_output=True,
                       text=True, timeout=300)
    run_dir = from_dict(recipe).run_dir
    assert p.returncode == 130, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "SIGINT: saved step 3 (of 6)" in p.stderr and "the same command resumes it" in p.stderr
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()  # the interval is 2: this one is the Ctrl-C's
    assert json.loads((run_dir / "stopped.json").read_text())["step"] == 3  # for launchers that hide the status
    # a SIGTERM during the last step: the run is finished all the same (exit 0, not "stopped")
    again = subprocess.run(cmd, cwd=REPO, env=subprocess_env(GRT_FAULT_SIGNAL_AT_STEP="6:SIGTERM"),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not (run_dir / "stopped.json").exists()
    assert_resumed(again.stdout, 3, 6, run_dir, step_losses(run_dir.parent / "ref"), on="single x1")


def test_grt_run_stops_after_the_sigterm_save_and_does_not_evaluate(recipe, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(write_recipe(tmp_path, recipe))], cwd=REPO,
                       env=subprocess_env(GRT_FAULT_SIGNAL_AT_STEP="3:SIGTERM"), capture_output=True, text=True,
                       timeout=300)
    run_dir = from_dict(recipe).run_dir
    assert p.returncode == 143, p.stderr[-2000:]
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()
    assert not (run_dir / "eval").exists()  # the half-trained model was not evaluated


def test_a_second_ctrl_c_aborts_at_once_the_same_one_delivered_twice_does_not(recipe):
    t = Trainer(from_dict(recipe))
    t._on_signal(signal.SIGINT, None)
    t._on_signal(signal.SIGINT, None)  # torchrun passing the terminal's Ctrl-C on: the same press
    t._on_signal(signal.SIGTERM, None)  # a launcher's TERM after the Ctrl-C: still a save
    assert t._stop_signal == signal.SIGINT
    t._stop_time -= SIGINT_REPEAT_S + 0.1
    with pytest.raises(KeyboardInterrupt):
        t._on_signal(signal.SIGINT, None)
    t._release_run_folder()


# ------------------------------------------------------------------------------ history, recipe, run folder
def test_resume_past_max_steps_says_so_and_leaves_the_recipe_alone(recipe, tmp_path, capsys):
    cfg = from_dict(recipe)
    Trainer(cfg).fit()
    written = (cfg.run_dir / "recipe.yaml").read_text()
    recipe["train"].update(max_steps=4, lr=0.002)
    capsys.readouterr()
    Trainer(from_dict(recipe)).fit()
    out = capsys.readouterr()
    assert "already past train.max_steps=4" in out.out and "newest checkpoint is step 6" in out.out
    assert "the recipe changed since the checkpoint at step 6" in out.err
    assert "train.lr: 0.001 -> 0.002" in out.err and "train.max_steps: 6 -> 4" in out.err
    assert (cfg.run_dir / "recipe.yaml").read_text() == written
    assert history(cfg.run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_restart_from_scratch_keeps_one_history_and_the_old_one_aside(recipe, capsys):
    cfg = from_dict(recipe)
    Trainer(cfg).fit()
    shutil.rmtree(cfg.run_dir / "checkpoints")
    capsys.readouterr()
    Trainer(cfg).fit()
    assert "the earlier metrics moved to metrics.before-" in capsys.readouterr().err
    assert history(cfg.run_dir) == [1, 2, 3, 4, 5, 6]
    aside = list(cfg.run_dir.glob("metrics.before-*.jsonl"))
    assert len(aside) == 1 and history_of(aside[0]) == [1, 2, 3, 4, 5, 6]


def history_of(f: Path) -> list[int]:
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if "loss" in json.loads(line)]


def test_a_validation_failure_still_saves_the_finished_steps(recipe, monkeypatch):
    recipe["train"].update(eval_interval=3, checkpoint_interval=100)
    t = Trainer(from_dict(recipe))

    def failing_validate():
        raise ValueError("validation data went away")

    monkeypatch.setattr(t, "validate", failing_validate)
    with pytest.raises(ValueError, match="went away"):
        t.fit()
    assert (t.checkpointer.dir / "step_00000003").is_dir()  # step 3's validation failed: steps 1-3 are kept


def test_a_failed_start_leaves_no_run_folder(recipe, tmp_path):
    recipe["data"]["dataset_dir"] = str(tmp_path / "not-tokenized")
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(write_recipe(tmp_path, recipe))],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "grt tokenize" in p.stderr, p.stderr[-2000:]
    assert not from_dict(recipe).run_dir.exists()
    recipe["data"]["dataset_dir"] = str(tmp_path / "dataset")
    recipe["model"]["n_recurrence"] = 4  # fails after the folder is taken: the model differs from the checkpoint
    Trainer(from_dict({**recipe, "model": {**recipe["model"], "n_recurrence": 3}})).fit()
    with pytest.raises(ValueError, match="the model changed"):
        Trainer(from_dict(recipe))
    assert from_dict(recipe).run_dir.is_dir()  # a folder with checkpoints is of course kept
    assert not (from_dict(recipe).run_dir / ".lock").read_text()  # and released


# ------------------------------------------------------------------------------ data checked before step 1
def test_a_too_short_validation_set_fails_before_step_1_with_the_hint_that_fits(tmp_path, corpus):
    (tmp_path / "val.txt").write_text("a few words")
    r = tiny_recipe(tmp_path, corpus, data={"validation_sources": [{"kind": "files",
                                                                    "paths": [str(tmp_path / "val.txt")]}]})
    tokenize(from_dict(r).data, quiet=True)
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(write_recipe(tmp_path, r))], cwd=REPO,
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "val split" in p.stderr and "data.validation_sources" in p.stderr and "val_fraction" not in p.stderr
    assert not from_dict(r).run_dir.exists()  # nothing trained, nothing left behind


def test_block_size_beyond_the_shards_names_shard_tokens(tmp_path, corpus):
    r = tiny_recipe(tmp_path, corpus, model={"block_size": 1024})
    r["data"]["shard_tokens"] = 1024  # windows of 1025 tokens cannot fit in one shard
    tokenize(from_dict(r).data, quiet=True)
    with pytest.raises(ValueError, match=r"data.shard_tokens=1,024 < model.block_size\+1=1,025 and windows never "
                                         r"cross shards"):
        Trainer(from_dict(r))


def test_a_truncated_shard_and_an_id_beyond_the_vocabulary_are_named(recipe):
    import numpy as np

    cfg = from_dict(recipe)
    shard = Path(cfg.data.dataset_dir) / "train_000001.bin"
    original = shard.read_bytes()
    shard.write_bytes(original[:1000])
    with pytest.raises(ValueError, match="train_000001.bin holds 500 tokens .*the manifest says 4,096"):
        Trainer(cfg)
    ids = np.frombuffer(original, dtype="<u2").copy()
    ids[123] = 60000  # >= the GPT-2 vocabulary (50,257): same size, so only data.verify=full or the batch sees it
    shard.write_bytes(ids.tobytes())
    with pytest.raises(ValueError, match=r"train_000001.bin holds 1 token id\(s\) >= .* the first \(60000\) at token "
                                         r"offset 123"):
        Trainer(from_dict({**recipe, "data": {**recipe["data"], "verify": "full"}}))
    recipe["train"].update(max_steps=40)  # enough steps to draw every window of the dataset
    t = Trainer(from_dict(recipe))
    with pytest.raises(ValueError) as e:
        t.fit()
    assert "token id 60000 at token offset 123" in str(e.value) and "train_000001.bin" in str(e.value)
    assert "grt data verify" in str(e.value)


# ------------------------------------------------------------------------------------------------ eval side
def test_eval_takes_a_moved_dataset_and_refuses_a_loose_damaged_file(recipe, tmp_path, capsys):
    cfg = from_dict(recipe)
    Trainer(cfg).fit()
    moved = tmp_path / "moved-dataset"
    shutil.move(cfg.data.dataset_dir, moved)
    assert grt(["eval", str(cfg.run_dir), f"data.dataset_dir={moved}", "eval.max_steps=2"]) == 0
    assert grt(["eval", str(cfg.run_dir), "data.tokenizer=gpt2", "model.d_model=64"]) == 2  # not the trained model
    loose = tmp_path / "loose" / "state.pt"
    loose.parent.mkdir()
    loose.write_bytes(b"\x80\x04not a pickle at all")
    capsys.readouterr()
    assert grt(["eval", str(loose)]) == 1
    err = capsys.readouterr().err
    assert f"cannot read {loose}" in err and "Traceback" not in err
