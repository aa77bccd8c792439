"""`grt tokenize`: sources -> GPT-2 BPE -> uint16 shards (train / val) + manifest.json, written atomically."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.config import DataConfig, config_hash
from pipeline.tokenize.bpe import gpt2_encoding, tokenizer_identity
from pipeline.tokenize.sources import SourceStats, iter_documents
from pipeline.tokenize.writer import FORMAT_VERSION, MANIFEST, ShardWriter, read_manifest, write_manifest

BATCH_DOCS = 256  # documents per tiktoken batch call


def data_fingerprint(cfg: DataConfig) -> str:
    """What decides the dataset's content (the output folder does not)."""
    d = dataclasses.asdict(cfg)
    d.pop("dataset_dir")
    return config_hash(d)


def is_validation(text: str, fraction: float) -> bool:
    """A document goes to validation when the hash of its content falls under ``fraction``: deterministic and
    independent of order, so no document can be in both splits."""
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8", "replace")).digest()[:8], "little")
    return h < fraction * 2**64


def tokenize(cfg: DataConfig, force: bool = False, quiet: bool = False) -> dict:
    """Tokenize ``cfg.sources`` into ``cfg.dataset_dir``; reuse an existing dataset made from the same config."""
    out = Path(cfg.dataset_dir)
    fingerprint = data_fingerprint(cfg)
    if (out / MANIFEST).is_file() and not force:
        manifest = read_manifest(out)
        if manifest.get("fingerprint") == fingerprint:
            if not quiet:
                print(f"tokenize: {out} is up to date ({manifest['splits']['train']['tokens']:,} train tokens); "
                      f"--force to rebuild")
            return manifest
        raise FileExistsError(f"{out} holds a dataset made from a different data config (fingerprint "
                              f"{manifest.get('fingerprint')} != {fingerprint}); choose another data.dataset_dir "
                              f"or pass --force to overwrite it")
    ident = tokenizer_identity(cfg.tokenizer)
    dtype = np.uint16 if ident["n_vocab"] <= 2**16 else np.uint32
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    enc = gpt2_encoding()
    writers = {s: ShardWriter(tmp, s, cfg.shard_tokens, dtype) for s in ("train", "val")}
    source_stats = []
    t0 = time.time()
    bar = tqdm(desc="tokenize", unit=" docs", disable=quiet, mininterval=1.0)
    for src in cfg.sources:
        stats = SourceStats()
        batch: list[str] = []

        def flush():
            for text, ids in zip(batch, enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1)):
                ids.append(ident["eot_id"])  # end-of-text after every document
                writers["val" if is_validation(text, cfg.val_fraction) else "train"].add_document(ids)
            bar.update(len(batch))
            batch.clear()

        for doc in iter_documents(src, stats):
            batch.append(doc.text)
            if len(batch) >= BATCH_DOCS:
                flush()
        flush()
        source_stats.append({"kind": src.kind, "paths": src.paths, "documents": stats.documents,
                             "bytes": stats.bytes, "skipped": stats.skipped or {}})
    bar.close()
    splits = {s: w.close() for s, w in writers.items()}
    if splits["val"]["tokens"] == 0 or splits["train"]["tokens"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        empty = "validation" if splits["val"]["tokens"] == 0 else "training"
        raise ValueError(f"the {empty} split is empty ({sum(s['documents'] for s in source_stats)} documents in "
                         f"all): add documents or change data.val_fraction={cfg.val_fraction}")
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tokenizer": ident,
        "dtype": np.dtype(dtype).name,
        "splits": splits,
        "sources": source_stats,
        "data_config": dataclasses.asdict(cfg),
        "seconds": round(time.time() - t0, 2),
    }
    write_manifest(tmp, manifest)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    if not quiet:
        mb = sum(s["bytes"] for s in source_stats) / 1e6
        print(f"tokenize: {mb:.1f} MB -> {splits['train']['tokens']:,} train + {splits['val']['tokens']:,} val "
              f"tokens in {manifest['seconds']:.1f} s -> {out}")
    return manifest
