"""Tokenization across nodes: `grt tokenize RECIPE --tasks N --task-id I` then `grt tokenize merge DIR` writes the
same bytes as a one-node `grt tokenize RECIPE`, also after a task is killed (kill -9) and run again."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipeline.cli import main
from pipeline.config import from_dict
from pipeline.tokenize.merge import merge
from pipeline.tokenize.merge import unit_problems
from pipeline.tokenize.sources import Unit
from pipeline.tokenize.stage import FAULT_STOP_ENV
from pipeline.tokenize.stage import data_fingerprint
from pipeline.tokenize.tasks import slice_units

REPO = Path(__file__).resolve().parents[1]


def tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (hidden ones and subfolders included) but the folder lock's."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.name.startswith(".lock")}


def _corpus(root: Path) -> dict:
    """Three sources over 10 files; documents repeated within a file, across files and across sources (so across
    tasks), a record without the text field, and a max_bytes cap that stops the second source partway."""
    rng = random.Random(3)
    vocab = [f"w{i}" for i in range(500)] + "the of and to in is was for on".split()
    docs = [f"doc {i}: " + " ".join(rng.choice(vocab) for _ in range(rng.randint(20, 200))) for i in range(300)]
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    seen: list[str] = []
    for f in range(6):
        lines = [{"text": docs[rng.randrange(300)]} for _ in range(40)]  # ~13% repeats of earlier documents
        seen += [x["text"] for x in lines]
        lines.insert(5, {"content": "no text field"})
        (root / "a" / f"part{f}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for f in range(3):
        (root / "b" / f"t{f}.txt").write_text("\n\n".join(docs[rng.randrange(300)] for _ in range(30)))
    # 50 documents all met in the first source, from every one of its files (so from every task)
    (root / "c.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in seen[::len(seen) // 50][:50]))
    return {"sources": [{"paths": [str(root / "a" / "*.jsonl")]},
                        {"paths": [str(root / "b" / "*.txt")], "text_mode": "paragraphs", "max_bytes": 20_000},
                        {"paths": [str(root / "c.jsonl")], "text_field": "body"}],
            "shard_tokens": 1024, "val_fraction": 0.15, "workers": 1}


def _recipe(tmp_path: Path, data: dict, name: str) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump({"name": "tok", "data": {**data, "dataset_dir": str(tmp_path / name)}}))
    return f


def test_slices_are_contiguous_balanced_and_cover_every_unit():
    sizes = [100, 100, None, 400, 100, 100, 100, 100]
    owner = slice_units(sizes, 3)
    assert owner == sorted(owner) and set(owner) == {0, 1, 2}
    # None counts as the mean 1000/7: midpoints 50 150 271 543 793 893 993 1093 of 1143, times 3 / 1143, floored
    assert owner == [0, 0, 0, 1, 2, 2, 2, 2]
    assert slice_units([5], 4) == [2]  # one unit: one task has it, the others are empty


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _kill_at_snapshot(cmd: list[str], n: int) -> None:
    """Run ``cmd``, which stops itself as it is about to save state snapshot ``n``, and SIGKILL it there."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, FAULT_STOP_ENV: str(n)})
    deadline = time.time() + 60
    while proc.poll() is None and not _stopped(proc.pid) and time.time() < deadline:
        time.sleep(0.01)
    assert _stopped(proc.pid), f"{cmd} did not stop at its snapshot {n} (exit status {proc.poll()})"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.multiprocess
