"""train.depth_granularity (step | micro_step) and evaluation with the training noise on (exit_states(noise=True)).

- the depth draws against the formula written here (sha256 of the key -> torch.Generator), the step key unchanged;
- the trainer passes each micro-step its own depth and logs them;
- GRT's exit_states with noise against a hand-written loop of Eq. 2 with the same draws; Poisson's noisy start;
- one 2-rank FSDP run over gloo (slow): both ranks run the same depth at every micro-step, and a SIGKILL + resume
  gives the per-step losses of the uninterrupted run exactly.

Run as a script (under torchrun) it is that 2-rank run's worker: ``python tests/test_depth_granularity.py RECIPE NAME
RECORD_DIR`` trains the recipe with micro-step depths and writes, per rank, the n_steps every training forward ran.
"""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import from_dict
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import MoRConfig
from pipeline.model.configs import OuroConfig
from pipeline.model.configs import PoissonConfig
from pipeline.model.configs import RRTConfig

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ the depth formulas, written out here
def key_generator(text: str) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little"))


def grt_depth(seed, step, R, micro=None):
    """r ~ U{1..R} from sha256("depth:seed:step") (per step, the key of every existing run) or ...:micro."""
    text = f"depth:{seed}:{step}" + ("" if micro is None else f":{micro}")
    return int(torch.randint(1, R + 1, (1,), generator=key_generator(text)))


def poisson_depth(seed, step, r, sigma, micro=None):
    """p = Poisson(LogNormal(log r - sigma^2/2, sigma)) + 1 from sha256("poisson-depth:seed:step[:micro]")."""
    gen = key_generator(f"poisson-depth:{seed}:{step}" + ("" if micro is None else f":{micro}"))
    rate = torch.full((1,), float(r), dtype=torch.float64).log_normal_(math.log(r) - sigma ** 2 / 2, sigma,
                                                                       generator=gen)
    return int(torch.poisson(rate, generator=gen)) + 1


def tiny(cls, **kw):
    base = dict(vocab_size=64, block_size=16, d_model=32, n_head=2)
    if issubclass(cls, (GPTConfig, OuroConfig)):
        base["n_layer"] = 2
    else:
        base.update(n_prelude=1, n_core=1, n_coda=1)
    from pipeline.model import build_model

    torch.manual_seed(0)
    return build_model(cls(**{**base, **kw}))


# ---------------------------------------------------------------------------------------------------------- depth
def test_step_granularity_draws_are_unchanged():
    """The default keeps the key sha256("depth:seed:step") of every earlier run, whatever the global RNG holds."""
    grt, poisson = tiny(GRTConfig, n_recurrence=6), tiny(PoissonConfig, n_recurrence=4, depth_sigma=0.5)
    # what the code before depth_granularity existed drew for seed 3, steps 0..19 (run on commit ae5dee0)
    assert [grt.train_depth(3, s) for s in range(20)] == [2, 3, 6, 1, 1, 1, 3, 2, 6, 1, 3, 4, 5, 3, 2, 2, 2, 3, 6, 4]
    for step in range(40):
        torch.manual_seed(1000 + step)
        assert grt.train_depth(3, step) == grt_depth(3, step, 6), step
        assert poisson.train_depth(3, step) == poisson_depth(3, step, 4, 0.5), step


def test_micro_step_draws_are_a_function_of_seed_step_and_micro_step():
    grt, poisson = tiny(GRTConfig, n_recurrence=6), tiny(PoissonConfig, n_recurrence=4, depth_sigma=0.5)
    draws = {}
    for step in range(30):
        for micro in range(8):
            torch.manual_seed(step * micro)  # the global RNG plays no part
            r = grt.train_depth(3, step, micro)
            assert r == grt_depth(3, step, 6, micro)
            assert poisson.train_depth(3, step, micro) == poisson_depth(3, step, 4, 0.5, micro)
            draws[step, micro] = r
    # micro-steps of one step differ (8 draws from U{1..6}: all equal with probability 6^-7)
    assert all(len({draws[s, m] for m in range(8)}) > 1 for s in range(30))
    assert [poisson.train_depth(3, 0, m) for m in range(8)] != [poisson.train_depth(3, 0)] * 8
    # still U{1..R}: chi-squared over 1,200 micro-step draws (df 5, p = 0.001 at 20.5)
    many = [grt.train_depth(5, s, m) for s in range(150) for m in range(8)]
    chi2 = sum((many.count(r) - 200) ** 2 / 200 for r in range(1, 7))
    assert chi2 < 20.5 and set(many) == set(range(1, 7))
    assert [grt.train_depth(4, 7, m) for m in range(8)] != [grt.train_depth(5, 7, m) for m in range(8)]


