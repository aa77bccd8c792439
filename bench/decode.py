"""The paper's decoding tables (§3.3, Tables 3 and 4), GRT and its dense iso-FLOP twin side by side in one run:

Table 3 (latency and peak memory): batch 4, a 1,024-token prompt, 128 greedy new tokens. Prefill (ms) and decode
    (ms per new token after the prefill, one token per forward with the KV cache) for GPT-2 medium vs GRT
    medium-isoflop (2+5x4+2) and GPT-2 large vs GRT large-isoflop (1+5x6+5), eager and torch.compile'd, GRT with
    each strategy of ``--table3-kv``; arms alternated (order reversed every round) so machine noise hits all alike;
    ratios GRT / dense. Memory: weights + KV bytes from the tensors allocated; on CUDA also the peak allocated.
Table 4 (decoding memory): weights + KV in bf16 at B = 1 and B = 32, T = 1,024 cached positions, for each KV
    strategy of GRT medium-isoflop vs GPT-2 medium, as ratios (paper: averaged KV 0.39x GPT-2 medium at B = 32).

    python -m bench.decode [--full] [--device cpu|cuda] [--tables 3,4] [--repeat N] [--compile blocks|trainer|off]
                           [--table3-kv full,averaged] [--out FILE]

Sizes: the recipes' models (recipes/paper/*.yaml) at the paper's protocol with ``--full`` (the default on CUDA);
on a CPU by default a reduced size that finishes in minutes: the same layer layouts (so the same block executions
and the same KV layer-cache counts), width / 4 at 64 per head, prompt 128, 16 new tokens, Table 4 at T = 128. The
JSON states the sizes run. Weights are random (latency and memory do not depend on them).

Compilation (``--compile``), the choice for decode: ``blocks`` (default) compiles every transformer block and GRT's
gate MLP, the pure-tensor modules, and leaves the cache's bookkeeping (slot lookup per step, compaction, advance) and
the loop over steps eager, so a dense and a recurrent model are compiled alike; the cache's length grows every token,
which dynamo makes a dynamic dimension after its first recompile. ``trainer`` compiles what training compiles
(``parallelize.apply_compile``: each prelude/coda block and the whole recurrence step ``model.recur``, so GRT's
projection and gate update are inside the graph too); for decode that graph reads the cache's per-step Python state
(step index, steps run, slot counts) and is guarded on it: one compiled variant per step and phase (14 for 2+5x4+2
at a tiny size), each an inductor build, too slow for the CPU default. The recompile limit is raised so that no
variant falls back to eager silently. Reported per compiled arm: dynamo's frames compiled, graphs and graph breaks
in the first run and in the timed rounds (which should compile nothing), and per scale the compiled variants held
per compiled forward (each beyond the first a recompile).

Dtypes: bf16 weights on CUDA (as the paper); float32 on a CPU for Table 3 (this CPU has no native bf16 matmul, so
bf16 timings would measure the emulation), bf16 for Table 4 everywhere (its figures are bytes).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import torch

from pipeline.model import build_model
from pipeline.model import count_params
from pipeline.model import model_class
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import ModelConfig
from pipeline.model.kv_cache import KV_STRATEGIES
from pipeline.model.kv_cache import KVCache
from pipeline.train.parallelize import apply_compile

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = 2**20, 2**30

# The recipes' model sections (recipes/paper/*.yaml, their bases _paper-base / _grt-base), used when PyYAML is absent
# (a bare GPU image); with it the recipes themselves are read.
RECIPE_MODELS = {
    "gpt2-medium": dict(type="gpt", n_layer=24, d_model=1024, n_head=16),
    "grt-medium-isoflop": dict(type="grt", n_prelude=2, n_core=5, n_recurrence=4, n_coda=2, d_model=1024, n_head=16),
    "gpt2-large": dict(type="gpt", n_layer=36, d_model=1280, n_head=20),
    "grt-large-isoflop": dict(type="grt", n_prelude=1, n_core=5, n_recurrence=6, n_coda=5, d_model=1280, n_head=20),
}
PAIRS = {"medium": ("gpt2-medium", "grt-medium-isoflop"), "large": ("gpt2-large", "grt-large-isoflop")}

# The paper's printed figures, for the comparison the JSON carries (Table 3: ms/token and MB; Table 4: x GPT-2 medium)
PAPER_TABLE3 = {"medium": {"eager_ms": (2.95, 3.62), "compiled_ms": (2.54, 2.81), "peak_mb": (747, 402)},
                "large": {"eager_ms": (4.33, 5.33), "compiled_ms": (3.33, 3.67), "peak_mb": (1570, 639)}}
PAPER_TABLE4 = {"B=1": {"full": 0.55, "averaged": 0.47}, "B=32": {"full": 0.91, "averaged": 0.39}}


@dataclass
class Sizes:
    """What one run measures. ``widths``: (d_model, n_head) per scale, None = the recipe's."""

    name: str
    widths: dict = field(default_factory=lambda: {"medium": None, "large": None})
    batch: int = 4  # Table 3 (paper: 4)
    prompt: int = 1024  # Table 3 (paper: 1,024)
    new_tokens: int = 128  # Table 3 (paper: 128)
    t4_batches: tuple = (1, 32)  # Table 4 (paper: 1 and 32)
    t4_positions: int = 1024  # Table 4: T, the cached positions (paper: 1,024)
    t4_decode: int = 4  # Table 4: of the T positions, the last ones decoded one by one after a prefill of the rest
    vocab_size: int | None = None  # None: the recipes' 50,257


