"""Document masking (``data.document_masking``), two measurements side by side in one run:

(a) its cost on this machine: training tokens/s (forward + backward) of the same model on the same windows of the
    bundled corpus, with the windows' document index (attention inside each document, positions restarting) and
    without it (one causal sequence per window); a small GRT and the dense model of the same width, both with the
    llama block (the modern recipe's block), the arms alternating;
(b) the share of attention work that block sparsity saves for the bundled corpus's document lengths: over the
    training windows at ``--block-size``, the (query, key) pairs the block-causal mask keeps against the causal
    mask, and the 128 x 128 tiles a block-sparse kernel (FlexAttention) still visits (any kept pair) and of those
    the full ones (every pair kept: no mask evaluated). Pure counting: no GPU needed.

    python -m bench.document_masking [--dataset data/stdlib] [--block-size 1024] [--repeat 3] [--windows N]

The documents come from the shards' ``.idx`` files (document start offsets), as the loader reads them. The dataset
is the quickstart's bundled corpus (the Python standard library), tokenized first when it is missing.

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.layout import documents_from_starts

TILE = 128  # FlexAttention's default block size (queries and keys)
RECIPE = "recipes/quickstart-grt.yaml"  # its data section is the bundled corpus


def dataset(path: Path) -> Path:
    """The bundled corpus's tokenized dataset at ``path``, tokenized now with the quickstart's data section when it
    has no manifest yet."""
    if not (path / "manifest.json").is_file():
        from pipeline.config import load_recipe
        from pipeline.tokenize import tokenize

        cfg = load_recipe(RECIPE, [f"data.dataset_dir={path}"])
        tokenize(cfg.data, quiet=True)
    return path


def shard_documents(path: Path, split: str = "train"):
    """(tokens, document starts) of every shard of a split: its token file and its ``.idx`` offsets."""
    manifest = json.loads((path / "manifest.json").read_text())
    for sh in manifest["splits"][split]["shards"]:
        tokens = np.memmap(path / sh["file"], dtype=manifest["dtype"], mode="r")
        yield tokens, np.fromfile(path / sh["index_file"], dtype="<u4").astype(np.int64)


def window_docs(path: Path, seq_len: int, limit: int | None = None,
                every: int = 1) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """The training windows of ``seq_len + 1`` tokens, back to back in each shard as the loader cuts them, and the
    document index of their ``seq_len`` inputs; every ``every``-th window, at most ``limit``."""
    windows, docs = [], []
    for tokens, starts in shard_documents(path):
        for s in range(0, len(tokens) - seq_len, seq_len * every):
            if limit is not None and len(windows) >= limit:
                return windows, docs
            windows.append(np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64))
            docs.append(documents_from_starts(s, seq_len, starts))
    return windows, docs


# ------------------------------------------------------------------------------------ (b) counting the mask
def mask_counts(docs: torch.Tensor, tile: int = TILE) -> dict[str, int]:
    """The (query, key) pairs and the ``tile`` x ``tile`` tiles of one window's causal and block-causal masks, from
    its document index ``docs`` [T] (non-decreasing). A tile below the diagonal keeps a pair when its last key and
    its first query share a document, and keeps them all when its first key and last query do (documents are
    contiguous); a diagonal tile always keeps its own diagonal."""
    T = docs.numel()
    lengths = torch.unique_consecutive(docs, return_counts=True)[1]
    n = math.ceil(T / tile)
    first = docs[torch.arange(n) * tile]
    last = docs[torch.clamp(torch.arange(1, n + 1) * tile, max=T) - 1]
    below = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)  # [query tile, key tile], key tile earlier
    kept = below & (last[None, :] == first[:, None])
    full = below & (first[None, :] == last[:, None])
    return {"pairs_causal": T * (T + 1) // 2, "pairs_documents": int((lengths * (lengths + 1) // 2).sum()),
            "tiles_causal": n * (n + 1) // 2, "tiles_documents": int(kept.sum()) + n,
            "full_tiles_causal": n * (n - 1) // 2, "full_tiles_documents": int(full.sum()),
            "documents": int(lengths.numel())}


def sparsity(path: Path, seq_len: int, limit: int | None) -> dict:
    """(b): the counts of :func:`mask_counts` summed over the training windows, their ratios, and the documents'
    lengths as the windows cut them."""
    _, docs = window_docs(path, seq_len, limit)
    total: dict[str, int] = {}
    pieces = []
    for d in docs:
        for k, v in mask_counts(d).items():
            total[k] = total.get(k, 0) + v
        pieces.append(torch.unique_consecutive(d, return_counts=True)[1])
    pieces = torch.cat(pieces).double()
    return {
        "block_size": seq_len, "tile": TILE, "windows": len(docs), **total,
        "documents_per_window": round(total["documents"] / len(docs), 2),
        "document_piece_tokens": {"mean": round(pieces.mean().item(), 1), "median": pieces.median().item(),
                                  "p90": pieces.quantile(0.9).item()},
        "pairs_kept": round(total["pairs_documents"] / total["pairs_causal"], 4),
        "pairs_saved": round(1 - total["pairs_documents"] / total["pairs_causal"], 4),
        "tiles_kept": round(total["tiles_documents"] / total["tiles_causal"], 4),
        "tiles_saved": round(1 - total["tiles_documents"] / total["tiles_causal"], 4),
    }


# ------------------------------------------------------------------------------------- (a) tokens/s, side by side
def models(vocab: int, seq_len: int, d: int, heads: int) -> dict:
    """A small GRT (1+1x4+1) and the dense model with its block executions (6 layers), llama block, same width."""
    common = dict(vocab_size=vocab, block_size=seq_len, d_model=d, n_head=heads, block="llama", bias=False,
                  n_kv_head=max(1, heads // 2), dropout=0.0)
    return {"grt": GRTConfig(**common, n_prelude=1, n_core=1, n_recurrence=4, n_coda=1),
            "dense": GPTConfig(**common, n_layer=6)}


def throughput(path: Path, seq_len: int, batch: int, d: int, heads: int, repeat: int) -> dict:
    """(a): tokens/s of one training step (forward + backward) with and without the windows' documents; every arm on
    the same ``batch`` windows (spread evenly over the training split), the arms alternating and each one's best of
    ``repeat`` taken."""
    total = json.loads((path / "manifest.json").read_text())["splits"]["train"]["tokens"]
    windows, docs = window_docs(path, seq_len, batch, every=max(1, total // seq_len // batch))
    x = torch.tensor(np.stack(windows))
    idx, targets, doc = x[:, :-1], x[:, 1:], torch.stack(docs)
    vocab = int(json.loads((path / "manifest.json").read_text())["tokenizer"]["n_vocab"])
    arms = {}
    for name, cfg in models(vocab, seq_len, d, heads).items():
        torch.manual_seed(0)
        model = build_model(cfg).train()
        for masked in (False, True):
            def step(model=model, masked=masked):
                _, loss = model(idx, targets, docs=doc if masked else None)
                loss.backward()
                model.zero_grad(set_to_none=True)
            arms[f"{name}_{'documents' if masked else 'causal'}"] = step
    for fn in arms.values():  # warm-up
        fn()
    best = {k: math.inf for k in arms}
    for _ in range(repeat):
        for k, fn in arms.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    tokens = batch * seq_len
    out = {"shapes": {"d_model": d, "heads": heads, "kv_heads": max(1, heads // 2), "seq_len": seq_len,
                      "batch": batch, "vocab": vocab, "documents_per_window": round(doc[:, -1].float().mean().item()
                                                                                    + 1, 2)},
           "tokens_per_s": {k: round(tokens / v, 1) for k, v in best.items()}}
    out["masked_over_causal"] = {m: round(best[f"{m}_causal"] / best[f"{m}_documents"], 3) for m in ("grt", "dense")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="data/stdlib", help="the bundled corpus's dataset folder (tokenized first "
                                                             "with the quickstart's data section when missing)")
    ap.add_argument("--block-size", type=int, default=1024, help="(b): the window length counted")
    ap.add_argument("--windows", type=int, default=None, help="(b): at most this many windows (default: all)")
    ap.add_argument("--train-block-size", type=int, default=256, help="(a): the training window length")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    path = dataset(Path(args.dataset))
    out = {"dataset": str(path), "threads": torch.get_num_threads(), "repeat": args.repeat,
           "sparsity": sparsity(path, args.block_size, args.windows),
           "throughput": throughput(path, args.train_block_size, args.batch, args.d_model, args.heads, args.repeat)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
