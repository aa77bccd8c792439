"""The nodes of one job, as two "nodes" of one rank each on loopback:

- started with different recipes (another train.lr, another model.d_model on node 1), every rank stops before any
  model is built, with one line naming each differing key and which node holds which value;
- a rank killed mid-training (kill -9): the survivor exits non-zero with one line naming the dead rank, its node and
  the last intact checkpoint, and writes stopped.json; no gloo traceback;
- a rank frozen (SIGSTOP: its sockets stay open, as NCCL would wait): the survivor's heartbeat watch reports it in the
  same line within train.heartbeat_timeout_s, not the collective timeout;
- a rank that fails with an error (a simulated out of memory): it prints one line, the survivor names that error;
- node 0 (the store's host) killed: the survivor's one line names it, with no C++ stack of torch's store client.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from conftest import launched_recipe
from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]


def two_nodes(recipe: Path, name: str, per_node: list[list[str]], timeout: int = 120, frozen: bool = False,
              **env) -> list:
    """Node 0 and node 1, one rank each, started the way torchrun starts its workers (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, GROUP_RANK = the node rank; rank 0 hosts the store) but without torchrun's agents: half the
    processes to start, and no agent to kill the survivor, as on two real nodes."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", str(recipe), f"name={name}",
                               "train.backend=ddp", *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=subprocess_env(RANK=str(k), WORLD_SIZE="2", LOCAL_RANK="0",
                                                            LOCAL_WORLD_SIZE="1", GROUP_RANK=str(k),
                                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env))
             for k, extra in enumerate(per_node)]
    if not frozen:
        return [(p, *p.communicate(timeout=timeout)) for p in procs]
    first = (procs[0], *procs[0].communicate(timeout=timeout))  # the survivor of a frozen (SIGSTOPped) rank 1
    procs[1].kill()
    return [first, (procs[1], *procs[1].communicate(timeout=timeout))]


def worker_lines(err: str) -> list[str]:
    """The error lines of the rank's stderr."""
    return [line for line in err.splitlines() if line.startswith("error: ")]


def rank_traceback(err: str) -> bool:
    return "Traceback" in err or "gloo" in err


