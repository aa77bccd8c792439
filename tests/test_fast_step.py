"""The fast GRT step against the plain formulation: the exact algebraic savings (forward and backward), the Triton
gate kernels under TRITON_INTERPRET=1 (CPU; also tests/test_gpu.py's checks on tiny shapes), a kernel build per seed
never, the torch.library ops, and torch.compile without recompiles and without a seed drawn inside the step."""
import copy
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import ops
from ops import gate as gate_ops
from pipeline.model import build_model
from pipeline.model.configs import GRTConfig
from pipeline.model.grt import RecurrentStep
from pipeline.train.parallelize import compile_targets
from test_gpu import SEED_CLASSES
from test_gpu import assert_iid_standard_normal
from test_gpu import check_compiled_training_matches_eager
from test_gpu import check_gate_noise_forward_backward
from test_gpu import check_state_noise_kernel
from test_model import block
from test_model import embed
from test_model import grt_step
from test_model import head_loss

triton = pytest.importorskip("triton")
SHAPES = [(3, 37, 11), (1000,), (2, 1025), (0, 4)]  # odd sizes, a masked tail past one 1024-block, empty


@pytest.fixture
def backend():
    yield gate_ops.set_backend
    gate_ops.set_backend("auto")


def run_op(z, h, o, inv_tau, sigma, seed, dy):
    z, h, o = (t.detach().clone().requires_grad_() for t in (z, h, o))
    y = ops.gate_update(z, h, o, inv_tau, sigma, seed)
    y.backward(dy)
    return y.detach(), z.grad, h.grad, o.grad


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gate_matches_reference_noise_off(shape, dtype, backend):
    torch.manual_seed(0)
    z, h, o, dy = (torch.randn(shape).to(dtype) for _ in range(4))
    seed = torch.tensor(11)
    backend("triton")
    got = run_op(z, h, o, 1 / 0.7, 0.0, seed, dy)
    backend("reference")
    want = run_op(z, h, o, 1 / 0.7, 0.0, seed, dy)
    # by hand, in float64
    g = torch.sigmoid(z.double() / 0.7)
    by_hand = (g * h.double() + (1 - g) * o.double(), dy.double() * (h.double() - o.double()) * g * (1 - g) / 0.7,
               g * dy.double(), (1 - g) * dy.double())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b, c in zip(got, want, by_hand):
        assert a.dtype == dtype and a.shape == torch.Size(shape)
        torch.testing.assert_close(a.double(), c, **tol)
        torch.testing.assert_close(b.double(), c, **tol)


def test_triton_noise_is_iid_normal_block_by_block(backend):
    """The kernels' own noise, over 64 of their blocks and a masked tail: z = 0, h = 1, o = 0 makes the gate update
    g = sigmoid(eps_g) itself, and state noise on zeros is eps_x itself. Each is iid N(0, sigma^2) by
    assert_iid_standard_normal (every block its own draws, no correlation across neighbouring blocks or at lag 1,
    a Kolmogorov-Smirnov test), a function of (seed, index), and another seed draws uncorrelated noise."""
    from ops.gate_triton import BLOCK

    backend("triton")
    n = 64 * BLOCK + 100  # the interpreter runs ~1000x slower than a GPU: a few blocks' worth, not millions
    z, h, o = torch.zeros(n), torch.ones(n), torch.zeros(n)
    g = ops.gate_update(z, h, o, 1.0, 0.5, torch.tensor(7))  # h' = g = sigmoid(0.5 eps)
    assert_iid_standard_normal(torch.logit(g.double()) / 0.5, BLOCK, "gate noise")
    x = ops.state_noise(torch.zeros(n), 0.1, torch.tensor(3)).double() / 0.1
    assert_iid_standard_normal(x, BLOCK, "state noise")
    again = ops.state_noise(torch.zeros(n), 0.1, torch.tensor(3))
    assert torch.equal(again.double() / 0.1, x)  # a function of (seed, index)
    other = ops.state_noise(torch.zeros(n), 0.1, torch.tensor(4)).double() / 0.1
    assert abs((x * other).mean().item()) < 5 / n ** 0.5  # another seed: uncorrelated draws (5 standard errors)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_backward_uses_the_forwards_noise_finite_differences(path, backend):
    """At a fixed seed the op is a smooth function of z, h, o; its gradient must match central differences — which
    holds only if the backward redraws exactly the forward's noise."""
    backend(path)
    torch.manual_seed(1)
    z, h, o, w = (torch.randn(64) for _ in range(4))
    seed = torch.tensor(5)

    def f(z_, h_, o_):
        return (w * ops.gate_update(z_, h_, o_, 1.3, 0.8, seed)).sum().double()

    zz, hh, oo = (t.clone().requires_grad_() for t in (z, h, o))
    f(zz, hh, oo).backward()
    eps = 1e-2
    for grad, which in ((zz.grad, 0), (hh.grad, 1), (oo.grad, 2)):
        for i in (0, 17, 63):
            plus, minus = [z.clone(), h.clone(), o.clone()], [z.clone(), h.clone(), o.clone()]
            plus[which][i] += eps
            minus[which][i] -= eps
            fd = (f(*plus) - f(*minus)).item() / (2 * eps)
            assert grad[i].item() == pytest.approx(fd, rel=2e-2, abs=2e-3)
    # another seed, another noise: the gradient changes
    zz2 = z.clone().requires_grad_()
    (w * ops.gate_update(zz2, h, o, 1.3, 0.8, torch.tensor(6))).sum().backward()
    assert not torch.allclose(zz2.grad, zz.grad)


