"""bench/train.py's fair compiled baseline (arm d's ``grt_compiled_plain``): the GRT step with its gate update and
state noise as plain torch ops computes the model's function (equal to the reference ops at noise 0, noise of the
configured spread otherwise) and compiles to a graph with no custom op in it, so inductor can fuse the formula."""
import copy

import pytest
import torch

from conftest import load_bench
from ops import gate as gate_ops
from pipeline.model import build_model
from pipeline.model.configs import GRTConfig

bench = load_bench("train", "bench_train")


@pytest.fixture(autouse=True)
def _reset():
    yield
    gate_ops.set_backend("auto")
    torch._dynamo.reset()


def models(sigma: float):
    cfg = GRTConfig(vocab_size=64, block_size=16, d_model=32, n_head=2, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=3, dropout=0.0, sigma_x=sigma, sigma_g=sigma)
    torch.manual_seed(0)
    ref = build_model(cfg).train()
    plain = copy.deepcopy(ref)
    bench.use_plain_formula(plain)
    idx = torch.randint(0, 64, (2, 16))
    return ref, plain, idx, torch.roll(idx, -1, 1)


def loss_and_grads(model, idx, targets):
    _, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("training", [True, False])
def test_plain_step_equals_the_reference_path_at_noise_0(training):
    ref, plain, idx, targets = models(sigma=0.0)
    ref.train(training), plain.train(training)
    gate_ops.set_backend("reference")
    want_loss, want_grads = loss_and_grads(ref, idx, targets)
    got_loss, got_grads = loss_and_grads(plain, idx, targets)
    assert torch.equal(got_loss, want_loss)  # the same float32 formula, op for op
    assert type(plain.recur).__name__ == "PlainFormulaStep" and type(ref.recur).__name__ == "RecurrentStep"
    for n, g in want_grads.items():  # autograd through sigmoid vs the op's hand-written backward: rounding apart
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_plain_noise_has_the_configured_spread():
    """z = 0, h = 1, o = 0: the update is g = sigmoid(eps_g) itself, so logit(h') ~ N(0, sigma^2); the state noise
    of zeros is N(0, sigma^2) itself."""
    n, sigma = 1 << 18, 0.5
    torch.manual_seed(1)
    y = bench.plain_gate_update(torch.zeros(n), torch.ones(n), torch.zeros(n), 1.0, sigma)
    eps = torch.logit(y.double())
    assert abs(eps.mean().item()) < 0.01 and eps.std().item() == pytest.approx(sigma, rel=0.01)
    x = bench.plain_state_noise(torch.zeros(n, dtype=torch.bfloat16), 0.3)
    assert x.dtype == torch.bfloat16 and x.float().std().item() == pytest.approx(0.3, rel=0.01)
    # noise on in training: the loss moves with the seed, and a seed repeats it
    _, plain, idx, targets = models(sigma=0.1)
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        losses.append(plain(idx, targets)[1].item())
    assert losses[0] == losses[1] != losses[2]


def graphs_of(model, idx, targets) -> list:
    """The FX graphs dynamo hands the compiler for the model's recurrence step (forward with noise on)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model.recur.compile(backend=capture)
    model(idx, targets)[1].backward()
    return graphs


def test_compiled_plain_step_has_no_custom_op_in_its_graph():
    ref, plain, idx, targets = models(sigma=0.1)
    gate_ops.set_backend("reference")
    targets_of = [{str(n.target) for g in graphs_of(m, idx, targets) for n in g.graph.nodes} for m in (ref, plain)]
    assert any("grt.gate_update" in t for t in targets_of[0])  # the control: the custom op, opaque to inductor
    assert not any("grt." in t for t in targets_of[1])
    assert {str(torch.sigmoid), str(torch.randn_like)} <= targets_of[1]
