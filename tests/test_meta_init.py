"""Initial weights: one GPT-2 rule, each parameter from its own (seed, name) generator, so the plain CPU build, the
meta-device build sharded by FSDP2 (1 and 2 ranks) and the build under deepspeed.zero.Init (ZeRO-3, 2 ranks) give
exactly the same weights, and the tied head stays tied."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.train.materialize import _check_materialized

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "meta_init_worker.py"
# vocab 97 does not divide by 2: FSDP pads the embedding's second shard
TINY = dict(type="grt", vocab_size=97, block_size=16, d_model=32, n_head=2, n_prelude=1, n_core=1, n_coda=1,
            n_recurrence=3)
SEED = 7
TINY_LLAMA = dict(block="llama", bias=False, n_kv_head=1, qk_norm=True, vocab_multiple=64)
RSS_GPT = dict(type="gpt", vocab_size=1024, block_size=64, d_model=512, n_head=8, n_layer=16)  # 51M parameters


def test_build_model_follows_the_gpt2_rule():
    """Against the rule written out here: LayerNorm 1/0, biases 0 except the gate's last at gate_bias_init, weights
    N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 x block executions at R))."""
    cfg = GRTConfig(vocab_size=500, block_size=32, d_model=64, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=4, gate_bias_init=3.5)
    m = build_model(cfg, seed=SEED)
    std_resid = 0.02 / math.sqrt(2 * (1 + 2 * 4 + 1))
    assert m.lm_head.weight is m.embed.wte.weight
    for name, p in m.named_parameters():
        if ".ln" in name or name.startswith("ln_f"):
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        elif name == "recur.gate.fc2.bias":
            assert torch.equal(p, torch.full_like(p, 3.5))
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            want = std_resid if name.endswith("c_proj.weight") else 0.02
            assert abs(p.mean().item()) < 4 * want / math.sqrt(p.numel()), name
            # the sample std of n draws is off by about want / sqrt(2n) (1 sigma): 4 sigma plus a stated 1% margin
            assert p.std().item() == pytest.approx(want, rel=4 / math.sqrt(2 * p.numel()) + 0.01), name
    # pooled over every block (49k to 82k draws): a scale one recursion off (sqrt(10/12), -8.7%) fails by far
    P = dict(m.named_parameters())
    for suffix in ("c_proj.weight", "c_attn.weight", "c_fc.weight"):
        pooled = torch.cat([p.flatten() for k, p in P.items() if k.endswith(suffix)])
        want = std_resid if suffix == "c_proj.weight" else 0.02
        assert pooled.std().item() == pytest.approx(want, rel=4 / math.sqrt(2 * pooled.numel()) + 0.01), suffix


def test_weights_depend_on_seed_and_name_only():
    cfg = GRTConfig(vocab_size=97, block_size=16, d_model=32, n_head=2, n_prelude=1, n_core=1, n_coda=1)
    torch.manual_seed(SEED)
    a = build_model(cfg)  # the seed defaults to torch.initial_seed()
    torch.manual_seed(123)
    torch.randn(10)  # the global stream's position does not matter
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  build_model(cfg, seed=SEED).state_dict().values()))
    assert not torch.equal(a.embed.wte.weight, build_model(cfg, seed=SEED + 1).embed.wte.weight)
    # a deeper model: the parameters the two share by name start equal (no global stream in module order)
    deeper = build_model(GRTConfig(**{**vars(cfg), "n_coda": 2}), seed=SEED)
    for name in ("embed.wte.weight", "prelude.0.attn.c_attn.weight", "coda.0.mlp.c_fc.weight"):
        assert torch.equal(a.get_parameter(name), deeper.get_parameter(name)), name
    gpt = build_model(GPTConfig(vocab_size=97, block_size=16, d_model=32, n_head=2, n_layer=2), seed=SEED)
    assert gpt.lm_head.weight is gpt.embed.wte.weight
    assert torch.equal(gpt.embed.wte.weight, a.embed.wte.weight)


def test_llama_build_follows_the_gpt2_rule():
    """The llama block under the same rule: RMSNorm weights (block, QK-norm, final) 1, o_proj and down_proj the
    residual N(0, 0.02 / sqrt(2 x block executions at R)), q/k/v/gate/up_proj and the padded embedding N(0, 0.02)."""
    cfg = GRTConfig(vocab_size=500, block_size=32, d_model=64, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=4, **TINY_LLAMA)
    m = build_model(cfg, seed=SEED)
    std_resid = 0.02 / math.sqrt(2 * (1 + 2 * 4 + 1))
    assert m.lm_head.weight is m.embed.wte.weight and m.embed.wte.weight.shape[0] == 512
    P = dict(m.named_parameters())
    norms = [k for k in P if k.endswith(("ln_1.weight", "ln_2.weight", "q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4 * 4  # four blocks
    for k in norms:
        assert torch.equal(P[k], torch.ones_like(P[k])), k
    for suffix in ("o_proj.weight", "down_proj.weight", "q_proj.weight", "k_proj.weight", "gate_proj.weight",
                   "wte.weight"):
        pooled = torch.cat([p.flatten() for k, p in P.items() if k.endswith(suffix) and not k.startswith("recur.")])
        want = std_resid if suffix in ("o_proj.weight", "down_proj.weight") else 0.02
        assert pooled.std().item() == pytest.approx(want, rel=4 / math.sqrt(2 * pooled.numel()) + 0.01), suffix


def test_materialisation_refuses_buffers_and_broken_ties():
    m = build_model(GPTConfig(vocab_size=97, block_size=16, d_model=32, n_head=2, n_layer=1), device="meta")
    n = len(list(m.parameters()))
    m.register_buffer("table", torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"buffers \['table'\] are uninitialised"):
        _check_materialized(m, n)
    del m.table
    m.to_empty(device="cpu")  # a plain module's to_empty replaces each Parameter: the tie is lost
    with pytest.raises(RuntimeError, match="untied"):
        _check_materialized(m, n)


def run_worker(out: Path, nproc: int, backends: list[str], port: int, *extra: str, model: dict = TINY) -> None:
    """tests/meta_init_worker.py under torchrun over gloo on this host."""
    args = [str(WORKER), str(out), json.dumps(model), str(SEED), *backends, *extra]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
              str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.run(launch + args, cwd=REPO, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.slow
def test_sharded_builds_equal_the_plain_build(tmp_path):
    """fsdp at 1 and 2 ranks (meta -> fully_shard -> to_empty -> init) and ZeRO-3 at 2 ranks (zero.Init) against
    build_model on one CPU process: every tensor of the full state dict equal, the head tied on every rank, and
    the first eval loss through the wrapped model the same."""
    ref_model = build_model(GRTConfig(**TINY), seed=SEED).eval()
    ref = ref_model.state_dict()
    gen = torch.Generator().manual_seed(0)  # the worker's batch
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"] + 1), generator=gen)
    with torch.no_grad():
        ref_loss = ref_model(idx[:, :-1], idx[:, 1:])[1].item()

    (tmp_path / "ws1").mkdir()
    (tmp_path / "ws2").mkdir()
    run_worker(tmp_path / "ws1", 1, ["fsdp"], free_port())
    run_worker(tmp_path / "ws2", 2, ["fsdp", "zero3"], free_port(), f"--rss-model={json.dumps(RSS_GPT)}")
    checked = []
    for ws, backend in (("ws1", "fsdp"), ("ws2", "fsdp"), ("ws2", "zero3")):
        for rank in range(int(ws[-1])):
            got = torch.load(tmp_path / ws / f"{backend}-rank{rank}.pt")
            where = f"{backend} {ws} rank {rank}"
            assert got["tied"] and got["tied_after_forward"], where
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-6), where
            if rank == 0:
                state = got["state"]
                assert sorted(state) == sorted(ref), where
                unequal = [k for k in ref if state[k].dtype != ref[k].dtype or not torch.equal(state[k], ref[k])]
                assert not unequal, (where, unequal)
            checked.append(where)
    assert len(checked) == 5

    # docs: "No rank holds the whole model at start-up". The fsdp build of a 51M-parameter GPT (194.5 MiB fp32)
    # on 2 ranks, each rank's peak RSS growth: measured 105.8 MiB = its half (97.3 MiB) + 8.5 MiB (each parameter
    # is drawn in full, one at a time: the largest is 4 MiB). Bound: half + the largest parameter + 10% of the model
    # (120.8 MiB). Materialising the model on the CPU before sharding (no meta device) measured 206 MiB.
    d, L, V, S = RSS_GPT["d_model"], RSS_GPT["n_layer"], RSS_GPT["vocab_size"], RSS_GPT["block_size"]
    model_mb = 4 * (V * d + S * d + L * (12 * d * d + 13 * d) + 2 * d) / 2**20  # wte (tied head), wpe, blocks, ln_f
    largest_mb = 4 * (4 * d * d + 4 * d) / 2**20  # mlp.c_fc: 4d x d + 4d
    for rank in range(2):
        rss = torch.load(tmp_path / "ws2" / f"fsdp-rss-rank{rank}.pt")["rss_mb"]
        assert rss <= model_mb / 2 + largest_mb + 0.1 * model_mb, (rank, rss, model_mb)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sharded_llama_builds_equal_the_plain_build(tmp_path):
    """The llama block (GQA, QK-norm, a padded vocabulary) built by fsdp and ZeRO-3 on 2 ranks equals build_model."""
    model = {**TINY, **TINY_LLAMA}
    from pipeline.model.configs import MODEL_CONFIGS

    ref_model = build_model(MODEL_CONFIGS["grt"](**model), seed=SEED).eval()
    ref = ref_model.state_dict()
    gen = torch.Generator().manual_seed(0)  # the worker's batch
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"] + 1), generator=gen)
    with torch.no_grad():
        ref_loss = ref_model(idx[:, :-1], idx[:, 1:])[1].item()
    run_worker(tmp_path, 2, ["fsdp", "zero3"], free_port(), model=model)
    for backend in ("fsdp", "zero3"):
        for rank in range(2):
            got = torch.load(tmp_path / f"{backend}-rank{rank}.pt")
            assert got["tied"] and got["tied_after_forward"], (backend, rank)
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-6), (backend, rank)
        state = torch.load(tmp_path / f"{backend}-rank0.pt")["state"]
        assert sorted(state) == sorted(ref), backend
        assert not [k for k in ref if not torch.equal(state[k], ref[k])], backend