def test_models_without_a_sampled_depth_ignore_the_micro_step():
    assert tiny(GRTConfig, n_recurrence=5, depth_sampling="fixed").train_depth(1, 2, 3) == 5
    for cls, kw in [(GPTConfig, {}), (MoRConfig, {}), (RRTConfig, {"lora_rank": 2}), (OuroConfig, {})]:
        assert tiny(cls, **kw).train_depth(1, 2, 3) is None, cls.__name__


def record_forward_depths(model) -> list:
    """Every training forward's n_steps, in call order."""
    ran = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: ran.append(kwargs.get("n_steps")) if mod.training
                                    else None, with_kwargs=True)
    return ran


@pytest.mark.parametrize("granularity", ["step", "micro_step"])
def test_the_trainer_runs_and_logs_each_micro_steps_depth(tmp_path, corpus, granularity):
    from conftest import tiny_recipe
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    recipe = tiny_recipe(tmp_path, corpus, {"n_recurrence": 4}, train={
        "grad_accum_steps": 4, "micro_batch_size": 2, "max_steps": 3, "eval_interval": 100,
        "checkpoint_interval": 100, "depth_granularity": granularity})
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    trainer = Trainer(cfg)
    ran = record_forward_depths(trainer.raw_model)
    trainer.fit()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    for step in range(3):
        micro = [None] * 4 if granularity == "step" else range(4)
        want = [grt_depth(cfg.seed, step, 4, m) for m in micro]
        assert ran[4 * step: 4 * step + 4] == want, step
        row = rows[step]
        if granularity == "step":
            assert row["depth"] == want[0] and "depths" not in row
        else:
            assert row["depths"] == want and row["depth"] == pytest.approx(sum(want) / 4)
    if granularity == "micro_step":
        assert any(len(set(r["depths"])) > 1 for r in rows)


# ------------------------------------------------------------------------------------------------ evaluation noise
def draw_noise(shape, sigma):
    """One op's noise as the model draws it: a seed from the global RNG, then sigma * N(0, 1) from a generator."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    return sigma * torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def hand_exit_states(m, idx, n, seed=None):
    """Eq. 2 by hand, noise off (``seed`` None) or with the training noise drawn after torch.manual_seed(seed):
    eps_x on the projection input every step (or on h^(0) with state_noise=init), eps_g in the gate, in the model's
    order. Returns the states after coda + LN_f at r = 0..n and the gate's mean at r = 1..n."""
    from test_model import block
    from test_model import embed
    from test_model import grt_step
    from test_model import ln

    cfg, noise = m.cfg, seed is not None
    if noise:
        torch.manual_seed(seed)
    h_pre = embed(m, idx)
    for b in m.prelude:
        h_pre = block(b, h_pre)
    h = h_pre
    if noise and cfg.state_noise == "init":
        h = h + cfg.sigma_x * torch.randn_like(h)

    def readout(x):
        for b in m.coda:
            x = block(b, x)
        return ln(x, m.ln_f.weight, m.ln_f.bias)

    states, gates = {0: readout(h)}, {}
    for r in range(1, n + 1):
        eps_x = eps_g = 0.0
        if noise:
            if cfg.state_noise == "every_step" and cfg.sigma_x > 0:
                eps_x = draw_noise(h.shape, cfg.sigma_x)
            eps_g = draw_noise(h.shape, cfg.sigma_g)  # a seed is drawn even at sigma_g = 0, as in training
        h, g = grt_step(m, h, h_pre, eps_x, eps_g)
        states[r], gates[r] = readout(h), g.mean().item()
    return states, gates


