"""Sharded checkpoints (torch.distributed.checkpoint) on 2-3 gloo processes, launched with torchrun as a user would:

- fsdp writes every rank's own shards; SIGKILL between checkpoints (with async saves) and during a save resume
  exactly (==, fp32 on CPU);
- a sharded checkpoint resumes on another world size and backend (2 -> 1, 2 -> 3, 1 -> 2, fsdp -> ddp): each
  resumed run says so and trains only the steps after the checkpoint, with the losses of the uninterrupted run (1e-5:
  only the reduction order differs);
- `grt checkpoint convert` to full and safetensors: the weights equal the shards read by DCP's own converter, and
  `grt eval` on the outputs gives the run's loss;
- rank 0's peak memory during a save: full gathers the whole state there, sharded only its own share.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import free_port
from conftest import launched_recipe
from conftest import printed_steps
from conftest import step_losses
from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]
STEPS, CKPT_EVERY, KILL_AFTER = 12, 4, 6  # killed once step 6 is logged: 2 steps past the checkpoint at 4

pytestmark = pytest.mark.slow




def launch(recipe: Path, name: str, nproc: int, *overrides: str, port: int, fault: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """`grt train` on ``nproc`` processes (torchrun), or in this one process's way (nproc 0: no launcher)."""
    args = ["-m", "pipeline.cli", "train", str(recipe), f"name={name}", *overrides]
    cmd = [sys.executable, *args] if nproc == 0 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
        *args]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(**(fault or {})), capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def assert_resumed(p: subprocess.CompletedProcess, on: str) -> None:
    """The run started from the checkpoint at step 4 on ``on`` (``fsdp x3``, ...) and trained only the steps after
    it: a run that silently started over would train all of them, to the same losses."""
    assert f"resumed at step {CKPT_EVERY} on {on} " in p.stdout, p.stdout[-3000:]
    assert printed_steps(p.stdout) == list(range(CKPT_EVERY + 1, STEPS + 1)), p.stdout[-3000:]


def checkpoint_rows(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "checkpoint" in r]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    # 6 micro-batches per step: divisible by 1, 2 and 3 ranks
    path = launched_recipe(tmp, max_steps=STEPS, checkpoint_interval=CKPT_EVERY, eval_interval=6, grad_accum_steps=6,
                           collective_timeout_s=60)
    return tmp, path


@pytest.fixture(scope="module")
def uninterrupted(setup):
    tmp, recipe = setup
    launch(recipe, "full-fsdp", 2, "train.backend=fsdp", port=free_port())
    return step_losses(tmp / "runs" / "full-fsdp")


