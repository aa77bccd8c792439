"""The GPU-speed paths of eval and generation (issue #23, items 10 and 11), checked on the CPU against references
written here: a prefill applies the LM head to one position per row (its tokens equal the argmax of full-logits
forwards), a one-query cached decode calls SDPA with no mask (its logits equal the uncached model's), the exit
curve's sums stay on the device (host transfers counted, and exit_stats run on the meta device, where any transfer
raises), the forward runs under the asked-for precision while the head's math stays fp32, and the head's chunk is
sized by device."""
import argparse
import warnings

import pytest
import torch
import torch.nn.functional as F

import pipeline.eval.exit_losses as exits_mod
from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.eval.exit_losses import exit_curve
from pipeline.eval.exit_losses import exit_stats
from pipeline.eval.exit_losses import head_chunk
from pipeline.infer.command import option_problems
from pipeline.infer.generate import generate
from pipeline.infer.precision import exact_fp32
from pipeline.infer.precision import inference_precision
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import MoRConfig
from pipeline.model.configs import OuroConfig
from pipeline.model.configs import PoissonConfig
from pipeline.model.configs import RecurrentTransformerConfig
from pipeline.model.configs import RecurTraceConfig
from pipeline.model.configs import RRTConfig
from pipeline.model.kv_cache import KVCache

BASE = dict(vocab_size=96, block_size=32, d_model=16, n_head=2)
LOOP = dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3)
CONFIGS = {  # every model type `grt generate` serves
    "gpt": GPTConfig(**BASE, n_layer=2),
    "grt": GRTConfig(**BASE, **LOOP),
    "poisson": PoissonConfig(**BASE, **LOOP),
    "mor": MoRConfig(**BASE, **LOOP, router_alpha=1.0),
    "rrt": RRTConfig(**BASE, **LOOP, lora_rank=4),
    "ouro": OuroConfig(**BASE, n_layer=2, n_recurrence=3),
    "recurrent_transformer": RecurrentTransformerConfig(**BASE, n_layer=2, tile=4),
    "recurtrace": RecurTraceConfig(**BASE, **LOOP),
}
_MODELS: dict = {}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread


def model_of(model_type: str):
    """Weights moved off init (every step differs, GRT's gate neither open nor shut); MoR routes causally."""
    if model_type not in _MODELS:
        torch.manual_seed(4)
        m = build_model(CONFIGS[model_type]).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.2 * torch.randn_like(p))
            if model_type == "grt":
                m.recur.gate.fc2.bias.normal_(0.0, 1.0)
        if model_type == "mor":
            m.routing = "threshold"
        _MODELS[model_type] = m
    return _MODELS[model_type]


# ------------------------------------------------------------------------------------- prefill: the last position
@torch.no_grad()
def full_logits_decode(model, prompts, n_new):
    """The decoding loop with full logits at every forward (the head over every prompt position), greedy."""
    cache, feed = KVCache.left_padded(prompts, model.cfg.block_size, "full")
    out = [[] for _ in prompts]
    for _ in range(n_new):
        nxt = model(feed, cache=cache)[0][:, -1].argmax(dim=-1)
        for row, tok in enumerate(nxt.tolist()):
            out[row].append(tok)
        feed = nxt[:, None]
    return out


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_prefill_applies_the_head_to_one_position_per_row(model_type):
    model = model_of(model_type)
    prompts = [[5, 17, 3, 44, 9, 61, 2, 8, 30], [7, 12, 90, 4]]  # left-padded to 9 columns
    n_new = 3
    rows_in = []  # positions the head read, per call
    handle = model.lm_head.register_forward_hook(lambda m, args, out: rows_in.append(tuple(args[0].shape[:2])))
    try:
        gen = generate(model, prompts, n_new, model.cfg.block_size)
    finally:
        handle.remove()
    # the prefill and each decode step: 2 rows x 1 position, so the prefill's head costs 2 x 2dV FLOPs (the old
    # path: 2 rows x 9 positions, 9 times that)
    assert rows_in == [(2, 1)] * n_new
    assert gen.tokens == full_logits_decode(model, prompts, n_new)
    for row, p in enumerate(prompts):  # the first token: the uncached model's last-position argmax, prompt alone
        with torch.no_grad():
            assert gen.tokens[row][0] == int(model(torch.tensor([p]))[0][0, -1].argmax())


