"""One precision for the recurrent state on every backend: under bf16 autocast the residual stream and GRT's state h
stay fp32 (the gate updates them in fp32) whether the parameters are held in fp32 (single, DDP), gathered in bf16 by
FSDP2 or cast to bf16 by DeepSpeed's bf16 engine, and the same recipe gives the same losses under ddp and fsdp.

In process (fast): FSDP2 on a 1-rank gloo group and a model with bf16-held parameters against one fp32-parameter
process, every model type. Launched (slow): the backend matrix in bf16 (single; 2 ranks of ddp, fsdp, ZeRO 1/2/3)
against each other and fp32, with exact resume.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from conftest import launched_recipe
from conftest import step_losses
from conftest import step_values
from conftest import subprocess_env
from pipeline.config import TrainConfig
from pipeline.model import build_model
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.train.parallelize import blocks_of
from pipeline.train.parallelize import parallelize

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "state_precision_worker.py"
TINY = dict(vocab_size=97, block_size=16, d_model=32, n_head=2)
MODELS = {
    "gpt": dict(n_layer=2),
    "grt": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3),
    "poisson": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3, backprop_steps=2),
    "mor": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3),
    "rrt": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3, lora_rank=4, lora_alpha=8.0),
    "ouro": dict(n_layer=2, n_recurrence=3),
}


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group in this process (an in-memory store: no port), for FSDP2."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def bf16_step(model_type: str, how: str) -> tuple[float, dict[str, set[torch.dtype]]]:
    """One bf16-autocast forward + backward of the tiny ``model_type`` with its parameters held as ``how`` says:
    ``fp32`` (single / DDP), ``fsdp`` (FSDP2, bf16 param_dtype), ``bf16`` (cast like DeepSpeed's bf16 engine does).
    Returns the loss and the dtypes seen: the last block's output (``stream``) and, with a recurrence step, the
    state it takes and returns (``h_in``, ``h_out``; GRT's h, Poisson's state, ...)."""
    cfg = MODEL_CONFIGS[model_type](type=model_type, **TINY, **MODELS[model_type])
    model = build_model(cfg, seed=7)
    if how == "bf16":
        for p in model.parameters():  # what DeepSpeed's bf16 engine does to the module: parameters only
            p.data = p.data.to(torch.bfloat16)
    tc = TrainConfig(device="cpu", backend="fsdp" if how == "fsdp" else "single", dtype="bfloat16")
    parallelize(model, tc, torch.bfloat16, torch.device("cpu"))
    seen: dict[str, set[torch.dtype]] = {"stream": set(), "h_in": set(), "h_out": set()}
    last = [b for blocks in blocks_of(model).values() for b in blocks][-1]
    last.register_forward_hook(lambda m, args, out: seen["stream"].add(out.dtype))
    if hasattr(model, "recur"):
        def record(m, args, out):
            seen["h_in"].add(args[0].dtype)
            seen["h_out"].add((out[0] if isinstance(out, tuple) else out).dtype)
        model.recur.register_forward_hook(record)
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"] + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the same noise in every run
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.item(), seen


@pytest.mark.parametrize("model_type", list(MODELS))
def test_fsdp_bf16_runs_the_one_process_arithmetic(one_rank_group, model_type):
    """FSDP2 gathers the blocks in bf16 but casts no module input, and keeps the root (embeddings, head, final LN) in
    fp32: at the same weights its bf16 forward is the one-process forward (fp32 parameters under autocast), the
    same dtypes everywhere and the same loss (rel 1e-6: the same arithmetic; before, the stream and h were bf16)."""
    ref_loss, ref = bf16_step(model_type, "fp32")
    loss, got = bf16_step(model_type, "fsdp")
    assert got == ref
    assert loss == pytest.approx(ref_loss, rel=1e-6)


def test_grt_state_is_fp32_whatever_holds_the_parameters(one_rank_group):
    """GRT's state h enters and leaves every recurrence step in fp32 and the stream reaching the coda is fp32, with
    fp32 parameters, FSDP2's bf16 gathers and DeepSpeed-style bf16 parameters alike."""
    for how in ("fp32", "fsdp", "bf16"):
        _, seen = bf16_step("grt", how)
        assert seen == {"stream": {torch.float32}, "h_in": {torch.float32}, "h_out": {torch.float32}}, how


@pytest.mark.parametrize("model_type", list(MODELS))
def test_bf16_held_parameters_keep_the_one_process_dtypes(model_type):
    """DeepSpeed's bf16 engine holds every parameter in bf16: under autocast the embedding still starts an fp32
    stream, so each model sees the dtypes of the fp32-parameter run; the loss moves only by the bf16 rounding of
    the embeddings and LayerNorm parameters (rel 1e-4; measured <= 1e-5 here)."""
    ref_loss, ref = bf16_step(model_type, "fp32")
    loss, got = bf16_step(model_type, "bf16")
    assert got == ref
    assert loss == pytest.approx(ref_loss, rel=1e-4)


# ------------------------------------------------------------------------------------------------ launched, 2 ranks
STEPS, CKPT = 12, 8
# g = sigmoid(6) = 0.9975: each step's update (1 - g)(o - h) is 0.25% of o - h, under bf16's relative rounding step
# (2^-8 = 0.39%), so a bf16 state drops most of it and the losses show it (with the default +4 the tiny model's
# losses move by ~1e-5 either way); lr 3e-3 makes the steps move the weights further
OVERRIDES = ["train.lr=3e-3", "model.gate_bias_init=6"]
BACKENDS = {"single": ["train.backend=single"], "ddp": ["train.backend=ddp"], "fsdp": ["train.backend=fsdp"],
            "zero1": ["train.backend=deepspeed", "train.zero_stage=1"],
            "zero2": ["train.backend=deepspeed", "train.zero_stage=2"],
            "zero3": ["train.backend=deepspeed", "train.zero_stage=3"]}
# Tolerances: the largest relative gap over the 12 steps against ddp in bf16, measured on this 2-core CPU with one
# thread per rank (deterministic there), times 2 for another machine's summation order. Measured (loss, grad norm):
# single 5.5e-6, 5.2e-5 (the same arithmetic, another reduction order: one process sums the 4 micro-batches);
# fsdp 7.8e-6, 1.7e-4 (block parameters gathered in bf16: LayerNorm gains rounded, their gradients in bf16);
# ZeRO-1/2/3 up to 9.1e-5, 3.1e-3 (DeepSpeed's bf16 engine holds every parameter in bf16, embedding and tied head
# included, and steps AdamW from an fp32 master); fp32 single 3.2e-5, 6.2e-4 (bf16's rounding of the matmul
# inputs: smaller than DeepSpeed's bf16-held parameters).
LOSS_TOL = {"single": 1.2e-5, "fsdp": 1.6e-5, "zero1": 2e-4, "zero2": 2e-4, "zero3": 2e-4, "fp32": 7e-5}
NORM_TOL = {"single": 1.2e-4, "fsdp": 3.5e-4, "zero1": 7e-3, "zero2": 7e-3, "zero3": 7e-3, "fp32": 1.3e-3}


def launch(tmp: Path, recipe: Path, backend: str, name: str, *extra: str) -> subprocess.CompletedProcess:
    out = tmp / f"dtypes-{name}"
    out.mkdir(exist_ok=True)
    entry = [str(WORKER), str(out), "train", str(recipe), f"name={name}", *BACKENDS[backend], *OVERRIDES, *extra]
    cmd = ([sys.executable] if backend == "single" else
           [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())])
    p = subprocess.run(cmd + entry, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for rank in range(1 if backend == "single" else 2):
        dtypes = json.loads((out / f"dtypes-rank{rank}.json").read_text())
        assert dtypes == {"h_in": ["torch.float32"], "h_out": ["torch.float32"]}, (backend, rank, dtypes)
    return p


@pytest.mark.slow
def test_bf16_on_every_backend_same_losses_and_norms_fp32_state_exact_resume(tmp_path):
    """The backend matrix in bf16, launched as a user would: single, and 2 ranks of ddp, fsdp and DeepSpeed ZeRO 1, 2
    and 3, with train.dtype=bfloat16, the same recipe; and single in fp32. A forward hook on every rank records h's
    dtype (tests/state_precision_worker.py): the state is fp32 on every backend. Per step, the losses and gradient
    norms agree with ddp's within LOSS_TOL / NORM_TOL (see there: derived from the measured gaps), and with fp32's.
    Exact resume in bf16: each run is copied with its last checkpoint removed and resumed from step 8; the resumed
    steps equal the uninterrupted ones exactly."""
    recipe = launched_recipe(tmp_path, max_steps=STEPS, grad_accum_steps=4, eval_interval=1000,
                             checkpoint_interval=CKPT, keep_checkpoints=2, collective_timeout_s=60)
    runs = tmp_path / "runs"
    losses, norms = {}, {}
    for backend in BACKENDS:
        launch(tmp_path, recipe, backend, backend, "train.dtype=bfloat16")
        losses[backend] = step_losses(runs / backend)
        norms[backend] = step_values(runs / backend, "grad_norm")
        assert sorted(losses[backend]) == list(range(1, STEPS + 1)), backend
        # exact resume: the same run from its checkpoint at step CKPT
        resumed = runs / f"{backend}-resumed"
        shutil.copytree(runs / backend, resumed)
        shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS:08d}")
        p = launch(tmp_path, recipe, backend, f"{backend}-resumed", "train.dtype=bfloat16")
        assert f"resumed at step {CKPT}" in p.stdout, p.stdout[-2000:]
        again = step_losses(resumed)
        assert [again[s] for s in range(CKPT + 1, STEPS + 1)] == \
            [losses[backend][s] for s in range(CKPT + 1, STEPS + 1)], backend
    launch(tmp_path, recipe, "single", "fp32", "train.dtype=float32")
    losses["fp32"], norms["fp32"] = step_losses(runs / "fp32"), step_values(runs / "fp32", "grad_norm")
    ddp_loss, ddp_norm = losses["ddp"], norms["ddp"]
    gaps = {b: (max(abs(losses[b][s] - ddp_loss[s]) / ddp_loss[s] for s in ddp_loss),
                max(abs(norms[b][s] - ddp_norm[s]) / ddp_norm[s] for s in ddp_norm)) for b in LOSS_TOL}
    table = {b: f"loss {lg:.1e} norm {ng:.1e}" for b, (lg, ng) in gaps.items()}
    for b, (loss_gap, norm_gap) in gaps.items():
        assert loss_gap <= LOSS_TOL[b] and norm_gap <= NORM_TOL[b], (b, table)
