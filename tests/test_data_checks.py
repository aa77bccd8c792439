"""Training checks its data: a damaged manifest, a shard of the wrong size, token ids out of the vocabulary and splits
too short for one window are errors naming the file, the numbers and the fix — before step 1 where they can be
checked, and never an `index out of range in self` mid-run."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import subprocess_env
from pipeline.cli import main
from pipeline.tokenize.writer import ShardWriter
from pipeline.tokenize.writer import read_manifest
from pipeline.tokenize.writer import scan_shard
from pipeline.tokenize.writer import verify_dataset
from pipeline.tokenize.writer import write_manifest
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards
from pipeline.train.data import check_shards
from pipeline.train.data import check_windows
from pipeline.train.data import validation_batches

N_VOCAB = 50257  # GPT-2's
FIX = "grt tokenize RECIPE --force"


def make_dataset(out: Path, train_tokens: int = 3000, val_tokens: int = 400, shard_tokens: int = 1024,
                 data_config: dict | None = None) -> Path:
    """A dataset written by hand: documents of 100 tokens with ids i % 50000, shards by ShardWriter, a complete
    manifest (what `grt tokenize` writes, without the tokenizer)."""
    out.mkdir(parents=True)
    splits = {}
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        w = ShardWriter(out, split, shard_tokens, np.uint16)
        ids = np.arange(n) % 50_000
        for start in range(0, n, 100):
            w.add_document(ids[start:start + 100].astype(np.uint16))
        splits[split] = w.close()
    docs = sum(s["documents"] for s in splits.values())
    skipped = {"malformed_json": 0}
    manifest = {"format_version": 2, "fingerprint": "0" * 16,
                "tokenizer": {"name": "gpt2", "vocab_hash": "ab" * 32, "n_vocab": N_VOCAB, "eot_id": 50256},
                "dtype": "uint16", "shard_tokens": shard_tokens, "splits": splits,
                "sources": [{"kind": "files", "paths": ["x.txt"], "name": None, "documents": docs, "bytes": 10 * docs,
                             "tokens": train_tokens + val_tokens, "duplicates": 0, "skipped": skipped}],
                "totals": {"documents": docs, "tokens": train_tokens + val_tokens, "bytes": 10 * docs,
                           "duplicates": 0, "skipped": skipped},
                "data_config": data_config or {"validation_sources": [], "val_fraction": 0.1}}
    write_manifest(out, manifest)
    return out


def edit_manifest(d: Path, fn) -> None:
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the manifest
def test_manifest_that_is_not_json_names_it(tmp_path, capsys):
    d = make_dataset(tmp_path / "ds")
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[:len(text) // 2])  # cut short, as by a full disk
    with pytest.raises(ValueError) as e:
        read_manifest(d)
    assert str(d / "manifest.json") in str(e.value) and "not valid JSON" in str(e.value) and FIX in str(e.value)
    for command in ("stats", "verify"):
        rc, err = cli(capsys, "data", command, str(d))
        assert rc == 1 and err.count("\n") == 1 and str(d / "manifest.json") in err and FIX in err


def test_manifest_that_is_a_json_list_is_an_error_not_a_traceback(tmp_path):
    d = make_dataset(tmp_path / "ds")
    (d / "manifest.json").write_text(json.dumps([json.loads((d / "manifest.json").read_text())]))
    for command in ("stats", "verify"):
        r = subprocess.run([sys.executable, "-m", "pipeline.cli", "data", command, str(d)], capture_output=True,
                           text=True, env=subprocess_env(), cwd=Path(__file__).resolve().parents[1], timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and f"{d / 'manifest.json'} is not a usable manifest: it holds an array" \
            in r.stderr and FIX in r.stderr
    with pytest.raises(ValueError, match="holds an array"):
        TokenShards(d, "train")


@pytest.mark.parametrize("damage, expected", [
    (lambda m: m["tokenizer"].pop("n_vocab"), "tokenizer.n_vocab is missing"),
    (lambda m: m["splits"].pop("val"), "splits.val is missing"),
    (lambda m: m["splits"]["train"]["shards"][1].pop("sha256"), "splits.train.shards[1].sha256 is missing"),
    (lambda m: m["splits"]["train"]["shards"][0].update(tokens="1024"),
     "splits.train.shards[0].tokens is '1024', not a count"),
    (lambda m: m.update(splits=[]), "splits is an array, not an object"),
    (lambda m: m.pop("totals"), "totals is missing"),
    (lambda m: m["sources"][0].update(skipped=None), "sources[0].skipped is null, not an object"),
    (lambda m: m.update(dtype="float32"), "dtype 'float32' is not one of ['uint16', 'uint32']"),
    (lambda m: m["splits"]["val"]["shards"][0].update(file="../elsewhere.bin"),
     "splits.val.shards[0].file '../elsewhere.bin' is not a file name"),
    (lambda m: m.update(format_version=1), "format_version 1 is not 2"),
])
def test_manifest_missing_or_wrong_field_is_named(tmp_path, capsys, damage, expected):
    d = make_dataset(tmp_path / "ds")
    edit_manifest(d, damage)
    with pytest.raises(ValueError) as e:
        read_manifest(d)
    assert f"{d / 'manifest.json'} is not a usable manifest: {expected}" in str(e.value) and FIX in str(e.value)
    for command in ("stats", "verify"):
        rc, err = cli(capsys, "data", command, str(d))
        assert rc == 1 and err.count("\n") == 1 and expected in err


def test_every_problem_of_a_manifest_is_listed_at_once(tmp_path):
    d = make_dataset(tmp_path / "ds")
    edit_manifest(d, lambda m: (m["tokenizer"].pop("eot_id"), m.pop("shard_tokens")))
    with pytest.raises(ValueError) as e:
        read_manifest(d)
    assert "tokenizer.eot_id is missing" in str(e.value) and "shard_tokens is missing" in str(e.value)


# ------------------------------------------------------------------------------------------- shard sizes
def test_truncated_and_grown_shards_are_named_with_both_sizes(tmp_path):
    d = make_dataset(tmp_path / "ds")  # train: 1024 + 1024 + 952 tokens
    assert check_shards(TokenShards(d, "train"), N_VOCAB, "size") == []
    (d / "train_000001.bin").write_bytes((d / "train_000001.bin").read_bytes()[:201])  # 100 tokens and a byte
    with open(d / "train_000002.bin", "ab") as f:
        f.write(b"\0\0" * 8)
    shards = TokenShards(d, "train")  # maps what is there
    assert [a.size for a in shards.arrays] == [1024, 100, 960]
    problems = check_shards(shards, N_VOCAB, "size")
    assert len(problems) == 1
    msg = problems[0]
    assert f"the train split of the dataset at {d} does not match its manifest" in msg
    assert ("train_000001.bin holds 100 tokens and 1 stray byte(s) (201 bytes), the manifest says 1,024 "
            "(2,048 bytes)") in msg
    assert "train_000002.bin holds 960 tokens (1,920 bytes), the manifest says 952 (1,904 bytes)" in msg
    assert "train_000000.bin" not in msg and f"grt data verify {d}" in msg and FIX in msg


def test_empty_shard_does_not_crash_and_missing_one_is_named(tmp_path):
    d = make_dataset(tmp_path / "ds")
    (d / "val_000000.bin").write_bytes(b"")
    val = TokenShards(d, "val")
    assert val.tokens == 0 and "val_000000.bin holds 0 tokens (0 bytes), the manifest says 400" in \
        check_shards(val, N_VOCAB)[0]
    (d / "train_000001.bin").unlink()
    with pytest.raises(FileNotFoundError) as e:
        TokenShards(d, "train")
    assert "misses 1 of its 3 shard files (train_000001.bin)" in str(e.value) and FIX in str(e.value)


def test_full_verify_finds_a_flipped_byte(tmp_path):
    d = make_dataset(tmp_path / "ds")
    data = bytearray((d / "val_000000.bin").read_bytes())
    data[6] ^= 0x01  # token 3: 3 -> 2, still in range
    (d / "val_000000.bin").write_bytes(bytes(data))
    val = TokenShards(d, "val")
    assert check_shards(val, N_VOCAB, "size") == []
    (msg,) = check_shards(val, N_VOCAB, "full")
    assert f"val_000000.bin has sha256 {hashlib.sha256(data).hexdigest()[:16]}" in msg


# ---------------------------------------------------------------------------------- token ids out of range
def inject_bad_ids(d: Path, file: str, bad: dict[int, int], rehash: bool = True) -> None:
    """Set token offset -> id in a shard; with ``rehash`` the manifest's sha256 follows, as if the tokenizer itself
    had written them (only the id check can find them then)."""
    path = d / file
    ids = np.fromfile(path, dtype="<u2")
    for offset, value in bad.items():
        ids[offset] = value
    path.write_bytes(ids.tobytes())
    if rehash:
        def update(m):
            for info in m["splits"].values():
                for sh in info["shards"]:
                    if sh["file"] == file:
                        sh["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
        edit_manifest(d, update)


def test_ids_out_of_the_vocabulary_are_found_before_step_1(tmp_path):
    d = make_dataset(tmp_path / "ds")
    inject_bad_ids(d, "train_000001.bin", {300: 60000, 700: N_VOCAB})
    shards = TokenShards(d, "train")
    assert check_shards(shards, 50304, "size") == []  # sizes and hashes agree: only reading the ids finds them
    (msg,) = check_shards(shards, 50304, "full")  # a padded model vocabulary: the tokenizer's is the bound
    assert ("train_000001.bin holds 2 token id(s) >= the tokenizer's vocabulary size (n_vocab) 50,257, the first "
            "(60000) at token offset 300") in msg and f"grt data verify {d}" in msg
    # a smaller model vocabulary is the bound then
    (msg,) = check_shards(shards, 40000, "full")
    assert "holds 2 token id(s) >= the model's vocabulary size (model.vocab_size) 40,000" in msg


def test_scan_reads_in_blocks_and_finds_every_bad_id(tmp_path):
    d = make_dataset(tmp_path / "ds")
    inject_bad_ids(d, "train_000000.bin", {5: 65535, 31: 50300, 32: 50257, 1023: 50999})
    path = d / "train_000000.bin"
    whole = scan_shard(path, "uint16", N_VOCAB)
    for block in (2, 62, 64, 4096):  # block edges before, at and after the bad ids
        assert scan_shard(path, "uint16", N_VOCAB, block_bytes=block) == whole
    assert (whole["bad_ids"], whole["first_bad"], whole["first_bad_value"]) == (4, 5, 65535)
    assert whole["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_loader_names_shard_and_offset_instead_of_index_error(tmp_path):
    d = make_dataset(tmp_path / "ds")
    inject_bad_ids(d, "train_000001.bin", {300: 60000, 700: N_VOCAB})
    shards = TokenShards(d, "train")
    loader = SequenceLoader(shards, 32, 4, seed=1, vocab_size=50304)
    expected = [f"token id {v} at token offset {o} of {d / 'train_000001.bin'} is >= the tokenizer's vocabulary "
                f"size (n_vocab) 50,257" for o, v in ((300, 60000), (700, N_VOCAB))]
    batches = 0
    with pytest.raises(ValueError) as e:
        for batches in range(len(shards.window_index(32))):  # one epoch visits both bad windows
            loader.next_batch()
    assert any(x in str(e.value) for x in expected), str(e.value)
    assert f"grt data verify {d}" in str(e.value)
    # up to the bad window every batch came out; without vocab_size (old callers) nothing is checked
    unchecked = SequenceLoader(shards, 32, 4, seed=1)
    for _ in range(batches + 1):
        x, y, _ = unchecked.next_batch()
    assert x.shape == (4, 32)


def test_validation_batches_check_ids(tmp_path):
    d = make_dataset(tmp_path / "ds")
    inject_bad_ids(d, "val_000000.bin", {40: 51000})
    val = TokenShards(d, "val")
    with pytest.raises(ValueError) as e:
        list(validation_batches(val, 32, 4, vocab_size=N_VOCAB))
    assert f"token id 51000 at token offset 40 of {d / 'val_000000.bin'}" in str(e.value)
    assert len(list(validation_batches(val, 32, 4))) == 3  # (400 - 1) // 32 = 12 windows, 4 per batch


def test_data_verify_reports_ids_out_of_range(tmp_path, capsys):
    d = make_dataset(tmp_path / "ds")
    assert verify_dataset(d) == [] and main(["data", "verify", str(d)]) == 0
    inject_bad_ids(d, "train_000002.bin", {0: 60001, 951: 60002})
    inject_bad_ids(d, "val_000000.bin", {399: 50257})
    problems = verify_dataset(d)
    assert problems == [
        "train: train_000002.bin holds 2 token id(s) >= the tokenizer's vocabulary size (n_vocab) 50,257, the first "
        "(60001) at token offset 0",
        "val: val_000000.bin holds 1 token id(s) >= the tokenizer's vocabulary size (n_vocab) 50,257, the first "
        "(50257) at token offset 399"]
    capsys.readouterr()
    rc, err = cli(capsys, "data", "verify", str(d))
    assert rc == 1 and "train_000002.bin holds 2 token id(s)" in err and "val_000000.bin holds 1 token id(s)" in err
    assert verify_dataset(d, checksums=False) == []  # the quick look reads no data


# --------------------------------------------------------------------------------------- windows
def test_validation_too_short_hint_fits_the_configuration(tmp_path):
    d = make_dataset(tmp_path / "ds", val_tokens=20)
    train, val = [TokenShards(d, "train")], TokenShards(d, "val")
    (msg,) = check_windows(train, val, 32, has_validation_sources=False, val_fraction=0.05)
    assert (f"the val split of the dataset at {d} holds 20 tokens, fewer than one window of 33 "
            f"(model.block_size+1); raise data.val_fraction (now 0.05)") in msg
    (msg,) = check_windows(train, val, 32, has_validation_sources=True, val_fraction=0.05)
    assert "holds 20 tokens" in msg and "add text to data.validation_sources" in msg and "val_fraction" not in msg
    assert check_windows(train, val, 19, has_validation_sources=True, val_fraction=0.05) == []  # 20 = one window


def test_validation_batches_hint_comes_from_the_manifest(tmp_path):
    d = make_dataset(tmp_path / "ds", val_tokens=20, data_config={"validation_sources": [{"paths": ["v.txt"]}],
                                                                  "val_fraction": 0.05})
    with pytest.raises(ValueError) as e:
        next(validation_batches(TokenShards(d, "val"), 32, 4))
    assert "holds 20 tokens" in str(e.value) and "add text to data.validation_sources" in str(e.value)
    assert "val_fraction" not in str(e.value)


def test_shard_tokens_below_block_size_is_named_as_the_limit(tmp_path):
    d = make_dataset(tmp_path / "ds", train_tokens=3000, val_tokens=400, shard_tokens=64)
    train, val = [TokenShards(d, "train")], TokenShards(d, "val")
    assert check_windows(train, val, 63, has_validation_sources=False, val_fraction=0.1) == []  # 64 = one window
    problems = check_windows(train, val, 64, has_validation_sources=False, val_fraction=0.1)
    assert len(problems) == 2  # train and val, at once
    for split, msg in zip(("train", "val"), problems):
        assert msg.startswith(f"the {split} split of the dataset at {d} has no window of 65 tokens")
        assert ("data.shard_tokens=64 < model.block_size+1=65 and windows never cross shards; raise "
                "data.shard_tokens and re-tokenize") in msg and "lower model.block_size" in msg
    with pytest.raises(ValueError, match="data.shard_tokens=64 < model.block_size"):
        SequenceLoader(train, 64, 2, seed=0)


def test_every_training_dataset_of_a_mixture_needs_a_window(tmp_path):
    good = make_dataset(tmp_path / "good")
    short = make_dataset(tmp_path / "short", train_tokens=30)
    train = [TokenShards(good, "train"), TokenShards(short, "train")]
    problems = check_windows(train, TokenShards(good, "val"), 32, has_validation_sources=False, val_fraction=0.1)
    assert problems == [f"the train split of the dataset at {short} holds 30 tokens, fewer than one window of 33 "
                        f"(model.block_size+1); tokenize more text into it, or lower model.block_size"]
