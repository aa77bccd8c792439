"""The tokenize stage at scale: worker-count independence, SIGKILL + resume, bad input accounting, every format,
dedup, verification, the training-side checks (tokenizer mismatch, mixtures), and the memory and in-flight bounds."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
import zstandard

from conftest import make_corpus
from conftest import tiny_recipe
from pipeline.cli import main
from pipeline.config import DataConfig
from pipeline.config import SourceConfig
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.tokenize.bpe import gpt2_encoding
from pipeline.tokenize.stage import BATCH_RECORDS
from pipeline.tokenize.stage import FAULT_STOP_ENV
from pipeline.tokenize.writer import verify_dataset
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards

REPO = Path(__file__).resolve().parents[1]
SHARD_NAME = re.compile(r"(train|val)_\d{6}\.(bin|idx)")  # a shard's final name (writer.py)


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def word_docs(n: int, seed: int, words: int = 120) -> list[str]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(3000)] + "the of and to in is was for on that with as it by".split()
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


def test_one_and_two_workers_write_identical_bytes(tmp_path, corpus):
    srcs = [SourceConfig(paths=[str(corpus / "txt" / "*.txt"), str(corpus / "part.jsonl"),
                                str(corpus / "part.jsonl.zst")]), SourceConfig(kind="stdlib", max_bytes=400_000)]
    outs = []
    for w in (1, 2):
        cfg = DataConfig(sources=srcs, dataset_dir=str(tmp_path / f"w{w}"), shard_tokens=4096, val_fraction=0.1)
        tokenize(cfg, quiet=True, workers=w)
        outs.append(files_of(tmp_path / f"w{w}"))
    assert outs[0] == outs[1]
    assert sum(name.endswith(".bin") for name in outs[0]) > 10


def _recipe_file(tmp_path: Path, data: dict) -> Path:
    f = tmp_path / "recipe.yaml"
    f.write_text(yaml.safe_dump({"name": "tok", "data": data}))
    return f


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def corpus_with_records_lacking_text(path: Path, n: int = 5000) -> dict[str, list[int]]:
    """A JSON-lines corpus (outside the project) with bad records planted at known lines: every 7th lacks the text
    field (it has ``content`` and ``id``), every 13th is not UTF-8, every 17th is blank, every 23rd repeats an earlier
    document. Returns the 0-based line numbers of each kind, counted here, not by the stage."""
    docs = word_docs(n, seed=24, words=30)
    planted: dict[str, list[int]] = {"missing": [], "utf8": [], "blank": []}
    with open(path, "wb") as f:
        for i, doc in enumerate(docs):
            if i % 7 == 3:
                planted["missing"].append(i)
                f.write(json.dumps({"content": doc, "id": i}).encode() + b"\n")
            elif i % 13 == 9:
                planted["utf8"].append(i)
                f.write(b'{"text": "bad \xff byte"}\n')
            elif i % 17 == 16:
                planted["blank"].append(i)
                f.write(b"\n")
            else:
                f.write(json.dumps({"text": docs[i - 23] if i % 23 == 22 else doc}).encode() + b"\n")
    return planted


def test_sigkill_then_restart_resumes_and_is_byte_identical(tmp_path):
    """A job SIGKILLed at a known point (the testing hook stops it as it is about to save state snapshot 35: the shard
    that completed it is on disk, the state still says 34), with records lacking the text field on both sides of that
    point, in the batch before and in the batch it falls in: its workers die with it; every file under a shard's
    final name holds an uninterrupted run's bytes; the saved state counts every planted bad record up to its
    position, fields of records without the text field included; started again, it says it resumes after the
    shards its state records, leaves their files untouched (same inode and mtime) and ends byte-identical,
    manifest.json included (it holds no wall time or other run-dependent field: nothing is exempt from the
    comparison)."""
    corpus = tmp_path / "corpus" / "planted.jsonl"
    corpus.parent.mkdir()
    planted = corpus_with_records_lacking_text(corpus)
    # ~40 shards: each costs a state snapshot, and their fsyncs are most of the test's time
    data = {"sources": [{"paths": [str(corpus)]}], "shard_tokens": 8192, "val_fraction": 0.05}
    ref = DataConfig(**{**data, "sources": [SourceConfig(**data["sources"][0])]}, dataset_dir=str(tmp_path / "ref"))
    ref_manifest = tokenize(ref, quiet=True, workers=1)
    ref_files = files_of(tmp_path / "ref")
    n_missing = len(planted["missing"])
    src = ref_manifest["sources"][0]  # the counts against the planted ones: the reference is right, not only equal
    assert src["skipped"]["missing_text_field"] == n_missing and src["skipped"]["invalid_utf8"] == len(planted["utf8"])
    assert src["fields_of_records_without_text_field"] == {"content": n_missing, "id": n_missing}

    out = tmp_path / "killed"
    recipe = _recipe_file(tmp_path, {**data, "dataset_dir": str(out)})
    cmd = [sys.executable, "-m", "pipeline.cli", "tokenize", str(recipe), "--workers", "2"]
    stop_at = 35
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, FAULT_STOP_ENV: str(stop_at)})
    deadline = time.time() + 120
    while proc.poll() is None and not stopped(proc.pid) and time.time() < deadline:
        time.sleep(0.01)
    assert stopped(proc.pid), f"the job did not stop itself at snapshot {stop_at} (exit status {proc.poll()})"
    workers = children_of(proc.pid)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10  # the workers end with the job (parent-death signal), they are not left orphaned
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)], "tokenizer workers outlived the killed job"
    assert not (out / "manifest.json").exists()
    shard_files = {p.name: p.read_bytes() for p in out.iterdir() if SHARD_NAME.fullmatch(p.name)}
    assert [n for n, b in shard_files.items() if b != ref_files.get(n)] == []  # none partial, under a final name
    assert not list(out.rglob("*.tmp"))  # stopped between two writes
    state_now = json.loads((out / ".progress" / "state.json").read_text())
    assert state_now["snapshots"] == stop_at - 1
    done = [f for w in state_now["writers"].values() for s in w["shards"] for f in (s["file"], s["index_file"])]
    assert len(done) == 2 * (stop_at - 1) and set(done) < set(shard_files)  # + the shard of the unsaved snapshot
    # where the kill landed: in the second batch (the 877 kB file is one batch of BATCH_RECORDS lines, then the rest),
    # after some of its records without the text field (every 7th line is one), before others
    last = state_now["position"][2]
    assert BATCH_RECORDS + 7 <= last, last
    before = sum(i <= last for i in planted["missing"])
    assert 0 < before < n_missing, (last, before)
    st = state_now["stats"][0]
    assert (st["skipped"]["missing_text_field"], st["skipped"]["invalid_utf8"]) == \
        (before, sum(i <= last for i in planted["utf8"]))
    assert st["fields_of_records_without_text_field"] == {"content": before, "id": before}
    stamps = {f: ((out / f).stat().st_ino, (out / f).stat().st_mtime_ns) for f in done}

    again = subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert {f: ((out / f).stat().st_ino, (out / f).stat().st_mtime_ns) for f in done} == stamps  # not rewritten
    assert (f"tokenize: resuming {out} after {state_now['bytes_read'] / 1e6:,.1f} MB of input "
            f"({len(done) // 2} shards done)") in again.stderr, again.stderr[-2000:]
    assert (out / "manifest.json").read_text() == ref_files["manifest.json"].decode()  # a diff on failure
    assert files_of(out) == ref_files
    assert not (out / ".progress").exists()


def test_a_shard_write_cut_short_leaves_nothing_under_its_final_name(tmp_path, monkeypatch):
    """A crash while a shard's token data is written (here: fsync fails on the .bin's file) leaves the data only
    under ``train_000000.bin.tmp``: no ``train_000000.bin``, which readers would take as a finished shard."""
    import pipeline.tokenize.writer as writer

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".bin.tmp"):
            raise OSError("simulated crash")
    monkeypatch.setattr(writer.os, "fsync", fsync)
    w = writer.ShardWriter(tmp_path, "train", 8, np.dtype(np.uint16))
    with pytest.raises(OSError, match="simulated crash"):
        w.add_document(np.arange(10, dtype=np.uint16))
    names = {p.name for p in tmp_path.iterdir()}
    assert "train_000000.bin" not in names and "train_000000.bin.tmp" in names, names
    assert (tmp_path / "train_000000.bin.tmp").read_bytes() == np.arange(8, dtype="<u2").tobytes()


BAD_PLAN = {"malformed_json": 3, "missing_text_field": 4, "invalid_utf8": 2, "empty": 5, "binary": 3}


def planted_corpus(root: Path) -> tuple[Path, dict[str, list[str]]]:
    """Good documents with every kind of bad record planted; returns the expected first locations."""
    root.mkdir()
    good = word_docs(40, seed=1)
    lines: list[bytes] = []
    where: dict[str, list[int]] = {k: [] for k in BAD_PLAN}
    bad_lines = {
        "malformed_json": [b'{"text": "unterminated', b"not json at all", b'["a", "list"]'],
        "missing_text_field": [b'{"body": "x"}', b'{"text": null}', b'{"text": 12}', b'{}'],
        "invalid_utf8": [b'{"text": "caf\xe9"}', b'\xff\xfe{"text": "x"}'],
        "empty": [json.dumps({"text": t}).encode() for t in ("", " ", "\n\n", "\t", "   \n ")],
        "binary": [json.dumps({"text": t}).encode() for t in ("\x00\x01\x02 bin", "abc\x00def",
                                                              "\x01\x02\x03\x04\x05\x06\x07\x08\x0e\x0f" * 3)],
    }
    assert {k: len(v) for k, v in bad_lines.items()} == BAD_PLAN
    queue = [(k, b) for k, bs in bad_lines.items() for b in bs]
    rng = random.Random(0)
    rng.shuffle(queue)
    for i, doc in enumerate(good):
        lines.append(json.dumps({"text": doc}).encode())
        if i % 2 == 1 and queue:
            kind, b = queue.pop()
            lines.append(b)
            where[kind].append(len(lines))  # 1-based line number
    while queue:
        kind, b = queue.pop()
        lines.append(b)
        where[kind].append(len(lines))
    path = root / "planted.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))
    return path, {k: [f"{path}:{n}" for n in v] for k, v in where.items()}


def test_planted_bad_records_are_counted_exactly(tmp_path, capsys):
    path, where = planted_corpus(tmp_path / "in")
    cfg = DataConfig(sources=[SourceConfig(paths=[str(path)])], dataset_dir=str(tmp_path / "ds"), val_fraction=0.1)
    m = tokenize(cfg, workers=2)
    assert m["totals"]["skipped"] == BAD_PLAN
    assert m["totals"]["documents"] == 40
    for kind, locations in where.items():
        assert m["sources"][0]["first_skipped"][kind] == locations[:5]
    out = capsys.readouterr().out
    assert f"skipped 5 empty: first at {where['empty'][0]}" in out


def test_strict_fails_on_the_first_bad_record_with_its_location(tmp_path, capsys):
    path, where = planted_corpus(tmp_path / "in")
    first = min((loc for locs in where.values() for loc in locs), key=lambda s: int(s.rsplit(":", 1)[1]))
    recipe = _recipe_file(tmp_path, {"sources": [{"paths": [str(path)]}], "dataset_dir": str(tmp_path / "ds")})
    assert main(["tokenize", str(recipe), "--strict"]) == 1
    err = capsys.readouterr().err
    assert first in err and "strict" in err
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_missing_input_fails_at_once(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        tokenize(DataConfig(sources=[SourceConfig(paths=[str(tmp_path / "none*.jsonl")])],
                            dataset_dir=str(tmp_path / "ds")), quiet=True)


def test_an_unreadable_input_fails_at_once_naming_it(tmp_path, monkeypatch, capsys):
    """An input the job may not read (mode 0, and os.access made to say so: root, as on CI, reads anything) fails
    before anything is read or written (exit 1, no dataset folder), even when it is the last of several files."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": d}) + "\n" for d in word_docs(5, seed=9)))
    locked = tmp_path / "locked.jsonl"
    locked.write_text('{"text": "x"}\n')
    locked.chmod(0)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k:
                        False if Path(path) == locked and mode & os.R_OK else real_access(path, mode, *a, **k))
    ds = tmp_path / "ds"
    recipe = _recipe_file(tmp_path, {"sources": [{"paths": [str(good), str(locked)]}], "dataset_dir": str(ds)})
    assert main(["tokenize", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert f"data source file {locked} is not readable; fix its permissions or remove it" in err, err
    assert not ds.exists()


def test_every_format_gives_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = word_docs(30, seed=2)
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "data.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"content": docs}), tmp_path / "data.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "paras.txt").write_text("\n\n  \n".join(docs))
    variants = {
        "jsonl": SourceConfig(paths=[str(tmp_path / "jsonl" / "data.jsonl")], text_field="content"),
        "parquet": SourceConfig(paths=[str(tmp_path / "data.parquet")], text_field="content"),
        "hf_disk": SourceConfig(kind="hf", name=str(tmp_path / "saved"), text_field="content"),
        # the load_dataset(name, streaming=True) path that streams hub names, fed a local data folder
        "hf_stream": SourceConfig(kind="hf", name=str(tmp_path / "jsonl"), text_field="content"),
        "paragraphs": SourceConfig(paths=[str(tmp_path / "paras.txt")], text_mode="paragraphs"),
    }
    enc = gpt2_encoding()
    expected = sum(len(enc.encode_ordinary(d)) + 1 for d in docs)
    for name, src in variants.items():
        m = tokenize(DataConfig(sources=[src], dataset_dir=str(tmp_path / f"ds_{name}"), val_fraction=0.2),
                     quiet=True, workers=1)
        assert m["totals"]["documents"] == 30, name
        assert m["totals"]["tokens"] == expected, name
    ref = files_of(tmp_path / "ds_jsonl")
    for name in variants:
        got = files_of(tmp_path / f"ds_{name}")
        assert {k: v for k, v in got.items() if k != "manifest.json"} == \
               {k: v for k, v in ref.items() if k != "manifest.json"}, name


def test_exact_dedup_across_sources_ignores_whitespace(tmp_path):
    docs = word_docs(20, seed=3)
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    b = tmp_path / "b.jsonl"  # 5 of the same documents with other spacing, and 5 new ones
    b.write_text("".join(json.dumps({"text": "  " + d.replace(" ", "\n  ") + "\n"}) + "\n" for d in docs[:5])
                 + "".join(json.dumps({"text": d}) + "\n" for d in word_docs(5, seed=4)))
    cfg = DataConfig(sources=[SourceConfig(paths=[str(a)]), SourceConfig(paths=[str(b)])],
                     dataset_dir=str(tmp_path / "ds"), val_fraction=0.2)
    m = tokenize(cfg, quiet=True)
    assert [s["duplicates"] for s in m["sources"]] == [0, 5]
    assert [s["documents"] for s in m["sources"]] == [20, 5]
    cfg.dedup, cfg.dataset_dir = False, str(tmp_path / "nodedup")
    assert tokenize(cfg, quiet=True)["totals"]["documents"] == 30


def test_separate_validation_source(tmp_path):
    tr, va = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    tr.write_text("".join(json.dumps({"text": d}) + "\n" for d in word_docs(20, seed=5)))
    va.write_text("".join(json.dumps({"text": d}) + "\n" for d in word_docs(4, seed=6)))
    cfg = DataConfig(sources=[SourceConfig(paths=[str(tr)])], validation_sources=[SourceConfig(paths=[str(va)])],
                     dataset_dir=str(tmp_path / "ds"))
    m = tokenize(cfg, quiet=True)
    assert (m["splits"]["train"]["documents"], m["splits"]["val"]["documents"]) == (20, 4)


def test_verify_catches_a_corrupted_shard(tmp_path, corpus, capsys):
    cfg = DataConfig(sources=[SourceConfig(paths=[str(corpus / "part.jsonl")])], dataset_dir=str(tmp_path / "ds"),
                     val_fraction=0.2, shard_tokens=1024)
    tokenize(cfg, quiet=True)
    assert verify_dataset(tmp_path / "ds") == []
    assert main(["data", "verify", str(tmp_path / "ds")]) == 0
    assert main(["data", "stats", str(tmp_path / "ds")]) == 0
    shard = tmp_path / "ds" / "train_000001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify_dataset(tmp_path / "ds")
    assert len(problems) == 1 and "train_000001.bin sha256" in problems[0]
    assert main(["data", "verify", str(tmp_path / "ds")]) == 1


def test_training_refuses_a_dataset_of_another_tokenizer(tmp_path, corpus):
    from pipeline.train.trainer import Trainer

    cfg = from_dict(tiny_recipe(tmp_path, corpus))
    tokenize(cfg.data, quiet=True)
    mpath = Path(cfg.data.dataset_dir) / "manifest.json"
    m = json.loads(mpath.read_text())
    m["tokenizer"].update(name="llama", vocab_hash="ab" * 32, n_vocab=32000, eot_id=2)
    mpath.write_text(json.dumps(m))
    with pytest.raises(ValueError) as e:
        Trainer(cfg)
    msg = str(e.value)
    assert "eot_id: dataset 2 != recipe's gpt2 tokenizer 50256" in msg
    assert "n_vocab: dataset 32000 != recipe's gpt2 tokenizer 50257" in msg
    assert "vocab_hash: dataset 'abab" in msg and "name: dataset 'llama'" in msg


def test_mixture_samples_in_proportion_and_resumes_exactly(tmp_path):
    dirs = []
    for i in range(2):
        root = make_corpus(tmp_path / f"c{i}", n_docs=30 + 10 * i)
        cfg = DataConfig(sources=[SourceConfig(paths=[str(root / "part.jsonl"), str(root / "part.jsonl.zst")])],
                         dataset_dir=str(tmp_path / f"ds{i}"), val_fraction=0.1)
        tokenize(cfg, quiet=True)
        dirs.append(cfg.dataset_dir)
    shards = [TokenShards(d, "train") for d in dirs]
    loader = SequenceLoader(shards, 16, 4, seed=3, weights=[3.0, 1.0])
    picks = [k for _ in range(250) for k, _ in loader.next_indices()]
    assert picks.count(0) == 750 and picks.count(1) == 250  # exactly 3:1 over 1,000 samples
    assert max(abs(picks[:n].count(0) - 0.75 * n) for n in range(1, 1001)) <= 1  # and at every point
    # 2 ranks see disjoint halves of each global micro-batch
    r0, r1 = (SequenceLoader(shards, 16, 4, seed=3, rank=r, world_size=2, weights=[3.0, 1.0]) for r in (0, 1))
    a, b = r0.next_indices(), r1.next_indices()
    assert not set(a) & set(b)
    # resume: a loader restored from the state at step 100 continues exactly
    ref = SequenceLoader(shards, 16, 4, seed=3, weights=[3.0, 1.0])
    for _ in range(100):
        ref.next_indices()
    state = ref.state_dict()
    cont = SequenceLoader(shards, 16, 4, seed=3, weights=[3.0, 1.0])
    cont.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(50):
        x, y, _ = ref.next_batch()
        x2, y2, _ = cont.next_batch()
        assert np.array_equal(x, x2) and np.array_equal(y, y2)


# Whole-word GPT-2 tokens of 9-14 letters: text of them tokenizes at ~20 MB/s a core (~5x common English), so the
# memory test can feed ~100 MB in seconds.
LONG_WORDS = ("information development international government experience performance environment management "
              "understanding relationship particularly technology community significant professional organization "
              "responsibility communication opportunity considerable").split()

_PEAK_RSS = """
import ctypes, re, resource, sys
try:  # no transparent hugepages (inherited by the forked workers): with THP "always" RSS moves in 2 MB steps
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
except (OSError, AttributeError):
    pass
from pathlib import Path
from pipeline.config import DataConfig, SourceConfig
from pipeline.tokenize import tokenize
from pipeline.tokenize.bpe import gpt2_encoding, tokenizer_identity

def status_kb(key):
    return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))

tokenizer_identity(), gpt2_encoding()  # the BPE ranks are loaded before the baseline, as the job loads them first
before = status_kb("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak) to the current RSS
tokenize(DataConfig(sources=[SourceConfig(paths=[sys.argv[1]])], dataset_dir=sys.argv[2], shard_tokens=1 << 20),
         quiet=True, workers=2)
print(before, status_kb("VmHWM"), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def write_long_word_docs(path: Path, mb: int, doc_bytes: int = 8192) -> Path:
    """~``mb`` MB of JSON lines: distinct ~8 KB documents cut from one random text of LONG_WORDS."""
    rng = np.random.default_rng(0)
    base = " ".join(np.asarray(LONG_WORDS)[rng.integers(0, len(LONG_WORDS), 200_000)])
    with open(path, "w") as f:
        for i in range(mb * 1_000_000 // doc_bytes):
            at = (i * 7919) % (len(base) - doc_bytes)
            f.write(json.dumps({"text": f"doc {i}: " + base[at:at + doc_bytes]}) + "\n")
    return path


def test_peak_memory_does_not_grow_with_input_size(tmp_path):
    """Peak RSS growth of the job over its process's RSS just before it (VmHWM reset there), for 8, 32 and 96 MB of
    input, 2 workers. The design holds 2N+2 = 6 batches of ~1 MB plus two 2 MB open shards (~12 MB measured): the
    main process's growth stays under 24 MB whatever the size, and from 8 to 96 MB it grows by under 4 MB (~2 MB
    measured: the dedup set, ~100 bytes a document, and allocator slack). The workers' peak (the largest child's
    ru_maxrss; they are forked after the baseline and do not count the parent's untouched pages, so their "growth"
    is negative, -4 to -6 MB) is held to the flatness bound only. Holding the input (say, list() of the batches)
    costs about a byte per input byte: +24 MB at 32 MB, +88 MB at 96 MB. Transparent hugepages are turned off in
    the measured process: with THP "always" (common on CI hosts) RSS moves in 2 MB steps and the flatness bound
    failed 3 runs in 8 (tried with glibc's hugetlb tunable)."""
    sizes = (8, 32, 96)
    growth = {}
    for mb in sizes:
        src = write_long_word_docs(tmp_path / f"in{mb}.jsonl", mb)
        out = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(src), str(tmp_path / f"ds{mb}")], cwd=REPO,
                             check=True, capture_output=True, text=True)
        before, main_peak, worker_peak = (int(kib) * 1024 / 1e6 for kib in out.stdout.split())  # MB
        growth[mb] = (main_peak - before, worker_peak - before)
        src.unlink()
    for mb in sizes:
        assert growth[mb][0] < 24, growth  # main process
        for side in (0, 1):  # main process, workers
            assert growth[mb][side] - growth[sizes[0]][side] < 4, growth


