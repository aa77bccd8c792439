"""`grt tokenizer train SOURCES --vocab-size N --out DIR`: a byte-level BPE trained on the user's corpus with the
``tokenizers`` library, written as ``DIR/tokenizer.json`` for ``data.tokenizer``.

SOURCES are read as the tokenize stage reads them (:mod:`pipeline.tokenize.sources`): files, globs or folders (plain
text one document per file, JSON lines, parquet), the word ``stdlib`` (the bundled corpus), or a recipe whose
``data.sources`` are taken. Bad records are skipped as tokenize skips them. GPT-2's byte-level pre-tokenisation (no
normaliser), so every text round-trips byte for byte; special tokens ``<|endoftext|>`` (EOS, id 0) and
``<|startoftext|>`` (BOS, id 1). The same input gives the byte-identical file: the trainer counts words exactly and
breaks ties between equally frequent pairs by the pair itself, and the file lists the vocabulary in id order.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterator

from pipeline.tokenize.bpe import EOT_TOKEN
from pipeline.tokenize.sources import parse_record
from pipeline.tokenize.sources import plan_units
from pipeline.tokenize.sources import read_unit
from pipeline.tokenize.tokenizers import BOS_NAMES

BOS_TOKEN = BOS_NAMES[0]
SPECIAL_TOKENS = [EOT_TOKEN, BOS_TOKEN]  # ids 0 and 1
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, and the special tokens
OUT_FILE = "tokenizer.json"


def source_configs(sources: list[str]) -> list:
    """SourceConfigs for the command line's SOURCES (a recipe contributes its data.sources)."""
    from pipeline.config import SourceConfig
    from pipeline.config import load_recipe

    out = []
    for s in sources:
        if s == "stdlib":
            out.append(SourceConfig(kind="stdlib"))
        elif s.endswith((".yaml", ".yml")) and Path(s).is_file():
            out.extend(load_recipe(s).data.sources)
        else:
            out.append(SourceConfig(kind="files", paths=[s]))
    return out


def iter_texts(configs: list, counts: dict) -> Iterator[str]:
    """Every usable document of the sources, in the tokenize stage's order; ``counts`` gets documents / skipped."""
    for i, src in enumerate(configs):
        taken = 0
        for unit in plan_units(i, src):
            for rec in read_unit(unit, src):
                if rec.fmt == "blank":
                    continue
                text, reason = parse_record(rec.raw, rec.fmt, src.text_field)
                if reason is not None:
                    counts["skipped"] += 1
                    continue
                nbytes = len(text.encode("utf-8", "surrogatepass"))
                if src.max_bytes is not None and taken + nbytes > src.max_bytes:  # the source ends, as in tokenize
                    break
                taken += nbytes
                counts["documents"] += 1
                counts["bytes"] += nbytes
                yield text
            else:
                continue
            break


def train_tokenizer(configs: list, vocab_size: int, min_frequency: int = 2):
    """(a trained byte-level BPE ``tokenizers.Tokenizer``, counts of what was read)."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size} is below {MIN_VOCAB} (256 bytes and {len(SPECIAL_TOKENS)} special "
                         f"tokens); give a larger one")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    counts = {"documents": 0, "skipped": 0, "bytes": 0}
    tok.train_from_iterator(iter_texts(configs, counts), trainer=trainer)
    if not counts["documents"]:
        raise ValueError(f"no document in the sources ({counts['skipped']:,} records skipped): nothing to train on")
    return tok, counts


def cmd_tokenizer_train(args) -> int:
    out = Path(args.out)
    t0 = time.time()
    tok, counts = train_tokenizer(source_configs(args.sources), args.vocab_size, args.min_frequency)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (OUT_FILE + ".tmp")
    tmp.write_text(tok.to_str(pretty=True), encoding="utf-8")
    tmp.replace(out / OUT_FILE)
    print(f"tokenizer: {counts['documents']:,} documents ({counts['bytes'] / 1e6:,.1f} MB"
          + (f", {counts['skipped']:,} records skipped" if counts["skipped"] else "")
          + f") -> byte-level BPE, {tok.get_vocab_size():,} tokens in {time.time() - t0:.1f} s -> {out / OUT_FILE} "
          f"(set data.tokenizer: {out / OUT_FILE})", file=sys.stdout)
    return 0


def register(sub) -> None:
    tk = sub.add_parser("tokenizer", help="train a tokenizer on your corpus").add_subparsers(
        dest="tokenizer_command", required=True)
    s = tk.add_parser("train", help="byte-level BPE (tokenizers library) on SOURCES -> DIR/tokenizer.json")
    s.add_argument("sources", nargs="+", metavar="SOURCES",
                   help="text/JSONL/parquet files, globs or folders; 'stdlib' (the bundled corpus); or a recipe "
                        "(its data.sources)")
    s.add_argument("--vocab-size", type=int, required=True, help="tokens in all, the 2 special tokens included")
    s.add_argument("--out", required=True, help="folder to write tokenizer.json into")
    s.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences for a merge (default 2)")
    s.set_defaults(fn=cmd_tokenizer_train)
