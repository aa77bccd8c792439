"""The tokenize stage at scale: worker-count independence, SIGKILL + resume, bad input accounting, every format,
dedup, verification, and the training-side checks (tokenizer mismatch, mixtures)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
import zstandard

from pipeline.cli import main
from pipeline.config import DataConfig, SourceConfig, from_dict
from pipeline.tokenize import tokenize
from pipeline.tokenize.bpe import gpt2_encoding
from pipeline.tokenize.sources import stdlib_root
from pipeline.tokenize.writer import verify_dataset
from pipeline.train.data import SequenceLoader, TokenShards

from conftest import make_corpus, tiny_recipe

REPO = Path(__file__).resolve().parents[1]


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def word_docs(n: int, seed: int, words: int = 120) -> list[str]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(3000)] + "the of and to in is was for on that with as it by".split()
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


def write_jsonl_zst(path: Path, docs: list[str]) -> Path:
    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return path


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


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_then_restart_is_byte_identical(tmp_path):
    data = {"sources": [{"kind": "stdlib", "max_bytes": 2_000_000}], "shard_tokens": 1024, "val_fraction": 0.05}
    ref = DataConfig(**{**data, "sources": [SourceConfig(**data["sources"][0])]}, dataset_dir=str(tmp_path / "ref"))
    tokenize(ref, quiet=True, workers=1)

    out = tmp_path / "killed"
    recipe = _recipe_file(tmp_path, {**data, "dataset_dir": str(out)})
    cmd = [sys.executable, "-m", "pipeline.cli", "tokenize", str(recipe), "--workers", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / ".progress" / "state.json"
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once a good number of shards are done
        if state.is_file() and json.loads(state.read_text())["snapshots"] >= 40:
            break
        time.sleep(0.01)
    workers = children_of(proc.pid)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10  # the workers end with the job (parent-death signal), they are not left orphaned
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)], "tokenizer workers outlived the killed job"
    assert not (out / "manifest.json").exists(), "the job finished before it could be killed"
    assert not list(out.glob("*.tmp")) or True  # a temporary file may remain; never under a final name
    finished = [p.name for p in out.glob("*.bin")]
    state_now = json.loads(state.read_text())
    done = {s["file"] for w in state_now["writers"].values() for s in w["shards"]}
    assert done <= set(finished)  # every shard the state counts is complete on disk

    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert files_of(out) == files_of(tmp_path / "ref")
    assert not (out / ".progress").exists()


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


def test_missing_or_unreadable_input_fails_at_once(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        tokenize(DataConfig(sources=[SourceConfig(paths=[str(tmp_path / "none*.jsonl")])],
                            dataset_dir=str(tmp_path / "ds")), quiet=True)
    f = tmp_path / "locked.jsonl"
    f.write_text('{"text": "x"}\n')
    f.chmod(0)
    if os.access(f, os.R_OK):  # root reads anything
        pytest.skip("running as root: permissions are not enforced")
    with pytest.raises(PermissionError, match="not readable"):
        tokenize(DataConfig(sources=[SourceConfig(paths=[str(f)])], dataset_dir=str(tmp_path / "ds")), quiet=True)


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
        x, y = ref.next_batch()
        x2, y2 = cont.next_batch()
        assert np.array_equal(x, x2) and np.array_equal(y, y2)


def test_peak_memory_does_not_grow_with_input_size(tmp_path):
    """Peak RSS of the main process (VmHWM: per process image, unlike ru_maxrss, which a child inherits from the
    process that started it) and of the tokenizer workers, for a corpus and one 10x larger."""
    small = write_jsonl_zst(tmp_path / "small.jsonl.zst", word_docs(4000, seed=7))
    big = write_jsonl_zst(tmp_path / "big.jsonl.zst", word_docs(40000, seed=8))
    peaks = []
    for f in (small, big):
        code = ("import re, resource\nfrom pipeline.config import DataConfig, SourceConfig\n"
                "from pipeline.tokenize import tokenize\n"
                f"tokenize(DataConfig(sources=[SourceConfig(paths=['{f}'])], dataset_dir='{tmp_path / f.stem}',"
                " shard_tokens=1 << 20), quiet=True, workers=2)\n"
                "hwm = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
                "print(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
        peaks.append([int(x) for x in out.stdout.split()])
    (main_small, workers_small), (main_big, workers_big) = peaks
    assert main_big <= 1.5 * main_small and workers_big <= 1.5 * workers_small, peaks
