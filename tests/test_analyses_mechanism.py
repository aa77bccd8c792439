"""Appendix E.7-E.9 and Figure 4 (pipeline/eval/analyses/mechanism.py) against hand computations on hand-made tensors
and a tiny GRT."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.eval.analyses.dynamics import trace_steps
from pipeline.eval.analyses.mechanism import AttentionStatistics
from pipeline.eval.analyses.mechanism import GateAttribution
from pipeline.eval.analyses.mechanism import attention_probabilities
from pipeline.eval.analyses.mechanism import attention_row_statistics
from pipeline.eval.analyses.mechanism import classify_head
from pipeline.eval.analyses.mechanism import gate_weight_spectra
from pipeline.eval.analyses.mechanism import next_token_traces
from pipeline.eval.analyses.mechanism import projection_analysis
from pipeline.eval.analyses.mechanism_plots import plot_attention
from pipeline.eval.analyses.mechanism_plots import plot_gate_attribution
from pipeline.eval.analyses.mechanism_plots import plot_projection
from pipeline.eval.analyses.mechanism_plots import plot_traces
from pipeline.eval.analyses.suite import traced_pass
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.grt import Gate
from pipeline.model.grt import RecurrentStep
from pipeline.model.layers import CausalSelfAttention
from plot_check import assert_drawn
from plot_check import assert_png_of
from plot_check import capture_figures
from plot_check import texts

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


def tiny_grt(**over) -> torch.nn.Module:
    cfg = dict(vocab_size=VOCAB, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1, n_recurrence=3)
    model = build_model(GRTConfig(**{**cfg, **over}), seed=3)
    with torch.no_grad():  # a gate bias of 0 and larger weights than GPT-2's init, so the statistics are not trivial
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
        if model.recur.gate is not None:
            model.recur.gate.fc2.bias.zero_()
    return model.eval()


def batches(n=2, B=2, T=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (B, T), generator=gen), None) for _ in range(n)]


def random_orthogonal(n, gen):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


# -------------------------------------------------------------------------------------------------- attention
def test_recomputed_attention_times_v_is_the_modules_attention():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, 0.0, True).eval()
    with torch.no_grad():
        attn.c_attn.weight.mul_(5)
    x = torch.randn(2, 10, 32)
    P = attention_probabilities(attn, x)
    q, k, v = attn.c_attn(x).split(32, dim=2)
    q, k, v = (t.view(2, 10, 4, 8).transpose(1, 2) for t in (q, k, v))
    y_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(P @ v, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn.c_proj((P @ v).transpose(1, 2).reshape(2, 10, 32)), attn(x), atol=1e-5, rtol=1e-5)
    assert torch.all(P.triu(1) == 0)
    torch.testing.assert_close(P.sum(-1), torch.ones(2, 4, 10))


def test_llama_attention_recomputed_within_documents_is_the_modules_attention():
    """GQA (2 key heads for 4 query heads), QK-norm, rotary positions restarting at each document: the recomputed
    probabilities times the values give the module's own output, and no weight crosses a document."""
    from pipeline.model.layout import TokenLayout
    from pipeline.model.llama import LlamaAttention

    torch.manual_seed(0)
    attn = LlamaAttention(32, 4, 2, 0.0, qk_norm=True).eval()
    with torch.no_grad():
        attn.q_proj.weight.mul_(5)
    x, docs = torch.randn(2, 10, 32), torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    layout = TokenLayout.build(torch.zeros(2, 10, dtype=torch.long), docs=docs, rope=(8, 10000.0))
    P = attention_probabilities(attn, x, layout)
    _, _, v = attn.projections(x, layout)
    y = (P @ v.repeat_interleave(2, dim=1)).transpose(1, 2).reshape(2, 10, 32)
    torch.testing.assert_close(attn.o_proj(y), attn(x, layout=layout), atol=1e-5, rtol=1e-5)
    same_doc = (docs[:, :, None] == docs[:, None, :])[:, None]
    assert torch.all(P[~same_doc.expand_as(P)] == 0) and torch.all(P.triu(1) == 0)
    torch.testing.assert_close(P.sum(-1), torch.ones(2, 4, 10))