@pytest.mark.parametrize("kw", [{}, {"tau": 0.7, "sigma_x": 0.3, "sigma_g": 0.5}, {"state_noise": "init"}])
def test_grt_exit_states_with_and_without_noise_equal_the_hand_written_loop(kw):
    from test_model import small_grt

    m = small_grt(**kw).eval()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    want, want_gates = hand_exit_states(m, idx, 4, seed=11)
    want_clean, want_clean_gates = hand_exit_states(m, idx, 4)
    with torch.no_grad():
        torch.manual_seed(11)
        gates, clean_gates = {}, {}
        got = dict(m.exit_states(idx, range(5), gates, noise=True))
        torch.manual_seed(11)
        without_gates = dict(m.exit_states(idx, [2, 4], noise=True))  # asking for gates changes no draw
        clean = dict(m.exit_states(idx, range(5), clean_gates))
    for r in range(5):
        torch.testing.assert_close(got[r], want[r], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(clean[r], want_clean[r], rtol=1e-10, atol=1e-10)
    for r in range(1, 5):
        assert gates[r] == pytest.approx(want_gates[r], rel=1e-6)  # the noisy gate's mean (float32)
        assert clean_gates[r] == pytest.approx(want_clean_gates[r], rel=1e-6)
    for r in (2, 4):
        assert torch.equal(without_gates[r], got[r])
    assert (got[4] - clean[4]).abs().max() > 1e-3  # the noise is really on


def test_grt_exit_states_noise_is_seeded_and_vanishes_at_sigma_zero():
    from test_model import small_grt

    m = small_grt().eval()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        runs = []
        for seed in (5, 5, 6):
            torch.manual_seed(seed)
            runs.append(dict(m.exit_states(idx, [3], noise=True))[3])
        assert torch.equal(runs[0], runs[1]) and not torch.allclose(runs[0], runs[2])
        off_gates, on_gates = {}, {}
        off = dict(m.exit_states(idx, range(4), off_gates))
        m.cfg.sigma_x = m.cfg.sigma_g = 0.0  # the same model with no noise to draw
        on = dict(m.exit_states(idx, range(4), on_gates, noise=True))
    for r in range(4):
        torch.testing.assert_close(on[r], off[r], rtol=1e-12, atol=1e-12)
    assert {r: float(g) for r, g in on_gates.items()} == pytest.approx({r: float(g) for r, g in off_gates.items()},
                                                                        rel=1e-12)


def test_poisson_exit_states_with_noise_start_from_the_training_draw():
    from test_model_poisson import batch
    from test_model_poisson import reference_loss
    from test_model_poisson import small
    from test_model_poisson import trunc_normal_state

    m = small().eval()
    idx, tgt = batch(m)
    std = math.sqrt(2 / (5 * m.cfg.d_model))
    with torch.no_grad():
        torch.manual_seed(21)
        got = dict(m.exit_states(idx, [0, 1, 3], noise=True))
        clean = dict(m.exit_states(idx, [0]))
    torch.manual_seed(21)
    h0 = trunc_normal_state((*idx.shape, m.cfg.d_model), std)
    for e in (0, 1, 3):
        want_logits, _ = reference_loss(m, idx, tgt, e, h0)
        torch.testing.assert_close(m.lm_head(got[e]), want_logits, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got[0], clean[0])


def test_only_the_noisy_types_accept_eval_noise():
    from pipeline.model.configs import MODEL_CONFIGS
    from pipeline.model.registry import NOISY_TYPES

    idx = torch.randint(0, 64, (1, 8))
    kw = {"rrt": {"lora_rank": 2}}
    for name, cls in MODEL_CONFIGS.items():
        m = tiny(cls, **kw.get(name, {})).eval()
        with torch.no_grad():
            if name in NOISY_TYPES:
                assert len(list(m.exit_states(idx, [1], noise=True))) == 1
            else:
                with pytest.raises(ValueError, match=f"model.type={name} has no inference noise"):
                    list(m.exit_states(idx, [1], noise=True))
    assert set(NOISY_TYPES) == {"grt", "poisson"}  # the two trained with noise (state/gate noise, random start)


# ----------------------------------------------------------------------------------- two ranks, kill and resume
STEPS, CKPT_EVERY, KILL_AFTER, ACCUM = 6, 3, 5, 4  # 2 ranks x 2 micro-steps; killed 2 steps past the checkpoint


def launch(recipe: Path, name: str, record: Path, **env) -> subprocess.CompletedProcess:
    from conftest import free_port
    from conftest import subprocess_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), str(recipe), name, str(record)]
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=300)


