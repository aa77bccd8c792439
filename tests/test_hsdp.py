"""HSDP (``train.fsdp_shard``) on this CPU: 4 gloo ranks as 2 simulated nodes x 2 (two torchrun agents on
127.0.0.1, ``train.fsdp_shard=node``: shard within a node, replicate across the two). Its losses and gradient norms
equal one process's to the tolerance of tests/test_distributed.py's fsdp equivalence, and its checkpoint at step 4
(DCP shards of a 2-D mesh) resumes under flat FSDP on 2 ranks with the losses of the uninterrupted HSDP run; that
flat run's step-6 checkpoint resumes in turn under HSDP with ``train.fsdp_shard=2`` on one agent of 4 ranks."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import resume_check
from conftest import free_port
from conftest import launched_recipe
from conftest import step_losses
from conftest import step_values
from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]
STEPS, CKPT_EVERY = 8, 4


def _train(recipe: Path, name: str, *over: str) -> list[str]:
    return ["-m", "pipeline.cli", "train", str(recipe), f"name={name}", *over]


def _check(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _two_nodes(recipe: Path, name: str, *over: str) -> str:
    """2 torchrun agents x 2 ranks (static rendezvous on 127.0.0.1): LOCAL_WORLD_SIZE=2, WORLD_SIZE=4."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                               *_train(recipe, name, *over)], cwd=REPO, env=subprocess_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        _check(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        outs.append(out)
    return "".join(outs)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hsdp_on_two_nodes_matches_one_process_and_resumes_under_fsdp_on_two_ranks(tmp_path):
    recipe = launched_recipe(tmp_path, max_steps=STEPS, checkpoint_interval=CKPT_EVERY, eval_interval=STEPS,
                             grad_accum_steps=4, collective_timeout_s=60)
    runs = tmp_path / "runs"
    out = _two_nodes(recipe, "hsdp", "train.backend=fsdp", "train.fsdp_shard=node")
    assert "from scratch on fsdp x4 (HSDP: shard 2 x replicate 2) cpu" in out, out[-2000:]
    _check(subprocess.run([sys.executable, *_train(recipe, "single")], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600))
    hsdp, single = step_losses(runs / "hsdp"), step_losses(runs / "single")
    assert sorted(hsdp) == list(range(1, STEPS + 1))
    norms = {n: step_values(runs / n, "grad_norm") for n in ("hsdp", "single")}
    for step in range(1, STEPS + 1):  # test_distributed.py's fsdp tolerances (fp32 sums in another order)
        assert hsdp[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5), step
        assert norms["hsdp"][step] == pytest.approx(norms["single"][step], rel=1e-3), step

    # the checkpoint's DCP table of contents: each tensor in 2 chunks (a shard group of 2, its replica's chunks the
    # same), where flat FSDP over the 4 ranks writes 4
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pipeline.train.checkpoint import SHARDS_DIR

    meta = FileSystemReader(str(runs / "hsdp" / "checkpoints" / f"step_{CKPT_EVERY:08d}" / SHARDS_DIR)).read_metadata()
    chunks = [len(m.chunks) for m in meta.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)
              and m.size and m.size[0] >= 4]
    assert chunks and max(chunks) == 2, chunks

    # the HSDP checkpoint at step 4 resumes under flat FSDP at world size 2 (DCP reshards the 2-D mesh's shards)
    shutil.copytree(runs / "hsdp", runs / "resumed")
    shutil.rmtree(runs / "resumed" / "checkpoints" / f"step_{STEPS:08d}")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), *_train(recipe, "resumed", "train.backend=fsdp",
                                                  f"train.checkpoint_interval={CKPT_EVERY // 2}")],  # also step 6
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    _check(p)
    resume_check.assert_resumed(p.stdout, CKPT_EVERY, STEPS, on="fsdp x2")
    resumed = step_losses(runs / "resumed")
    for step in range(CKPT_EVERY + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(hsdp[step], rel=1e-5, abs=1e-6), step

    # the other way: flat FSDP's step-6 checkpoint (2 ranks) resumes under HSDP with train.fsdp_shard=2 on ONE
    # torchrun agent of 4 ranks (its shard groups of 2 come from the number, not from the node layout)
    again = CKPT_EVERY + CKPT_EVERY // 2
    shutil.copytree(runs / "resumed", runs / "rehsdp")
    shutil.rmtree(runs / "rehsdp" / "checkpoints" / f"step_{STEPS:08d}")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                        str(free_port()), *_train(recipe, "rehsdp", "train.backend=fsdp", "train.fsdp_shard=2")],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    _check(p)
    resume_check.assert_resumed(p.stdout, again, STEPS, on="fsdp x4 (HSDP: shard 2 x replicate 2)")
    rehsdp = step_losses(runs / "rehsdp")
    for step in range(again + 1, STEPS + 1):
        assert rehsdp[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5), step