def test_row_statistics_within_documents_count_each_documents_prefix():
    """Documents of 3 and 2 tokens, a head uniform over the keys each row sees: rows 1, 2 and 4 count (0 and 3 see
    one key), normalised by ln of their own keys."""
    docs = torch.tensor([[0, 0, 0, 1, 1]])
    visible = ((docs[:, :, None] == docs[:, None, :]) & torch.ones(5, 5, dtype=torch.bool).tril())[:, None]
    P = visible.float() / visible.sum(-1, keepdim=True)
    stats, rows = attention_row_statistics(P, visible=visible)
    assert rows == 3
    want = {"entropy": (math.log(2) + math.log(3) + math.log(2)) / 3, "entropy_normalised": 1.0,
            "prev_mass": (1 / 2 + 1 / 3 + 1 / 2) / 3, "diag_mass": (1 / 2 + 1 / 3 + 1 / 2) / 3,
            "distance": (1 / 2 + 1 + 1 / 2) / 3}
    for name, value in want.items():
        assert stats[name].item() == pytest.approx(value, abs=1e-6), name


@torch.no_grad()
def test_llama_grt_attention_statistics_within_documents_equal_the_documents_apart():
    """A llama GRT's traced attention statistics over a window of two documents are the row-weighted mean of the
    statistics of each document run alone (the masked forward equals separate forwards)."""
    from pipeline.train.data import Batch

    model = tiny_grt(block="llama", bias=False, n_kv_head=2)
    for block in model.recur.blocks:  # sharper heads than near-uniform ones, so heads and steps differ
        block.attn.q_proj.weight.mul_(6.0)
    x = batches(n=1, B=1, T=12)[0][0]
    docs = torch.tensor([[0] * 5 + [1] * 7])
    masked = traced_pass(model, [Batch(x, x, docs)], 3, "cpu", ["attention"], noise=False,
                         analysis_tokens=0)["attention"]
    apart = [traced_pass(model, [(part, None)], 3, "cpu", ["attention"], noise=False, analysis_tokens=0)["attention"]
             for part in (x[:, :5], x[:, 5:])]
    for name in ("entropy", "entropy_normalised", "prev_mass", "diag_mass", "distance"):
        want = (4 * np.array(apart[0][name]) + 6 * np.array(apart[1][name])) / 10  # 4 and 6 rows see 2+ keys
        np.testing.assert_allclose(np.array(masked[name]), want, atol=2e-5, err_msg=name)
    assert np.ptp(np.array(masked["entropy"])) > 0.1  # heads that differ: the comparison means something


def test_row_statistics_on_hand_made_patterns():
    T = 5
    P = torch.zeros(1, 3, T, T)
    for t in range(T):
        P[0, 0, t, : t + 1] = 1.0 / (t + 1)  # uniform over the causal prefix: t + 1 keys
        P[0, 1, t, max(t - 1, 0)] = 1.0  # one-hot on the previous token (row 0 on itself)
        P[0, 2, t, max(t - 1, 0): t + 1] = 0.5 if t else 1.0  # uniform over k = 2 keys {t-1, t}
    stats, rows = attention_row_statistics(P)
    assert rows == T - 1
    rows_t = range(1, T)
    expected = {
        "entropy": [np.mean([math.log(t + 1) for t in rows_t]), 0.0, math.log(2)],
        "entropy_normalised": [1.0, 0.0, np.mean([math.log(2) / math.log(t + 1) for t in rows_t])],
        "prev_mass": [np.mean([1 / (t + 1) for t in rows_t]), 1.0, 0.5],
        "diag_mass": [np.mean([1 / (t + 1) for t in rows_t]), 0.0, 0.5],
        "distance": [np.mean([t / 2 for t in rows_t]), 1.0, 0.5]}
    for name, want in expected.items():
        np.testing.assert_allclose(stats[name].numpy(), want, atol=1e-6, err_msg=name)
    with_row0, rows0 = attention_row_statistics(P, first_query=0)  # row 0: one key, entropy 0, diagonal 1
    assert rows0 == T
    np.testing.assert_allclose(with_row0["entropy"][0].item(), sum(math.log(t + 1) for t in range(T)) / T, atol=1e-6)
    np.testing.assert_allclose(with_row0["diag_mass"][1].item(), 1 / T, atol=1e-6)


