"""`grt info` against the arithmetic of the paper's shapes (issue #2's reference numbers) and Eq. 1 by hand."""
import json
from pathlib import Path

import pytest

from pipeline.cli import main

PAPER = Path(__file__).resolve().parents[1] / "recipes" / "paper"
V, S = 50257, 1024

# name -> (params in millions, (n_pre, n_rec, R, n_coda) or n_layer, d)
REFERENCE = {
    "gpt2-small": (124.44, 12, 768),
    "gpt2-medium": (354.82, 24, 1024),
    "gpt2-large": (774.03, 36, 1280),
    "grt-medium-isoflop": (171.13, (2, 5, 4, 2), 1024),
    "grt-large-isoflop": (290.30, (1, 5, 6, 5), 1280),
    "grt-small-isoflop": (None, (1, 1, 10, 1), 768),
    "grt-medium-isoparam": (None, (2, 20, 4, 2), 1024),
    "grt-large-isoparam": (None, (3, 30, 6, 3), 1280),
}


def info(name, capsys):
    assert main(["info", str(PAPER / f"{name}.yaml"), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_params_and_eq1_flops(name, capsys):
    params_m, shape, d = REFERENCE[name]
    got = info(name, capsys)
    if isinstance(shape, int):
        blocks, overhead, shorthand = shape, 0, f"{shape}L"
    else:
        p, b, R, c = shape
        blocks, overhead, shorthand = p + b * R + c, R * 10 * d * d, f"{p}+{b}x{R}+{c}"
    eq1 = blocks * (24 * d * d + 4 * S * d) + overhead
    assert got["shorthand"] == shorthand
    assert got["block_executions"] == blocks
    assert got["flops_per_token"] == eq1
    assert got["flops_per_token_with_head"] == eq1 + 2 * d * V
    assert got["params"] - got["params_without_position"] == S * d
    # executed: per step W_x (2d^2) + the gate's state half and second layer (4d^2); once the anchor halves (4d^2)
    executed = eq1 if isinstance(shape, int) else eq1 - overhead + R * 6 * d * d + 4 * d * d
    assert got["executed_flops_per_token"] == executed
    if params_m is not None:
        assert abs(got["params"] / 1e6 - params_m) <= 0.01, got["params"]
    else:  # arithmetic: embeddings, blocks 12d^2+13d, W_proj 2d^2+d, gate 3d^2+2d (+4d for its two LNs), final LN
        p, b, R, c = shape
        expected = V * d + S * d + (p + b + c) * (12 * d * d + 13 * d) + 2 * d * d + d + 3 * d * d + 2 * d + 4 * d
        assert got["params"] == expected + 2 * d


def test_gpt2_small_eq1_published_figures(capsys):
    got = info("gpt2-small", capsys)
    assert got["flops_per_token"] / 1e9 == pytest.approx(0.2076, abs=5e-5)
    assert got["flops_per_token_with_head"] / 1e9 == pytest.approx(0.2848, abs=5e-5)


def test_training_flops_of_each_method_by_hand():
    """The trainer's MFU basis: 3x the forward, minus what Poisson's no-grad steps skip, with MoR's capacities,
    with Ouro's head at every loop."""
    from pipeline.model import model_class
    from pipeline.model.configs import MoRConfig
    from pipeline.model.configs import OuroConfig
    from pipeline.model.configs import PoissonConfig

    d, S, V = 64, 32, 100
    block = 24 * d * d + 4 * S * d
    head = 2 * d * V
    pc = PoissonConfig(vocab_size=V, block_size=S, d_model=d, n_head=2, n_prelude=1, n_core=2, n_coda=1,
                       n_recurrence=4, backprop_steps=3)
    poisson = model_class("poisson")
    for p in (1, 3, 6):
        fwd = (2 + 2 * p) * block + p * 4 * d * d + head
        assert poisson.training_flops_per_token(pc, p) == 3 * fwd - 2 * max(p - 3, 0) * (2 * block + 4 * d * d)
    oc = OuroConfig(vocab_size=V, block_size=S, d_model=d, n_head=2, n_layer=2, n_recurrence=3)
    assert model_class("ouro").training_flops_per_token(oc) == 3 * (3 * 2 * block + 3 * 2 * d + 3 * head)
    mc = MoRConfig(vocab_size=V, block_size=S, d_model=d, n_head=2, n_prelude=1, n_core=1, n_coda=1,
                   n_recurrence=2)
    ks = [32, 16]  # capacities 1 and 1/2 of S = 32; each router scores the previous recursion's 32 chosen tokens
    executed = 2 * block + sum(k / S * 24 * d * d + (k / S) ** 2 * 4 * S * d for k in ks) + 2 * (2 * d)
    assert model_class("mor").training_flops_per_token(mc) == pytest.approx(3 * (executed + head), rel=1e-6)


def test_llama_block_params_and_eq1_flops_by_hand(capsys):
    """gpt2-small with the llama block, GQA (12 query / 4 kv heads), QK-norm and the vocabulary padded to 128:
    per block q,o d x d, k,v d x d_kv, SwiGLU 3 d f with f = 256 ceil(8/3 d / 256), two RMSNorms d, QK-norm 2 hd;
    the tied embedding has the padded rows, no position embedding; the head's FLOPs use the real vocabulary."""
    overrides = ["model.block=llama", "model.bias=false", "model.n_kv_head=4", "model.qk_norm=true",
                 "model.vocab_multiple=128"]
    assert main(["info", str(PAPER / "gpt2-small.yaml"), *overrides, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    d, L, hd, d_kv, f, rows = 768, 12, 64, 4 * 64, 2048, 50304
    weights = 2 * d * d + 2 * d * d_kv + 3 * d * f
    assert got["params"] == got["params_without_position"] == rows * d + L * (weights + 2 * d + 2 * hd) + d
    assert got["flops_per_token"] == L * (2 * weights + 4 * S * d)
    assert got["flops_per_token_with_head"] == got["flops_per_token"] + 2 * d * V
    assert (got["block"], got["n_kv_head"], got["mlp_hidden"], got["embedding_rows"]) == ("llama", 4, f, rows)
    assert main(["info", str(PAPER / "gpt2-small.yaml"), *overrides]) == 0
    assert "llama: 12 query / 4 key-value heads, SwiGLU hidden 2048; vocabulary 50,257 in 50,304 rows" in \
        capsys.readouterr().out