def test_three_tasks_and_merge_equal_one_node_also_after_kill_9(tmp_path, capsys):
    data = _corpus(tmp_path / "corpus")
    one = _recipe(tmp_path, data, "one")
    assert main(["tokenize", str(one)]) == 0
    ref = tree(tmp_path / "one")
    m = json.loads(ref["manifest.json"])
    assert m["totals"]["duplicates"] >= 50 and m["sources"][2]["duplicates"] == 50  # dedup across tasks is exercised
    assert m["sources"][0]["skipped"]["missing_text_field"] == 6
    assert 0 < m["sources"][1]["bytes"] <= 20_000 and m["splits"]["val"]["documents"] > 5
    assert len(m["splits"]["train"]["shards"]) > 10

    multi = _recipe(tmp_path, data, "multi")
    out = tmp_path / "multi"
    # task 1 stops itself at its 3rd state snapshot and is killed with SIGKILL there
    cmd = [sys.executable, "-m", "pipeline.cli", "tokenize", str(multi), "--tasks", "3", "--task-id"]
    _kill_at_snapshot([*cmd, "1"], 3)
    assert json.loads((out / ".tasks/1/.progress/state.json").read_text())["snapshots"] == 2
    for i in (0, 2):
        assert main(["tokenize", str(multi), "--tasks", "3", "--task-id", str(i)]) == 0
    capsys.readouterr()
    assert main(["tokenize", "merge", str(out)]) == 1  # task 1 unfinished: refused in one line, naming it
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "task 1 of 3" in err and f"grt tokenize {multi} --tasks 3 --task-id 1" in err, err
    assert not (out / "manifest.json").exists()

    run = subprocess.run([*cmd, "1"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         check=True)
    assert "task 1 of 3: resuming after" in run.stderr, run.stderr[-1000:]
    assert all((out / ".tasks" / str(i) / "task.json").is_file() for i in range(3))
    _kill_at_snapshot([sys.executable, "-m", "pipeline.cli", "tokenize", "merge", str(out)], 5)  # the merge too
    assert json.loads((out / ".progress/state.json").read_text())["snapshots"] == 4
    assert main(["tokenize", "merge", str(out)]) == 0
    got = tree(out)
    assert not (out / ".tasks").exists() and not (out / ".progress").exists()
    assert got["manifest.json"].decode() == ref["manifest.json"].decode()  # a readable diff on failure
    assert sorted(got) == sorted(ref)
    assert [n for n in ref if got[n] != ref[n]] == []
    record = {n: (len(b), hashlib.sha256(b).hexdigest()) for n, b in got.items()}
    print("byte-identity:", len(record), "files,", sum(n for n, _ in record.values()), "bytes, all equal;",
          json.dumps(record))  # for the report: every file, its size and sha256, equal to the one-node run


def test_merge_writes_into_the_folder_it_is_given_from_any_working_folder(tmp_path, monkeypatch):
    """A recipe's relative data.dataset_dir is taken from where the tasks ran; `grt tokenize merge DIR` run from
    another folder merges DIR itself (not DIR's relative path again under the new working folder)."""
    data = _corpus(tmp_path / "corpus")
    one = _recipe(tmp_path, data, "one")
    assert main(["tokenize", str(one)]) == 0
    (tmp_path / "rel.yaml").write_text(yaml.safe_dump({"name": "tok", "data": {**data, "dataset_dir": "data/ds"}}))
    monkeypatch.chdir(tmp_path)
    for i in range(2):
        assert main(["tokenize", "rel.yaml", "--tasks", "2", "--task-id", str(i)]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["tokenize", "merge", str(tmp_path / "data" / "ds")]) == 0
    assert tree(tmp_path / "data" / "ds") == tree(tmp_path / "one")
    assert not (tmp_path / "elsewhere" / "data").exists()


def _tasks(recipe: Path, n: int, ids=None, force: bool = False) -> None:
    for i in range(n) if ids is None else ids:
        assert main(["tokenize", str(recipe), "--tasks", str(n), "--task-id", str(i), *(["--force"] * force)]) == 0


def test_force_redoes_a_task_and_a_task_checks_the_folder_it_merges_into(tmp_path, capsys):
    data = _corpus(tmp_path / "corpus")
    one = _recipe(tmp_path, data, "one")
    assert main(["tokenize", str(one)]) == 0
    ref = tree(tmp_path / "one")
    capsys.readouterr()
    _tasks(one, 3, [0])  # this config's finished dataset: up to date, nothing written
    assert "is up to date" in capsys.readouterr().out and not (tmp_path / "one" / ".tasks").exists()
    other = tmp_path / "other.yaml"  # another data config, same folder: refused in one line, both fingerprints
    other.write_text(yaml.safe_dump({"name": "tok", "data": {**data, "val_fraction": 0.3,
                                                             "dataset_dir": str(tmp_path / "one")}}))
    assert main(["tokenize", str(other), "--tasks", "3", "--task-id", "0"]) == 1
    err = capsys.readouterr().err.strip()
    fp_one = json.loads(ref["manifest.json"])["fingerprint"]
    fp_other = data_fingerprint(from_dict({"data": {**data, "val_fraction": 0.3}}).data)
    assert "\n" not in err and fp_one in err and fp_other in err and "--force" in err, err
    assert tree(tmp_path / "one") == ref

    multi = _recipe(tmp_path, data, "multi")
    out = tmp_path / "multi"
    _tasks(multi, 3)
    shard = sorted((out / ".tasks/0").glob("docs_*.bin"))[1]
    shard.write_bytes(bytes(len(shard.read_bytes())))  # task 0's output damaged after it finished
    (out / ".tasks/0/mine.txt").write_text("a user's file")
    (out / "notes.txt").write_text("a user's file")
    _tasks(multi, 3, [0])
    assert "task 0 of 3 is done" in capsys.readouterr().out  # without --force a finished task is kept
    _tasks(multi, 3, [0], force=True)
    run = capsys.readouterr()
    assert "resuming" not in run.err and "is done" not in run.out and "task 0 of 3:" in run.out
    assert (out / ".tasks/0/mine.txt").read_text() == "a user's file"  # only what grt wrote is redone
    (out / ".tasks/0/mine.txt").unlink()
    assert main(["tokenize", "merge", str(out)]) == 0
    got = tree(out)
    assert got.pop("notes.txt") == b"a user's file"
    assert got == ref
    # --force on a finished dataset: its manifest goes (the merge rebuilds it), the task is redone, user files stay
    _tasks(multi, 3, [1], force=True)
    assert not (out / "manifest.json").exists() and (out / "notes.txt").is_file()
    capsys.readouterr()
    assert main(["tokenize", "merge", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tasks 0, 2 of 3 are missing or unfinished" in err, err
    _tasks(multi, 3, [0, 2])
    other.write_text(yaml.safe_dump({"name": "tok", "data": {**data, "val_fraction": 0.3, "dataset_dir": str(out)}}))
    assert main(["tokenize", str(other)]) == 0  # another config's dataset written into the folder meanwhile
    capsys.readouterr()
    assert main(["tokenize", "merge", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fp_other in err and "--force" in err, err
    assert main(["tokenize", "merge", str(out), "--force"]) == 0
    got = tree(out)
    assert got.pop("notes.txt") == b"a user's file"
    assert got == ref


def test_merge_checks_the_units_the_tasks_read_against_the_split_of_the_sources(tmp_path, capsys):
    """A file grown and a file added after the tasks ran: the merge names the units and the tasks to redo; redoing
    them (--force) gives the one-node dataset of the sources as they are now."""
    data = _corpus(tmp_path / "corpus")
    multi = _recipe(tmp_path, data, "multi")
    out = tmp_path / "multi"
    _tasks(multi, 3)
    a = tmp_path / "corpus" / "a"
    before = (a / "part0.jsonl").stat().st_size
    with open(a / "part0.jsonl", "a") as f:
        f.write(json.dumps({"text": "a document added to part0 after its task ran"}) + "\n")
    (a / "part6.jsonl").write_text("".join(json.dumps({"text": f"new document {i} " * 30}) + "\n" for i in range(40)))
    one = _recipe(tmp_path, data, "one")
    assert main(["tokenize", str(one)]) == 0
    ref = tree(tmp_path / "one")
    capsys.readouterr()
    assert main(["tokenize", "merge", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and not (out / "manifest.json").exists(), err
    assert f"in no task: {a / 'part6.jsonl'}" in err, err
    assert f"{a / 'part0.jsonl'} at {before:,} bytes (task 0), now {(a / 'part0.jsonl').stat().st_size:,} bytes" in err
    redo = sorted({int(i) for i in re.findall(r"--task-id (\d+) --force", err)})
    assert 0 in redo and redo == sorted(set(redo)), err
    _tasks(multi, 3, redo, force=True)
    assert main(["tokenize", "merge", str(out)]) == 0
    assert tree(out) == ref


def test_merge_never_mixes_in_the_folders_of_a_run_with_another_number_of_tasks(tmp_path, capsys, monkeypatch):
    data = _corpus(tmp_path / "corpus")
    one = _recipe(tmp_path, data, "one")
    assert main(["tokenize", str(one)]) == 0
    ref = tree(tmp_path / "one")
    multi = _recipe(tmp_path, data, "multi")
    out = tmp_path / "multi"
    _tasks(multi, 4)  # an earlier attempt with 4 tasks, then 3
    _tasks(multi, 3, [0, 1])
    capsys.readouterr()
    assert main(["tokenize", "merge", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "newest run is --tasks 3" in err, err
    assert "folder 2 (--tasks 4, " in err and "--tasks 3 --task-id 2`" in err, err  # replaced by task 2 of 3
    assert "folder 3 (--tasks 4, " in err and f"rm -r {out / '.tasks' / '3'}" in err, err  # left over
    _tasks(multi, 3, [2])
    assert main(["tokenize", "merge", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "folder 2" not in err and f"rm -r {out / '.tasks' / '3'}`" in err, err
    assert not (out / "manifest.json").exists()
    shutil.rmtree(out / ".tasks" / "3")  # as the message says
    # the merge dies once it has deleted some of what the tasks wrote (after the manifest): run again, it is done
    rmtree = shutil.rmtree

    def killed_after(path, *args, **kwargs):
        existed = Path(path).exists()
        rmtree(path, *args, **kwargs)
        if existed and ".tasks" in str(path):
            raise _Killed

    monkeypatch.setattr(shutil, "rmtree", killed_after)
    with pytest.raises(_Killed):
        merge(out, quiet=True)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert main(["tokenize", "merge", str(out)]) == 0
    assert "is already merged" in capsys.readouterr().out
    assert tree(out) == ref


class _Killed(BaseException):
    """A kill -9 at a chosen point, in process."""


def test_unit_check_names_units_in_no_task_or_read_twice(tmp_path):
    """Six files of 100 bytes split for 3 tasks: [f0 f1] [f2 f3] [f4 f5] (midpoints 50..550 of 600, times 3 / 600).
    Task 1 read f1 too, and task 2 did not read f4."""
    units = [[Unit(0, i, f"f{i}", "jsonl", 100) for i in range(6)]]
    read = {0: [0, 1], 1: [1, 2, 3], 2: [5]}
    for t, idx in read.items():
        (tmp_path / ".tasks" / str(t)).mkdir(parents=True)
        (tmp_path / ".tasks" / str(t) / "task.json").write_text(json.dumps({"units": [[0, i, f"f{i}", 100]
                                                                                       for i in idx]}))
    msg = unit_problems(tmp_path, SimpleNamespace(units=units), 3, "r.yaml")
    assert "\n" not in msg and "in no task: f4 at 100 bytes;" in msg, msg
    assert "read twice: f1 at 100 bytes (tasks 0, 1)" in msg, msg
    assert msg.endswith("redo tasks 1, 2: `grt tokenize r.yaml --tasks 3 --task-id 1 --force`; "
                        "`grt tokenize r.yaml --tasks 3 --task-id 2 --force`, then merge again"), msg
    read[1], read[2] = [2, 3], [4, 5]
    for t in (1, 2):
        (tmp_path / ".tasks" / str(t) / "task.json").write_text(json.dumps({"units": [[0, i, f"f{i}", 100]
                                                                                       for i in read[t]]}))
    assert unit_problems(tmp_path, SimpleNamespace(units=units), 3, "r.yaml") is None