@pytest.mark.parametrize("stats, cls", [
    ((0.30, 0.88, 0.05), "previous_token"),  # the paper's Block 0 Head 14: sharp, but previous-token first
    ((0.50, 0.05, 0.90), "self"),
    ((0.40, 0.40, 0.55), "self"),  # both positional masses pass: the larger wins
    ((0.50, 0.10, 0.10), "local_sharp"),
    ((4.50, 0.01, 0.01), "broad"),
    ((2.50, 0.30, 0.30), "general"),
])
def test_classify_hand_made_heads(stats, cls):
    assert classify_head(*stats) == cls


def reference_attention(model, xs, n_steps):
    """Per (step, block, head) means over batches and rows t >= 1, from block inputs rebuilt by hand, fp64."""
    step = model.recur
    sums = {k: np.zeros((n_steps, len(step.blocks), model.cfg.n_head)) for k in ("entropy", "prev_mass", "diag_mass",
                                                                              "distance")}
    rows = 0
    for x in xs:
        h_pre = model.encode(x)
        for r, h, o, _, _ in trace_steps(model, x, n_steps):
            o_hand = step.proj(h, part="x") + step.proj(h_pre, part="a")
            for b, block in enumerate(step.blocks):
                a = block.ln_1(o_hand).double()
                B, T, C = a.shape
                H = model.cfg.n_head
                q, k, _ = F.linear(a, block.attn.c_attn.weight.double(), block.attn.c_attn.bias.double()).split(C, 2)
                q, k = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k))
                s = q @ k.transpose(-1, -2) / math.sqrt(C // H)
                s = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, torch.tensor(-math.inf, dtype=s.dtype))
                P = torch.exp(s - s.max(-1, keepdim=True).values)
                P = (P / P.sum(-1, keepdim=True)).numpy()  # [B, H, T, T]
                for t in range(1, T):
                    row = P[:, :, t, : t + 1]
                    sums["entropy"][r - 1, b] += -(row * np.log(row)).sum(-1).sum(0)
                    sums["prev_mass"][r - 1, b] += P[:, :, t, t - 1].sum(0)
                    sums["diag_mass"][r - 1, b] += P[:, :, t, t].sum(0)
                    sums["distance"][r - 1, b] += (row * (t - np.arange(t + 1))).sum(-1).sum(0)
                o_hand = block(o_hand)
            torch.testing.assert_close(o_hand, o)  # the hand-rebuilt core is the traced proposal
        rows += x.shape[0] * (x.shape[1] - 1)
    return {k: v / rows for k, v in sums.items()}


@torch.no_grad()
def test_attention_statistics_hooks_map_calls_to_steps_and_blocks():
    model = tiny_grt()
    for block in model.recur.blocks:  # sharper heads than the init's near-uniform ones, so steps and heads differ
        block.attn.c_attn.weight.mul_(6.0)
    data = batches()
    res = traced_pass(model, data, 3, "cpu", ["attention"], noise=False, analysis_tokens=0)["attention"]
    assert np.ptp(np.array(res["entropy"])) > 0.3  # heads that differ, or the mapping check below means little
    ref = reference_attention(model, [x for x, _ in data], 3)
    for name, want in ref.items():
        np.testing.assert_allclose(np.array(res[name]), want, atol=2e-5, err_msg=name)
    assert res["passes"] == 2 and len(res["entropy"]) == 3 and len(res["entropy"][0]) == 2
    np.testing.assert_allclose(res["mean_entropy"], ref["entropy"].mean(axis=(1, 2)), atol=2e-5)
    over = {k: ref[k].mean(0) for k in ("entropy", "prev_mass", "diag_mass")}
    want_classes = [[classify_head(over["entropy"][b, h], over["prev_mass"][b, h], over["diag_mass"][b, h])
                     for h in range(4)] for b in range(2)]
    assert res["classes"] == want_classes
    assert sum(res["class_counts"].values()) == 8
    # a pass of the wrong depth is refused, and the hooks are gone once the context closes
    with AttentionStatistics(model, 3) as stats:
        for _ in trace_steps(model, data[0][0], 2):
            pass
    with pytest.raises(RuntimeError, match="whole number of traced passes"):
        stats.result()
    calls = stats.calls
    model(data[0][0])
    assert stats.calls == calls