class _CountingPool:
    """Wraps the stage's executor: counts the batches submitted whose result the stage has not yet taken back."""

    def __init__(self, inner, counts: dict):
        self.inner, self.counts = inner, counts

    def submit(self, fn, *args):
        fut = self.inner.submit(fn, *args)
        self.counts["submitted"] += 1
        self.counts["max_in_flight"] = max(self.counts["max_in_flight"],
                                           self.counts["submitted"] - self.counts["taken"])
        return _CountedFuture(fut, self.counts)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class _CountedFuture:
    def __init__(self, fut, counts: dict):
        self.fut, self.counts, self.taken = fut, counts, False

    def result(self, timeout=None):
        if not self.taken:
            self.taken = True
            self.counts["taken"] += 1
        return self.fut.result(timeout)


@pytest.mark.parametrize("workers", [1, 2])
def test_at_most_2n_plus_2_batches_are_in_flight(tmp_path, monkeypatch, workers):
    """docs/data.md: "At most 2N+2 batches are in flight". Batches of 5 records (BATCH_RECORDS patched down) make 40 of
    them, far more than the bound; the stage's executor is wrapped to count batches submitted and not yet taken back.
    The count reaches exactly 2N+2 (the stage takes a result back once 2N+2 are out), never more: an unbounded or
    looser queue would show up to all 40 at once."""
    import pipeline.tokenize.stage as stage

    counts = {"submitted": 0, "taken": 0, "max_in_flight": 0}
    for name in ("ProcessPoolExecutor", "_InProcess"):
        real = getattr(stage, name)
        monkeypatch.setattr(stage, name, lambda *a, real=real, **k: _CountingPool(real(*a, **k), counts))
    monkeypatch.setattr(stage, "BATCH_RECORDS", 5)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in word_docs(200, seed=10)))
    tokenize(DataConfig(sources=[SourceConfig(paths=[str(src)])], dataset_dir=str(tmp_path / "ds"),
                        val_fraction=0.1), quiet=True, workers=workers)
    assert counts["submitted"] == 40 and counts["taken"] == 40, counts
    assert counts["max_in_flight"] == 2 * workers + 2, counts