PAPER_SIZES = Sizes("paper")
# width / 4 at the paper's 64 per head, the same layer layouts; the vocabulary stays GPT-2's
CPU_SIZES = Sizes("reduced (CPU default)", widths={"medium": (256, 4), "large": (320, 5)}, prompt=128, new_tokens=16,
                  t4_positions=128)


def recipe_model(name: str, d_model: int | None = None, n_head: int | None = None, min_positions: int = 0,
                 vocab_size: int | None = None) -> ModelConfig:
    """The model section of recipes/paper/<name>.yaml, optionally narrowed, its position table lengthened to
    ``min_positions`` if shorter (Table 3's 1,024 + 128 positions are past GPT-2's 1,024: random weights, and
    (min_positions - 1,024) d parameters more, which the reported params include)."""
    try:
        from pipeline.config import load_recipe

        cfg = load_recipe(ROOT / "recipes" / "paper" / f"{name}.yaml").model
    except ImportError:  # no PyYAML: the same section as written here
        fields = dict(RECIPE_MODELS[name])
        cls = GPTConfig if fields.pop("type") == "gpt" else GRTConfig
        cfg = cls(vocab_size=50257, block_size=1024, dropout=0.0, bias=True, **fields)
    changes = {k: v for k, v in dict(d_model=d_model, n_head=n_head, vocab_size=vocab_size).items() if v is not None}
    changes["block_size"] = max(cfg.block_size, min_positions)
    return dataclasses.replace(cfg, **changes)


