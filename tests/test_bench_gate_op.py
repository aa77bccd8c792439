"""bench/gate_op.py on this CPU: its timer against a known delay, its L2 rotation against the H200's cache by hand, and
the dry run's JSON (the CUDA run's keys, the byte counts by hand, every derived figure from the ones it reports)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"


gate_op = load_bench("gate_op")


def test_per_call_time_of_a_known_delay():
    calls = []
    s = gate_op.per_call_s(lambda i: (calls.append(i), time.sleep(0.005)), 4, 3, torch.device("cpu"))
    assert 0.005 <= s < 0.008
    assert calls == [0] + [0, 1, 2, 3] * 3  # one warm-up, then back-to-back batches over the rotation index


def test_rotation_keeps_each_calls_inputs_out_of_the_h200_l2():
    """Forward bytes at 8192 x 1024: 4 tensors x 8 Mi elements x 2 (bf16) = 64 MiB, x 4 (fp32) = 128 MiB; 4 x 60 MiB
    of L2 to cycle through takes 4 and 2 sets. On a CPU: no rotation."""
    cuda = torch.device("cuda")
    assert gate_op.rotation(4 * 8192 * 1024 * 2, cuda) == 4
    assert gate_op.rotation(4 * 8192 * 1024 * 4, cuda) == 2
    assert gate_op.rotation(4 * 8 * 64 * 4, torch.device("cpu")) == 1


@pytest.mark.slow
def test_dry_run_reports_the_cuda_keys():
    out = subprocess.run([sys.executable, "bench/gate_op.py", "--rows", "8", "--d", "64", "--calls", "2", "--repeat",
                          "1", "--dtypes", "bfloat16", "--sigmas", "0.1"], cwd=BENCH.parent, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["timer"] == "host clock (perf_counter)" and "interpreter" in res["kernel_path"]
    r = res["results"]["bfloat16_sigma0.1"]
    assert f"[bench/gate_op] bfloat16_sigma0.1: {json.dumps(r)}" in out.stderr  # each case as it finishes
    assert r["kernel_fwd_bytes"] == 4 * 8 * 64 * 2 and r["kernel_bwd_bytes"] == 7 * 8 * 64 * 2
    for k in ("fwd", "bwd"):
        assert r[f"kernel_{k}_gb_per_s"] == pytest.approx(r[f"kernel_{k}_bytes"] / r[f"kernel_{k}_us"] / 1e3, abs=0.06)
        assert r[f"kernel_{k}_fraction_of_copy_bandwidth"] == pytest.approx(
            r[f"copy_same_bytes_as_{k}_us"] / r[f"kernel_{k}_us"], abs=2e-3)
    assert r["copy_gb_per_s"] == pytest.approx(r["kernel_fwd_bytes"] / r["copy_same_bytes_as_fwd_us"] / 1e3, rel=0.05)
    for ref in ("eager_reference", "compiled_reference"):
        assert r[f"fused_op_speedup_over_{ref}"] == pytest.approx(
            r[f"{ref}_fwd_bwd_us"] / r["fused_op_fwd_bwd_us"], abs=2e-3)
    assert r["fused_op_overhead_over_kernels_us"] == pytest.approx(
        r["fused_op_fwd_bwd_us"] - r["kernel_fwd_us"] - r["kernel_bwd_us"], abs=0.03)