# ------------------------------------------------------------------------------ cached decode: SDPA with no mask
@pytest.mark.parametrize("model_type", ["gpt", "grt"])
def test_one_query_cached_decode_calls_sdpa_without_a_mask(model_type, monkeypatch):
    model = model_of(model_type).double()
    try:
        calls = []
        sdpa = F.scaled_dot_product_attention

        def recording(q, k, v, *args, **kwargs):
            calls.append((q.shape[2], k.shape[2], kwargs.get("attn_mask"), kwargs.get("is_causal", False), args))
            return sdpa(q, k, v, *args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        seq = [5, 17, 3, 44, 9, 61, 2]
        cache, feed = KVCache.left_padded([seq[:-1]], model.cfg.block_size, "full")
        with torch.no_grad():
            model(feed, cache=cache)
            calls.clear()
            decoded = model(torch.tensor([seq[-1:]]), cache=cache)[0][0, -1]
        assert calls and all(t == 1 and keys == len(seq) for t, keys, _, _, _ in calls)
        assert all(mask is None and not causal and not args for _, _, mask, causal, args in calls)
        monkeypatch.undo()
        with torch.no_grad():  # the reference: the uncached model over the whole sequence (causal mask)
            full = model(torch.tensor([seq]))[0][0, -1]
        torch.testing.assert_close(decoded, full, rtol=0, atol=1e-10)
    finally:
        model.float()


# --------------------------------------------------------------------------------- exit curve: sums on the device
def test_exit_stats_runs_on_the_meta_device_without_a_host_transfer():
    """Any .item() / .cpu() of a meta tensor raises, so exit_stats completing there proves it never syncs, at any
    number of chunks."""
    V, d, rows = 50, 8, 70
    states = {e: torch.empty(2, rows // 2, d, device="meta") for e in (0, 1, 2)}
    weight = torch.empty(V, d, device="meta")
    targets = torch.empty(2, rows // 2, dtype=torch.long, device="meta")
    losses, kl, agree = exit_stats(states, weight, targets, ref=2, chunk=16)  # 5 chunks
    assert losses.shape == (rows, 3) and losses.dtype == torch.float32 and losses.device.type == "meta"
    assert kl.shape == (3,) and kl.dtype == torch.float64 and agree.dtype == torch.long


class HostTransfers:
    """Counts the tensor methods that bring a value to the host (a device sync on CUDA)."""
    METHODS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def counted(t, *args, **kwargs):
            self.n += 1
            return original(t, *args, **kwargs)
        return counted


def reference_curve(model, batches, exits, ref):
    """Loss, KL to ``ref`` and top-1 agreement from the full [tokens, V] logits in float64."""
    logp = {e: [] for e in exits}
    ys = []
    with torch.no_grad():
        for x, y in batches:
            for e, s in model.exit_states(x, exits):
                logits = (s @ model.lm_head.weight.t()).double()
                logp[e].append(F.log_softmax(logits, dim=-1).reshape(-1, logits.shape[-1]))
            ys.append(y.reshape(-1))
    y = torch.cat(ys)
    lp = {e: torch.cat(v) for e, v in logp.items()}
    loss = [-lp[e].gather(1, y[:, None]).mean().item() for e in exits]
    kl = [(lp[e].exp() * (lp[e] - lp[ref])).sum(-1).mean().item() for e in exits]
    top1 = [(lp[e].argmax(-1) == lp[ref].argmax(-1)).double().mean().item() for e in exits]
    return loss, kl, top1


@pytest.mark.parametrize("chunk", [8, 256])
def test_exit_curve_transfers_to_the_host_once_whatever_the_batches_and_chunks(chunk, monkeypatch):
    model = model_of("gpt")
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 96, (2, 20), generator=gen), torch.randint(0, 96, (2, 20), generator=gen))
               for _ in range(3)]  # 40 rows per batch: 5 chunks of 8
    expected = reference_curve(model, batches, [1, 2], 2)
    monkeypatch.setattr(exits_mod, "CPU_HEAD_CHUNK", chunk)
    counts = []
    for n_batches in (1, 3):
        with monkeypatch.context() as m:
            transfers = HostTransfers(m)
            res = exit_curve(model, batches[:n_batches], [1, 2], 2, torch.device("cpu"))
        counts.append(transfers.n)
    # the end of the curve only (the sums: one .cpu(); their lists), not per chunk or per batch (the old path:
    # per batch and chunk, one .cpu() per exit and two .item() per exit besides the reference)
    assert counts[0] == counts[1] <= 4
    for got, want in zip((res["loss"], res["kl"], res["top1"]), expected):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------------------------------------- precision
def test_bf16_eval_runs_the_forward_under_autocast_and_the_head_in_fp32():
    model = model_of("grt")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (4, 32), generator=gen), torch.randint(0, 96, (4, 32), generator=gen))]
    seen = []
    layer = model.recur.blocks[0].mlp.c_fc if hasattr(model.recur, "blocks") else model.prelude[0].mlp.c_fc
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    try:
        fp32 = exit_curve(model, batches, [0, 1, 2, 3], 3, torch.device("cpu"), dtype="float32")
        auto = exit_curve(model, batches, [0, 1, 2, 3], 3, torch.device("cpu"), dtype="auto")
        bf16 = exit_curve(model, batches, [0, 1, 2, 3], 3, torch.device("cpu"), dtype="bfloat16", keep_tokens=True)
    finally:
        handle.remove()
    n = len(seen) // 3
    assert seen[:2 * n] == [torch.float32] * 2 * n and seen[2 * n:] == [torch.bfloat16] * n
    assert auto == fp32  # auto on the CPU: the fp32 forward, bit for bit
    assert bf16["token_losses"].dtype == torch.float32
    # measured on this model: |bf16 - fp32| <= 5.5e-4 nats per exit's mean loss, <= 2.9e-4 for KL (on a d 16 GRT
    # with the GPT-2 vocabulary: 5.5e-4 and 5.6e-4); the bound leaves ~10x for other CPUs' bf16 kernels
    assert max(abs(a - b) for a, b in zip(bf16["loss"], fp32["loss"])) < 5e-3
    assert max(abs(a - b) for a, b in zip(bf16["kl"], fp32["kl"])) < 5e-3