def test_fsdp_writes_shards_and_resumes_exactly_after_kills(setup, uninterrupted):
    tmp, recipe = setup
    step4 = tmp / "runs" / "full-fsdp" / "checkpoints" / "step_00000004"
    assert torch.load(step4 / "state.pt", weights_only=False)["checkpoint_format"] == "sharded"
    assert "model" not in torch.load(step4 / "state.pt", weights_only=False)  # no full state dict anywhere
    assert sorted(p.name for p in (step4 / "model_optim").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # SIGKILL between checkpoints, with async saves: the checkpoint at 4 was published in the background
    killed = tmp / "runs" / "killed-async"
    p = launch(recipe, "killed-async", 2, "train.backend=fsdp", "train.async_checkpoint=true", port=free_port(),
               fault={"GRT_FAULT_KILL_AT_STEP": str(KILL_AFTER)}, check=False)
    assert p.returncode != 0 and max(step_losses(killed)) == KILL_AFTER
    assert sorted(q.name for q in (killed / "checkpoints").iterdir()) == ["step_00000004"]
    assert_resumed(launch(recipe, "killed-async", 2, "train.backend=fsdp", "train.async_checkpoint=true",
                          port=free_port()), "fsdp x2")
    resumed = step_losses(killed)
    assert [resumed[s] == uninterrupted[s] for s in range(CKPT_EVERY + 1, STEPS + 1)] == [True] * (STEPS - CKPT_EVERY)

    # SIGKILL on every rank while the checkpoint of step 8 is being written (shards on disk, not published)
    in_save = tmp / "runs" / "killed-in-save"
    p = launch(recipe, "killed-in-save", 2, "train.backend=fsdp", port=free_port(),
               fault={"GRT_FAULT_KILL_IN_SAVE": "8"}, check=False)
    assert p.returncode != 0
    assert sorted(q.name for q in (in_save / "checkpoints").iterdir()) == [".tmp_step_00000008", "step_00000004"]
    assert_resumed(launch(recipe, "killed-in-save", 2, "train.backend=fsdp", port=free_port()), "fsdp x2")
    assert not list((in_save / "checkpoints").glob(".tmp_*"))  # the interrupted save was swept at the next publish
    resumed = step_losses(in_save)
    assert [resumed[s] == uninterrupted[s] for s in range(CKPT_EVERY + 1, STEPS + 1)] == [True] * (STEPS - CKPT_EVERY)


def test_sharded_checkpoints_reshard_across_world_sizes_and_backends(setup, uninterrupted):
    tmp, recipe = setup
    runs = tmp / "runs"
    launch(recipe, "killed-2", 2, "train.backend=fsdp", port=free_port(),
           fault={"GRT_FAULT_KILL_AT_STEP": str(KILL_AFTER)}, check=False)
    launch(recipe, "killed-1", 0, "train.backend=single", "train.checkpoint_format=sharded", port=0,
           fault={"GRT_FAULT_KILL_AT_STEP": str(KILL_AFTER)}, check=False)
    plans = {  # name: (source run, processes, overrides of the resumed run)
        "2to1-single": ("killed-2", 0, ["train.backend=single"]),
        "2to3-fsdp": ("killed-2", 3, ["train.backend=fsdp"]),
        "fsdp-to-ddp": ("killed-2", 2, ["train.backend=ddp"]),
        "1to2-fsdp": ("killed-1", 2, ["train.backend=fsdp"]),
    }
    for i, (name, (source, nproc, overrides)) in enumerate(plans.items()):
        shutil.copytree(runs / source, runs / name)
        assert [q.name for q in (runs / name / "checkpoints").iterdir()] == ["step_00000004"]
        p = launch(recipe, name, nproc, *overrides, port=free_port())
        assert_resumed(p, f"{overrides[0].split('=')[1]} x{max(nproc, 1)}")
        resumed = step_losses(runs / name)
        assert sorted(resumed) == list(range(1, STEPS + 1))
        for step in range(CKPT_EVERY + 1, STEPS + 1):
            assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-6), (name, step)
        # the resumed run keeps its backend's default format: full for single and ddp
        last = torch.load(runs / name / "checkpoints" / f"step_{STEPS:08d}" / "state.pt", weights_only=False)
        assert last["checkpoint_format"] == ("sharded" if overrides == ["train.backend=fsdp"] else "full"), name


def test_convert_to_full_and_safetensors_loads_in_eval(setup, uninterrupted):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from pipeline.cli import main
    from pipeline.eval.stage import evaluate

    tmp, _ = setup
    run = tmp / "runs" / "full-fsdp"
    shards = run / "checkpoints" / f"step_{STEPS:08d}" / "model_optim"
    dcp_to_torch_save(shards, tmp / "reference.pt")  # DCP's own converter: the independent reading of the shards
    reference = torch.load(tmp / "reference.pt", weights_only=False)
    assert main(["checkpoint", "convert", str(run), "--to", "full"]) == 0
    assert main(["checkpoint", "convert", str(run), "--to", "safetensors", "--out", str(tmp / "st")]) == 0
    full_dir = run / "exports" / f"step_{STEPS:08d}-full"
    full = torch.load(full_dir / "state.pt", weights_only=False)
    tensors = load_file(tmp / "st" / "model.safetensors")
    assert set(full["model"]) == set(reference["model"])
    for name, t in reference["model"].items():
        assert torch.equal(full["model"][name], t), name
        if name != "lm_head.weight":  # tied to embed.wte.weight: stored once
            assert torch.equal(tensors[name], t), name
    assert "lm_head.weight" not in tensors
    # the optimizer state comes along in the full format: the same moments per parameter name
    for name, moments in reference["optimizer"]["state"].items():
        assert torch.equal(full["optimizer"]["state"][name]["exp_avg_sq"], moments["exp_avg_sq"]), name
    losses = {k: evaluate(p, quiet=True)["loss"] for k, p in
              {"sharded": run, "full": full_dir, "safetensors": tmp / "st"}.items()}
    assert losses["full"] == losses["sharded"] and losses["safetensors"] == losses["sharded"]