@pytest.mark.slow  # two pairs of ranks started, one killed: ~20 s on a 2-core box
def test_nodes_with_different_recipes_stop_and_a_dead_rank_is_named(tmp_path):
    recipe = launched_recipe(tmp_path, max_steps=40, checkpoint_interval=3, eval_interval=1000, grad_accum_steps=2,
                             collective_timeout_s=60)
    t0 = time.time()
    # node 1 given another learning rate and width than the recipe's (lr 1e-3, d_model 32: tests/conftest.py)
    out = two_nodes(recipe, "mismatch", [[], ["train.lr=0.05", "model.d_model=48"]])
    mismatch_s = time.time() - t0
    for k, (p, stdout, stderr) in enumerate(out):
        assert p.returncode != 0, (k, stdout[-2000:], stderr[-3000:])
        lines = worker_lines(stderr)
        assert len(lines) == 1, (k, stderr[-3000:])
        line = lines[0]
        assert "model.d_model: node 0 (rank 0) = 32, node 1 (rank 1) = 48" in line, line
        assert "train.lr: node 0 (rank 0) = 0.001, node 1 (rank 1) = 0.05" in line, line
        assert not rank_traceback(stderr), stderr[-3000:]
        assert "step " not in stdout  # nothing trained
    assert not (tmp_path / "runs" / "mismatch" / "metrics.jsonl").exists() or \
        (tmp_path / "runs" / "mismatch" / "metrics.jsonl").read_text() == ""

    # rank 1 (node 1) dies like `kill -9` right after step 7 is logged: step 6 is the last checkpoint
    t0 = time.time()
    (p0, out0, err0), (p1, _, err1) = two_nodes(recipe, "dying", [[], []], GRT_FAULT_KILL_AT_STEP="7",
                                             GRT_FAULT_KILL_RANK="1")
    dying_s = time.time() - t0
    print(f"mismatch run {mismatch_s:.1f} s, dying run {dying_s:.1f} s")
    assert p0.returncode == 1 and p1.returncode == -9, (p0.returncode, p1.returncode)
    assert (tmp_path / "runs" / "dying" / "checkpoints").is_dir(), out0[-3000:] + err0[-3000:] + err1[-3000:]
    run = tmp_path / "runs" / "dying"
    ckpt = run / "checkpoints" / "step_00000006"
    assert sorted(c.name for c in (run / "checkpoints").iterdir() if c.name.startswith("step_")) == \
        ["step_00000003", "step_00000006"]
    lines = worker_lines(err0)
    assert len(lines) == 1, err0[-4000:]
    line = lines[0]
    assert "rank 1 (node 1, host " in line and "stopped answering" in line, line
    assert f"last intact checkpoint: step 6 at {ckpt}" in line, line
    assert "Connection reset" not in err0 and not rank_traceback(err0), err0[-4000:]
    stopped = json.loads((run / "stopped.json").read_text())
    assert (stopped["step"], stopped["checkpoint"], stopped["max_steps"]) == (6, str(ckpt), 40)
    assert "rank 1" in stopped["signal"]

    # rank 1 frozen (SIGSTOP: its sockets stay open, so gloo waits as NCCL would) after step 4: the survivor's heartbeat
    # watch (4 s) reports it long before the collective timeout (60 s), with the same line and stopped.json
    t0 = time.time()
    (p0, out0, err0), _ = two_nodes(recipe, "frozen", [["train.heartbeat_timeout_s=4"]] * 2, frozen=True,
                                    GRT_FAULT_KILL_AT_STEP="4", GRT_FAULT_KILL_RANK="1",
                                    GRT_FAULT_KILL_SIGNAL="SIGSTOP")
    frozen_s = time.time() - t0
    run = tmp_path / "runs" / "frozen"
    ckpt = run / "checkpoints" / "step_00000003"
    assert p0.returncode == 1, (p0.returncode, err0[-3000:])
    assert frozen_s < 40, frozen_s  # not the 60 s collective timeout
    lines = worker_lines(err0)
    assert len(lines) == 1 and "rank 1 (node 1, host " in lines[0] and "stopped answering" in lines[0], err0[-3000:]
    assert f"last intact checkpoint: step 3 at {ckpt}" in lines[0], lines[0]
    stopped = json.loads((run / "stopped.json").read_text())
    assert (stopped["step"], stopped["checkpoint"]) == (3, str(ckpt)) and "rank 1" in stopped["signal"]

    # rank 1 fails (a simulated out-of-memory error after step 4): it prints one line, and rank 0 names its error
    t0 = time.time()
    (p0, _, err0), (p1, _, err1) = two_nodes(recipe, "oom", [[], []], GRT_FAULT_RAISE_AT_STEP="4:1")
    oom_s = time.time() - t0
    assert p0.returncode == 1 and p1.returncode == 1, (p0.returncode, p1.returncode, err1[-3000:])
    lines1 = worker_lines(err1)
    assert len(lines1) == 1 and lines1[0].startswith("error: out of memory on the CPU: lower train.micro_batch_size"), \
        err1[-3000:]
    assert "Traceback" not in err1, err1[-3000:]
    lines = worker_lines(err0)
    assert len(lines) == 1, err0[-3000:]
    assert "rank 1 (node 1, host " in lines[0] and "failed: out of memory on the CPU" in lines[0], lines[0]
    assert "stopped answering" not in lines[0] and "Fix the cause before relaunching" in lines[0], lines[0]

    # node 0 (the store's host) dies after step 4: rank 1 says so in one line, with no C++ stack of the store client
    t0 = time.time()
    (p0, _, _), (p1, _, err1) = two_nodes(recipe, "node0", [[], []], GRT_FAULT_KILL_AT_STEP="4",
                                          GRT_FAULT_KILL_RANK="0")
    node0_s = time.time() - t0
    print(f"frozen run {frozen_s:.1f} s, failing run {oom_s:.1f} s, node 0 run {node0_s:.1f} s")
    assert p0.returncode == -9 and p1.returncode == 1, (p0.returncode, p1.returncode)
    lines = worker_lines(err1)
    assert len(lines) == 1 and lines[0].startswith("error: node 0 (host "), err1[-3000:]
    assert "rank 0) stopped answering (the launcher's store it hosts at 127.0.0.1:" in lines[0], lines[0]
    assert "is gone) during step 5, so rank 1 stops too" in lines[0], lines[0]
    assert "frame #" not in err1 and "recvValue" not in err1, err1[-3000:]


def test_nodes_launched_under_different_names_are_named_not_waited_for(tmp_path):
    """`grt launch --node-rank K` on two nodes given different name=: their ports (derived from the name) differ, so
    torchrun would wait 600 s in silence. Both stop after --rendezvous-timeout with one line naming the node, the
    address, the port and the run name."""
    import hashlib

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"out_dir: {tmp_path / 'runs'}\ntrain: {{backend: ddp, device: cpu}}\n")
    names = [f"peers-{tmp_path.name}-{k}" for k in (0, 1)]
    # docs/multi-node.md: 20000 + (first 8 bytes of sha256(name), big-endian) mod 12768
    ports = [20000 + int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") % 12768 for n in names]
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline.cli", "launch", str(recipe), f"name={names[k]}",
                               "--nodes", "2", "--gpus-per-node", "1", "--master-addr", "127.0.0.1", "--node-rank",
                               str(k), "--no-check", "--rendezvous-timeout", "3"], cwd=tmp_path,
                              env=subprocess_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    out = [p.communicate(timeout=60) for p in procs]
    print(f"two launches with different names: {time.time() - t0:.1f} s")
    for k, (p, (_, err)) in enumerate(zip(procs, out)):
        assert p.returncode == 1, (k, err[-3000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
        assert f"127.0.0.1:{ports[k]}" in lines[0] and f"run name {names[k]!r}" in lines[0], lines[0]
        assert "all nodes must use the same name=" in lines[0], lines[0]
    assert "node 0 of 2: node(s) 1 did not join" in out[0][1]
    assert "node 1 of 2 found no node 0" in out[1][1]
