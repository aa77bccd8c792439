"""Static hyper-connections in GRT's core (model.hyper_streams; Zhu et al. 2024, pipeline/model/hyper_connections.py)
against independent references: the plain GRT (at the paper's initialisation the hyper-connected core is the plain
core, so the same block weights give the same outputs and gradients), the paper's equations written out stream by
stream, and its initialisation table."""
import json

import pytest
import torch
import yaml

from conftest import tiny_recipe
from pipeline.cli import main
from pipeline.config import RecipeError
from pipeline.config import from_dict
from pipeline.model import build_model
from pipeline.model.configs import GRTConfig
from pipeline.model.hyper_connections import HyperConnectedBlock
from pipeline.model.kv_cache import KVCache
from pipeline.model.layers import Block
from pipeline.train.optim import param_groups

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread

BASE = dict(vocab_size=64, block_size=16, d_model=32, n_head=2, n_prelude=1, n_core=3, n_coda=1, n_recurrence=2)


def grt(n: int, seed: int = 5, **kw):
    """A float64 GRT with ``n`` streams, GPT-2 init from ``seed`` (each parameter seeded by its name: the block
    weights of n = 1 and n > 1 are the same tensors)."""
    return build_model(GRTConfig(**{**BASE, **kw}, hyper_streams=n), seed=seed).double()


def move_hc_off_init(model, seed: int = 0) -> None:
    """Random A_m, A_r, B (non-symmetric A_r, every entry non-zero): away from the init, where streams stay equal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hc_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("n,n_core", [(2, 3), (3, 3), (2, 1)])
def test_at_init_equals_the_plain_grt_outputs_and_gradients(n, n_core):
    """At Eq. 14's init every stream stays x + the plain residual updates, so the mean is the plain core: the same
    logits, loss and gradients of every shared parameter as hyper_streams=1 (training mode: the noise too). One core
    block: it both replicates and averages."""
    plain, hyper = grt(1, n_core=n_core), grt(n, n_core=n_core)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain.eval(), hyper.eval()
    ref, out = plain(idx)[0], hyper(idx)[0]
    assert (out - ref).abs().max().item() < 1e-12 and ref.abs().max() > 0.1
    plain.train(), hyper.train()
    losses = []
    for m in (plain, hyper):
        torch.manual_seed(2)  # the same state and gate noise
        loss = m(idx, idx)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    hyper_grads = dict(hyper.named_parameters())
    for name, p in plain.named_parameters():
        assert (hyper_grads[name].grad - p.grad).abs().max().item() < 1e-12, name


def test_initialisation_is_the_papers_eq14():
    """A_m of the core's k-th sublayer (block i: attention 2i, MLP 2i + 1) = e_{k mod n}, A_r = I, B = 1, through
    build_model's init (gpt2_init_value) and on a model built on meta and initialised later."""
    n = 2
    eye = torch.eye(n, dtype=torch.float64)
    on_meta = build_model(GRTConfig(**BASE, hyper_streams=n), device="meta").to_empty(device="cpu")
    on_meta.init_weights(5)  # as the sharded trainer does: every value from gpt2_init_value
    for model in (grt(n), on_meta.double()):
        for i, block in enumerate(model.recur.blocks):
            for k, hc in ((2 * i, block.hc_attn), (2 * i + 1, block.hc_mlp)):
                assert torch.equal(hc.a_m, eye[k % n]) and torch.equal(hc.a_r, eye), (i, k)
                assert torch.equal(hc.b, torch.ones(n, dtype=torch.float64))


def hand_written_block(block: Block, x: torch.Tensor, weights) -> torch.Tensor:
    """Zhu et al. Eqs. 2-5 stream by stream for the attention then the MLP sublayer of ``block`` (its own pre-LN
    sublayers) on streams x [n, B, T, d]; ``weights`` = [(A_m, A_r, B) of the attention, those of the MLP]:
    h_0 = sum_j A_m[j] h_j, then stream i <- B_i T(h_0) + sum_j A_r[j, i] h_j."""
    n = x.shape[0]
    H = list(x)
    for (ln, sub), (a_m, a_r, b) in zip(((block.ln_1, block.attn), (block.ln_2, block.mlp)), weights):
        h0 = sum(a_m[j] * H[j] for j in range(n))
        y = sub(ln(h0))
        H = [b[i] * y + sum(a_r[j, i] * H[j] for j in range(n)) for i in range(n)]
    return torch.stack(H)


def weights_of(block: HyperConnectedBlock):
    return [(hc.a_m, hc.a_r, hc.b) for hc in (block.hc_attn, block.hc_mlp)]


