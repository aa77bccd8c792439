"""A run folder on object storage (``out_dir: s3://...``) against the real S3 server of tests/s3_server.py (moto):
checkpoints uploaded with the index last, kill -9 in the middle of an upload, a truncated object, eval and export
from the store, credentials never shown. The reference for every loss is the same recipe trained on a local disk."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from pipeline.cli import main
from pipeline.runtime import storage
from tests.conftest import launched_recipe
from tests.conftest import step_losses
from tests.conftest import subprocess_env
from tests.s3_server import ACCESS_KEY
from tests.s3_server import SECRET

pytestmark = pytest.mark.slow


def _grt(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _losses_on_store(url: str) -> dict[int, float]:
    rows = [json.loads(line) for line in storage.read_text(f"{url}/metrics.jsonl").splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_kill_in_upload_truncated_object_eval_and_export(tmp_path, s3_server):
    recipe = launched_recipe(tmp_path, max_steps=6, checkpoint_interval=2, eval_interval=2, keep_checkpoints=10)
    local = yaml.safe_load(recipe.read_text())
    remote = {**local, "out_dir": s3_server.url("runs")}
    (tmp_path / "s3.yaml").write_text(yaml.safe_dump(remote))
    url = s3_server.url("runs", local["name"])
    node = lambda name: subprocess_env(GRT_RUN_CACHE=str(tmp_path / name))  # noqa: E731 (one node's disk)
    outputs = []

    # the reference: the same recipe on the local disk, uninterrupted
    ref = _grt("train", str(recipe), env=subprocess_env())
    assert ref.returncode == 0, ref.stderr
    want = step_losses(tmp_path / "runs" / local["name"])

    # killed (SIGKILL) while uploading step 4's checkpoint, after its first file: no index, so never committed
    killed = _grt("train", str(tmp_path / "s3.yaml"), env={**node("node_a"), "GRT_FAULT_KILL_IN_UPLOAD": "4:1"})
    outputs.append(killed)
    assert killed.returncode == -9, killed.stderr
    keys = s3_server.keys("runs")
    step4 = [k for k in keys if "step_00000004" in k]
    assert step4 and not any(k.endswith("index.json") for k in step4), keys
    assert any(k.endswith("step_00000002/index.json") for k in keys)

    # a folder on the store that grt did not upload (no index, no upload marker) is named, never removed
    client = s3_server.client()
    foreign = f"{s3_server.prefix}/runs/{local['name']}/checkpoints/step_00000001/state.pt"
    client.put_object(Bucket=s3_server.bucket, Key=foreign, Body=b"someone else's")

    # the same command on another node (an empty disk): resumes from step 2, the newest intact checkpoint
    resumed = _grt("train", str(tmp_path / "s3.yaml"), env=node("node_b"))
    outputs.append(resumed)
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: checkpoint step 2 of" in resumed.stdout
    assert f"note: removed {url}/checkpoints/step_00000004: an upload of a checkpoint that a kill interrupted" in \
        resumed.stderr
    assert f"warning: ignored {url}/checkpoints/step_00000001: it has no index.json and was not uploaded by grt" in \
        resumed.stderr
    assert client.get_object(Bucket=s3_server.bucket, Key=foreign)["Body"].read() == b"someone else's"
    client.delete_object(Bucket=s3_server.bucket, Key=foreign)
    got = _losses_on_store(url)
    assert got == want  # steps 1-2 of the killed run, 3-6 after the resume: an uninterrupted run's
    committed = sorted(k.rsplit("/", 2)[1] for k in s3_server.keys("runs") if k.endswith("/index.json"))
    assert committed == ["step_00000002", "step_00000004", "step_00000006"]

    # eval and export straight from the store equal the local run's; on the node that trained (node_b) they read a
    # copy of their own: the training's copy is left as it is
    rc_eval_local = main(["eval", str(tmp_path / "runs" / local["name"]), "eval.diagnostics=false"])
    local_exits = json.loads((tmp_path / "runs" / local["name"] / "eval" / "exits.json").read_text())
    trained_copy = tmp_path / "node_b" / url.replace("://", "/")
    before = {f: f.read_bytes() for f in trained_copy.rglob("*") if f.is_file()}
    evaluated = _grt("eval", url, "eval.diagnostics=false", env=node("node_b"))
    outputs.append(evaluated)
    assert rc_eval_local == 0 and evaluated.returncode == 0, evaluated.stderr
    store_exits = json.loads(storage.read_text(f"{url}/eval/exits.json"))
    assert store_exits["loss"] == local_exits["loss"] and store_exits["step"] == 6
    assert {f: f.read_bytes() for f in trained_copy.rglob("*") if f.is_file()} == before
    exported = _grt("export", url, "--out", str(tmp_path / "hf_s3"), "--no-verify", env=node("node_c"))
    outputs.append(exported)
    assert exported.returncode == 0, exported.stderr
    assert main(["export", str(tmp_path / "runs" / local["name"]), "--out", str(tmp_path / "hf_local"),
                 "--no-verify"]) == 0
    assert ((tmp_path / "hf_s3" / "model.safetensors").read_bytes() ==
            (tmp_path / "hf_local" / "model.safetensors").read_bytes())

    # a truncated object: verify names it; the same command again falls back to step 4 (step 6 set aside), even on
    # the node whose own copy of step 6 is intact: the store decides
    key = f"{s3_server.prefix}/runs/{local['name']}/checkpoints/step_00000006/state.pt"
    body = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=body[: len(body) // 2])
    verified = _grt("checkpoint", "verify", url, env=node("node_c"))
    outputs.append(verified)
    assert verified.returncode == 1
    assert f"step_00000006: DAMAGED: state.pt has {len(body) // 2:,} bytes, the index says {len(body):,}" in \
        verified.stdout
    assert "step_00000004: intact" in verified.stdout
    longer = _grt("train", str(tmp_path / "s3.yaml"), env=node("node_b"))
    outputs.append(longer)
    assert longer.returncode == 0, longer.stderr
    assert "checkpoint step 6 on the store is damaged" in longer.stderr
    assert "resume: checkpoint step 4 of" in longer.stdout
    assert any("damaged_step_00000006/state.pt" in k for k in s3_server.keys("runs"))
    assert _losses_on_store(url) == want  # steps 5 and 6 trained again from step 4, as before

    # every checkpoint on the store damaged: each set aside, and the run refuses to start over quietly (one line)
    for step in (2, 4, 6):
        k = f"{s3_server.prefix}/runs/{local['name']}/checkpoints/step_{step:08d}/state.pt"
        client.put_object(Bucket=s3_server.bucket, Key=k, Body=b"cut")
    refused = _grt("train", str(tmp_path / "s3.yaml"), env=node("node_a"))
    outputs.append(refused)
    assert refused.returncode != 0 and refused.stderr.count("is damaged") == 3
    assert refused.stderr.strip().splitlines()[-1].startswith(f"error: {url}/checkpoints holds only checkpoints set "
                                                              f"aside as damaged (damaged_step_00000002, ")

    # credentials: read from the environment, never printed or written
    for out in outputs:
        assert SECRET not in out.stdout + out.stderr and ACCESS_KEY not in out.stdout + out.stderr
    for k in s3_server.keys("runs"):
        if not k.endswith((".pt", ".png", ".distcp")):
            body = client.get_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/{k}")["Body"].read()
            assert SECRET.encode() not in body, k


@pytest.mark.multiprocess
def test_two_nodes_without_a_shared_disk(tmp_path, s3_server):
    """2 simulated nodes (torchrun agents x 1 rank, FSDP, sharded checkpoints), each with its own disk: each node's
    copy holds only its own rank's shard, the store holds both; killed after step 5, the job resumes on two fresh
    nodes from step 4 with a one-process run's losses (tests/test_distributed.py's fsdp tolerance)."""
    from tests.conftest import free_port

    recipe = launched_recipe(tmp_path, max_steps=6, checkpoint_interval=2, eval_interval=6, grad_accum_steps=2,
                             collective_timeout_s=60, keep_checkpoints=10)
    local = yaml.safe_load(recipe.read_text())
    (tmp_path / "s3.yaml").write_text(yaml.safe_dump({**local, "out_dir": s3_server.url("runs")}))
    url = s3_server.url("runs", local["name"])

    def two_nodes(disks: tuple[str, str], *over: str, **fault) -> list[subprocess.CompletedProcess]:
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                   str(n), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                                   "-m", "pipeline.cli", "train", str(tmp_path / "s3.yaml"),
                                   *(over or ["train.backend=fsdp"])],
                                  env=subprocess_env(GRT_RUN_CACHE=str(tmp_path / disks[n]), **fault), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (0, 1)]
        outs = [p.communicate(timeout=600) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]

    killed = two_nodes(("a", "b"), GRT_FAULT_KILL_AT_STEP="5")
    assert all(p.returncode != 0 for p in killed)
    shards = sorted(k.rsplit("/", 1)[1] for k in s3_server.keys("runs") if "step_00000004/model_optim/" in k)
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    for disk, own in (("a", [".metadata", "__0_0.distcp"]), ("b", ["__1_0.distcp"])):  # each node: its rank's
        folder = tmp_path / disk / url.replace("://", "/") / "checkpoints" / "step_00000004" / "model_optim"
        assert sorted(p.name for p in folder.iterdir()) == own, disk

    resumed = two_nodes(("c", "d"))
    for p in resumed:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "resume: checkpoint step 4 of" in resumed[0].stdout
    single = _grt("train", str(recipe), env=subprocess_env())
    assert single.returncode == 0, single.stderr
    want, got = step_losses(tmp_path / "runs" / local["name"]), _losses_on_store(url)
    assert sorted(got) == list(range(1, 7))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), step

    # DDP's full format: rank 0 alone writes; the other node's copy still publishes the step (its index only), so
    # that every node agrees on the newest checkpoint (a rollback fetches the files)
    for p in two_nodes(("e", "f"), "train.backend=ddp", "name=ddp", "train.max_steps=2"):
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ddp_url = s3_server.url("runs", "ddp")
    copies = {disk: tmp_path / disk / ddp_url.replace("://", "/") / "checkpoints" / "step_00000002" for disk in "ef"}
    assert sorted(p.name for p in copies["e"].iterdir()) == ["index.json", "recipe.yaml", "state.pt"]
    assert sorted(p.name for p in copies["f"].iterdir()) == ["index.json"]
    assert json.loads((copies["f"] / "index.json").read_text()) == json.loads((copies["e"] / "index.json").read_text())
