"""The fused gate op against its ceiling and its alternatives, each timed the same way, per dtype and noise level:

- kernel only: the Triton forward and backward kernels launched directly, many calls back to back captured in one
  CUDA graph and timed with CUDA events (no host sync, dispatch or seed drawing inside the timed region), over input
  sets rotated so that no call finds its inputs in L2; bandwidth = the bytes each kernel must move (forward: z, h, o
  read, h' written; backward: dy, z, h, o read, dz, dh, do written) / time, against ``copy_`` of the same bytes
  measured the same way (the ceiling);
- end to end: one training call of the op (a seed drawn, custom-op dispatch, autograd, forward + backward), many
  back to back between two CUDA events (no sync per call, so host overhead shows only where it outlasts the GPU's
  work), against the plain PyTorch formula eager and compiled by inductor (noise from torch.randn in the graph),
  timed the same way.

    python -m bench.gate_op [--device cuda|cpu] [--rows 8192] [--d 1024] [--calls 100] [--repeat 5]
                            [--dtypes float32,bfloat16] [--sigmas 0,0.1]

Prints one JSON object (and each case's figures to stderr as it finishes). On a CPU (a dry run on small shapes) the
kernels run in Triton's interpreter when triton imports (a check that the code path works, not a speed) and every
timer is the host clock around the back-to-back calls; the keys are the same.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # the kernels run on a CPU only in Triton's interpreter, chosen before the import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ops import gate as gate_ops  # noqa: E402  (after TRITON_INTERPRET is chosen)

L2_FLUSH_BYTES = 4 * 60 * 2**20  # H200: 60 MB of L2; rotating inputs over 4x that keeps every call's reads in HBM


def eager_reference(z, h, o, inv_tau: float, sigma: float):
    """The plain formula (float32 math, as the kernels), noise from torch.randn: what inductor fuses on its own."""
    logit = z.float() * inv_tau
    if sigma > 0:
        logit = logit + sigma * torch.randn_like(logit)
    g = torch.sigmoid(logit)
    return (o.float() + g * (h.float() - o.float())).to(h.dtype)


def fused_op(z, h, o, inv_tau: float, sigma: float):
    return gate_ops.gate_update(z, h, o, inv_tau, sigma, gate_ops.new_seed())


def per_call_s(fn, calls: int, repeat: int, device: torch.device) -> float:
    """Median over ``repeat`` batches of (batch time / calls), ``fn(i)`` called ``calls`` times back to back: CUDA
    events around the batch on CUDA, the host clock on a CPU."""
    fn(0)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for i in range(calls):
                fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def graph_per_call_s(fn, calls: int, repeat: int, device: torch.device) -> float:
    """Like :func:`per_call_s`, with the ``calls`` launches captured once in a CUDA graph and the graph replayed: no
    launch gaps from the host. On a CPU: :func:`per_call_s`."""
    if device.type != "cuda":
        return per_call_s(fn, calls, repeat, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (Triton's build) outside the capture
        for i in range(3):
            fn(i)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return per_call_s(lambda _: graph.replay(), 1, repeat, device) / calls


def rotation(bytes_per_call: int, device: torch.device) -> int:
    """Input sets to rotate over so that a call's inputs are out of L2 by the time they come round again."""
    return max(2, math.ceil(L2_FLUSH_BYTES / bytes_per_call)) if device.type == "cuda" else 1


