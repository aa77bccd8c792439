"""Nothing lost or corrupted by the tokenize stage: one job per dataset folder (lock, stale-lock takeover, workers
that let go of it and end with the job), damaged compressed inputs that fail naming the file and the byte offset,
and a `text_field` that the records lack, said as such."""
from __future__ import annotations

import ctypes
import gzip
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest
import yaml
import zstandard

from conftest import subprocess_env
from pipeline.cli import main
from pipeline.config import DataConfig
from pipeline.config import RecipeError
from pipeline.config import SourceConfig
from pipeline.runtime.locking import FolderLock
from pipeline.tokenize import tokenize
from pipeline.tokenize.sources import DamagedInputError
from pipeline.tokenize.worker import init_worker
from pipeline.tokenize.writer import verify_dataset

REPO = Path(__file__).resolve().parents[1]
N_DOCS = 2000  # ~180 KB compressed: several of the zstd reader's 64 KB chunks, so a cut falls mid-stream


def docs(n: int, seed: int = 0, words: int = 40) -> list[str]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(3000)] + "the of and to in is was for on that with as it by".split()
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


def jsonl(texts: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: t}) + "\n" for t in texts).encode()


def grt(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def recipe(tmp_path: Path, data: dict) -> Path:
    f = tmp_path / "recipe.yaml"
    f.write_text(yaml.safe_dump({"name": "tok", "data": data}))
    return f


# ------------------------------------------------------------------------------------------------ dataset lock
def test_second_tokenize_into_one_folder_fails_naming_the_holder(tmp_path):
    """Two `grt tokenize` on one dataset_dir: the first holds it (reading a FIFO the test feeds only after the
    second has tried), the second exits 1 at once naming the first's pid, the first's dataset verifies."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    ds = tmp_path / "ds"
    rec = recipe(tmp_path, {"sources": [{"paths": [str(fifo)]}], "dataset_dir": str(ds), "val_fraction": 0.2,
                            "shard_tokens": 4096})
    first = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "tokenize", str(rec), "--workers", "2"],
                             cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and first.poll() is None:
            text = (ds / ".lock").read_text() if (ds / ".lock").is_file() else ""
            if text.strip() and json.loads(text)["pid"] == first.pid:
                break
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()
        second = grt("tokenize", str(rec), "--workers", "1", timeout=60)
        assert second.returncode == 1, second.stderr
        assert f"pid {first.pid}" in second.stderr and "dataset folder" in second.stderr
        assert "in use by another job" in second.stderr and "Traceback" not in second.stderr
        texts = docs(300, seed=1)
        with open(fifo, "wb") as f:  # now the first job reads its input and finishes
            f.write(jsonl(texts))
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    m = json.loads((ds / "manifest.json").read_text())
    assert m["totals"]["documents"] == len(texts)
    assert main(["data", "verify", str(ds)]) == 0
    assert (ds / ".lock").read_text() == ""  # released: the holder record is cleared


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no_flock"])
def test_a_dead_jobs_lock_is_taken_over(tmp_path, capsys, monkeypatch, flock):
    if not flock:  # as on a filesystem without flock: the lock is an exclusively created file
        monkeypatch.setenv("GRT_LOCK_FALLBACK", "1")
    ds = tmp_path / "ds"
    code = ("import os, sys\nfrom pipeline.runtime.locking import FolderLock\n"
            f"FolderLock({str(ds)!r}, 'dataset folder').acquire()\nprint(os.getpid(), flush=True)\nos._exit(0)\n")
    dead = int(subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout)
    left = ds / (".lock" if flock else ".lock.excl")
    assert json.loads(left.read_text())["pid"] == dead  # the record the dead job left behind
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(docs(50)))
    m = tokenize(DataConfig(sources=[SourceConfig(paths=[str(src)])], dataset_dir=str(ds), val_fraction=0.2),
                 quiet=True)
    err = capsys.readouterr().err
    assert "took over the dataset folder" in err and f"pid {dead}" in err
    assert m["totals"]["documents"] == 50 and verify_dataset(ds) == []
    with FolderLock(ds, "dataset folder"):  # and the job released it
        pass


def test_an_up_to_date_check_waits_out_a_brief_holder_and_force_keeps_the_lock(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(docs(50)))
    ds = tmp_path / "ds"
    cfg = DataConfig(sources=[SourceConfig(paths=[str(src)])], dataset_dir=str(ds), val_fraction=0.2)
    made = tokenize(cfg, quiet=True, workers=1)
    # another job holds the folder for a moment (as a second `grt run` sharing the dataset does while it checks)
    code = ("import sys, time\nfrom pipeline.runtime.locking import FolderLock\n"
            f"with FolderLock({str(ds)!r}, 'dataset folder'):\n    print('held', flush=True)\n    time.sleep(1.0)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        assert tokenize(cfg, quiet=True)["fingerprint"] == made["fingerprint"]  # waited, then found it up to date
        assert time.time() - t0 > 0.3
    finally:
        holder.wait(timeout=30)
    rebuilt = tokenize(cfg, quiet=True, force=True, workers=1)  # --force empties the folder, all but the lock
    assert rebuilt["splits"] == made["splits"] and verify_dataset(ds) == []
    assert (ds / ".lock").is_file() and (ds / ".lock").read_text() == ""


def _lock_state_in_worker(fd: int) -> tuple[bool, int]:
    try:
        os.fstat(fd)
        still_open = True
    except OSError:
        still_open = False
    sig = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return still_open, sig.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork workers and prctl are Linux's")
def test_workers_drop_the_inherited_lock_and_die_with_the_job(tmp_path):
    with FolderLock(tmp_path / "ds", "dataset folder") as lock:
        with ProcessPoolExecutor(1, mp_context=get_context("fork"), initializer=init_worker,
                                 initargs=(os.getpid(),)) as pool:
            still_open, sig = pool.submit(_lock_state_in_worker, lock._fd).result(timeout=60)
    assert not still_open  # the lock's descriptor is closed in the worker: it dies with the job, not with a worker
    assert sig == 9  # SIGKILL when the job's process ends


# ------------------------------------------------------------------------------------- damaged compressed inputs
def _damage(tmp_path: Path, kind: str) -> tuple[Path, int, int]:
    """A damaged copy of N_DOCS documents; returns (path, where the damage is, size of the good file)."""
    raw = jsonl(docs(N_DOCS))
    if kind.startswith("zst"):
        good = zstandard.ZstdCompressor().compress(raw)
    elif kind.startswith("gz"):
        good = gzip.compress(raw)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs(N_DOCS)}), tmp_path / "good.parquet", row_group_size=500)
        good = (tmp_path / "good.parquet").read_bytes()
    at = len(good) // 2
    data = bytearray(good[:at]) if kind.endswith("truncated") else bytearray(good)
    if kind.endswith("corrupted"):
        data[at:at + 64] = b"\xff" * 64
    path = tmp_path / {"zst": "in.jsonl.zst", "gz": "in.jsonl.gz", "parquet": "in.parquet"}[kind.split("_")[0]]
    path.write_bytes(bytes(data))
    return path, at, len(good)


@pytest.mark.parametrize("kind", ["zst_truncated", "zst_corrupted", "gz_truncated", "gz_corrupted",
                                  "parquet_truncated"])
@pytest.mark.parametrize("strict", [False, True])
def test_damaged_input_fails_naming_file_and_offset(tmp_path, kind, strict):
    path, at, size = _damage(tmp_path, kind)
    cfg = DataConfig(sources=[SourceConfig(paths=[str(path)])], dataset_dir=str(tmp_path / "ds"), val_fraction=0.2)
    with pytest.raises(DamagedInputError) as e:
        tokenize(cfg, quiet=True, strict=strict, workers=1)
    msg = str(e.value)
    assert msg.startswith(f"{path} is damaged") and "data.sources[0].paths" in msg
    assert not (tmp_path / "ds" / "manifest.json").exists()
    if kind.endswith("truncated") and kind != "parquet_truncated":
        assert f"ends inside a {'frame' if kind.startswith('zst') else 'member'} at compressed byte {at:,} " \
               f"(the file is truncated)" in msg
    elif kind == "zst_corrupted":  # located to the 64 KB chunk that holds the damage
        lo, hi, total = (int(x.replace(",", "")) for x in re.search(r"compressed bytes ([\d,]+)-([\d,]+) of "
                                                                     r"([\d,]+)", msg).groups())
        assert lo <= at < hi and total == size
    elif kind == "gz_corrupted":
        read = int(re.search(r"after ([\d,]+) of ", msg).group(1).replace(",", ""))
        assert at < read <= size
    read = re.search(r"([\d,]+) lines were read before it", msg)
    if kind.startswith("zst"):  # the good lines before the damage were read, and no more (gzip's and parquet's
        # read-ahead reaches the damage before a line is returned)
        assert 0 < int(read.group(1).replace(",", "")) < N_DOCS


def test_damaged_input_through_the_cli(tmp_path):
    path, at, _ = _damage(tmp_path, "zst_truncated")
    rec = recipe(tmp_path, {"sources": [{"paths": [str(path)]}], "dataset_dir": str(tmp_path / "ds")})
    r = grt("tokenize", str(rec), "--workers", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert str(path) in r.stderr and f"compressed byte {at:,}" in r.stderr and "malformed" not in r.stderr + r.stdout


@pytest.mark.parametrize("kind", ["jsonl", "zst"])
def test_a_json_lines_file_cut_mid_record_is_damage_not_a_malformed_record(tmp_path, kind):
    """Cut inside a line: plain, or compressed and cut exactly at a frame end (the stream is whole, the text not)."""
    raw = jsonl(docs(N_DOCS))
    cut = raw[:len(raw) // 2]
    assert not cut.endswith(b"\n")
    lines_before = cut.count(b"\n")
    path = tmp_path / ("in.jsonl" if kind == "jsonl" else "in.jsonl.zst")
    path.write_bytes(cut if kind == "jsonl" else zstandard.ZstdCompressor().compress(cut))
    cfg = DataConfig(sources=[SourceConfig(paths=[str(path)])], dataset_dir=str(tmp_path / "ds"), val_fraction=0.2)
    with pytest.raises(DamagedInputError) as e:
        tokenize(cfg, quiet=True, workers=1)
    assert str(e.value).startswith(f"{path} is damaged: its last line (line {lines_before + 1:,}")
    assert "the file is truncated" in str(e.value)


def test_intact_compressed_inputs_read_fully(tmp_path):
    texts = docs(N_DOCS)
    half = N_DOCS // 2  # a .zst of two frames (as pzstd or `cat a.zst b.zst` write) is read across both
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(texts[:half]))
                                           + zstandard.ZstdCompressor(write_checksum=True).compress(
                                               jsonl(texts[half:])))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(docs(100, seed=2))))
    m = tokenize(DataConfig(sources=[SourceConfig(paths=[str(tmp_path / "a.jsonl.zst"), str(tmp_path / "b.jsonl.gz")])],
                            dataset_dir=str(tmp_path / "ds"), val_fraction=0.2), quiet=True, workers=1)
    assert m["totals"]["documents"] == N_DOCS + 100
    assert sum(m["totals"]["skipped"].values()) == 0


# ------------------------------------------------------------------------------------------- text_field wording
def test_a_text_field_no_record_has_is_named_with_the_fields_they_have(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(json.dumps({"body": t, "id": i}).encode() + b"\n" for i, t in enumerate(docs(1200)))
                    + b'{"body": "x"}\n')
    cfg = DataConfig(sources=[SourceConfig(paths=[str(src)])], dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(RecipeError) as e:
        tokenize(cfg, workers=2)
    msg = str(e.value)
    assert "1,201 records had no field 'text' (fields they have: body, id)" in msg
    assert "set data.sources[0].text_field" in msg
    assert "val_fraction" not in msg and "split is empty" not in msg
    assert "warning: data.sources[0]: 1,201 records had no field 'text'" in capsys.readouterr().err  # said early too
    rec = recipe(tmp_path, {"sources": [{"paths": [str(src)]}], "dataset_dir": str(tmp_path / "ds2")})
    assert main(["tokenize", str(rec), "--workers", "1"]) == 2  # a recipe problem
    # strict: the first record says which field it lacks and which it has
    with pytest.raises(ValueError, match=re.escape(f"{src}:1: no field 'text' (fields it has: body, id); "
                                                   f"data.sources[0].text_field")):
        tokenize(DataConfig(sources=[SourceConfig(paths=[str(src)])], dataset_dir=str(tmp_path / "ds3"),
                            strict=True), quiet=True, workers=1)


def test_with_validation_sources_the_words_never_suggest_val_fraction(tmp_path):
    tr, va = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    tr.write_bytes(jsonl(docs(20)))
    va.write_bytes(jsonl(docs(4, seed=3), field="content"))
    cfg = DataConfig(sources=[SourceConfig(paths=[str(tr)])], validation_sources=[SourceConfig(paths=[str(va)])],
                     dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(RecipeError) as e:
        tokenize(cfg, quiet=True, workers=1)
    assert "data.validation_sources[0].text_field='text': 4 records had no field 'text' (fields they have: " \
           "content)" in str(e.value)
    assert "val_fraction" not in str(e.value)
    va.write_text('{"text": ""}\n{"text": "  "}\n')  # records with the field, but no text in them
    cfg.dataset_dir = str(tmp_path / "ds2")
    with pytest.raises(ValueError) as e:
        tokenize(cfg, quiet=True, workers=1)
    assert str(e.value) == ("the val split is empty: data.validation_sources kept no document (records dropped: "
                            "2 empty); add documents to data.validation_sources")


def test_a_text_field_most_records_lack_is_counted_as_skipped(tmp_path, capsys):
    src, va = tmp_path / "in.jsonl", tmp_path / "val.jsonl"
    texts = docs(30)
    src.write_bytes(b"".join(json.dumps({"text": t} if i % 6 == 0 else {"content": t, "url": "u"}).encode() + b"\n"
                             for i, t in enumerate(texts)))
    va.write_bytes(jsonl(docs(3, seed=4)))
    m = tokenize(DataConfig(sources=[SourceConfig(paths=[str(src)])],
                            validation_sources=[SourceConfig(paths=[str(va)])], dataset_dir=str(tmp_path / "ds")),
                 workers=1)
    assert m["sources"][0]["documents"] == 5 and m["sources"][0]["skipped"]["missing_text_field"] == 25
    assert m["sources"][0]["fields_of_records_without_text_field"] == {"content": 25, "url": 25}
    assert f"skipped 25 missing text field (fields they have: content, url): first at {src}:2" in \
           capsys.readouterr().out


def test_hf_rows_without_the_text_field_name_their_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.Dataset.from_dict({"content": docs(6), "lang": ["en"] * 6}).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(sources=[SourceConfig(kind="hf", name=str(tmp_path / "saved"))], dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(RecipeError, match=re.escape("6 records had no field 'text' (fields they have: content, "
                                                    "lang)")):
        tokenize(cfg, quiet=True, workers=1)
