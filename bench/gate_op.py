"""The fused gate op (forward + backward) against its ceiling and its alternatives, measured side by side:

- achieved bandwidth of the Triton op's forward + backward (bytes it must move: z, h, o read and h' written forward;
  dy, z, h, o read and dz, dh, do written backward) against a device-to-device copy of the same number of bytes;
- its speed-up over the eager PyTorch reference (autograd through sigmoid / mul / add) and over that reference
  compiled with torch.compile.

    python bench/gate_op.py [--device cuda|cpu] [--repeat 20] [--rows 8192] [--d 1024]

Prints one JSON object. On a CPU the Triton arm is skipped (the kernels run there only in Triton's interpreter) and
the two reference arms are timed on a small shape.
"""
from __future__ import annotations

import _bootstrap  # noqa: F401

import argparse
import json
import math
import time

import torch

from ops import gate as gate_ops  # noqa: E402


def eager_reference(z, h, o, inv_tau: float, sigma: float):
    logit = z.float() * inv_tau
    if sigma > 0:
        logit = logit + sigma * torch.randn_like(logit)
    g = torch.sigmoid(logit)
    return (o.float() + g * (h.float() - o.float())).to(h.dtype)


def fused(z, h, o, inv_tau: float, sigma: float):
    return gate_ops.gate_update(z, h, o, inv_tau, sigma, gate_ops.new_seed())


def fwd_bwd(fn, z, h, o, dy, sigma):
    def run():
        zz, hh, oo = (t.detach().requires_grad_() for t in (z, h, o))
        fn(zz, hh, oo, 1.0, sigma).backward(dy)
    return run


def timed(arms: dict, device: torch.device, repeat: int) -> dict[str, float]:
    """Median time per arm, arms interleaved."""
    for fn in arms.values():
        fn()
    times = {k: [] for k in arms}
    for _ in range(repeat):
        for k, fn in arms.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rows", type=int, default=None, help="batch x sequence positions (default: 8192 on CUDA)")
    ap.add_argument("--d", type=int, default=1024)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows = args.rows or (8192 if cuda else 256)
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "shape": [rows, args.d],
           "repeat": args.repeat, "results": {}}
    if cuda:
        gate_ops.set_backend("auto")
    else:
        out["note"] = "CPU dry run: the Triton arm and the copy ceiling need CUDA; only the references are timed"
    compiled_reference = torch.compile(eager_reference)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        z, h, o, dy = (torch.randn(rows, args.d, device=device, dtype=dtype) for _ in range(4))
        for sigma in (0.0, 0.1):
            arms = {"eager_reference": fwd_bwd(eager_reference, z, h, o, dy, sigma),
                    "compiled_reference": fwd_bwd(compiled_reference, z, h, o, dy, sigma)}
            if cuda:
                arms["fused"] = fwd_bwd(fused, z, h, o, dy, sigma)
                n_bytes = 11 * z.numel() * z.element_size()
                src = torch.empty(math.ceil(n_bytes / 2), dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                arms["copy_same_bytes"] = lambda: dst.copy_(src)  # reads + writes n_bytes in all
            t = timed(arms, device, args.repeat)
            res = {f"{k}_ms": round(v * 1e3, 4) for k, v in t.items()}
            if cuda:
                res["fused_gb_per_s"] = round(n_bytes / t["fused"] / 1e9, 1)
                res["copy_gb_per_s"] = round(n_bytes / t["copy_same_bytes"] / 1e9, 1)
                res["fused_fraction_of_copy_bandwidth"] = round(t["copy_same_bytes"] / t["fused"], 3)
                res["speedup_over_eager_reference"] = round(t["eager_reference"] / t["fused"], 2)
                res["speedup_over_compiled_reference"] = round(t["compiled_reference"] / t["fused"], 2)
            else:
                res["compiled_over_eager_time"] = round(t["compiled_reference"] / t["eager_reference"], 3)
            out["results"][f"{str(dtype).removeprefix('torch.')}_sigma{sigma}"] = res
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