def recorded(record: Path, rank: int) -> dict[int, list]:
    """{step: n_steps of each training forward} as rank ``rank`` ran them (a resumed step: the last time)."""
    out = {}
    for line in (record / f"rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["ran"]
    return out


@pytest.mark.slow
def test_two_ranks_run_the_same_micro_step_depths_and_resume_exactly(tmp_path):
    """FSDP over gloo, 2 ranks x 2 micro-steps: what each rank's forwards ran is recorded; a rank on another depth
    would call other modules (here gloo fails at once). Killed after step 5, resumed from step 3: exact losses."""
    from conftest import launched_recipe
    from conftest import step_losses
    from resume_check import assert_resumed

    recipe = launched_recipe(tmp_path, max_steps=STEPS, checkpoint_interval=CKPT_EVERY, eval_interval=100,
                             grad_accum_steps=ACCUM, collective_timeout_s=30)
    full_rec, killed_rec = tmp_path / "rec-full", tmp_path / "rec-killed"
    p = launch(recipe, "full", full_rec)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = launch(recipe, "killed", killed_rec, GRT_FAULT_KILL_AT_STEP=str(KILL_AFTER))
    assert p.returncode != 0 and max(step_losses(tmp_path / "runs" / "killed")) == KILL_AFTER
    resumed = launch(recipe, "killed", killed_rec)  # resumes from the checkpoint at step 3
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    seed, R = 7, 3  # tiny_recipe's seed and n_recurrence
    rows = {}
    for line in (tmp_path / "runs" / "full" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            rows[row["step"]] = row
    for rec in (full_rec, killed_rec):
        ranks = [recorded(rec, 0), recorded(rec, 1)]
        assert ranks[0] == ranks[1]  # every rank, every micro-step: the same depth
        for step in range(1, STEPS + 1):
            want = [grt_depth(seed, step - 1, R, m) for m in range(ACCUM // 2)]  # micro-steps of this rank
            assert ranks[0][step] == want, step
            assert rows[step]["depths"] == want
    assert any(len(set(rows[s]["depths"])) > 1 for s in rows)  # depths did change within a step
    # exact losses, fp32 on CPU
    assert_resumed(resumed.stdout, CKPT_EVERY, STEPS, tmp_path / "runs" / "killed",
                   step_losses(tmp_path / "runs" / "full"), on="fsdp x2")


def _worker(recipe: str, name: str, record_dir: str) -> None:
    """Train ``recipe`` on FSDP with micro-step depths; append each step's recorded forwards to RECORD/rank<r>.jsonl."""
    train_recording_depths(recipe, record_dir, [f"name={name}", "train.backend=fsdp",
                                                "train.depth_granularity=micro_step"])


def train_recording_depths(recipe: str, record_dir: str, overrides: list[str]) -> None:
    """Train ``recipe`` with ``overrides`` (a rank of a torchrun job); append each step's training forwards' depths to
    RECORD/rank<r>.jsonl (test_curriculum's 2-rank run uses it too)."""
    from pipeline.config import load_recipe
    from pipeline.train.callbacks import Callback
    from pipeline.train.trainer import Trainer

    trainer = Trainer(load_recipe(recipe, overrides))
    ran = record_forward_depths(trainer.raw_model)
    Path(record_dir).mkdir(exist_ok=True)
    out = open(Path(record_dir) / f"rank{trainer.backend.rank}.jsonl", "a")

    class Record(Callback):
        def on_step_end(self, trainer, metrics):
            out.write(json.dumps({"step": metrics["step"], "ran": ran[:]}) + "\n")
            out.flush()  # a SIGKILLed run keeps its finished steps
            ran.clear()

    trainer.callbacks.append(Record())
    trainer.fit()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
