"""train.z_loss against a hand formula: c * mean over predicted tokens of logsumexp(logits)^2, the logsumexp taken by
plain torch over the full float64 logits of the real vocabulary (pipeline/model/z_loss.py)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import linear_cross_entropy
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import MoRConfig
from pipeline.model.configs import OuroConfig
from pipeline.model.configs import PoissonConfig
from pipeline.model.configs import RecurrentTransformerConfig
from pipeline.model.configs import RecurTraceConfig
from pipeline.model.configs import RRTConfig
from pipeline.model.layers import head_output
from pipeline.train.callbacks import TrackerCallback
from pipeline.train.callbacks import format_step_line

pytestmark = pytest.mark.usefixtures("one_thread")

C = 0.05  # large enough that a wrong term shows far above float64 rounding


def hand(h, w, t, c):
    """(mean CE + c mean lse^2, per-token CE + c lse^2) from the full float64 logits."""
    logits = h.reshape(-1, h.shape[-1]) @ w.T
    t = t.reshape(-1)
    valid = t != -1
    z = torch.logsumexp(logits, dim=-1).square() * valid
    ce = F.cross_entropy(logits, t, ignore_index=-1, reduction="none")
    return (ce.sum() + c * z.sum()) / valid.sum(), ce + c * z, z


@pytest.mark.parametrize("chunk", [7, None])
def test_fused_op_value_and_gradient_equal_the_hand_formula(chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 19, 16, dtype=torch.double, requires_grad=True)  # 38 rows: chunks end in a partial tail
    w = (3 * torch.randn(50, 16, dtype=torch.double)).requires_grad_()  # lse far from 0: the term matters
    t = torch.randint(0, 50, (2, 19))
    t[0, :4] = -1
    ref_mean, ref_tok, ref_z = hand(h, w, t, C)
    z = torch.empty(t.shape, dtype=torch.double)
    mean = linear_cross_entropy(h, w, t, chunk=chunk, z_loss=C, z_out=z)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z.reshape(-1), ref_z, rtol=1e-12, atol=1e-12)
    ref_grads = torch.autograd.grad(3.0 * ref_mean, (h, w), retain_graph=True)
    for got, ref in zip(torch.autograd.grad(3.0 * mean, (h, w)), ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    tok = linear_cross_entropy(h, w, t, chunk=chunk, reduction="none", z_loss=C)  # Ouro's per-step path
    torch.testing.assert_close(tok.reshape(-1), ref_tok, rtol=1e-12, atol=1e-12)
    g = torch.rand(t.shape, dtype=torch.double)  # a per-token upstream gradient, as Ouro's p_t gives
    for got, ref in zip(torch.autograd.grad((g * tok).sum(), (h, w)),
                        torch.autograd.grad((g.reshape(-1) * ref_tok).sum(), (h, w))):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk=chunk, z_loss=C), ref_mean.detach())
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk=chunk, reduction="none", z_loss=C).reshape(-1),
                                   ref_tok.detach())


def test_padded_vocabulary_head_takes_lse_over_the_real_rows_only():
    torch.manual_seed(1)
    head = nn.Linear(16, 56, bias=False).double()  # 50 real rows + 6 padding rows of model.vocab_multiple
    head.n_vocab = 50
    with torch.no_grad():
        head.weight[50:] = 10.0  # padding that would dominate a logsumexp taken over it
    h = torch.randn(2, 9, 16, dtype=torch.double, requires_grad=True)
    t = torch.randint(0, 50, (2, 9))
    t[1, -2:] = -1
    head.z_loss = C
    _, loss = head_output(head, h, t)
    ref, _, ref_z = hand(h, head.weight[:50], t, C)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(head.z_term, C * ref_z.sum() / (t != -1).sum(), rtol=1e-12, atol=1e-12)
    head.eval()  # validation: pure cross-entropy
    torch.testing.assert_close(head_output(head, h, t)[1], hand(h, head.weight[:50], t, 0.0)[0], rtol=1e-12,
                               atol=1e-12)


def test_z_loss_zero_is_bit_identical_to_no_z_loss():
    torch.manual_seed(2)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(-1, 50, (37,))
    for reduction in ("mean", "none"):
        a = linear_cross_entropy(h, w, t, chunk=5, reduction=reduction)
        b = linear_cross_entropy(h, w, t, chunk=5, reduction=reduction, z_loss=0.0)
        assert torch.equal(a, b)
        ga, gb = torch.autograd.grad(a.sum(), (h, w)), torch.autograd.grad(b.sum(), (h, w))
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))


BASE = dict(vocab_size=60, vocab_multiple=64, block_size=16, d_model=32, n_head=2, dropout=0.0)  # 4 padding rows
CONFIGS = {
    "gpt": GPTConfig(**BASE, n_layer=2),
    "grt": GRTConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=2),
    "poisson": PoissonConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=2),
    "mor": MoRConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=2),
    "rrt": RRTConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=2, lora_rank=4),
    "recurrent_transformer": RecurrentTransformerConfig(**BASE, n_layer=2, tile=4),
    "recurtrace": RecurTraceConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=2),
}


def _loss(model, x, y, n, coef):
    model.lm_head.z_loss = coef
    torch.manual_seed(5)  # GRT's training noise, MoR's routing: the same draw in every forward
    return model(x, y, n_steps=n)[1]


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_training_loss_is_ce_plus_the_hand_z_term(model_type):
    """loss(z_loss=c) = loss(z_loss=0) + c * mean lse^2 of the training forward's own logits, in value and in gradient;
    validation (eval mode) stays the plain loss."""
    torch.manual_seed(0)
    model = build_model(CONFIGS[model_type]).double().train()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of a few nats: the term is far above rounding
    x = torch.randint(0, 60, (2, 16))
    y = torch.randint(0, 60, (2, 16))
    y[0, :3] = -1
    n = model.full_depth(model.cfg)
    plain = _loss(model, x, y, n, 0.0)
    torch.manual_seed(5)
    logits = model(x, n_steps=n)[0]  # the same training forward's logits over the real vocabulary
    valid = y != -1
    z_hand = (torch.logsumexp(logits, -1).square() * valid).sum() / valid.sum()
    assert C * z_hand > 1e-2  # the term is far above the tolerances below
    ref = plain + C * z_hand
    params = [p for p in model.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    got = _loss(model, x, y, n, C)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model.lm_head.z_term, C * z_hand.detach(), rtol=1e-10, atol=1e-12)
    for g, r in zip(torch.autograd.grad(got, params, allow_unused=True), ref_grads):
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-10)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(_loss(model, x, y, n, C), _loss(model, x, y, n, 0.0), rtol=0, atol=0)


def test_ouro_per_step_losses_each_get_the_z_term():
    """Ouro: sum_t p_t (CE_t + c lse_t^2) - beta H(p), so the loss grows by c * mean_tokens sum_t p_t lse_t^2, each
    loop's lse from plain torch over its own full logits."""
    torch.manual_seed(0)
    model = build_model(OuroConfig(**BASE, n_layer=1, n_recurrence=3)).double().train()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    x = torch.randint(0, 60, (2, 16))
    y = torch.randint(0, 60, (2, 16))
    y[1, -4:] = -1
    plain, got = _loss(model, x, y, 3, 0.0), _loss(model, x, y, 3, C)
    with torch.no_grad():
        w = model.lm_head.weight[:60]
        lse2 = torch.stack([torch.logsumexp(s @ w.T, -1).square() for _, s in model.exit_states(x, [1, 2, 3])], -1)
        p = model.exit_distribution(x, 3)
    valid = y != -1
    z_hand = ((p * lse2).sum(-1) * valid).sum() / valid.sum()
    assert C * z_hand > 1e-3
    torch.testing.assert_close(got.detach(), plain.detach() + C * z_hand, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model.lm_head.z_term, C * z_hand, rtol=1e-10, atol=1e-12)