# ---------------------------------------------------------------------------------------------- gate attribution
def layer_norm_np(x, w, b):
    x = x.astype(np.float64)
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b


@torch.no_grad()
def test_gate_attribution_matches_a_hand_computation_streamed_over_batches():
    d = 8
    torch.manual_seed(1)
    gate = Gate(d, 4.0)
    for p in gate.parameters():
        p.copy_(torch.randn_like(p))
    data = [(torch.randn(2, 5, d), torch.randn(2, 5, d)) for _ in range(3)]  # (h^(r-1), h_pre) per batch
    acc = GateAttribution(gate)
    for h, pre in data:
        acc.update(1, h, pre)
        acc.update(2, 2 * h + pre, pre)  # a second step, so the per-step bookkeeping is tested too
    res = acc.result()
    W = gate.fc1.weight.double().numpy()
    Wx, Wa, b1 = W[:, :d], W[:, d:], gate.fc1.bias.double().numpy()
    lnh = [p.double().numpy() for p in (gate.ln_h.weight, gate.ln_h.bias)]
    lnp = [p.double().numpy() for p in (gate.ln_pre.weight, gate.ln_pre.bias)]
    for i, scale in enumerate((1, 2)):
        hs = np.concatenate([(scale * h + (pre if scale == 2 else 0)).numpy().reshape(-1, d) for h, pre in data])
        pres = np.concatenate([pre.numpy().reshape(-1, d) for _, pre in data])
        ax = layer_norm_np(hs, *lnh) @ Wx.T
        ah = layer_norm_np(pres, *lnp) @ Wa.T + b1
        vx, vh = ax.var(0).sum(), ah.var(0).sum()
        assert res["state_var_frac"][i] == pytest.approx(vx / (vx + vh), abs=1e-5)
        assert res["anchor_var_frac"][i] == pytest.approx(vh / (vx + vh), abs=1e-5)
        assert res["cross_cov_frac"][i] == pytest.approx(1 - (vx + vh) / (ax + ah).var(0).sum(), abs=1e-5)
        dom = np.mean(np.linalg.norm(ax, axis=1) > np.linalg.norm(ah, axis=1))
        assert res["x_dominance"][i] == pytest.approx(dom)
        assert res["x_dominance_units"][i] == pytest.approx(np.mean(np.abs(ax) > np.abs(ah)))
        assert res["sign_agreement"][i] == pytest.approx(np.mean(ax * ah > 0))
    assert res["step"] == [1, 2]


@torch.no_grad()
def test_gate_attribution_with_the_anchor_half_zeroed_is_all_state():
    d = 8
    gate = Gate(d, 4.0)
    torch.nn.init.normal_(gate.fc1.weight)
    gate.fc1.weight[:, d:] = 0
    gate.fc1.bias.zero_()
    acc = GateAttribution(gate)
    acc.update(1, torch.randn(3, 4, d), torch.randn(3, 4, d))
    res = acc.result()
    assert res["state_var_frac"] == [1.0] and res["anchor_var_frac"] == [0.0]
    assert res["x_dominance"] == [1.0] and res["sign_agreement"] == [0.0]