def kernel_only(z, h, o, dy, sigma: float, calls: int, repeat: int, device, n_sets: int) -> dict:
    """The Triton kernels launched directly (no op dispatch, no autograd, one fixed seed) vs copy_ of their bytes."""
    from ops import gate_triton

    sets = [tuple(t.clone() for t in (z, h, o, dy)) for _ in range(n_sets)]
    e = z.element_size() * z.numel()
    fwd_bytes, bwd_bytes = 4 * e, 7 * e

    def fwd(i):
        zz, hh, oo, _ = sets[i % n_sets]
        gate_triton.gate_forward(zz, hh, oo, 1.0, sigma, 3)

    def bwd(i):
        zz, hh, oo, dd = sets[i % n_sets]
        gate_triton.gate_backward(dd, zz, hh, oo, 1.0, sigma, 3)

    def copier(n_bytes):  # dst.copy_(src) reads n/2 and writes n/2 bytes: n bytes moved, as the kernel's count
        bufs = [(torch.empty(n_bytes // 2, dtype=torch.uint8, device=device),
                 torch.empty(n_bytes // 2, dtype=torch.uint8, device=device)) for _ in range(n_sets)]
        return lambda i: bufs[i % n_sets][1].copy_(bufs[i % n_sets][0])

    t = {"fwd": graph_per_call_s(fwd, calls, repeat, device), "bwd": graph_per_call_s(bwd, calls, repeat, device),
         "copy_fwd": graph_per_call_s(copier(fwd_bytes), calls, repeat, device),
         "copy_bwd": graph_per_call_s(copier(bwd_bytes), calls, repeat, device)}
    return {"kernel_fwd_bytes": fwd_bytes, "kernel_bwd_bytes": bwd_bytes,
            "kernel_fwd_us": round(t["fwd"] * 1e6, 2), "kernel_bwd_us": round(t["bwd"] * 1e6, 2),
            "kernel_fwd_gb_per_s": round(fwd_bytes / t["fwd"] / 1e9, 1),
            "kernel_bwd_gb_per_s": round(bwd_bytes / t["bwd"] / 1e9, 1),
            "copy_same_bytes_as_fwd_us": round(t["copy_fwd"] * 1e6, 2),
            "copy_same_bytes_as_bwd_us": round(t["copy_bwd"] * 1e6, 2),
            "copy_gb_per_s": round(fwd_bytes / t["copy_fwd"] / 1e9, 1),
            "kernel_fwd_fraction_of_copy_bandwidth": round(t["copy_fwd"] / t["fwd"], 3),
            "kernel_bwd_fraction_of_copy_bandwidth": round(t["copy_bwd"] / t["bwd"], 3)}


def end_to_end(arms: dict, z, h, o, dy, sigma: float, calls: int, repeat: int, device, n_sets: int) -> dict:
    """Each arm's forward + backward as training calls it (fresh leaves, so autograd runs in full), back to back."""
    sets = [tuple(t.clone() for t in (z, h, o, dy)) for _ in range(n_sets)]

    def call(fn):
        def run(i):
            zz, hh, oo, dd = sets[i % n_sets]
            zz, hh, oo = (t.detach().requires_grad_() for t in (zz, hh, oo))
            fn(zz, hh, oo, 1.0, sigma).backward(dd)
        return run

    return {f"{name}_fwd_bwd_us": round(per_call_s(call(fn), calls, repeat, device) * 1e6, 2)
            for name, fn in arms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=None, help="batch x sequence positions (default: 8192 CUDA, 64 CPU)")
    ap.add_argument("--d", type=int, default=None, help="width (default: 1024 CUDA, 256 CPU)")
    ap.add_argument("--calls", type=int, default=None, help="back-to-back calls per timed batch (100 CUDA, 3 CPU)")
    ap.add_argument("--repeat", type=int, default=None, help="timed batches, median reported (5 CUDA, 2 CPU)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sigmas", default="0,0.1", help="gate noise levels (0: the kernels' no-noise variant)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows, d = args.rows or (8192 if cuda else 64), args.d or (1024 if cuda else 256)
    calls, repeat = args.calls or (100 if cuda else 3), args.repeat or (5 if cuda else 2)
    kernels = gate_ops._triton_available() and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "shape": [rows, d], "calls": calls,
           "repeat": repeat, "timer": "CUDA events" if cuda else "host clock (perf_counter)",
           "kernel_path": ("Triton on CUDA, one CUDA graph of the back-to-back calls" if cuda else
                           "Triton's interpreter: checks the code path, not a speed") if kernels else
                          "skipped: triton does not import", "results": {}}
    gate_ops.set_backend("auto" if cuda else "triton" if kernels else "reference")
    arms = {"eager_reference": eager_reference, "compiled_reference": torch.compile(eager_reference)}
    if kernels:
        arms = {"fused_op": fused_op, **arms}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for sigma in (float(s) for s in args.sigmas.split(",")):
            torch.manual_seed(0)
            z, h, o, dy = (torch.randn(rows, d, device=device, dtype=dtype) for _ in range(4))
            n_sets = rotation(4 * z.numel() * z.element_size(), device)  # the forward's bytes, the fewest moved
            res = {"input_sets_rotated": n_sets}
            if kernels:
                res.update(kernel_only(z, h, o, dy, sigma, calls, repeat, device, n_sets))
            res.update(end_to_end(arms, z, h, o, dy, sigma, calls, repeat, device, n_sets))
            if kernels:
                for ref in ("eager_reference", "compiled_reference"):
                    res[f"fused_op_speedup_over_{ref}"] = round(res[f"{ref}_fwd_bwd_us"] / res["fused_op_fwd_bwd_us"],
                                                                3)
                # what dispatch, autograd and the seed add to the two kernels
                res["fused_op_overhead_over_kernels_us"] = round(
                    res["fused_op_fwd_bwd_us"] - res["kernel_fwd_us"] - res["kernel_bwd_us"], 2)
            case = f"{dtype_name}_sigma{sigma}"
            out["results"][case] = res
            print(f"[bench/gate_op] {case}: {json.dumps(res)}", file=sys.stderr, flush=True)
    gate_ops.set_backend("auto")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