def test_trainer_logs_z_loss_apart_from_the_loss(tmp_path, corpus):
    """One training step with and without z-loss from the same weights and batches: the logged loss is the same
    cross-entropy, and z_loss (c * mean lse^2, lse ~ log V for a fresh model) is logged beside it, to the console
    line and MLflow; without z-loss no z_loss key appears."""
    from conftest import tiny_recipe
    from pipeline.config import from_dict
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    steps = {}
    for coef in (0.0, 0.02):
        cfg = from_dict(tiny_recipe(tmp_path, corpus, name=f"z{coef}", train={"z_loss": coef}))
        tokenize(cfg.data, quiet=True)
        trainer = Trainer(cfg, callbacks=[])
        try:
            trainer.model.train()
            steps[coef] = trainer.train_step()
        finally:
            trainer._release_run_folder()
    off, on = steps[0.0], steps[0.02]
    assert "z_loss" not in off
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6)  # the logged loss stays the cross-entropy
    vocab = cfg.model.vocab_size
    assert on["z_loss"] == pytest.approx(0.02 * torch.tensor(vocab).log().item() ** 2, rel=0.2)
    assert f"z_loss {on['z_loss']:.2e}" in format_step_line({**on, "mfu": None}, 4)
    assert "z_loss" not in format_step_line({**off, "mfu": None}, 4)

    class Tracker:
        logged = {}

        def log_metrics(self, m, step):
            self.logged.update(m)

    TrackerCallback(Tracker()).on_step_end(type("T", (), {"cfg": cfg})(), on)
    assert Tracker.logged["z_loss"] == on["z_loss"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_rank_fsdp_and_deepspeed_train_and_log_z_loss_as_one_process(tmp_path):
    """The coefficient set on the head reaches the loss under FSDP2 and DeepSpeed (ZeRO-1) as in one process: the same
    per-step loss (cross-entropy) and z_loss, and the z term really trained (the losses differ from a run without)."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port
    from conftest import launched_recipe
    from conftest import step_values
    from conftest import subprocess_env

    path = launched_recipe(tmp_path, max_steps=3, checkpoint_interval=100, eval_interval=100, grad_accum_steps=2,
                           collective_timeout_s=30, z_loss=0.05)
    got = {}
    for backend in ("single", "fsdp", "deepspeed", "plain"):
        launch = ([] if backend in ("single", "plain") else
                  ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())])
        extra = ["train.z_loss=0"] if backend == "plain" else [f"train.backend={backend}"]
        p = subprocess.run([sys.executable, *launch, "-m", "pipeline.cli", "train", str(path), f"name={backend}",
                            *extra], cwd=Path(__file__).resolve().parents[1], env=subprocess_env(),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        run_dir = tmp_path / "runs" / backend
        if backend == "plain":  # no z_loss key anywhere, nor on the step line
            assert '"z_loss"' not in (run_dir / "metrics.jsonl").read_text() and "z_loss" not in p.stdout
            got[backend] = step_values(run_dir, "loss"), {}
        else:
            got[backend] = step_values(run_dir, "loss"), step_values(run_dir, "z_loss")
            assert "| z_loss " in p.stdout
    single_loss, single_z = got["single"]
    assert sorted(single_z) == [1, 2, 3] and all(v > 0 for v in single_z.values())
    assert got["plain"][0][1] == pytest.approx(single_loss[1], rel=1e-6)  # step 1: same weights, the same CE logged
    assert got["plain"][0][3] != pytest.approx(single_loss[3], rel=1e-6)  # after updates: the z term was trained
    for backend in ("fsdp", "deepspeed"):
        assert got[backend][0] == pytest.approx(single_loss, rel=1e-5, abs=1e-5)
        assert got[backend][1] == pytest.approx(single_z, rel=1e-5, abs=1e-7)