def test_gate_weight_spectra_of_hand_set_weights():
    d = 6
    gen = torch.Generator().manual_seed(2)
    gate = Gate(d, 4.0)
    s_x, s_a = torch.tensor([9.87, 5, 3, 2, 1, 0.5]), torch.tensor([6.85, 4, 2, 1, 1, 0.25])
    with torch.no_grad():
        for s, cols in ((s_x, slice(0, d)), (s_a, slice(d, 2 * d))):
            u, v = random_orthogonal(d, gen), random_orthogonal(d, gen)
            gate.fc1.weight[:, cols] = (u @ torch.diag(s.double()) @ v.T).float()
        gate.fc2.weight.copy_(torch.diag(torch.arange(1.0, d + 1)))
        gate.ln_h.weight.fill_(2.0)
    sp = gate_weight_spectra(gate)
    np.testing.assert_allclose(sp["W1_x"], s_x.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sp["W1_a"], s_a.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sp["fc2"], np.arange(d, 0, -1), rtol=1e-6)
    np.testing.assert_allclose(sp["W1_x_ln"], 2 * s_x.numpy(), rtol=1e-5)  # LN gain 2 on every input
    assert sp["leading"]["W1_x"] == pytest.approx(9.87, rel=1e-5)
    assert sp["leading_ratio_x_over_a"] == pytest.approx(9.87 / 6.85, rel=1e-5)


# ------------------------------------------------------------------------------------------------- projection
def test_projection_analysis_on_hand_built_weights():
    d = 4
    gen = torch.Generator().manual_seed(5)
    step = RecurrentStep(GRTConfig(vocab_size=VOCAB, block_size=8, d_model=d, n_head=2, n_core=1))
    u, v = random_orthogonal(d, gen), random_orthogonal(d, gen)
    w_x = u @ torch.diag(torch.tensor([4.0, 2, 1, 1], dtype=torch.float64)) @ v.T
    with torch.no_grad():
        step.proj.weight.copy_(torch.cat([w_x, -w_x], dim=1).float())  # anchor half = -state half: row cosine -1
        step.gate.fc1.weight.copy_(torch.cat([2 * torch.eye(d), torch.eye(d)], dim=1))
    res = projection_analysis(step)
    px = res["proj"]["W_x"]
    np.testing.assert_allclose(px["singular_values"], [4, 2, 1, 1], rtol=1e-5)
    # p = s / sum s = (1/2, 1/4, 1/8, 1/8)
    assert px["effective_rank"] == pytest.approx(math.exp(-(0.5 * math.log(0.5) + 0.25 * math.log(0.25)
                                                            + 2 * 0.125 * math.log(0.125))), rel=1e-5)
    assert px["energy_dim_90"] == 2  # energies 16, 4, 1, 1 of 22: 72.7% after one, 90.9% after two
    assert px["frobenius"] == pytest.approx(math.sqrt(22), rel=1e-5)
    assert res["proj"]["row_cosine"]["mean"] == pytest.approx(-1.0, abs=1e-6)
    assert res["proj"]["row_cosine"]["frac_above_0.5"] == 0.0
    assert res["gate_fc1"]["row_cosine"]["mean"] == pytest.approx(1.0, abs=1e-6)
    assert res["gate_fc1"]["W_x"]["effective_rank"] == pytest.approx(d, rel=1e-6)  # 2 I: flat spectrum
    assert res["frobenius"] == pytest.approx({"proj.W_x": math.sqrt(22), "proj.W_h": math.sqrt(22),
                                              "gate_fc1.W_x": 2 * math.sqrt(d), "gate_fc1.W_h": math.sqrt(d)}, rel=1e-5)
    bare = projection_analysis(RecurrentStep(GRTConfig(vocab_size=VOCAB, block_size=8, d_model=d, n_head=2, n_core=1,
                                                       reinject=False, gate="none")))
    assert bare["proj"] is None and bare["gate_fc1"] is None and bare["frobenius"] == {}
    assert "reinject=false" in bare["absent"]["proj"] and "gate=none" in bare["absent"]["gate_fc1"]


# ---------------------------------------------------------------------------------------------------- traces
def encode(text):
    return [ord(c) % VOCAB for c in text]


