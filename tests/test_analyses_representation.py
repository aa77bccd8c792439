"""The representation analyses of Appendix E.3-E.6 and E.10 (pipeline/eval/analyses/representation.py) against hand
computations and independent float64 implementations; their plots write PNGs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.eval.analyses.representation import SuccessiveStates
from pipeline.eval.analyses.representation import TokenGateMean
from pipeline.eval.analyses.representation import TokenSample
from pipeline.eval.analyses.representation import cka_matrix
from pipeline.eval.analyses.representation import cross_cka
from pipeline.eval.analyses.representation import dense_layer_states
from pipeline.eval.analyses.representation import effective_rank
from pipeline.eval.analyses.representation import effective_rank_by_step
from pipeline.eval.analyses.representation import gate_difficulty
from pipeline.eval.analyses.representation import gate_difficulty_by_step
from pipeline.eval.analyses.representation import linear_cka
from pipeline.eval.analyses.representation import relative_improvement
from pipeline.eval.analyses.representation_plots import plot_cka
from pipeline.eval.analyses.representation_plots import plot_representation
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from plot_check import assert_drawn
from plot_check import assert_png_of
from plot_check import capture_figures

pytestmark = pytest.mark.usefixtures("one_thread")


def hsic_cka(X: np.ndarray, Y: np.ndarray) -> float:
    """CKA through centred Gram matrices (Kornblith et al. 2019, Eq. HSIC): HSIC(K, L) = tr(K H L H) / (n - 1)^2,
    CKA = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)), K = X X^T, L = Y Y^T, H = I - 11^T / n; nothing centred first."""
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    n = X.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    K, L = X @ X.T, Y @ Y.T

    def hsic(A, B):
        return np.trace(A @ H @ B @ H) / (n - 1) ** 2
    return hsic(K, L) / math.sqrt(hsic(K, K) * hsic(L, L))


def random_orthogonal(d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q


# ----------------------------------------------------------------------------------------------------------- CKA
def test_cka_of_a_matrix_with_itself_is_one_and_invariant_to_rotation_and_scale():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(50, 8, generator=gen, dtype=torch.float64) + 3.0  # an offset: centring must remove it
    Y = torch.randn(50, 6, generator=gen, dtype=torch.float64) @ torch.randn(6, 6, generator=gen,
                                                                            dtype=torch.float64) + X[:, :6]
    assert linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)
    base = linear_cka(X, Y)
    assert 0.05 < base < 0.99
    Q = random_orthogonal(6, gen)
    assert linear_cka(X, 4.5 * (Y @ Q)) == pytest.approx(base, abs=1e-10)
    assert linear_cka(X, Y + 7.0) == pytest.approx(base, abs=1e-10)  # a shift of every token
    # not invariant to an anisotropic scaling, which linear CKA is not meant to be
    assert abs(linear_cka(X, Y * torch.tensor([10.0, 1, 1, 1, 1, 1], dtype=torch.float64)) - base) > 1e-3


@pytest.mark.parametrize("n,d1,d2", [(40, 5, 7), (4, 20, 16)])  # tokens >> dims (feature form), << dims (Gram form)
def test_cka_equals_the_hsic_form_with_centred_gram_matrices(n, d1, d2):
    gen = torch.Generator().manual_seed(n)
    X = torch.randn(n, d1, generator=gen) * torch.linspace(0.2, 3.0, d1) + 1.0
    Y = torch.cat([X[:, :2] * 2.0, torch.randn(n, d2 - 2, generator=gen)], dim=1)
    assert linear_cka(X, Y) == pytest.approx(hsic_cka(X.numpy(), Y.numpy()), rel=1e-9)


def test_cka_matrix_and_cross_cka_against_the_hsic_form():
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(2, 10, 6, generator=gen) for _ in range(3)]  # [B, T, d]: flattened to 20 tokens
    steps[2] = steps[1] + 0.1 * steps[2]
    layers = [torch.randn(20, 4, generator=gen), steps[1].reshape(20, 6) @ torch.randn(6, 5, generator=gen)]
    within = cka_matrix(steps)
    flat = [s.reshape(20, 6).numpy() for s in steps]
    assert within["step"] == [0, 1, 2] and within["tokens"] == 20
    for i in range(3):
        for j in range(3):
            assert within["cka"][i][j] == pytest.approx(hsic_cka(flat[i], flat[j]), rel=1e-9)
    cross = cross_cka(steps, layers, steps=[0, 3, 6])
    assert cross["step"] == [0, 3, 6] and cross["layer"] == [0, 1]
    for i in range(3):
        for l in range(2):
            assert cross["cka"][i][l] == pytest.approx(hsic_cka(flat[i], layers[l].numpy()), rel=1e-9)
    assert cross["best_layer"][1] == 1  # layer 1 is a linear map of step 1's states
    assert cka_matrix([torch.ones(5, 3), torch.randn(5, 3)])["cka"][0][1] is None  # constant: undefined
    # wide states (d >> tokens) take the Gram form
    wide = [torch.randn(6, 40, generator=gen, dtype=torch.float64) for _ in range(3)]
    wide_layers = [wide[0] @ torch.randn(40, 30, generator=gen, dtype=torch.float64), wide[2][:, :25]]
    within, cross = cka_matrix(wide), cross_cka(wide, wide_layers)
    for i in range(3):
        for j in range(3):
            assert within["cka"][i][j] == pytest.approx(hsic_cka(wide[i].numpy(), wide[j].numpy()), rel=1e-9)
        for l in range(2):
            assert cross["cka"][i][l] == pytest.approx(hsic_cka(wide[i].numpy(), wide_layers[l].numpy()), rel=1e-9)
    with pytest.raises(ValueError, match="same tokens"):
        linear_cka(torch.randn(5, 3), torch.randn(6, 3))


def test_dense_layer_states_last_layer_gives_the_forward_logits():
    torch.manual_seed(0)
    model = build_model(GPTConfig(type="gpt", vocab_size=64, block_size=16, d_model=32, n_head=2, n_layer=3)).eval()
    idx = torch.randint(0, 64, (2, 16))
    states = dense_layer_states(model, idx)
    assert len(states) == 4 and all(s.shape == (2, 16, 32) for s in states)
    with torch.no_grad():
        logits, _ = model(idx)
        assert torch.allclose(model.lm_head(model.ln_f(states[-1])), logits, atol=1e-5)
        assert torch.allclose(states[0], model.embed(idx))
        assert torch.allclose(states[2], model.blocks[1](model.blocks[0](model.embed(idx))), atol=1e-6)
    with pytest.raises(ValueError, match="eval"):
        dense_layer_states(model.train(), idx)


def test_token_sample_keeps_the_first_rows_across_batches():
    sample = TokenSample(5)
    a, b = torch.arange(12.0).reshape(1, 3, 4), torch.arange(100.0, 124.0).reshape(2, 3, 4)
    for batch in (a, b):
        sample.add(0, batch)
        sample.add(1, batch * 2)
    expected = torch.cat([a.reshape(3, 4), b.reshape(6, 4)[:2]])
    assert torch.equal(sample.matrix(0), expected) and torch.equal(sample.matrix(1), 2 * expected)
    assert sample.steps() == [0, 1]


# ----------------------------------------------------------------------------------------------- effective rank
def test_effective_rank_of_a_rank_k_matrix_with_equal_singular_values_is_k():
    gen = torch.Generator().manual_seed(1)
    n, d, k = 40, 12, 5
    U, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    U = U - U.mean(dim=0)  # zero-mean columns so centring changes nothing ...
    U, _ = torch.linalg.qr(U)  # ... and orthonormal again (still zero-mean: the span is orthogonal to ones)
    V, _ = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))
    X = 3.0 * U @ V.T
    out = effective_rank(X)
    assert out["effective_rank"] == pytest.approx(k, rel=1e-9)
    assert out["max_rank"] == min(n - 1, d) and out["effective_rank_fraction"] == pytest.approx(k / d, rel=1e-9)
    # two singular values 3 and 1: p = (3/4, 1/4), exp(-(3/4 ln 3/4 + 1/4 ln 1/4)), uncentred
    Y = torch.zeros(4, 3)
    Y[0, 0], Y[1, 2] = 3.0, 1.0
    hand = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert effective_rank(Y, centre=False)["effective_rank"] == pytest.approx(hand, rel=1e-9)
    # centring matters: a constant offset is one direction uncentred, nothing centred
    Z = torch.ones(6, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert effective_rank(Z, centre=False)["effective_rank"] == pytest.approx(1.0, rel=1e-6)
    assert effective_rank(Z)["effective_rank"] == 0.0


def test_effective_rank_by_step_and_the_late_delta():
    gen = torch.Generator().manual_seed(2)
    sample = TokenSample(64)
    h0 = torch.randn(1, 64, 8, generator=gen)
    e = torch.zeros(1, 64, 8)
    e[..., 0] = torch.randn(1, 64, generator=gen)  # the last update moves along one direction only
    for r, h in enumerate([h0, 2 * h0, 2 * h0 + e]):
        sample.add(r, h)
    out = effective_rank_by_step(sample)
    assert out["step"] == [0, 1, 2] and out["delta_step"] == [1, 2]
    assert out["effective_rank"][1] == pytest.approx(out["effective_rank"][0], rel=1e-9)  # scale-free
    assert out["late_delta"]["step"] == 2 and out["late_delta"]["effective_rank"] == pytest.approx(1.0, rel=1e-6)


# ----------------------------------------------------------------------------------------- successive states
def test_successive_states_cosines_and_gain_on_hand_made_states():
    # one token per batch, d = 2; two batches (the accumulator pools them)
    traj = [[[1.0, 0.0], [1.0, 1.0], [2.0, 1.0]],  # Δ1 = (0, 1), Δ2 = (1, 0): cos 0, |Δ2|/|Δ1| = 1
            [[0.0, 2.0], [0.0, 4.0], [0.0, 7.0]]]  # Δ1 = (0, 2), Δ2 = (0, 3): cos 1
    props = [[[0.0, 1.0], [1.0, -1.0]], [[1.0, 0.0], [0.0, -3.0]]]  # o^(1), o^(2)
    acc = SuccessiveStates()
    for t, o in zip(traj, props):
        hs = [torch.tensor([[v]]) for v in t]  # [1, 1, 2]
        for r in (1, 2):
            acc.update(r, hs[r - 1], hs[r], torch.tensor([[o[r - 1]]]))
    res = acc.result()
    assert res["step"] == [1, 2] and res["tokens"] == 2
    cos = lambda a, b: sum(x * y for x, y in zip(a, b)) / math.hypot(*a) / math.hypot(*b)  # noqa: E731
    assert res["cosine"][0] == pytest.approx((cos([1, 1], [1, 0]) + cos([0, 4], [0, 2])) / 2)
    assert res["cosine"][1] == pytest.approx((cos([2, 1], [1, 1]) + cos([0, 7], [0, 4])) / 2)
    assert res["proposal_cosine"][0] == pytest.approx((cos([0, 1], [1, 0]) + cos([1, 0], [0, 2])) / 2)
    assert res["proposal_cosine"][1] == pytest.approx((cos([1, -1], [1, 1]) + cos([0, -3], [0, 4])) / 2)
    assert res["delta_cosine"] == [None, pytest.approx(0.5)]
    assert res["delta_ratio"] == [None, pytest.approx(math.sqrt((1 + 9) / (1 + 4)))]
    with pytest.raises(ValueError, match="in order"):
        SuccessiveStates().update(2, hs[0], hs[1])


# ------------------------------------------------------------------------------------------- gate vs difficulty
def test_gate_difficulty_perfect_line_and_independent_data():
    loss = torch.linspace(0.5, 9.5, 100, dtype=torch.float64)
    out = gate_difficulty(0.9 - 0.01 * loss, loss)
    assert out["pearson_r"] == pytest.approx(-1.0, abs=1e-12) and out["r2"] == pytest.approx(1.0, abs=1e-12)
    assert out["slope"] == pytest.approx(-0.01, abs=1e-9) and out["intercept"] == pytest.approx(0.9, abs=1e-9)
    assert out["tokens"] == 100 and out["bins"]["tokens"] == [10] * 10
    first = loss[:10]
    assert out["bins"]["loss_mean"][0] == pytest.approx(first.mean().item())
    assert out["bins"]["gate_mean"][0] == pytest.approx((0.9 - 0.01 * first).mean().item(), abs=1e-12)
    gen = torch.Generator().manual_seed(4)
    noise = gate_difficulty(torch.rand(20000, generator=gen), torch.randn(20000, generator=gen).exp())
    assert noise["r2"] < 1e-3  # |r| ~ 1/sqrt(n) = 0.007
    assert gate_difficulty(torch.ones(10), torch.arange(10.0))["pearson_r"] is None  # a constant gate
    with pytest.raises(ValueError, match="same tokens"):
        gate_difficulty(torch.ones(3), torch.ones(4))


def test_token_gate_mean_over_steps_and_features():
    gates = TokenGateMean()
    g1 = torch.tensor([[[0.2, 0.4], [1.0, 0.8]]])  # [1, 2 tokens, 2 features]: token means 0.3, 0.9
    g2 = torch.tensor([[[0.5, 0.5], [0.6, 0.6]]])  # 0.5, 0.6
    gates.update(1, g1)
    gates.update(2, g2)
    assert torch.allclose(gates.values(), torch.tensor([0.4, 0.75]))
    out = gate_difficulty_by_step(gates, torch.tensor([1.0, 3.0]))
    assert out["step"] == [1, 2] and out["pearson_r"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert out["all_steps"]["slope"] == pytest.approx((0.75 - 0.4) / 2)


# ------------------------------------------------------------------------------------------ relative improvement
def test_relative_improvement_on_a_hand_table():
    out = relative_improvement([2, 0, 3, 1], [3.0, 5.0, 2.7, 4.0])  # unsorted on purpose
    assert out["step"] == [1, 2, 3] and out["from_exit"] == [0, 1, 2] and out["base_exit"] == 0
    assert out["relative_improvement"] == [pytest.approx(0.2), pytest.approx(0.25), pytest.approx(0.1)]
    assert out["cumulative"] == [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.46)]
    bands = {"exit": [0, 1, 2], "bands": {
        "bytes": {"what": "byte", "tokens": 3, "loss": [4.0, 2.0, 1.5]},
        "rare": {"what": "rare", "tokens": 0, "loss": None}}}
    out = relative_improvement([0, 1, 2], [5.0, 4.0, 3.0], bands)
    assert out["bands"]["bytes"]["relative_improvement"] == [pytest.approx(0.5), pytest.approx(0.25)]
    assert out["bands"]["bytes"]["cumulative"] == [pytest.approx(0.5), pytest.approx(0.625)]
    assert out["bands"]["rare"]["relative_improvement"] is None
    assert relative_improvement([1, 2], [0.0, 1.0])["relative_improvement"] == [None]


# ------------------------------------------------------------------------------------------------------- plots
def test_plots_draw_their_data(tmp_path, monkeypatch):
    """Each figure drew, value for value, the matrices and series it was given (read back from the figure's
    artists), and its PNG decodes at the figure's size: a plot that draws nothing, or the wrong data, fails."""
    figs = capture_figures(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    states = [torch.randn(30, 8, generator=gen) for _ in range(3)]
    within = cka_matrix(states)
    cross = cross_cka(states, [torch.randn(30, 8, generator=gen) for _ in range(4)])
    acc, sample, gates = SuccessiveStates(), TokenSample(30), TokenGateMean()
    for r in range(3):
        sample.add(r, states[r])
    for r in (1, 2):
        acc.update(r, states[r - 1][None], states[r][None], states[0][None])
        gates.update(r, torch.rand(1, 30, 8, generator=gen))
    bands = {"exit": [0, 1, 2], "bands": {"bytes": {"what": "byte", "tokens": 3, "loss": [4.0, 2.0, 1.5]}}}
    res = {"name": "tiny", "val_tokens": 30, "similarity": acc.result(),
           "effective_rank": effective_rank_by_step(sample),
           "relative_improvement": relative_improvement([0, 1, 2], [5.0, 4.0, 3.0], bands),
           "gate_difficulty": gate_difficulty_by_step(gates, torch.rand(30, generator=gen))}
    paths = [plot_cka(within, cross, tmp_path / "cka.png"), plot_cka(within, None, tmp_path / "cka_within.png"),
             plot_representation(res, tmp_path / "repr.png")]
    assert len(figs) == len(paths)
    for fig, p in zip(figs, paths):
        assert_png_of(fig, p, dpi=100)
    assert_drawn(figs[0], within["cka"], cross["cka"], what="cka")
    stars = [line for ax in figs[0].axes for line in ax.lines if line.get_marker() == "*"]
    best = [(i, b) for i, b in enumerate(cross["best_layer"]) if b is not None]
    assert len(stars) == 1 and list(stars[0].get_xdata()) == [b for _, b in best] and best
    assert_drawn(figs[1], within["cka"], what="cka within")
    rel = res["relative_improvement"]
    assert_drawn(figs[2], res["similarity"]["cosine"], res["effective_rank"]["effective_rank_fraction"],
                 [100 * v for v in rel["relative_improvement"]],
                 [100 * v for v in rel["bands"]["bytes"]["relative_improvement"]],
                 res["gate_difficulty"]["all_steps"]["bins"]["gate_mean"], what="representation")
