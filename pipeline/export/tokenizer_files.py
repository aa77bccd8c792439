"""The tokenizer files of an exported Hugging Face folder for a user tokenizer (``data.tokenizer`` a tokenizer.json or
a tiktoken BPE file): ``tokenizer.json`` + ``tokenizer_config.json`` that ``AutoTokenizer`` loads offline, giving the
ids the pipeline trained on. GPT-2's own files are written by :func:`pipeline.export.hf.write_tokenizer`.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.tokenize.bpe import EOT_TOKEN
from pipeline.tokenize.tokenizers import Tokenizer


def hf_backend(tok: Tokenizer):
    """A ``tokenizers.Tokenizer`` equal to ``tok``: the file itself, or a tiktoken rank file converted."""
    if tok.kind == "hf":
        return tok.impl
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=tok.path, pattern=tok.pattern,
                                extra_special_tokens=[EOT_TOKEN]).converted()
    if backend.token_to_id(EOT_TOKEN) != tok.eos_id:  # ranks with gaps: the converter numbers them otherwise
        raise ValueError(f"{tok.path}: its ranks are not 0..{tok.eos_id - 1} without gaps (or <|endoftext|> is not "
                         f"right after the last rank, as in o200k_base), so the converted tokenizer.json would number "
                         f"tokens otherwise; export with a Hugging Face tokenizer.json")
    return backend


def write_user_tokenizer(folder: Path, tok: Tokenizer, block_size: int) -> None:
    """tokenizer.json and tokenizer_config.json (EOS as pad, left padding; BOS named where the tokenizer has one)."""
    from transformers import PreTrainedTokenizerFast

    backend = hf_backend(tok)
    eos = backend.id_to_token(tok.eos_id)
    bos = backend.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos, padding_side="left",
                                   model_max_length=block_size, **({"bos_token": bos} if bos else {}))
    fast.save_pretrained(str(folder))