@torch.no_grad()
def test_next_token_traces_equal_the_forward_at_every_depth():
    model = tiny_grt()
    prompts = ["the gate", "a + b ="]
    traces = next_token_traces(model, prompts, 3, encode, lambda t: f"<{t}>", top_k=3)
    for text, tr in zip(prompts, traces):
        idx = torch.tensor([encode(text)])
        assert tr["exit"] == [0, 1, 2, 3]
        union = set()
        for i, r in enumerate(tr["exit"]):
            p = model(idx, n_steps=r)[0][0, -1].double().softmax(-1)  # r = 0: prelude only
            union |= set(p.topk(3).indices.tolist())
            for c in tr["candidates"]:
                assert c["prob"][i] == pytest.approx(p[c["token_id"]].item(), abs=1e-6)
            assert tr["argmax"][i]["token_id"] == p.argmax().item()
            assert tr["argmax"][i]["token"] == f"<{p.argmax().item()}>"
        assert {c["token_id"] for c in tr["candidates"]} == union
        last = [c["prob"][-1] for c in tr["candidates"]]
        assert last == sorted(last, reverse=True)


@torch.no_grad()
def test_next_token_traces_on_a_dense_model_read_its_layers():
    model = build_model(GPTConfig(vocab_size=VOCAB, block_size=16, d_model=32, n_head=2, n_layer=2), seed=1).eval()
    tr = next_token_traces(model, ["abc"], 2, encode, str, top_k=2)[0]
    assert tr["exit"] == [1, 2]
    p = model(torch.tensor([encode("abc")]))[0][0, -1].double().softmax(-1)
    assert tr["argmax"][-1]["prob"] == pytest.approx(p.max().item(), abs=1e-6)


# ------------------------------------------------------------------------------------------------------ plots
@torch.no_grad()
def test_plots_draw_their_data(tmp_path, monkeypatch):
    """Each figure drew, value for value, the series it was given (read back from the figure's artists), and its
    PNG decodes at the figure's size: a plot that draws nothing, or the wrong series, fails."""
    figs = capture_figures(monkeypatch)
    model = tiny_grt()
    data = batches(n=1)
    traced = traced_pass(model, data, 3, "cpu", ["gate_attribution", "attention"], noise=False, analysis_tokens=0)
    gate = traced["gate_attribution"]
    proj = projection_analysis(model.recur)
    bare = projection_analysis(tiny_grt(reinject=False, gate="none").recur)
    attn = traced["attention"]
    traces = next_token_traces(model, ["ab", "xyz"], 3, encode, str)
    paths = [plot_gate_attribution(gate, tmp_path / "gate.png"), plot_projection(proj, tmp_path / "proj.png"),
             plot_projection(bare, tmp_path / "bare.png"), plot_attention(attn, tmp_path / "attn.png"),
             plot_traces(traces, tmp_path / "traces.png")]
    assert len(figs) == len(paths)
    for fig, p in zip(figs, paths):
        assert_png_of(fig, p, dpi=110)
    sx = [math.nan if v is None else v for v in gate["state_var_frac"]]
    assert_drawn(figs[0], sx, [1 - v for v in sx], gate["x_dominance"], gate["sign_agreement"],
                 *([gate["spectra"][k] for k in ("W1_x", "W1_a", "fc2")] if gate.get("spectra") else []),
                 what="gate attribution")
    assert_drawn(figs[1], *[proj["proj"][h][k] for h in ("W_x", "W_h") for k in ("singular_values",
                                                                                  "cumulative_energy")],
                 list(proj["frobenius"].values()), what="projection")
    assert bare["absent"] and all(msg in texts(figs[2]) for msg in bare["absent"].values())  # said, not drawn
    ent = np.array(attn["entropy"]).reshape(len(attn["step"]), -1)
    assert_drawn(figs[3], ent, attn["mean_entropy"], attn["mean_diag_mass"], list(attn["class_counts"].values()),
                 what="attention")
    assert_drawn(figs[4], *[[c["prob"] for c in tr["candidates"][:6]] for tr in traces], what="traces")
