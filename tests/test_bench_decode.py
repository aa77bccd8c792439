"""bench/decode.py at a tiny size: the JSON's fields, and its figures against references written here: parameter bytes
from the blocks' parameter equation, KV bytes from the issue's layer-count formula (2 tensors x B x positions x d per
layer cache: n_pre + n_core R + n_coda for ``full``, n_pre + n_core + n_coda for the compact strategies, n_layer for
the dense model), and every ratio recomputed from the measured numbers it reports."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench"
D, H, V = 32, 2, 64


decode = load_bench("decode")

SIZES = decode.Sizes("tiny", widths={"medium": (D, H), "large": (D, H)}, batch=2, prompt=6, new_tokens=3,
                     t4_batches=(1, 3), t4_positions=12, t4_decode=2, vocab_size=V)
# recipes/paper: GPT-2 medium 24L, GRT medium-isoflop 2+5x4+2 (positions: the recipes' 1,024)
S = 1024
LAYOUT = {"dense": dict(n_layer=24), "grt": dict(n_prelude=2, n_core=5, n_recurrence=4, n_coda=2)}


def params(kind: str) -> int:
    """Unique parameters by hand: embeddings V d + S d, blocks 12d^2 + 13d each, final LN 2d; GRT adds W_proj
    (2d^2 + d) and the gate (two LNs 4d, Linear(2d, d) 2d^2 + d, Linear(d, d) d^2 + d)."""
    block = 12 * D * D + 13 * D
    if kind == "dense":
        unique_blocks, extra = LAYOUT["dense"]["n_layer"], 0
    else:
        g = LAYOUT["grt"]
        unique_blocks = g["n_prelude"] + g["n_core"] + g["n_coda"]
        extra = (2 * D * D + D) + (4 * D + 2 * D * D + D + D * D + D)
    return V * D + S * D + unique_blocks * block + 2 * D + extra


def caches(kind: str, kv: str) -> int:
    if kind == "dense":
        return LAYOUT["dense"]["n_layer"]
    g = LAYOUT["grt"]
    return g["n_prelude"] + g["n_core"] * (g["n_recurrence"] if kv == "full" else 1) + g["n_coda"]


def kv_bytes(kind: str, kv: str, batch: int, positions: int, element: int) -> int:
    return caches(kind, kv) * 2 * batch * positions * D * element


@pytest.fixture(scope="module", autouse=True)
def threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds synchronisation
    yield
    torch.set_num_threads(n)


def test_table4_bytes_and_ratios_follow_the_layer_count_formula():
    out = decode.table4(SIZES, torch.device("cpu"))
    json.dumps(out)  # printable as is
    T = SIZES.t4_positions
    assert out["protocol"]["T"] == T and out["protocol"]["prefill"] + out["protocol"]["decode_forwards"] == T
    for B in SIZES.t4_batches:
        row = out[f"B={B}"]
        dense_total = 2 * params("dense") + kv_bytes("dense", "full", B, T, 2)  # bf16: 2 bytes
        assert row["gpt2_medium"]["weights_bytes"] == 2 * params("dense")
        assert row["gpt2_medium"]["kv_bytes"] == kv_bytes("dense", "full", B, T, 2)
        for kv in ("full", "last", "first", "averaged"):
            e = row[f"grt_{kv}"]
            assert e["layer_caches"] == caches("grt", kv)
            assert e["weights_bytes"] == 2 * params("grt")
            assert e["kv_bytes"] == kv_bytes("grt", kv, B, T, 2)
            total = 2 * params("grt") + kv_bytes("grt", kv, B, T, 2)
            assert e["ratio_total"] == pytest.approx(total / dense_total, abs=1e-4)
            assert e["ratio_kv"] == pytest.approx(caches("grt", kv) / 24, abs=1e-4)
            assert out["ratios_total_grt_over_gpt2_medium"][f"B={B}"][kv] == e["ratio_total"]
    goal = out["goal_averaged_at_largest_batch"]
    assert goal["batch"] == 3 and goal["ratio_total"] == out["B=3"]["grt_averaged"]["ratio_total"]
    assert goal["at_paper_size"] is False


def test_table4_paper_size_figures_are_the_papers():
    """The formula at the paper's sizes gives Table 4's own GiB (0.75 / 0.41 / 0.35 at B = 1, 3.66 / 3.32 / 1.44 at
    B = 32), from GPT-2 medium's 354.8M and GRT medium-isoflop's 171.1M parameters counted here."""
    gib = 2**30
    p_dense = 50257 * 1024 + 1024 * 1024 + 24 * (12 * 1024**2 + 13 * 1024) + 2 * 1024
    p_grt = (50257 * 1024 + 1024 * 1024 + 9 * (12 * 1024**2 + 13 * 1024) + 2 * 1024
             + (2 * 1024**2 + 1024) + (4 * 1024 + 3 * 1024**2 + 2 * 1024))
    out = decode.paper_size_formula()
    assert out["params"] == {"dense": p_dense, "grt": p_grt}
    for B, dense, full, avg in ((1, 0.75, 0.41, 0.35), (32, 3.66, 3.32, 1.44)):
        kv = 2 * 2 * B * 1024 * 1024
        row = out[f"B={B}"]
        for key, n_caches, p, paper in (("gpt2_medium", 24, p_dense, dense), ("grt_full", 24, p_grt, full),
                                        ("grt_averaged", 9, p_grt, avg)):
            total = (2 * p + n_caches * kv) / gib
            assert round(total, 2) == paper
            assert row[key]["total_gib"] == pytest.approx(total, abs=1e-3)
        assert row["grt_averaged"]["ratio"] == pytest.approx((2 * p_grt + 9 * kv) / (2 * p_dense + 24 * kv), abs=1e-4)


def test_table3_fields_and_ratios_from_the_measured_numbers():
    kvs = ["full", "averaged"]
    out = decode.table3(SIZES, torch.device("cpu"), torch.float32, repeat=2, compile_mode="blocks", grt_kvs=kvs,
                        scales=("medium",), compile_backend="eager")
    json.dumps(out)
    p = out["protocol"]
    assert (p["batch"], p["prompt"], p["new_tokens"], p["decode_forwards_timed"]) == (2, 6, 3, 2)
    res = out["medium"]
    assert res["models"]["dense"]["params"] == params("dense") and res["models"]["grt"]["params"] == params("grt")
    assert res["models"]["dense"]["block_executions"] == res["models"]["grt"]["block_executions"] == 24
    positions = SIZES.prompt + SIZES.new_tokens
    for arm, (kind, kv) in {"dense": ("dense", "full"), "grt_full": ("grt", "full"),
                            "grt_averaged": ("grt", "averaged")}.items():
        mem = res["memory"][arm]
        assert mem["weights_bytes"] == 4 * params(kind)  # float32
        assert mem["kv_bytes"] == kv_bytes(kind, kv, SIZES.batch, positions, 4)
        assert mem["weights_plus_kv_bytes"] == mem["weights_bytes"] + mem["kv_bytes"]
    arms = res["arms"]
    assert set(arms) == {f"{a}_{m}" for a in ("dense", "grt_full", "grt_averaged") for m in ("eager", "compiled")}
    for a in arms.values():
        assert len(a["decode_ms_per_token_mean_by_round"]) == 2 and a["decode_ms_per_token"] > 0 and a["prefill_ms"] > 0
    for kv in kvs:
        r = res["ratios"][f"grt_{kv}_over_dense"]
        for mode in ("eager", "compiled"):
            assert r[f"decode_latency_{mode}"] == pytest.approx(
                arms[f"grt_{kv}_{mode}"]["decode_ms_per_token"] / arms[f"dense_{mode}"]["decode_ms_per_token"],
                rel=1e-3)
            assert r[f"prefill_latency_{mode}"] == pytest.approx(
                arms[f"grt_{kv}_{mode}"]["prefill_ms"] / arms[f"dense_{mode}"]["prefill_ms"], rel=1e-3)
        want = (4 * params("grt") + kv_bytes("grt", kv, SIZES.batch, positions, 4)) / (
            4 * params("dense") + kv_bytes("dense", "full", SIZES.batch, positions, 4))
        assert r["weights_plus_kv"] == pytest.approx(want, abs=1e-4)
    # compiled per block: dynamo traced the blocks and GRT's gate without graph breaks, and settled after the first
    # run (nothing compiled in the timed rounds)
    assert arms["dense_compiled"]["dynamo_first_run"]["frames_compiled"] > 0
    for a in ("dense_compiled", "grt_full_compiled", "grt_averaged_compiled"):
        assert arms[a]["dynamo_first_run"]["graph_breaks"] == 0
        assert arms[a]["dynamo_timed_runs"] == {"frames_compiled": 0, "graphs": 0, "graph_breaks": 0}
    assert set(res["dynamo_cache_entries"]) == {"Block.forward", "Gate.forward"}
    assert all(n >= 1 for n in res["dynamo_cache_entries"].values())



def test_decode_bench_imports_nothing_a_bare_gpu_image_lacks():
    """`make gpu-check` runs bench/decode.py on a machine with torch and triton only: building its models imports
    neither DeepSpeed nor MLflow nor tiktoken."""
    code = ("import runpy, sys; sys.argv = ['decode']; "
            "d = runpy.run_path('bench/decode.py', run_name='not_main'); d['paper_size_formula'](); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'mlflow', 'tiktoken'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=BENCH.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", sorted(decode.RECIPE_MODELS))
def test_models_without_pyyaml_are_the_recipes(name, monkeypatch):
    """Without PyYAML the bench builds the models from its own copy of the recipes' model sections: the same."""
    from_recipe = decode.recipe_model(name)
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    with pytest.raises(ImportError):
        import yaml  # noqa: F401
    assert decode.recipe_model(name) == from_recipe