def test_generate_under_bf16_runs_bf16_forwards_and_caches():
    model = model_of("gpt")
    seen = []
    handle = model.blocks[0].mlp.c_fc.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    try:
        gen = generate(model, [[5, 17, 3]], 2, model.cfg.block_size, dtype="bfloat16")
        generate(model, [[5, 17, 3]], 2, model.cfg.block_size)  # no dtype: as the caller has it (fp32 here)
    finally:
        handle.remove()
    assert seen == [torch.bfloat16] * 2 + [torch.float32] * 2
    assert len(gen.tokens[0]) == 2


def test_exact_fp32_turns_tf32_and_autocast_off_inside_and_restores_them():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with warnings.catch_warnings():  # a CPU-only torch warns that CUDA autocast is off; the flags are the point
            warnings.simplefilter("ignore")
            for name in ("auto", "bfloat16"):
                with inference_precision(name, "cuda"):
                    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
                    with exact_fp32("cuda"):
                        assert not torch.backends.cuda.matmul.allow_tf32
                    assert torch.backends.cuda.matmul.allow_tf32
                assert not torch.backends.cuda.matmul.allow_tf32
        with inference_precision("float32", "cuda"):
            assert not torch.backends.cuda.matmul.allow_tf32
        with inference_precision("bfloat16", "cpu") as dtype:
            assert dtype == torch.bfloat16 and torch.is_autocast_enabled("cpu")
            assert not torch.backends.cuda.matmul.allow_tf32  # a CPU run leaves CUDA's flags alone
            with exact_fp32("cpu"):
                assert not torch.is_autocast_enabled("cpu")
            assert torch.is_autocast_enabled("cpu")
        with inference_precision("float32", "cpu") as dtype:
            assert dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
        torch.backends.cuda.matmul.allow_tf32 = True
        with exact_fp32("cuda"):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_dtype_choices_are_checked_with_a_suggestion(tmp_path):
    recipe = tiny_recipe(tmp_path, tmp_path)
    recipe.setdefault("eval", {})["dtype"] = "bf16"
    with pytest.raises(Exception, match=r"eval.dtype='bf16'.*did you mean 'bfloat16'"):
        from_dict(recipe)
    args = argparse.Namespace(temperature=0.0, top_k=None, top_p=None, max_new_tokens=4, n_steps=None, stream=False,
                              batch_file=None, exit="none", exit_threshold=None, stop=None, dtype="fp16")
    assert any("--dtype fp16" in p and "bfloat16" in p for p in option_problems(args, 1))


# -------------------------------------------------------------------------------------------- chunk sizing
def test_head_chunk_by_device():
    V = 50257
    assert head_chunk(V, "cpu") == 256
    for budget in (1 << 30, 3 << 28, 200 << 20):
        rows = head_chunk(V, "cuda", buffers=3, budget=budget)
        # the largest multiple of 256 rows whose three fp32 [rows, V] buffers fit the budget
        assert rows % 256 == 0 and 3 * V * 4 * rows <= budget < 3 * V * 4 * (rows + 256)
    assert head_chunk(V, "cuda", budget=1 << 30) == 1536  # 2^30 / (3 * 50257 * 4) = 1780.4 rows
    assert head_chunk(V, "cuda", buffers=2, budget=1 << 30) == 2560  # 2670.7
    assert head_chunk(V, "cuda", budget=100 << 20) == 173  # under 256 rows: as many as fit
    assert head_chunk(V, "cuda", budget=1) == 1


def test_head_chunk_default_budget_on_cuda(monkeypatch):
    """The smaller of 1 GiB and a quarter of the memory free to the process (the driver's free memory plus what
    torch's allocator holds unused)."""
    GiB = 1 << 30
    for free, reserved, allocated, budget in [(80 * GiB, 0, 0, GiB),
                                              (2 * GiB, GiB, GiB // 2, (2 * GiB + GiB // 2) // 4)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 141 * GiB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        assert head_chunk(50257, "cuda") == head_chunk(50257, "cuda", budget=budget)
    assert head_chunk(50257, "cuda") == 1024  # 640 MiB / (3 * 50257 * 4) = 1112.7 rows
