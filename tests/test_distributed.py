"""Distributed training on this CPU: 2 processes over gloo, launched with torchrun exactly as a user would.

- equivalence: with the same global batch, ddp, fsdp (with and without activation checkpointing, which is checked to
  recompute every recurrence step) and DeepSpeed ZeRO 1/2/3 give the losses, gradient norms and final weights of one
  process;
- exact resume: SIGKILL between checkpoints, start again: the second run says it resumed at the checkpoint and trains
  only the steps after it, with per-step losses equal to an uninterrupted run's, for single, ddp, fsdp (also with
  activation checkpointing) and ZeRO 1, 2 and 3; a ddp checkpoint resumes under fsdp, ZeRO-1 on another world size;
- SIGTERM and SIGINT save and exit 143 / 130, and the run resumes exactly;
  a dying rank makes the other fail within the collective timeout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import resume_check
from conftest import free_port
from conftest import launched_recipe
from conftest import printed_steps
from conftest import step_losses
from conftest import step_values
from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]
STEPS, CKPT_EVERY, KILL_AFTER = 20, 8, 11  # kill once step 11 is logged: 3 steps past the checkpoint at 8
BACKENDS = {
    "single": ["train.backend=single"],
    "ddp": ["train.backend=ddp"],
    "fsdp": ["train.backend=fsdp"],
    "fsdp_ckpt": ["train.backend=fsdp", "train.activation_checkpointing=core_step"],
    "zero1": ["train.backend=deepspeed", "train.zero_stage=1"],
    "zero2": ["train.backend=deepspeed", "train.zero_stage=2"],
    "zero3": ["train.backend=deepspeed", "train.zero_stage=3"],
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    path = launched_recipe(tmp, max_steps=STEPS, checkpoint_interval=CKPT_EVERY, eval_interval=10, grad_accum_steps=4,
                           collective_timeout_s=30)
    return tmp, path


COUNTED = ("fsdp", "fsdp_ckpt")  # launched through tests/forward_count_worker.py: recurrence steps counted


def command(backend: str, recipe: Path, name: str, count_forwards: bool = False) -> list[str]:
    """`grt train` (with ``count_forwards``, the same command through tests/forward_count_worker.py) for ``backend``:
    one process for single, torchrun with 2 processes otherwise."""
    entry = [str(REPO / "tests" / "forward_count_worker.py")] if count_forwards else ["-m", "pipeline.cli"]
    args = [*entry, "train", str(recipe), f"name={name}", *BACKENDS[backend]]
    if backend == "single":
        return [sys.executable, *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port())]
    return torchrun + args


def run(backend: str, recipe: Path, name: str, timeout: int = 600, count_forwards: bool = False,
        **env: str) -> subprocess.CompletedProcess:
    p = subprocess.run(command(backend, recipe, name, count_forwards), cwd=REPO, env=subprocess_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def where(backend: str) -> str:
    """How the start-up line names the backend and world size: ``fsdp x2``, ``deepspeed x2``, ``single x1``."""
    name = next(o.split("=")[1] for o in BACKENDS[backend] if o.startswith("train.backend="))
    return f"{name} x{1 if backend == 'single' else 2}"


def assert_resumed(p: subprocess.CompletedProcess, step: int, backend: str, steps: int = STEPS) -> None:
    """The run started from the checkpoint of ``step`` on ``backend`` and trained exactly the steps after it, up to
    ``steps`` (resume_check.assert_resumed; the callers compare the losses)."""
    resume_check.assert_resumed(p.stdout, step, steps, on=where(backend))


@pytest.fixture(scope="module")
def uninterrupted(setup):
    tmp, recipe = setup
    for backend in BACKENDS:
        env = {}
        if backend in COUNTED:
            env["GRT_TEST_FORWARDS_DIR"] = str(tmp / f"forwards-{backend}")
            (tmp / f"forwards-{backend}").mkdir()
        run(backend, recipe, f"full-{backend}", count_forwards=backend in COUNTED, **env)
    return {b: step_losses(tmp / "runs" / f"full-{b}") for b in BACKENDS}


@pytest.fixture(scope="module")
def final_weights(setup, uninterrupted):
    """The weights of each backend's last checkpoint, read the way `grt eval` reads them (any format: full, DCP
    shards, DeepSpeed ZeRO files)."""
    from pipeline.train.trained import load_trained

    tmp, _ = setup
    return {b: load_trained(tmp / "runs" / f"full-{b}", device="cpu")[0].state_dict() for b in BACKENDS}


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "fsdp_ckpt", "zero1", "zero2", "zero3"])
def test_same_losses_grad_norms_and_weights_as_one_process(setup, uninterrupted, final_weights, backend):
    """Same global batch, same samples, same depths, same noise: only the reduction order differs (fp32). The losses
    alone miss a wrong gradient scale: AdamW divides it out, and every step here is clipped to norm 1 (the norms are
    1.1-1.8), so gradients summed over the ranks instead of averaged (doubled) give the same updates and all 20
    losses within 1e-5 (tried). So the gradient norm before clipping is compared at every step too (doubled: relative
    error 1), and the final weights, read from each backend's last checkpoint as `grt eval` reads them.

    Tolerances, measured here (fp32 sums in another order; a run repeats bit for bit): grad norms at step 1, from the
    same initial weights, within 3e-6 relative; then the weights drift apart (AdamW's normalised step magnifies the
    relative error of tiny gradient entries) and the norms with them, at most 2e-7 (ddp), 1.2e-4 (fsdp) and 2.6e-4
    (ZeRO) by step 20: 1e-3 leaves 4x. Final weights: at most 2e-6 apart (ZeRO; ddp 5e-7), ~1/500 of one step's
    update (lr 1e-3): 1e-5 absolute."""
    tmp, _ = setup
    single, other = uninterrupted["single"], uninterrupted[backend]
    assert sorted(other) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert other[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5), step
    norms = {b: step_values(tmp / "runs" / f"full-{b}", "grad_norm") for b in ("single", backend)}
    assert sorted(norms[backend]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert norms[backend][step] == pytest.approx(norms["single"][step], rel=1e-3), step
    ref, got = final_weights["single"], final_weights[backend]
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.allclose(got[name], t, rtol=0, atol=1e-5), (name, (got[name] - t).abs().max().item())


def test_activation_checkpointing_recomputes_each_recurrence_step_under_fsdp(setup, uninterrupted):
    """fsdp with ``activation_checkpointing=core_step`` gives the losses of one process (above), and so would a
    checkpointing that does nothing: here each use of the recurrence step runs its forward twice with it (the
    forward, then the recomputation in backward) and once without. Reference: the depth r each step logged, times
    this rank's micro-batches per step (grad_accum_steps 4 over 2 ranks); validation runs without autograd and is not
    counted."""
    tmp, _ = setup
    depths = step_values(tmp / "runs" / "full-fsdp", "depth")
    assert sorted(depths) == list(range(1, STEPS + 1))
    assert step_values(tmp / "runs" / "full-fsdp_ckpt", "depth") == depths
    uses = sum(depths.values()) * 4 // 2
    for backend, per_use in (("fsdp", 1), ("fsdp_ckpt", 2)):
        counts = [json.loads((tmp / f"forwards-{backend}" / f"rank{r}.json").read_text())["forwards"] for r in (0, 1)]
        assert counts == [per_use * uses] * 2, (backend, counts, uses)


@pytest.mark.parametrize("backend", ["single", "ddp", "fsdp", "fsdp_ckpt", "zero1", "zero2", "zero3"])
def test_sigkill_and_resume_continue_exactly(setup, uninterrupted, backend):
    tmp, recipe = setup
    name = f"killed-{backend}"
    run_dir = tmp / "runs" / name
    # every rank SIGKILLs itself right after step 11 is logged (GRT_FAULT_KILL_AT_STEP): between checkpoints
    p = subprocess.run(command(backend, recipe, name), cwd=REPO,
                       env=dict(subprocess_env(), GRT_FAULT_KILL_AT_STEP=str(KILL_AFTER)),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode != 0
    assert max(step_losses(run_dir)) == KILL_AFTER
    assert STEPS not in step_losses(run_dir)
    assert [c.name for c in (run_dir / "checkpoints").iterdir()] == [f"step_{CKPT_EVERY:08d}"]
    p = run(backend, recipe, name)  # starts again from the checkpoint at step 8
    assert_resumed(p, CKPT_EVERY, backend)
    resumed, full = step_losses(run_dir), uninterrupted[backend]
    assert sorted(resumed) == list(range(1, STEPS + 1))  # one history: the killed run's steps 9..11 were cut back
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert resumed[step] == full[step], (step, resumed[step], full[step])  # exact, fp32 on CPU


@pytest.mark.parametrize("backend, sig", [("single", "SIGTERM"), ("ddp", "SIGTERM"), ("single", "SIGINT"),
                                          ("fsdp", "SIGINT"), ("zero1", "SIGINT")])
def test_a_signal_saves_a_checkpoint_and_exits_with_its_status(setup, uninterrupted, backend, sig):
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C: the terminal signals the whole process group, so under torchrun each
    rank gets it twice, once directly and once passed on by torchrun) to every process: each rank saves at the same
    step and exits non-zero; the same command then resumes exactly."""
    tmp, recipe = setup
    name = f"{sig.lower()}-{backend}"
    run_dir = tmp / "runs" / name
    proc = subprocess.Popen(command(backend, recipe, name), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run_dir / "metrics.jsonl").is_file() and
                                          len(step_losses(run_dir)) >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, getattr(signal, sig))
    out, _ = proc.communicate(timeout=120)
    if backend == "single":  # 128 + the signal number (torchrun reports the signal it got itself with its own code)
        assert proc.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    else:
        assert proc.returncode != 0, out[-3000:]
    steps = sorted(step_losses(run_dir))
    assert steps[-1] < STEPS, "the run ended before the signal arrived: nothing was interrupted"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts[-1] == f"step_{steps[-1]:08d}", (ckpts, steps[-1])
    assert f"{sig}: saved step {steps[-1]} " in out, out[-3000:]
    assert_resumed(run(backend, recipe, name), steps[-1], backend)  # from the signal's checkpoint
    resumed, full = step_losses(run_dir), uninterrupted[backend]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(steps[-1] + 1, STEPS + 1):
        assert resumed[step] == full[step], (step, resumed[step], full[step])


