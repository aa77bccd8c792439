"""Memory traffic of the Recurrent Transformer's self-KV attention (companion abstract: "an exact tiling-based
algorithm ... reducing HBM traffic from Theta(N^2) to Theta(N log N)"), the token-by-token reference and the tiled
divide-and-conquer side by side at N = 256 ... 4096, one head of ``--head-dim``, tile ``--tile``.

Traffic is counted (``pipeline.model.self_kv_attention.Traffic``: elements moved between main memory and a fast
memory holding one tile), not measured: a CPU has no HBM/SRAM split to time. The tiled count comes from a real run
of the algorithm (random weights, no autograd); the reference's from its closed form d (N^2 + 5N), which
tests/test_self_kv_attention.py checks against the counter at small N (running it at N = 4096 takes minutes and
gives the same number). Also timed: both algorithms at the smallest N, to show the tiled one costs no extra compute
on a CPU. Prints one JSON object.

    python -m bench.self_kv_traffic [--lengths 256,512,1024,2048,4096] [--head-dim 64] [--tile 64]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from pipeline.model.self_kv_attention import Traffic
from pipeline.model.self_kv_attention import attend_reference
from pipeline.model.self_kv_attention import attend_tiled


def layer(x: torch.Tensor, w: list[torch.Tensor]):
    """Queries and own keys/values from the input; position t's output x_t + tanh(o_t W_o) gives its memory key."""
    def reveal(t0, t1, o):
        y = x[..., t0:t1, :] + torch.tanh(o @ w[3])
        return y @ w[1], y @ w[2]
    return x @ w[0], x @ w[1], x @ w[2], reveal


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tile", type=int, default=64)
    args = ap.parse_args(argv)
    d, tile = args.head_dim, args.tile
    torch.manual_seed(0)
    rows = []
    for n in (int(v) for v in args.lengths.split(",")):
        x = torch.randn(1, 1, n, d)
        w = [torch.randn(d, d) / math.sqrt(d) for _ in range(4)]
        tr = Traffic()
        with torch.no_grad():
            attend_tiled(*layer(x, w), tile=tile, traffic=tr)
        ref = d * (n * n + 5 * n)
        rows.append({"n": n, "reference_elements": ref, "tiled_elements": tr.total,
                     "reference_over_tiled": round(ref / tr.total, 2),
                     "tiled_over_n_d_log2_n_over_tile": round(tr.total / (n * d * math.log2(max(n / tile, 2))), 3),
                     "reference_over_n2_d": round(ref / (n * n * d), 4)})
    n0 = int(args.lengths.split(",")[0])
    x = torch.randn(1, 1, n0, d)
    w = [torch.randn(d, d) / math.sqrt(d) for _ in range(4)]
    seconds = {}
    for name, fn, kw in (("reference", attend_reference, {}), ("tiled", attend_tiled, {"tile": tile})):
        with torch.no_grad():
            t0 = time.perf_counter()
            fn(*layer(x, w), **kw)
            seconds[name] = round(time.perf_counter() - t0, 3)
    out = {"bench": "self_kv_traffic", "head_dim": d, "tile": tile, "unit": "elements moved (counted)",
           "rows": rows, "cpu_seconds_at_smallest_n": seconds}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