def test_ops_registered_for_compile():
    """torch.library's own checks: schema, fake (meta) implementation, autograd registration."""
    z, h, o = (torch.randn(4, 8, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.grt.gate_update.default, (z, h, o, 1.0, 0.1, torch.tensor(3)))
    torch.library.opcheck(torch.ops.grt.state_noise.default, (h, 0.1, torch.tensor(3)))


# ------------------------------------------------------------------------------------- the step's exact savings
def small_grt(**kw):
    torch.manual_seed(0)
    cfg = GRTConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=3, sigma_x=0.0, sigma_g=0.0, **kw)
    m = build_model(cfg)
    with torch.no_grad():
        m.recur.gate.fc2.bias.normal_(0.0, 1.0)
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def plain_loss(m, idx, targets, r):
    """The paper's formulation written by hand: concatenations, no precomputed anchor halves."""
    h = embed(m, idx)
    for b in m.prelude:
        h = block(b, h)
    h_pre, x = h, h
    for _ in range(r):
        x, _ = grt_step(m, x, h_pre, 0.0, 0.0)
    return head_loss(m, x, targets)[1]


def test_fast_step_equals_plain_formulation_forward_and_backward():
    m = small_grt().double().train()
    ref = copy.deepcopy(m)
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    _, loss = m(idx, targets, n_steps=3)
    want = plain_loss(ref, idx, targets, 3)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    grads = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    assert set(m.state_dict()) == set(ref.state_dict())  # same parameters, same checkpoint keys


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_fast_path_trains_like_the_plain_formulation_for_20_steps(path, backend):
    backend(path)
    m = small_grt().train()
    ref = copy.deepcopy(m)
    opt_a = torch.optim.AdamW(m.parameters(), lr=3e-3)
    opt_b = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, 1)  # one batch, memorised
    for step in range(20):
        r = 1 + step % 3
        _, a = m(idx, targets, n_steps=r)
        b = plain_loss(ref, idx, targets, r)
        assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-5), step
        for opt, loss in ((opt_a, a), (opt_b, b)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert a.item() < plain_loss(small_grt(), idx, targets, r).item()  # and it did learn


# ------------------------------------------------------------------------------------------------ torch.compile
def test_compile_makes_three_graphs_and_none_across_depths():
    """``apply_compile`` compiles each prelude/coda block and the recurrence step whole, and leaves the loop over r
    eager, so training at depths 1, 2, 3, 1, 2, 3, 6 compiles exactly three graphs, in this order, and nothing after
    r = 2 (a compiled loop would specialise on r: a graph per new depth; no compile: none):
      1. one Block graph, shared by the prelude and the coda block (the same forward; torch 2.13 passes a module's
         parameters into the graph as inputs, so another instance of the class needs no graph of its own);
      2. the step at r = 1 (no anchor terms yet: it computes them from h_pre, which is also its state);
      3. the step at r >= 2 (it takes the anchor terms step 1 returned).
    Three frames, each compiled once. At every step the loss and every gradient equal eager's with the reference
    ops (check_compiled_training_matches_eager, the GPU test's helper, here with the Triton kernels interpreted and
    a backend that records each graph and runs it as it is)."""
    from torch._dynamo.utils import counters

    graphs, runs = [], Counter()

    def recording_backend(gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        kind = ("block" if not any("modules_gate_" in n for n in names) else
                "later steps" if any("anchor" in n for n in names) else "step 1")
        graphs.append(kind)

        def run(*args):
            runs[kind] += 1
            return gm.forward(*args)
        return run

    torch._dynamo.reset()
    counters.clear()
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    fast = check_compiled_training_matches_eager(small_grt(), idx, targets, (1, 2, 3, 1, 2, 3, 6),
                                                 backend=recording_backend, fused="triton")
    frames, stats = dict(counters["frames"]), dict(counters["stats"])
    torch._dynamo.reset()
    assert {type(t).__name__ for t in compile_targets(fast)} == {"Block", "RecurrentStep"}
    assert graphs == ["block", "step 1", "later steps"], graphs
    assert frames == {"total": 3, "ok": 3} and stats["unique_graphs"] == 3, (frames, stats)
    # every compiled piece runs compiled: per forward the Block graph once per prelude and coda block (a block left
    # uncompiled would run eager, unseen above), step 1 once and the later-steps graph r - 1 times
    depths = (1, 2, 3, 1, 2, 3, 6)
    assert runs == {"block": 2 * len(depths), "step 1": len(depths), "later steps": sum(r - 1 for r in depths)}, runs


# ------------------------------------------------------------- the GPU checks, on tiny shapes in Triton's interpreter
def test_state_noise_kernel_interpreted():
    check_state_noise_kernel("cpu", 1 << 14)


def test_gate_noise_forward_backward_and_mixed_dtypes_interpreted():
    check_gate_noise_forward_backward("cpu", [(3, 37, 11), (1025,), (0, 4)])


def specialisations(kernel, args: tuple, seeds, constexprs: dict, do_not_specialize=None) -> set:
    """The specialisation keys Triton's launcher computes for ``kernel(*args, seed)`` at each seed, as it would on
    an sm_90 GPU (Triton's own binder, no GPU needed): one key is one kernel build. ``do_not_specialize``: what
    the kernel declares when None."""
    jit = pytest.importorskip("triton.runtime.jit")
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    from triton.backends.compiler import GPUTarget

    if not hasattr(jit, "create_function_from_signature"):
        pytest.skip("this Triton has no create_function_from_signature; test_gpu.py counts real builds on CUDA")
    if do_not_specialize is None:  # a JITFunction keeps it, the interpreter's wrapper in its kwargs
        do_not_specialize = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
    registry = dict(jit._triton_jit_function_registry)
    try:
        fn = jit.JITFunction(kernel.fn, do_not_specialize=do_not_specialize)
    finally:  # a JITFunction registers itself under the kernel's name: keep the real kernel's entry
        jit._triton_jit_function_registry.clear()
        jit._triton_jit_function_registry.update(registry)
    binder = jit.create_function_from_signature(fn.signature, fn.params, nvidia.CUDABackend(GPUTarget("cuda", 90, 32)))
    return {str(binder(*args, s, **constexprs, debug=False)[1]) for s in seeds}


def test_a_new_seed_never_needs_a_new_kernel_build():
    from ops import gate_triton as gt

    t = torch.zeros(4096)
    cases = {"gate forward": (gt._gate_fwd, (t, t, t, t, 4096, 1.0, 0.1), dict(BLOCK=1024, NOISE=True)),
             "gate backward": (gt._gate_bwd, (t,) * 7 + (4096, 1.0, 0.1), dict(BLOCK=1024, NOISE=True)),
             "state noise": (gt._add_noise, (t, t, 4096, 0.1), dict(BLOCK=1024))}
    for name, (kernel, args, constexprs) in cases.items():
        assert len(specialisations(kernel, args, SEED_CLASSES, constexprs)) == 1, name
        # the control: without do_not_specialize these seeds need three builds (seed == 1, % 16 == 0, others)
        assert len(specialisations(kernel, args, SEED_CLASSES, constexprs, do_not_specialize=[])) == 3, name


def noisy_step():
    torch.manual_seed(0)
    cfg = GRTConfig(vocab_size=97, block_size=8, d_model=16, n_head=2, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=2, sigma_x=0.1, sigma_g=0.1)
    return RecurrentStep(cfg)


def test_compiled_step_takes_its_seeds_and_draws_none():
    """The step compiled whole (fullgraph: no graph break), training mode: no random op in its forward or backward
    ATen graphs (a seed drawn inside becomes inductor's randint, a C++ CPU kernel needing a host compiler on the GPU
    machine), and the noise it adds is the one eager draws from the same global RNG state."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = noisy_step().train()
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    h, h_pre = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    results = []
    for fn in (compiled, step):
        torch.manual_seed(7)
        hh = h.clone().requires_grad_()
        out, _, _ = fn(hh, h_pre, True, seeds=step.draw_seeds(True))
        out.sum().backward()
        results.append((out.detach(), hh.grad))
    torch._dynamo.reset()
    assert len(graphs) == 2, f"expected one forward and one backward graph, got {len(graphs)}"
    random_ops = [str(n.target) for g in graphs for n in g.graph.nodes
                  if any(w in str(n.target) for w in ("rand", "bernoulli", "seed"))]
    assert not random_ops, f"random ops inside the compiled step: {random_ops}"
    ops_used = {str(n.target) for g in graphs for n in g.graph.nodes}
    assert {"grt.state_noise.default", "grt.gate_update.default"} <= ops_used, ops_used  # the noise is there
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.manual_seed(7)
    clean, _, _ = step(h, h_pre, False)
    assert (results[1][0] - clean).abs().max() > 1e-3  # and the noise changed the state


@pytest.mark.slow  # ~25 s with a cold inductor cache: six C++ kernels to build
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor on a CPU needs a C++ compiler")
def test_inductor_generates_no_seed_kernel_for_the_step():
    """The symptom itself: inductor's code for the compiled step (noise on) has no randint kernel. Here on a CPU
    every kernel is C++; on CUDA the seed's would be the only one (tests/test_gpu.py checks there is none)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    step = noisy_step().train()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    # one compile thread: a worker pool costs more to start on 2 busy cores than the few kernels take to build
    with torch.no_grad(), inductor_config.patch(compile_threads=1):
        _, code = run_and_get_code(compiled, torch.randn(1, 8, 16), torch.randn(1, 8, 16), True,
                                   seeds=step.draw_seeds(True))
    torch._dynamo.reset()
    kernels = set(re.findall(r"cpp_fused\w*", "\n".join(code)))
    assert kernels, "no generated kernels captured"
    assert not any("randint" in c for c in code), sorted(kernels)


@pytest.mark.parametrize("kw, per_step", [({}, 2), ({"sigma_x": 0.0}, 1), ({"state_noise": "init"}, 1),
                                          ({"gate": "none"}, 1), ({"sigma_g": 0.0}, 2)])
def test_the_loop_draws_the_seeds_training_always_drew(kw, per_step, monkeypatch):
    """Training draws per step eps_x's seed (every_step, sigma_x > 0), then eps_g's (any gate, even at sigma_g = 0),
    all in the eager loop; evaluation draws none and leaves the global RNG as it was."""
    import pipeline.model.grt as grt

    cfg = GRTConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=3, **{"sigma_x": 0.1, "sigma_g": 0.1, **kw})
    m = build_model(cfg)
    calls = []
    monkeypatch.setattr(grt, "new_seed", lambda: calls.append(1) or torch.tensor(len(calls)))
    idx = torch.randint(0, 97, (2, 16))
    m.train()(idx, idx, n_steps=3)
    assert len(calls) == 3 * per_step
    state = torch.get_rng_state()
    m.eval()(idx, idx, n_steps=3)
    assert len(calls) == 3 * per_step and torch.equal(torch.get_rng_state(), state)


def test_a_model_built_on_meta_first_still_computes():
    """grt.py first imported under `torch.device("meta")` (build_model on meta counts parameters: preflight, the
    checkpoint's tied names) must not leave its noise-off seed on meta, which would send every later forward to the
    op's fake kernel: the logits equal the plain-PyTorch trace of the same steps."""
    code = """
import torch
from pipeline.model.configs import GRTConfig
from pipeline.model import build_model
from pipeline.eval.analyses.dynamics import trace_steps
cfg = GRTConfig(vocab_size=64, block_size=16, d_model=32, n_head=2, n_prelude=1, n_core=1, n_coda=1, n_recurrence=3)
build_model(cfg, device="meta")
m = build_model(cfg).eval()
idx = torch.randint(0, 64, (2, 16))
with torch.no_grad():
    got = m(idx)[0]
    h = [s for *_, s in trace_steps(m, idx, 3)][-1]
    want = m.lm_head(m.readout(h))
print(torch.allclose(got, want, atol=1e-5), bool(torch.isfinite(got).all()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-2000:]
