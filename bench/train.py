"""Training-step benchmarks, each a ratio of two arms measured side by side in one run (machines are noisy):

(a) GRT vs dense at matched FLOPs per token (the same block executions): tokens/s ratio;
(b) activation checkpointing per recurrence step (`core_step`) vs none at R = 10: activation memory and step time;
(c) our dense model vs a nanoGPT-architecture reference written here from its description (pre-LN GPT-2 with a
    fused QKV projection, scaled-dot-product attention, GELU MLP, tied head, full logits + cross-entropy): forward +
    backward time ratio at the same config.

    python bench/train.py [--device cpu|cuda] [--repeat 5]

Prints one JSON object. Activation memory is counted from autograd's saved tensors (the same on CPU and GPU); on
CUDA the peak allocated memory is reported too.
"""
from __future__ import annotations

import _bootstrap  # noqa: F401  (first: keeps bench/tokenize.py from shadowing the standard library's tokenize)

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.config import GPTConfig, GRTConfig  # noqa: E402
from pipeline.model import build_model  # noqa: E402
from pipeline.train.parallelize import apply_activation_checkpointing  # noqa: E402


# ----------------------------------------------------------------- (c) the reference: nanoGPT's architecture
class RefBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab, block, d, h, L):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(RefBlock(d, h) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ------------------------------------------------------------------------------------------------ timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def saved_activation_mb(model, idx, targets, n_steps) -> float:
    """Bytes of the tensors autograd keeps for backward during one forward (unique storages): the activation memory
    that checkpointing trades for recomputation. Measured the same way on CPU and GPU."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, targets, n_steps=n_steps)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total / 2**20


def step_fn(model, idx, targets, n_steps=None):
    def run():
        if isinstance(model, RefGPT):
            loss = model(idx, targets)
        else:
            _, loss = model(idx, targets, n_steps=n_steps) if n_steps else model(idx, targets)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def interleaved(arms: dict, device, repeat: int) -> dict[str, float]:
    """Best time of each arm, the arms alternating so that drifts hit all of them alike."""
    for fn in arms.values():
        fn()
    sync(device)
    best = {k: math.inf for k in arms}
    for _ in range(repeat):
        for k, fn in arms.items():
            t = time.perf_counter()
            fn()
            sync(device)
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    # CPU-sized shapes; GPU: GPT-2 small width at 1,024 tokens
    d, h, S, B, V = (128, 4, 128, 8, 50257) if cpu else (768, 12, 1024, 8, 50257)
    torch.manual_seed(0)
    idx = torch.randint(0, V, (B, S), device=device)
    targets = torch.randint(0, V, (B, S), device=device)
    out = {"device": str(device), "shapes": {"d_model": d, "heads": h, "seq_len": S, "batch": B, "vocab": V},
           "repeat": args.repeat, "threads": torch.get_num_threads()}

    # (a) GRT 1+1x4+1 vs dense 6L: 6 block executions each
    grt = build_model(GRTConfig(vocab_size=V, block_size=S, d_model=d, n_head=h, n_prelude=1, n_core=1, n_coda=1,
                                n_recurrence=4)).to(device).train()
    dense = build_model(GPTConfig(vocab_size=V, block_size=S, d_model=d, n_head=h, n_layer=6)).to(device).train()
    t = interleaved({"grt": step_fn(grt, idx, targets, 4), "dense": step_fn(dense, idx, targets)}, device,
                    args.repeat)
    tokens = B * S
    out["a_grt_vs_dense_matched_flops"] = {
        "grt": "1+1x4+1", "dense": "6L", "grt_tokens_per_s": round(tokens / t["grt"]),
        "dense_tokens_per_s": round(tokens / t["dense"]),
        "ratio_grt_over_dense_tokens_per_s": round(t["dense"] / t["grt"], 3),
        "note": "training step (forward + backward) at R = 4, noise on; Eq. 1 gives GRT 4 x 10d^2 more FLOPs per "
                "token for its projection and gate",
    }
    del grt, dense

    # (b) core_step activation checkpointing vs none at R = 10 (1+1x10+1), timed side by side
    res, fns = {}, {}
    for mode in ("none", "core_step"):
        torch.manual_seed(0)
        m = build_model(GRTConfig(vocab_size=V, block_size=S, d_model=d, n_head=h, n_prelude=1, n_core=1, n_coda=1,
                                  n_recurrence=10)).to(device).train()
        apply_activation_checkpointing(m, mode)
        fns[mode] = step_fn(m, idx, targets, 10)
        res[mode] = {"saved_activations_mb": round(saved_activation_mb(m, idx, targets, 10), 1)}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            fns[mode]()
            res[mode]["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    for mode, seconds in interleaved(fns, device, args.repeat).items():
        res[mode]["step_s"] = round(seconds, 4)
    del fns
    out["b_activation_checkpointing_R10"] = {
        **res, "memory_ratio_core_step_over_none": round(res["core_step"]["saved_activations_mb"]
                                                         / res["none"]["saved_activations_mb"], 3),
        "time_ratio_core_step_over_none": round(res["core_step"]["step_s"] / res["none"]["step_s"], 3),
        "note": "memory: activations kept for backward during the forward (the LM head's fused loss keeps none)",
    }

    # (c) our dense GPT vs the nanoGPT-architecture reference, same config and weights layout
    torch.manual_seed(0)
    ours = build_model(GPTConfig(vocab_size=V, block_size=S, d_model=d, n_head=h, n_layer=6)).to(device).train()
    ref = RefGPT(V, S, d, h, 6).to(device).train()
    t = interleaved({"ours": step_fn(ours, idx, targets), "ref": step_fn(ref, idx, targets)}, device, args.repeat)
    out["c_dense_vs_nanogpt_reference"] = {
        "ours_s": round(t["ours"], 4), "reference_s": round(t["ref"], 4),
        "ratio_ours_over_reference_time": round(t["ours"] / t["ref"], 3),
        "note": "forward + backward of a 6-layer GPT-2; ours uses the fused chunked head + cross-entropy "
                "(ops/linear_cross_entropy.py), the reference materialises the logits as nanoGPT does",
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
