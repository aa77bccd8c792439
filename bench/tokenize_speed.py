"""Tokenize throughput: our `grt tokenize` pipeline against (a) raw tiktoken `encode_ordinary_batch` over the same
documents already in memory, with the same number of threads as we have workers — the ceiling — and (b) a Hugging
Face `datasets.map(num_proc=N)` tokenize-and-concatenate pass as nanoGPT's OpenWebText prep does it.

    python -m bench.tokenize_speed [--corpus FILE.jsonl.zst] [--workers 2] [--repeat 3]

Prints one JSON object. Each arm runs --repeat times, interleaved, and the best time counts (the machine is noisy);
the ratios compare arms measured in the same run.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from pipeline.config import DataConfig
from pipeline.config import SourceConfig
from pipeline.tokenize import tokenize
from pipeline.tokenize.bpe import gpt2_encoding

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "pretrain" / "imdb_reviews" / "imdb_test.jsonl.zst"


def read_docs(path: Path) -> list[str]:
    with open(path, "rb") as f:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
        return [json.loads(line)["text"] for line in text if line.strip()]


def raw_tiktoken(docs: list[str], workers: int) -> tuple[float, int]:
    enc = gpt2_encoding()
    t = time.perf_counter()
    ids = enc.encode_ordinary_batch(docs, num_threads=workers)
    return time.perf_counter() - t, sum(len(x) for x in ids)


def ours(corpus: Path, workers: int, tmp: Path) -> tuple[float, int]:
    out = tmp / "ours"
    cfg = DataConfig(sources=[SourceConfig(paths=[str(corpus)])], dataset_dir=str(out), dedup=False,
                     val_fraction=0.01)
    t = time.perf_counter()
    m = tokenize(cfg, force=True, quiet=True, workers=workers)
    dt = time.perf_counter() - t
    shutil.rmtree(out)
    return dt, m["totals"]["tokens"] - m["totals"]["documents"]  # without the EOTs, as the other arms count


def hf_map(corpus: Path, workers: int, tmp: Path) -> tuple[float, int]:
    """nanoGPT data/openwebtext/prepare.py's recipe: load_dataset -> map(encode_ordinary + EOT, num_proc) ->
    concatenate into one uint16 memmap in 1,024 batches."""
    import datasets

    enc = gpt2_encoding()
    cache = tmp / "hf_cache"

    def process(example):
        ids = enc.encode_ordinary(example["text"])
        ids.append(enc.eot_token)
        return {"ids": ids, "len": len(ids)}

    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    tokenized = ds.map(process, remove_columns=ds.column_names, num_proc=workers, desc=None)
    total = int(np.sum(tokenized["len"], dtype=np.uint64))
    arr = np.memmap(tmp / "hf.bin", dtype=np.uint16, mode="w+", shape=(total,))
    idx = 0
    n_batches = min(1024, len(tokenized))
    for i in range(n_batches):
        batch = tokenized.shard(num_shards=n_batches, index=i, contiguous=True).with_format("numpy")
        chunk = np.concatenate(batch["ids"])
        arr[idx: idx + len(chunk)] = chunk
        idx += len(chunk)
    arr.flush()
    dt = time.perf_counter() - t
    shutil.rmtree(cache, ignore_errors=True)
    (tmp / "hf.bin").unlink()
    return dt, total - len(tokenized)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not args.corpus.is_file():
        sys.exit(f"corpus {args.corpus} not found: pass --corpus FILE.jsonl.zst")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    docs = read_docs(args.corpus)
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    best: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for name, fn in (("raw_tiktoken", lambda: raw_tiktoken(docs, args.workers)),
                             ("ours", lambda: ours(args.corpus, args.workers, Path(tmp))),
                             ("hf_datasets_map", lambda: hf_map(args.corpus, args.workers, Path(tmp)))):
                dt, tokens = fn()
                if name not in best or dt < best[name][0]:
                    best[name] = (dt, tokens)
    arms = {name: {"seconds": round(dt, 3), "MB_per_s": round(mb / dt, 2), "tokens_per_s": round(tok / dt),
                   "tokens": tok} for name, (dt, tok) in best.items()}
    print(json.dumps({
        "corpus": str(args.corpus), "documents": len(docs), "text_MB": round(mb, 2), "workers": args.workers,
        "cpus": os.cpu_count(), "repeat": args.repeat, "arms": arms,
        "ratio_vs_raw_tiktoken": round(best["raw_tiktoken"][0] / best["ours"][0], 3),
        "ratio_vs_hf_datasets_map": round(best["hf_datasets_map"][0] / best["ours"][0], 3),
        "note": "ratios are throughput ratios (ours / other); ours includes reading and decompressing the file, "
                "parsing JSON, dedup hashing, validation split and writing shards + manifest; raw tiktoken starts "
                "from documents already in memory",
    }, indent=2))


if __name__ == "__main__":
    main()
