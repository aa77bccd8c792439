"""A disk that fills during a checkpoint save (issue #24, item 7): one line that says so, the save's unfinished
staging folder removed, stopped.json written, exit 1; the checkpoint before stays intact and resumes the run.

The disk fills by the GRT_FAULT_DISK_FULL hook (pipeline/train/faults.py): once the given bytes are written into the
step's staging folder, the next write fails with ENOSPC from inside torch.save (or DCP's writer), as on a real full
filesystem (checked by hand on a 30 MB tmpfs, which a test cannot mount without root). The 2-rank sharded async case
is in tests/test_sharded_checkpoint.py."""
from __future__ import annotations

import json
import os

import yaml

from conftest import step_losses
from conftest import tiny_recipe
from pipeline.cli import main as grt
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train import faults
from pipeline.train.checkpoint import verify_checkpoint


def tokenized_recipe(tmp_path, corpus, **train):
    """The tiny recipe with ``train`` overrides, its dataset tokenized: (recipe file, run folder)."""
    recipe = tiny_recipe(tmp_path, corpus)
    recipe["train"].update(train)
    tokenize(from_dict(recipe).data, quiet=True)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, from_dict(recipe).run_dir

def test_a_full_disk_during_a_full_format_save_stops_in_one_line_and_the_run_resumes(tmp_path, corpus, monkeypatch,
                                                                                     capsys):
    path, run_dir = tokenized_recipe(tmp_path, corpus, max_steps=3, checkpoint_interval=2, eval_interval=3)
    ckpts = run_dir / "checkpoints"
    # step 3's state.pt (~19 MB of weights and AdamW moments) fails after its first 64 KiB
    monkeypatch.setattr(faults, "FAULT_DISK_FULL", (3, 1 << 16, None))
    capsys.readouterr()
    assert grt(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: disk full: the checkpoint of step 3 "), err
    assert "Traceback" not in err and f"under {ckpts} " in err and " free of " in err
    assert "out_dir=" in err and f"{ckpts / 'step_00000002'}, is intact" in err
    assert sorted(os.listdir(ckpts)) == ["step_00000002"]  # .tmp_step_00000003 removed, nothing else
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert stopped["step"] == 2 and stopped["checkpoint"] == str(ckpts / "step_00000002"), stopped
    assert verify_checkpoint(ckpts / "step_00000002") == []  # every file's sha256 as written at step 2
    first = step_losses(run_dir)
    assert sorted(first) == [1, 2, 3]  # step 3 was trained before its save failed

    monkeypatch.setattr(faults, "FAULT_DISK_FULL", (0, 0, None))  # space freed
    assert grt(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "resumed at step 2 " in out, out
    assert step_losses(run_dir) == first  # step 3 trained again from the checkpoint: the same loss, exactly
    assert sorted(os.listdir(ckpts)) == ["step_00000002", "step_00000003"]
    assert not (run_dir / "stopped.json").exists()


def test_a_disk_that_fills_outside_a_save_stops_in_one_line(tmp_path, corpus, monkeypatch, capsys):
    """The disk fills while metrics.jsonl is flushed after step 3 (a full disk's flush raises ENOSPC with no file
    name, as here): one line that says so and names the run folder, the intact step-2 checkpoint and the fix;
    stopped.json; exit 1."""
    import errno

    import pipeline.train.callbacks as callbacks

    path, run_dir = tokenized_recipe(tmp_path, corpus, max_steps=4, checkpoint_interval=2, eval_interval=4)

    class FillsAtStep3:
        def __init__(self, f):
            self._f, self._full = f, False

        def write(self, text):
            self._full = self._full or '"step": 3,' in text
            return self._f.write(text)

        def flush(self):
            if self._full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.flush()

        def __getattr__(self, name):
            return getattr(self._f, name)

    monkeypatch.setattr(callbacks, "open", lambda *a, **k: FillsAtStep3(open(*a, **k)), raising=False)
    capsys.readouterr()
    assert grt(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: disk full at step 3: "), err
    assert "Traceback" not in err and f"a file of {run_dir}" in err and " free of " in err, err
    assert f"{run_dir / 'checkpoints' / 'step_00000002'}, is intact" in err and "run the same command again" in err
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert stopped["step"] == 2 and stopped["signal"] == "a full disk", stopped