def test_a_dying_rank_stops_the_other_with_a_clear_error(setup):
    tmp, recipe = setup
    t0 = time.time()
    p = subprocess.run(command("ddp", recipe, "dying") + ["train.max_steps=100000"], cwd=REPO,
                       env=dict(subprocess_env(), GRT_FAULT_KILL_AT_STEP="3", GRT_FAULT_KILL_RANK="1"),
                       capture_output=True, text=True, timeout=120)
    assert time.time() - t0 < 90  # bounded (collective timeout 30 s here), not a hang
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "Signal 9 (SIGKILL) received by PID" in out, out[-3000:]  # the launcher names the rank that died
    assert max(step_losses(tmp / "runs" / "dying")) == 3


def test_a_kill_during_a_checkpoint_save_leaves_the_previous_one_loadable(setup, uninterrupted):
    tmp, recipe = setup
    name = "killed-in-save"
    run_dir = tmp / "runs" / name
    p = subprocess.run(command("single", recipe, name), cwd=REPO,
                       env=dict(subprocess_env(), GRT_FAULT_KILL_IN_SAVE="16"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    ckpts = sorted(q.name for q in (run_dir / "checkpoints").iterdir())
    assert ckpts == [".tmp_step_00000016", "step_00000008"]  # the half-saved one never got its final name
    assert_resumed(run("single", recipe, name), CKPT_EVERY, "single")
    resumed = step_losses(run_dir)
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert resumed[step] == uninterrupted["single"][step]


def test_non_finite_steps_are_skipped_then_the_run_stops(setup):
    tmp, recipe = setup
    name = "nan"
    p = subprocess.run(command("ddp", recipe, name) + ["train.max_bad_steps=3"], cwd=REPO,
                       env=dict(subprocess_env(), GRT_FAULT_NAN_STEPS="5,12,13,14"), capture_output=True, text=True,
                       timeout=300)
    rows = [json.loads(line) for line in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]
    by_step = {r["step"]: r for r in rows}
    assert not by_step[5]["finite"] and by_step[6]["finite"] and by_step[6]["skipped_steps"] == 1  # skipped, on
    assert max(by_step) == 14 and p.returncode != 0  # the third non-finite step in a row stops the run
    assert "3 non-finite steps in a row (the last at step 14)" in p.stderr
    assert "Last good checkpoint: " in p.stderr and "step_00000008" in p.stderr


def test_eval_reads_checkpoints_of_every_backend(setup, uninterrupted):
    from pipeline.eval.stage import evaluate
    from pipeline.train.convert import convert

    tmp, _ = setup
    losses = {b: evaluate(tmp / "runs" / f"full-{b}", quiet=True)["loss"] for b in ("single", "fsdp", "zero3")}
    for b in ("fsdp", "zero3"):  # the same weights (to reduction order), read from a full or a sharded checkpoint
        assert losses[b] == pytest.approx(losses["single"], rel=1e-4)
    # ZeRO-3 shards -> one safetensors file / one full state.pt: the same weights without DeepSpeed's topology
    for to in ("safetensors", "full"):
        out = convert(tmp / "runs" / "full-zero3", to)
        assert evaluate(out, quiet=True)["loss"] == losses["zero3"], to


def test_deepspeed_resumes_on_another_world_size_through_the_universal_checkpoint(setup, uninterrupted):
    """A ZeRO-1 or ZeRO-2 checkpoint written by 2 ranks resumes on 1 (DeepSpeed's universal checkpoint) and trains on
    with the 2-rank run's losses (measured: 1e-7 relative); ZeRO-3, whose universal loading does not restore the
    optimizer state in the installed DeepSpeed, is refused with the reason."""
    import shutil

    import deepspeed

    tmp, recipe = setup
    for stage in (1, 2, 3):
        name = f"zero{stage}-2to1"
        shutil.copytree(tmp / "runs" / f"full-zero{stage}", tmp / "runs" / name)
        for later in (16, 20):  # back to the state after step 8, as if the job had stopped there
            shutil.rmtree(tmp / "runs" / name / "checkpoints" / f"step_{later:08d}")
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                            str(free_port()), "-m", "pipeline.cli", "train", str(recipe), f"name={name}",
                            *BACKENDS[f"zero{stage}"]], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                           timeout=600)
        if stage == 3:
            assert p.returncode != 0
            assert (f"written by 2 ranks with ZeRO-3, and DeepSpeed {deepspeed.__version__}'s universal checkpoint "
                    f"does not restore ZeRO-3 optimizer state") in p.stderr, p.stderr[-3000:]
            continue
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "resumed at step 8 on deepspeed x1" in p.stdout
        assert printed_steps(p.stdout) == list(range(CKPT_EVERY + 1, STEPS + 1))
        resumed, full = step_losses(tmp / "runs" / name), uninterrupted[f"zero{stage}"]
        for step in range(CKPT_EVERY + 1, STEPS + 1):
            assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


