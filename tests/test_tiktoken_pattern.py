"""A tiktoken rank file's split pattern (data.tiktoken_pattern): a public encoding's file brings its own pattern and
<|endoftext|> id, any other file needs the key, and the pattern is part of the tokenizer's identity. Expected ids are
worked out by hand from the small rank file below, never taken from the code."""
from __future__ import annotations

import base64

import pytest
import tiktoken_ext.openai_public as openai_public

from conftest import tiny_recipe
from pipeline.config import DataConfig
from pipeline.config import from_dict
from pipeline.config.loading import RecipeError
from pipeline.tokenize import tokenize
from pipeline.tokenize import tokenizers
from pipeline.tokenize.stage import content_config
from pipeline.tokenize.tokenizers import dataset_tokenizer
from pipeline.tokenize.tokenizers import file_sha256
from pipeline.tokenize.tokenizers import load_tokenizer
from pipeline.train.data_match import check_dataset_matches_model

# every byte, then merges: "12" 256, "123" 257, "45" 258, "12345" 259
MERGES = [b"12", b"123", b"45", b"12345"]
ONE, TWO, THREE, FOUR, FIVE = b"12345"  # a single byte's rank is the byte


@pytest.fixture
def rank_file(tmp_path):
    ranks = [bytes([b]) for b in range(256)] + MERGES
    path = tmp_path / "small.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    tokenizers._load_file.cache_clear()
    return path


def test_a_public_encodings_file_brings_its_own_pattern_and_eos(rank_file, monkeypatch):
    # tiktoken's r50k_base, with its rank file's sha256 swapped for this small file's (the real one is 1.6 MB)
    table = dict(tokenizers.known_encodings())
    table["r50k_base"] = {**table["r50k_base"], "sha256": file_sha256(rank_file)}
    assert table["r50k_base"]["pattern"] == openai_public.r50k_pat_str and table["r50k_base"]["eos_id"] == 50256
    monkeypatch.setattr(tokenizers, "known_encodings", lambda: table)
    tok = load_tokenizer(str(rank_file))  # no data.tiktoken_pattern needed
    # r50k keeps " 12345" and "12345" whole (\p{N}++): "12"+"3" -> "123", "4"+"5" -> "45", then "12345"
    assert tok.encode("12345") == [259]
    assert tok.encode("a 12345") == [ord("a"), ord(" "), 259]  # piece " 12345": no " 1" rank, so " " stays alone
    assert (tok.eos_id, tok.n_vocab) == (50256, 50257)  # r50k's own id, not max rank + 1
    assert tok.identity()["pattern"] == openai_public.r50k_pat_str
    assert not DataConfig(tokenizer=str(rank_file)).validate()
    # tiktoken's other encodings as read: o200k's <|endoftext|> is 199999 (its last rank is 199997)
    assert tokenizers.known_encodings()["o200k_base"]["eos_id"] == 199999


def test_an_unknown_file_without_a_pattern_is_refused_in_one_line(rank_file, tmp_path, corpus):
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(rank_file))
    msg = str(e.value)
    assert "\n" not in msg and "data.tiktoken_pattern" in msg and "cl100k_base" in msg, msg
    with pytest.raises(RecipeError, match="data.tiktoken_pattern"):
        from_dict(tiny_recipe(tmp_path, corpus, data={"tokenizer": str(rank_file)}))
    problems = DataConfig(tokenizer=str(rank_file), tiktoken_pattern=r"(\p{N}").validate()
    assert len(problems) == 1 and "data.tiktoken_pattern" in problems[0] and "regex" in problems[0], problems
    assert DataConfig(tokenizer="gpt2", tiktoken_pattern="r50k_base").validate()  # only for a tiktoken file


def test_the_stated_pattern_decides_the_split_and_the_identity(rank_file):
    r50k = load_tokenizer(str(rank_file), "r50k_base")
    cl100k = load_tokenizer(str(rank_file), "cl100k_base")
    digits = load_tokenizer(str(rank_file), r"\p{N}|\s+|[^\s\p{N}]+")
    assert r50k.encode("12345") == [259]  # one piece "12345"
    assert cl100k.encode("12345") == [257, 258]  # \p{N}{1,3}: pieces "123" and "45"
    assert digits.encode("12345") == [ONE, TWO, THREE, FOUR, FIVE]  # one digit a piece: no merge applies
    assert r50k.eos_id == cl100k.eos_id == len(MERGES) + 256  # an unknown file: max rank + 1
    assert r50k.vocab_hash == cl100k.vocab_hash  # the same file ...
    assert len({str(t.identity()) for t in (r50k, cl100k, digits)}) == 3  # ... three tokenizers


def test_a_dataset_made_with_one_pattern_is_refused_by_a_recipe_with_another(rank_file, tmp_path, corpus):
    def cfg(pattern):
        return from_dict(tiny_recipe(tmp_path, corpus, model={"vocab_size": 512},
                                     data={"tokenizer": str(rank_file), "tiktoken_pattern": pattern}))

    manifest = tokenize(cfg("cl100k_base").data, quiet=True)
    assert manifest["tokenizer"]["pattern"].startswith(r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+")  # cl100k's
    check_dataset_matches_model(manifest, cfg("cl100k_base"))  # its own pattern fits
    assert content_config(cfg("r50k_base").data) != content_config(cfg("cl100k_base").data)
    assert "tiktoken_pattern" not in content_config(DataConfig())  # gpt2 recipes keep their fingerprint
    other = cfg("r50k_base")
    rank_file.unlink()  # the user's file moved: the dataset's copy stands in, read with the recipe's pattern
    tokenizers._load_file.cache_clear()
    assert dataset_tokenizer(other).encode("12345") == [259]
    with pytest.raises(ValueError) as e:
        check_dataset_matches_model(manifest, other)
    assert "\n" not in str(e.value) and "pattern" in str(e.value), str(e.value)