def test_rank0_memory_during_a_save_full_vs_sharded(setup):
    """One step of a model whose training state (fp32 weights + AdamW moments, 12 bytes per parameter) is ~170 MB,
    saved at world size 2 and 3: full gathers all of it on rank 0, sharded never holds more than its own share."""
    tmp, recipe = setup
    wide = ["model.d_model=256", "model.n_head=4", "model.n_core=2", "train.max_steps=1", "train.eval_interval=100",
            "train.grad_accum_steps=6", "train.checkpoint_interval=1"]
    params = None
    peaks = {}
    for ws in (2, 3):
        for fmt in ("full", "sharded"):
            name = f"rss-{fmt}-{ws}"
            launch(recipe, name, ws, "train.backend=fsdp", f"train.checkpoint_format={fmt}", *wide,
                   port=free_port() + ws * 2 + (fmt == "full"))
            row, = checkpoint_rows(tmp / "runs" / name)
            peaks[(fmt, ws)] = row["rss_peak_over_before_mb"]
            params = params or torch.load(tmp / "runs" / name / "checkpoints" / "step_00000001" / "state.pt",
                                          weights_only=False)["info"]["params"]
    state_mb = 12 * params / 2**20
    print(json.dumps({"train_state_mb": round(state_mb, 1),
                      **{f"{f}@{w}": round(v, 1) for (f, w), v in peaks.items()}}))
    for ws in (2, 3):
        assert peaks[("full", ws)] > 0.8 * state_mb  # the whole state passes through rank 0
        assert peaks[("sharded", ws)] < 1.2 * state_mb / ws  # never more than its own share (+ slack)


def test_a_full_disk_during_an_async_sharded_save_stops_every_rank_and_the_run_resumes(setup, capsys):
    """Rank 1's background write of its shard of step 4 runs out of space (GRT_FAULT_DISK_FULL: ENOSPC inside DCP's
    writer after 4 KiB). The error reaches every rank at the next wait for that save: rank 0 alone says "disk full" in
    one line, no rank prints a traceback, the staging folder is removed, stopped.json names step 2, the job exits
    non-zero; step 2 is intact, and one process resumes from it to step 3's loss (1e-5: 2 ranks -> 1)."""
    from pipeline.config import from_dict
    from pipeline.train.checkpoint import verify_checkpoint
    from pipeline.train.trainer import Trainer

    tmp, recipe = setup
    run = tmp / "runs" / "disk-full"
    short = {"max_steps": 5, "checkpoint_interval": 2, "grad_accum_steps": 2}
    p = launch(recipe, "disk-full", 2, "train.backend=fsdp", "train.async_checkpoint=true",
               *(f"train.{k}={v}" for k, v in short.items()), port=free_port(),
               fault={"GRT_FAULT_DISK_FULL": "4:4096:1"}, check=False)
    assert p.returncode != 0, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "disk full" in line]
    assert len(said) == 1 and said[0].startswith("error: disk full: the checkpoint of step 4 "), p.stderr[-3000:]
    # the only traceback is torchrun's own report that a rank exited 1
    assert all("ChildFailedError" in t for t in p.stderr.split("Traceback (most recent call last):")[1:]), p.stderr
    ckpts = run / "checkpoints"
    assert sorted(q.name for q in ckpts.iterdir()) == ["step_00000002"]  # .tmp_step_00000004 removed
    assert json.loads((run / "stopped.json").read_text())["step"] == 2
    assert verify_checkpoint(ckpts / "step_00000002") == []
    first = step_losses(run)
    assert max(first) >= 4

    r = yaml.safe_load(recipe.read_text())
    r["name"] = "disk-full"
    r["train"].update(short, backend="single", max_steps=3)
    capsys.readouterr()
    Trainer(from_dict(r)).fit()
    assert "resumed at step 2 on single x1 " in capsys.readouterr().out
    assert step_losses(run)[3] == pytest.approx(first[3], rel=1e-5, abs=1e-6)