def test_a_ddp_checkpoint_resumes_and_trains_on_under_fsdp(setup, uninterrupted):
    """docs/checkpoints.md: a full checkpoint (rank 0's gathered state.pt, ddp's default) loads into single, ddp and
    fsdp at any world size. The ddp run's checkpoint at step 8 resumes under fsdp on 2 ranks, each rank taking its
    shards of the full model and optimizer state, and trains on with the uninterrupted ddp run's losses (1e-5:
    FSDP reduces in another order, as in the equivalence test)."""
    import shutil

    tmp, recipe = setup
    name = "ddp-to-fsdp"
    shutil.copytree(tmp / "runs" / "full-ddp", tmp / "runs" / name)
    for later in (16, 20):  # back to the state after step 8, as if the job had stopped there
        shutil.rmtree(tmp / "runs" / name / "checkpoints" / f"step_{later:08d}")
    assert_resumed(run("fsdp", recipe, name), CKPT_EVERY, "fsdp")
    resumed, full = step_losses(tmp / "runs" / name), uninterrupted["ddp"]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    last = torch.load(tmp / "runs" / name / "checkpoints" / f"step_{STEPS:08d}" / "state.pt", weights_only=False)
    assert last["checkpoint_format"] == "sharded"  # from then on fsdp's own format


