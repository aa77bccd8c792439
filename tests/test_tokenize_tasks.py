"""Tokenization across nodes: `grt tokenize RECIPE --tasks N --task-id I` then `grt tokenize merge DIR` writes the
same bytes as a one-node `grt tokenize RECIPE`, also after a task is killed (kill -9) and run again."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from pipeline.tokenize.stage import FAULT_STOP_ENV
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