@pytest.mark.parametrize("n", [2, 3])
def test_one_block_off_init_matches_the_hand_written_equations(n):
    """A middle core block (streams in, streams out) with random A_m, A_r, B; the first block replicates its input,
    the last returns the mean of the streams."""
    model = grt(n)
    move_hc_off_init(model)
    first, middle, last = model.recur.blocks
    assert isinstance(middle, HyperConnectedBlock) and (first.first, middle.first, middle.last, last.last) == (
        True, False, False, True)
    x = torch.randn(n, 2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hand_written_block(middle, x, weights_of(middle))
        assert (middle(x) - ref).abs().max().item() < 1e-12 and (ref[0] - ref[1]).abs().max() > 0.1
        ref_first = hand_written_block(first, x[0].expand(n, *x[0].shape), weights_of(first))
        assert (first(x[0]) - ref_first).abs().max().item() < 1e-12
        ref_last = hand_written_block(last, x, weights_of(last)).mean(0)
        assert (last(x) - ref_last).abs().max().item() < 1e-12


def test_gradients_reach_every_hc_parameter_and_the_count_is_n_core_2_n_plus_n2_plus_n():
    n = 3
    plain, model = grt(1), grt(n)
    move_hc_off_init(model)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    model.eval()(idx, idx)[1].backward()
    hc = {name: p for name, p in model.named_parameters() if ".hc_" in name}
    assert len(hc) == 3 * 2 * 3  # n_core blocks x 2 sublayers x (A_m, A_r, B)
    for name, p in hc.items():
        assert p.grad is not None and p.grad.abs().min() > 0, name
    added = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in plain.parameters())
    assert added == BASE["n_core"] * 2 * (n + n * n + n) == sum(p.numel() for p in hc.values())
    decayed = {id(p) for p in param_groups(model, 0.1)[0]["params"]}
    assert not any(id(p) in decayed for p in hc.values())  # small mixing matrices: no weight decay


def test_cached_decode_equals_the_full_forward_off_init():
    """The KV cache (full strategy) sees the width-mixed sublayer input as the plain block sees its stream: decoding
    token by token gives the uncached forward's logits."""
    model = grt(2)
    move_hc_off_init(model)
    model.eval()
    idx = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(idx)[0]
        cache = KVCache(model.cfg.block_size, "full")
        steps = torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(idx.shape[1])], dim=1)
    assert (steps - full).abs().max().item() < 1e-12


def test_hyper_streams_below_one_is_refused():
    with pytest.raises(RecipeError, match=r"model.hyper_streams must be >= 1 \(1: the plain residual core"):
        from_dict({"model": {**BASE, "type": "grt", "hyper_streams": 0}})


def test_grt_train_and_info_with_hyper_streams(tmp_path, corpus, capsys):
    """`grt info` counts the HC parameters; `grt train` runs a few steps; the mixing weights move off their init."""
    from pipeline.tokenize import tokenize
    from pipeline.train.trained import load_trained

    recipe = tiny_recipe(tmp_path, corpus, {"n_core": 2, "hyper_streams": 2},
                         train={"max_steps": 3, "eval_interval": 3, "checkpoint_interval": 3, "grad_accum_steps": 1})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({**recipe, "model": {**recipe["model"], "hyper_streams": 1}}))
    counts = []
    for p in (plain, path):
        assert main(["info", str(p), "--json"]) == 0
        counts.append(json.loads(capsys.readouterr().out)["params"])
    assert counts[1] - counts[0] == 2 * 2 * (2 + 4 + 2)
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    assert main(["train", str(path)]) == 0
    model = load_trained(cfg.run_dir, device="cpu")[0]
    hc = model.recur.blocks[1].hc_mlp
    assert not torch.equal(hc.a_r, torch.eye(2)) and not torch.equal(hc.b, torch.ones(2))


def test_info_notes_the_stream_mix_flops_eq1_leaves_out():
    """Per sublayer A_m (n d multiply-adds), A_r (n^2 d) and B (n d): (2n^2 + 4n) d FLOPs, two sublayers per core
    block, counted by hand at n = 3, d = 16, n_core = 2."""
    from pipeline.model.configs import GRTConfig
    from pipeline.model.grt import GRT

    cfg = GRTConfig(vocab_size=64, block_size=8, d_model=16, n_head=2, n_core=2, hyper_streams=3)
    assert any(f"add {2 * 2 * (2 * 9 + 12) * 16:,} FLOPs/token per recurrence step" in n for n in GRT.flops_notes(cfg))
    assert not any("hyper-connections" in n for n in GRT.flops_notes(GRTConfig(vocab_size=64, block_size=8)))