@pytest.mark.parametrize("backend", ["fsdp", "zero1"])
def test_a_damaged_newest_checkpoint_falls_back_on_every_rank(setup, uninterrupted, backend):
    """A flipped byte in one rank's shard (DCP) or in DeepSpeed's model states of the newest checkpoint: rank 0
    finds it against the index, moves it aside, and every rank resumes from the checkpoint before, exactly."""
    import shutil

    tmp, recipe = setup
    run_dir = tmp / "runs" / f"damaged-{backend}"
    shutil.copytree(tmp / "runs" / f"full-{backend}", run_dir)
    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    victim = next(newest.rglob("*_1_0.distcp" if backend == "fsdp" else "*model_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    p = subprocess.run(command(backend, recipe, run_dir.name), cwd=REPO, env=subprocess_env(), capture_output=True,
                       text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert f"checkpoint {newest} is damaged" in out and "sha256 differs" in out, out[-3000:]
    assert (run_dir / "checkpoints" / f"damaged_step_{STEPS:08d}").is_dir()
    assert_resumed(p, 2 * CKPT_EVERY, backend)
    resumed, full = step_losses(run_dir), uninterrupted[backend]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(2 * CKPT_EVERY + 1, STEPS + 1):  # retrained from the checkpoint at 16
        assert resumed[step] == full[step], (step, resumed[step], full[step])


def test_deepspeed_starts_beside_a_stale_torch_extension_lock(tmp_path):
    """A run killed while DeepSpeed JIT-builds its shared-memory op leaves torch's build lock behind, and every later
    init used to wait on it forever. The op serves inference only: DeepSpeed's init must neither build it nor wait."""
    ext = tmp_path / "torch_extensions"
    (ext / "deepspeed_shm_comm").mkdir(parents=True)
    (ext / "deepspeed_shm_comm" / "lock").touch()  # what a kill -9 during the build leaves
    code = ("from pipeline.config import TrainConfig\nfrom pipeline.train.backend import build_backend\n"
            "b = build_backend(TrainConfig(backend='deepspeed', device='cpu'))\nb.close()\nprint('initialised')")
    env = subprocess_env(TORCH_EXTENSIONS_DIR=str(ext), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "initialised" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert list((ext / "deepspeed_shm_comm").iterdir()) == [ext / "deepspeed_shm_comm" / "lock"]  # nothing built
