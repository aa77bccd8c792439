"""Document-masked attention kernels side by side (``data.document_masking``), forward + backward on CUDA (forward
only on the CPU, where FlexAttention has no backward), in one run:

  sdpa_causal       PyTorch SDPA, plain causal: the unmasked window, the time masking is compared with
  sdpa_documents    SDPA with the [B, 1, T, T] boolean block-causal mask (the CPU path, and CUDA's with dropout)
  flex_documents    FlexAttention, compiled, with the layout's block mask (CUDA's default path): its kernel skips the
                    128 x 128 tiles that lie wholly across documents

on the same q, k, v (grouped-query: fewer key/value heads) for two document layouts of the window: ``long`` (the
bundled corpus's shape: documents about as long as the window, ~1.1 per window) and ``short`` (documents of T/8 on
average: many per window, where block sparsity can pay). Document lengths are drawn from an exponential distribution
(seeded), so no dataset or tokenizer is needed (the GPU image has neither). Also per layout: the time to build the
forward's :class:`~pipeline.model.layout.TokenLayout` with the block mask (once per forward, not per block), the
share of tiles the block mask keeps, and flex's largest difference from SDPA's output and input gradients.

    python bench/document_attention.py [--sizes cuda|cpu|tiny] [--repeat 10]

Each arm's figure is the median over ``--repeat`` timed calls after warm-up (the compile of flex is in the warm-up,
and reported apart); the arms alternate. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the GPU image runs this from a bare checkout

from pipeline.model.attention import _compiled_flex  # noqa: E402
from pipeline.model.layout import TokenLayout  # noqa: E402

TILE = 128  # FlexAttention's default block size
SIZES = {  # B, T, query heads, key/value heads, head size, dtype
    "cuda": dict(B=4, T=4096, H=16, H_kv=4, hd=128, dtype="bfloat16"),
    "cpu": dict(B=1, T=512, H=4, H_kv=2, hd=32, dtype="float32"),
    "tiny": dict(B=1, T=128, H=2, H_kv=1, hd=16, dtype="float32"),
}


def document_index(B: int, T: int, mean_tokens: float, seed: int) -> torch.Tensor:
    """[B, T] document index per token, documents of exponentially distributed lengths (mean ``mean_tokens``, at
    least 1), the first one already under way at the window's start as a packed loader cuts it."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        ends, t = [], -int(torch.rand((), generator=gen) * mean_tokens)  # the first document began before the window
        while t < T:
            t += max(1, int(torch.empty(()).exponential_(1 / mean_tokens, generator=gen)))
            ends.append(min(max(t, 1), T))
        starts = torch.zeros(T, dtype=torch.int64)
        starts[[e for e in ends[:-1] if e < T]] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def tiles_kept(docs: torch.Tensor) -> float:
    """The share of the causal mask's TILE x TILE tiles a block-sparse kernel still visits (any pair kept)."""
    B, T = docs.shape
    n = -(-T // TILE)
    first = docs[:, torch.arange(n) * TILE]
    last = docs[:, torch.clamp(torch.arange(1, n + 1) * TILE, max=T) - 1]
    below = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)
    kept = (below & (last[:, None, :] == first[:, :, None])).sum() + B * n  # + the diagonal tiles
    return round(kept.item() / (B * n * (n + 1) // 2), 4)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(size: dict, repeat: int, device: torch.device) -> dict:
    B, T, H, H_kv, hd = size["B"], size["T"], size["H"], size["H_kv"], size["hd"]
    dtype = getattr(torch, size["dtype"])
    backward = device.type == "cuda"  # FlexAttention has no CPU backward (torch 2.13)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, T, hd, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
    k, v = (torch.randn(B, H_kv, T, hd, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
            for _ in "kv")
    grad = torch.randn(B, H, T, hd, device=device, dtype=dtype, generator=gen)
    idx = torch.zeros(B, T, dtype=torch.long, device=device)
    flex = _compiled_flex()
    out: dict = {"device": str(device), "torch": torch.__version__, "timed": "forward + backward" if backward
                 else "forward (no FlexAttention backward on the CPU)",
                 "shapes": {**size, "tile": TILE}, "layouts": {}}
    for name, mean in (("long", 0.9 * T), ("short", T / 8)):
        docs = document_index(B, T, mean, seed=1).to(device)
        build = [timed(lambda: TokenLayout.build(idx, docs=docs).block_mask(), device) for _ in range(3)]
        layout = TokenLayout.build(idx, docs=docs)
        dense, block = layout.dense_mask(), layout.block_mask()
        arms = {
            "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "sdpa_documents": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
            "flex_documents": lambda: flex(q, k, v, block_mask=block, enable_gqa=True),
        }
        results, compile_s = {}, {}
        for arm, fn in arms.items():  # warm-up (flex's compile, the first time), and the outputs compared below
            t = time.perf_counter()
            y = fn()
            if backward:
                y.backward(grad)
            compile_s[arm] = round(time.perf_counter() - t, 2)
            results[arm] = (y.detach().float(), *(t.grad.float() for t in (q, k, v) if backward))
            for t in (q, k, v):
                t.grad = None
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(repeat):
            for arm, fn in arms.items():
                times[arm].append(timed(lambda fn=fn: fn().backward(grad) if backward else fn(), device))
                for t in (q, k, v):
                    t.grad = None
        ms = {arm: round(statistics.median(ts) * 1e3, 3) for arm, ts in times.items()}
        ref, got = results["sdpa_documents"], results["flex_documents"]
        out["layouts"][name] = {
            "mean_document_tokens": round(mean, 1),
            "documents_per_window": round((docs[:, -1] + 1).float().mean().item(), 2),
            "tiles_kept": tiles_kept(docs.cpu()),
            "ms": ms,
            "flex_over_sdpa_causal": round(ms["flex_documents"] / ms["sdpa_causal"], 3),
            "flex_over_sdpa_documents": round(ms["flex_documents"] / ms["sdpa_documents"], 3),
            "sdpa_documents_over_sdpa_causal": round(ms["sdpa_documents"] / ms["sdpa_causal"], 3),
            "fastest_masked": min(("sdpa_documents", "flex_documents"), key=ms.get),
            "layout_build_ms": round(statistics.median(build) * 1e3, 3),
            "first_call_s": compile_s,
            # flex against SDPA with the same mask (output, and dq, dk, dv when timed): the largest |difference|
            # over the largest |value| of SDPA's, in the arms' dtype
            "flex_vs_sdpa_rel_diff": [float(f"{((a - b).abs().max() / b.abs().max()).item():.3g}")
                                      for a, b in zip(got, ref)],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", choices=sorted(SIZES), default=None,
                    help="shapes (default: cuda on a GPU, else cpu)")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[args.sizes or ("cuda" if device.type == "cuda" else "cpu")]
    print(json.dumps(measure(size, args.repeat, device), indent=2))


if __name__ == "__main__":
    main()