def layer_caches(cfg: ModelConfig, kv: str) -> int:
    """The issue's layer-count formula: n_pre + n_core R + n_coda (full) or n_pre + n_core + n_coda (compact);
    n_layer for a dense model, whatever the strategy."""
    if cfg.type == "gpt":
        return cfg.n_layer
    return cfg.n_prelude + cfg.n_core * (cfg.n_recurrence if kv == "full" else 1) + cfg.n_coda


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters in the dtype they are held in (``parameters()`` yields the tied head's tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def log(msg: str) -> None:
    print(f"[bench/decode] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------- generation
@torch.no_grad()
def generate(model, idx: torch.Tensor, new_tokens: int, kv: str, cuda_base: int | None = None) -> dict:
    """Greedy generation with the KV cache: one prefill over the prompt (which yields the first new token), then
    ``new_tokens - 1`` decode forwards of one token each, each timed on its own (a device sync per token, as a
    generation loop that checks for EOT or streams has anyway). Returns the prefill's seconds, each decode forward's,
    the cache, and on CUDA (``cuda_base``: the bytes allocated before the model was built) the peak bytes above that
    of the prefill and of the decode, the prompt's logits freed before the decode."""
    device = idx.device
    cache = KVCache(idx.shape[1] + new_tokens, kv)
    out = {}
    sync(device)
    t0 = time.perf_counter()
    logits, _ = model(idx, cache=cache)
    token = logits[:, -1:].argmax(-1)
    del logits  # the prompt's [B, T, V] logits: a prefill cost, not a decode one
    sync(device)
    t1 = time.perf_counter()
    if cuda_base is not None:
        out["cuda_peak_prefill_bytes"] = torch.cuda.max_memory_allocated(device) - cuda_base
        torch.cuda.reset_peak_memory_stats(device)
    decode_s = []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        logits, _ = model(token, cache=cache)
        token = logits[:, -1:].argmax(-1)
        sync(device)
        decode_s.append(time.perf_counter() - t)
    if cuda_base is not None:
        out["cuda_peak_decode_bytes"] = torch.cuda.max_memory_allocated(device) - cuda_base
    return {"prefill_s": t1 - t0, "decode_s": decode_s, "cache": cache, **out}


def compile_for_decode(model, mode: str, backend: str = "inductor") -> None:
    """``blocks``: every transformer block and GRT's gate MLP (pure-tensor modules; the cache bookkeeping and the
    step loop stay eager). ``trainer``: what training compiles (parallelize.apply_compile)."""
    if mode == "trainer":
        apply_compile(model, backend)
        return
    core = model.recurrent_core()
    blocks = list(model.blocks) if core is None else [*model.prelude, *core.blocks, *model.coda]
    gate = getattr(core, "gate", None)  # GRT's gate MLP (its ablation model.gate=none has none)
    for module in blocks + ([gate] if gate is not None else []):
        module.compile(backend=backend)


def dynamo_state() -> dict:
    """Dynamo's running totals: frames compiled (first compiles and recompiles), graphs, graph breaks."""
    from torch._dynamo.utils import counters

    return {"frames_compiled": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def dynamo_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def dynamo_cache_entries(models) -> dict:
    """Compiled variants held per compiled forward (a code object shared by all its module instances): each one
    beyond the first is a recompile, forced by a guard the earlier ones failed (a new length, a new step index)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forwards = {type(m).forward for model in models for m in model.modules() if hasattr(m, "_compiled_call_impl")
                and m._compiled_call_impl is not None}
    return {f.__qualname__: len(_debug_get_cache_entry_list(f)) for f in sorted(forwards, key=lambda f: f.__qualname__)}


# ------------------------------------------------------------------------------------------------------ Table 3
def time_arms(arms: dict, idx: torch.Tensor, new_tokens: int, repeat: int, label: str) -> dict:
    """Each arm (name -> (model, kv)) run once untimed (compilation; dynamo's counts kept for compiled arms), then
    ``repeat`` rounds of every arm, the order reversed every other round so that drifts hit all arms alike."""
    res, times = {}, {a: {"prefill_s": [], "decode_s": []} for a in arms}
    compiled = [a for a in arms if a.endswith("_compiled")]
    for a, (m, kv) in arms.items():
        before = dynamo_state() if a in compiled else None
        t = time.perf_counter()
        generate(m, idx, new_tokens, kv)
        res[a] = {"first_run_s": round(time.perf_counter() - t, 2)}
        log(f"{label}: {a} first run (compilation included) {res[a]['first_run_s']} s")
        if before is not None:
            res[a]["dynamo_first_run"] = dynamo_delta(before, dynamo_state())
            # anything compiled in the timed rounds: the arm never settled to its graphs (should stay 0)
            res[a]["dynamo_timed_runs"] = dynamo_delta(before, before)
    order = list(arms)
    for i in range(repeat):
        for a in (order if i % 2 == 0 else order[::-1]):
            before = dynamo_state() if a in compiled else None
            model, kv = arms[a]
            r = generate(model, idx, new_tokens, kv)
            times[a]["prefill_s"].append(r["prefill_s"])
            times[a]["decode_s"].append(r["decode_s"])
            if before is not None:
                d = dynamo_delta(before, dynamo_state())
                res[a]["dynamo_timed_runs"] = {k: v + d[k] for k, v in res[a]["dynamo_timed_runs"].items()}
        log(f"{label}: round {i + 1}/{repeat} done")
    for a in arms:
        per_token = [s for round_s in times[a]["decode_s"] for s in round_s]
        res[a]["prefill_ms"] = round(1e3 * statistics.median(times[a]["prefill_s"]), 3)
        # the median decode forward over all rounds: robust to the stalls a shared machine puts into a few tokens
        res[a]["decode_ms_per_token"] = round(1e3 * statistics.median(per_token), 3)
        res[a]["decode_ms_per_token_mean_by_round"] = [round(1e3 * statistics.fmean(r), 3)
                                                       for r in times[a]["decode_s"]]
    return res


def table3_scale(scale: str, sizes: Sizes, device: torch.device, dtype: torch.dtype, repeat: int,
                 compile_mode: str, grt_kvs: list[str], compile_backend: str = "inductor") -> dict:
    """One row pair of Table 3: the dense model and its GRT twin, eager and compiled, GRT with each of ``grt_kvs``."""
    cuda = device.type == "cuda"
    width = sizes.widths.get(scale) or (None, None)
    cfgs = {kind: recipe_model(name, *width, sizes.prompt + sizes.new_tokens, sizes.vocab_size)
            for kind, name in zip(("dense", "grt"), PAIRS[scale])}
    torch.manual_seed(0)
    idx = torch.randint(0, cfgs["dense"].vocab_size, (sizes.batch, sizes.prompt), device=device)
    res = {"models": {}, "memory": {}, "ratios": {}}
    eager, compiled, arms = {}, {}, {}
    for kind, cfg in cfgs.items():
        cls = model_class(cfg.type)
        base = torch.cuda.memory_allocated(device) if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        m = build_model(cfg, seed=0).to(device=device, dtype=dtype).eval()
        eager[kind] = m
        res["models"][kind] = {"recipe": PAIRS[scale][kind == "grt"], "shorthand": cls.shorthand(cfg),
                               "d_model": cfg.d_model, "n_head": cfg.n_head, "block_size": cfg.block_size,
                               "params": count_params(m)["params"], "block_executions": cls.block_executions(cfg)}
        for kv in (grt_kvs if kind == "grt" else ["full"]):
            arm = kind if kind == "dense" else f"grt_{kv}"
            # memory: this model alone, eager (on CUDA the peak above what was allocated before it was built)
            r = generate(m, idx, sizes.new_tokens, kv, base)
            mem = {"weights_bytes": weight_bytes(m), "kv_bytes": r["cache"].nbytes(),
                   "layer_caches": r["cache"].n_layer_caches()}
            mem["weights_plus_kv_bytes"] = mem["weights_bytes"] + mem["kv_bytes"]
            mem.update({k: v for k, v in r.items() if k.startswith("cuda_")})
            res["memory"][arm] = {**mem, "weights_plus_kv_mib": round(mem["weights_plus_kv_bytes"] / MiB, 1)}
            del r  # its cache, before the next strategy's is measured
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            arms[f"{arm}_eager"] = (m, kv)
        if compile_mode != "off":
            compiled[kind] = copy.deepcopy(m)  # the same weights (ties kept); compiled in place below
            compile_for_decode(compiled[kind], compile_mode, compile_backend)
            for kv in (grt_kvs if kind == "grt" else ["full"]):
                arms[f"{kind if kind == 'dense' else f'grt_{kv}'}_compiled"] = (compiled[kind], kv)

    if compile_mode != "off":
        import torch._dynamo as dynamo

        dynamo.reset()  # counts and graphs of this scale only
        # two models x (prefill, decode, decode at a dynamic length) per block code object, more in trainer mode's
        # per-step guards: dynamo's default limit (8) would silently send the later ones back to eager
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
    res["arms"] = time_arms(arms, idx, sizes.new_tokens, repeat, f"table 3 {scale}")
    if compiled:
        res["dynamo_cache_entries"] = dynamo_cache_entries(compiled.values())

    for kv in grt_kvs:
        g, ratios = f"grt_{kv}", {}
        for mode in ["eager"] + (["compiled"] if compile_mode != "off" else []):
            ratios[f"decode_latency_{mode}"] = round(res["arms"][f"{g}_{mode}"]["decode_ms_per_token"]
                                                     / res["arms"][f"dense_{mode}"]["decode_ms_per_token"], 4)
            ratios[f"prefill_latency_{mode}"] = round(res["arms"][f"{g}_{mode}"]["prefill_ms"]
                                                      / res["arms"][f"dense_{mode}"]["prefill_ms"], 4)
        ratios["weights_plus_kv"] = round(res["memory"][g]["weights_plus_kv_bytes"]
                                          / res["memory"]["dense"]["weights_plus_kv_bytes"], 4)
        if cuda:
            for k in ("cuda_peak_prefill_bytes", "cuda_peak_decode_bytes"):
                ratios[k.removesuffix("_bytes")] = round(res["memory"][g][k] / res["memory"]["dense"][k], 4)
        res["ratios"][f"{g}_over_dense"] = ratios
    p = PAPER_TABLE3[scale]
    res["paper_ratios_grt_over_dense"] = {f"decode_latency_{m}": round(p[f"{m}_ms"][1] / p[f"{m}_ms"][0], 3)
                                          for m in ("eager", "compiled")}
    res["paper_ratios_grt_over_dense"]["peak_memory"] = round(p["peak_mb"][1] / p["peak_mb"][0], 3)
    del eager, compiled, arms
    if cuda:
        torch.cuda.empty_cache()
    return res


def table3(sizes: Sizes, device: torch.device, dtype: torch.dtype, repeat: int, compile_mode: str,
           grt_kvs: list[str], scales=("medium", "large"), compile_backend: str = "inductor") -> dict:
    """Table 3 at each scale; ``compile_backend``: torch.compile's (the tests use "eager": dynamo without
    inductor's C++ build)."""
    out = {"protocol": {"batch": sizes.batch, "prompt": sizes.prompt, "new_tokens": sizes.new_tokens,
                        "decode_forwards_timed": sizes.new_tokens - 1, "dtype": str(dtype).removeprefix("torch."),
                        "compile": compile_mode, "compile_backend": compile_backend, "grt_kv": grt_kvs,
                        "rounds": repeat, "statistic": "median (decode: over every round's decode forwards; "
                                                       "prefill: over rounds)", "greedy": True,
                        "weights": "random (seed 0)"}}
    for scale in scales:
        out[scale] = table3_scale(scale, sizes, device, dtype, repeat, compile_mode, grt_kvs, compile_backend)
    out["note"] = ("decode_ms_per_token: one forward per new token after the prefill (which yields the first); "
                   "weights_plus_kv: the tensors allocated (weights in the run's dtype, the "
                   "preallocated cache of prompt + new_tokens positions); cuda_peak_*: torch.cuda.max_memory_allocated "
                   "above what was allocated before the model was built, prefill (with its [B, T, V] logits) and "
                   "decode apart. The paper's Table 3 peak memory is about its bf16 weights + 20-60 MB, less than a "
                   "KV cache of 4 x 1,152 positions alone (GPT-2 large: 849 MiB), so it cannot include one; ours does.")
    return out


# ------------------------------------------------------------------------------------------------------ Table 4
@torch.no_grad()
def table4(sizes: Sizes, device: torch.device, kvs=KV_STRATEGIES) -> dict:
    """Weights + KV (bf16) of GPT-2 medium and of GRT medium-isoflop with each KV strategy, at each batch size, after
    a prefill of T - t4_decode tokens and t4_decode decode forwards (a full cache of T positions)."""
    cuda = device.type == "cuda"
    T, n_dec = sizes.t4_positions, sizes.t4_decode
    width = sizes.widths.get("medium") or (None, None)
    cfgs = {kind: recipe_model(name, *width, T, sizes.vocab_size)
            for kind, name in zip(("dense", "grt"), PAIRS["medium"])}
    out = {"protocol": {"T": T, "prefill": T - n_dec, "decode_forwards": n_dec, "batches": list(sizes.t4_batches),
                        "dtype": "bfloat16", "models": {k: {"recipe": PAIRS["medium"][k == "grt"],
                                                            "shorthand": model_class(c.type).shorthand(c),
                                                            "d_model": c.d_model, "n_head": c.n_head}
                                                        for k, c in cfgs.items()}}}
    torch.manual_seed(0)
    prompts = {B: torch.randint(0, cfgs["dense"].vocab_size, (B, T - n_dec), device=device) for B in sizes.t4_batches}
    rows = {B: {} for B in sizes.t4_batches}
    for kind, cfg in cfgs.items():
        base = torch.cuda.memory_allocated(device) if cuda else None
        m = build_model(cfg, seed=0).to(device=device, dtype=torch.bfloat16).eval()
        for B, kv in [(B, kv) for B in sizes.t4_batches for kv in (kvs if kind == "grt" else ["full"])]:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            r = generate(m, prompts[B], n_dec, kv, base)
            e = {"weights_bytes": weight_bytes(m), "kv_bytes": r["cache"].nbytes(),
                 "layer_caches": r["cache"].n_layer_caches()}
            e["total_bytes"] = e["weights_bytes"] + e["kv_bytes"]
            e["total_gib"] = round(e["total_bytes"] / GiB, 4)
            if cuda:
                e["cuda_peak_decode_bytes"] = r["cuda_peak_decode_bytes"]
                e["cuda_peak_decode_gib"] = round(r["cuda_peak_decode_bytes"] / GiB, 4)
            rows[B]["gpt2_medium" if kind == "dense" else f"grt_{kv}"] = e
            del r  # its cache, before the next one is measured
        log(f"table 4: {PAIRS['medium'][kind == 'grt']} measured")
        del m
        if cuda:
            torch.cuda.empty_cache()
    for B, row in rows.items():
        dense = row["gpt2_medium"]
        for kv in kvs:
            e = row[f"grt_{kv}"]
            e["ratio_total"] = round(e["total_bytes"] / dense["total_bytes"], 4)
            e["ratio_kv"] = round(e["kv_bytes"] / dense["kv_bytes"], 4)
            if cuda:
                e["ratio_cuda_peak_decode"] = round(e["cuda_peak_decode_bytes"] / dense["cuda_peak_decode_bytes"], 4)
        out[f"B={B}"] = row
    out["ratios_total_grt_over_gpt2_medium"] = {f"B={B}": {kv: out[f"B={B}"][f"grt_{kv}"]["ratio_total"] for kv in kvs}
                                               for B in sizes.t4_batches}
    out["paper_ratios"] = PAPER_TABLE4
    if "averaged" in kvs:
        r = out[f"B={max(sizes.t4_batches)}"]["grt_averaged"]
        # the paper's 0.39 is its 1.44 / 3.66 GiB rounded to two decimals; its own unrounded figures (which the
        # computed_at_paper_size rows reproduce) give 0.394, so the goal is read at the paper's precision
        out["goal_averaged_at_largest_batch"] = {
            "batch": max(sizes.t4_batches), "ratio_total": r["ratio_total"], "target": 0.39,
            "met_at_two_decimals": round(r["ratio_total"], 2) <= 0.39, "at_paper_size": sizes.name == "paper",
            **({"ratio_cuda_peak_decode": r["ratio_cuda_peak_decode"]} if cuda else {})}
    out["computed_at_paper_size"] = paper_size_formula(kvs)
    return out


def paper_size_formula(kvs=KV_STRATEGIES, T: int = 1024, batches=(1, 32)) -> dict:
    """Not measured: the same totals at the paper's sizes from the parameter count (meta model, bf16) and the
    layer-count formula (2 tensors x B x T x d x 2 bytes per layer cache), the figures the measured rows check at a
    small size. A CPU run shows here what the full-size Table 4 should give."""
    cfgs = {k: recipe_model(n) for k, n in zip(("dense", "grt"), PAIRS["medium"])}
    params = {k: count_params(build_model(c, device="meta"))["params"] for k, c in cfgs.items()}
    out = {"T": T, "params": params}
    for B in batches:
        def total(kind, kv):
            return 2 * params[kind] + 2 * 2 * B * T * cfgs[kind].d_model * layer_caches(cfgs[kind], kv)

        dense = total("dense", "full")
        out[f"B={B}"] = {"gpt2_medium": {"total_gib": round(dense / GiB, 3), "ratio": 1.0}}
        for kv in kvs:
            out[f"B={B}"][f"grt_{kv}"] = {"total_gib": round(total("grt", kv) / GiB, 3),
                                          "ratio": round(total("grt", kv) / dense, 4)}
    return out


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action=argparse.BooleanOptionalAction, default=None,
                    help="the paper's sizes (default on CUDA); --no-full: the reduced CPU sizes")
    ap.add_argument("--tables", default="3,4")
    ap.add_argument("--repeat", type=int, default=None, help="timed rounds per arm (default: 5 on CUDA, 3 on CPU)")
    ap.add_argument("--compile", default="blocks", choices=["blocks", "trainer", "off"])
    ap.add_argument("--table3-kv", default="full,averaged", help="GRT's KV strategies in Table 3")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    full = cuda if args.full is None else args.full
    sizes = PAPER_SIZES if full else CPU_SIZES
    tables = set(args.tables.split(","))
    if tables - {"3", "4"}:
        ap.error(f"--tables {args.tables}: a comma-separated subset of 3,4")
    grt_kvs = args.table3_kv.split(",")
    if bad := [kv for kv in grt_kvs if kv not in KV_STRATEGIES]:
        ap.error(f"--table3-kv {','.join(bad)}: choose among {','.join(KV_STRATEGIES)}")
    t = time.time()
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "threads": torch.get_num_threads(), "sizes": sizes.name, "widths": sizes.widths}
    if "3" in tables:
        out["table3"] = table3(sizes, device, torch.bfloat16 if cuda else torch.float32,
                               args.repeat or (5 if cuda else 3), args.compile, grt_kvs)
    if "4" in tables:
        out["table4"] = table4(sizes, device)
    out["wall_s"] = round(time.time() - t, 1)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
