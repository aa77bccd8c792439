"""`make gpu-check`: the checks for a lent CUDA machine, in one command (each bench has its own time limit below).

1. the CUDA tests (tests/test_gpu.py: kernels vs reference in float32 and bfloat16, compiled + fused training vs
   eager), called directly so that pytest is not needed there;
2. bench/gate_op.py (fused op bandwidth vs copy, speed-ups over the eager and compiled references);
3. bench/train.py --arms d,e (GRT vs dense tokens/s eager / compiled / compiled + fused; MFU of GPT-2 medium);
4. bench/decode.py at the paper's sizes (Table 3: decode ms/token and peak memory, eager and compiled, GPT-2 medium /
   large vs GRT medium / large iso-FLOP; Table 4: weights + KV at B = 1 and 32 per KV strategy vs GPT-2 medium).

The machine needs torch and triton only: nothing here imports deepspeed, mlflow, tiktoken or PyYAML. Results go to
``$OUT/gpu_check.json`` when OUT is set (and to stdout). Without CUDA it is a dry run: the CUDA-only parts are
skipped with a message, the rest runs on the CPU on small shapes.
"""
from __future__ import annotations

import _bootstrap  # noqa: F401

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_cuda_tests() -> dict:
    spec = importlib.util.spec_from_file_location("test_gpu", ROOT / "tests" / "test_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = {}
    for name in sorted(n for n in dir(mod) if n.startswith("test_")):
        t = time.time()
        try:
            getattr(mod, name)()
            results[name] = {"ok": True, "s": round(time.time() - t, 1)}
        except Exception as e:  # noqa: BLE001 — reported, and the exit code says it
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    return results


def run_bench(args: list[str], timeout: int) -> dict:
    t = time.time()
    try:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # reported with the others' results instead of ending the check
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"ok": False, "error": f"{args[0]} ran past its {timeout} s limit; last output:\n{err[-2000:]}"}
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-3000:]}
    return {"ok": True, "s": round(time.time() - t, 1), "result": json.loads(proc.stdout)}


def main() -> int:
    cuda = torch.cuda.is_available()
    report = {"cuda": cuda, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if cuda:
        report["tests"] = run_cuda_tests()
        report["gate_op"] = run_bench(["bench/gate_op.py", "--repeat", "50"], 180)
        report["train"] = run_bench(["bench/train.py", "--arms", "d,e", "--repeat", "10", "--mfu-steps", "300"], 360)
        report["decode"] = run_bench(["bench/decode.py", "--full", "--repeat", "3"], 480)
    else:
        msg = "dry run: no CUDA device; skipped: the CUDA tests, the Triton arm and copy ceiling of gate_op, the GPU " \
              "train arms. Ran: the benches' CPU paths on small shapes."
        print(msg, file=sys.stderr)
        report["dry_run"] = msg
        report["gate_op"] = run_bench(["bench/gate_op.py", "--repeat", "3", "--rows", "64", "--d", "256"], 300)
        report["train"] = run_bench(["bench/train.py", "--arms", "d,e", "--repeat", "1", "--mfu-steps", "2"], 900)
        report["decode"] = run_bench(["bench/decode.py", "--repeat", "1"], 1200)  # the reduced CPU sizes
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    failed = [k for k, v in report.get("tests", {}).items() if not v["ok"]]
    failed += [k for k in ("gate_op", "train", "decode") if not report[k]["ok"]]
    if failed:
        print(f"gpu-check: FAILED {failed}", file=sys.stderr)
        return 1
    print("gpu-check: all passed" + (" (dry run)" if not cuda else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
