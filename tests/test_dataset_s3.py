"""Datasets on object storage: `grt tokenize` into s3://, training from it through the node-local cache, and the
cache's checks (sha256 of every shard, size cap), against the real S3 server of tests/s3_server.py (moto)."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.config import from_dict
from pipeline.tokenize import dataset_cache
from pipeline.tokenize import tokenize
from pipeline.train.trainer import Trainer
from tests.conftest import tiny_recipe


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(dataset_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(dataset_cache.CAP_ENV, raising=False)
    yield tmp_path / "cache"
    dataset_cache.release_datasets()


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _recipe(tmp_path, corpus, dataset_dir, out):
    return tiny_recipe(tmp_path, corpus, data={"dataset_dir": dataset_dir}, out_dir=str(tmp_path / out),
                       train={"max_steps": 2, "eval_interval": 2, "checkpoint_interval": 2})


def test_tokenize_to_s3_then_train_equals_local(tmp_path, corpus, s3_server, cache):
    url = s3_server.url("dataset")
    s3_cfg = from_dict(_recipe(tmp_path, corpus, url, "runs_s3"))
    local_cfg = from_dict(_recipe(tmp_path, corpus, str(tmp_path / "local"), "runs_local"))
    tokenize(s3_cfg.data, quiet=True)
    tokenize(local_cfg.data, quiet=True)  # the reference: the same recipe on the local disk
    local = tmp_path / "local"
    m = json.loads((local / "manifest.json").read_text())
    names = sorted(["manifest.json"] + [sh[k] for s in m["splits"].values() for sh in s["shards"]
                                        for k in ("file", "index_file")])
    assert s3_server.keys("dataset") == [f"dataset/{n}" for n in names]
    client = s3_server.client()
    for n in names:  # byte-identical to the local tokenization
        body = client.get_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/dataset/{n}")["Body"].read()
        assert body == (local / n).read_bytes(), n
    assert not (cache / "staging").exists() or not any((cache / "staging").iterdir())
    tokenize(s3_cfg.data, quiet=True)  # up to date: nothing rebuilt

    s3_cfg.tracking.enabled = True  # the MLflow dataset input names the store, not the node cache's copy
    Trainer(s3_cfg).fit()
    Trainer(local_cfg).fit()
    got, want = _losses(s3_cfg.run_dir), _losses(local_cfg.run_dir)
    assert got == want and len(got) == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(s3_cfg.tracking.uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (source,) = [json.loads(d.dataset.source)["uri"] for d in run.inputs.dataset_inputs]
    assert source == url
    assert main(["data", "verify", url]) == 0


def test_damaged_shard_object_is_refused(tmp_path, corpus, s3_server, cache, capsys):
    import yaml

    url = s3_server.url("dataset")
    recipe = _recipe(tmp_path, corpus, url, "runs")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    tokenize(from_dict(recipe).data, quiet=True)
    m = json.loads(s3_server.client().get_object(Bucket=s3_server.bucket,
                                                 Key=f"{s3_server.prefix}/dataset/manifest.json")["Body"].read())
    shard = m["splits"]["train"]["shards"][0]["file"]
    key = f"{s3_server.prefix}/dataset/{shard}"
    body = s3_server.client().get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=key, Body=body[:-2])  # cut short by one token
    with pytest.raises(ValueError) as e:
        dataset_cache.local_dataset(url)
    msg = str(e.value)
    assert "\n" not in msg and shard in msg and "sha256" in msg and "re-tokenize" in msg
    assert hashlib.sha256(body[:-2]).hexdigest()[:16] in msg  # what the store holds, hashed independently
    assert not list(cache.glob(f"*/{shard}"))  # never renamed into the cache
    assert not list(cache.glob("*/.*.part"))  # nor left behind under its temporary name
    folder = next(p for p in cache.iterdir() if p.is_dir() and p.name != "staging")  # the dataset's own folder
    (folder / f".{shard}.99999.part").write_bytes(b"a download killed before its rename")
    with pytest.raises(ValueError):
        dataset_cache.local_dataset(url)
    assert not list(cache.glob("*/.*.part"))  # the next filling of the cache removes it
    assert main(["train", str(tmp_path / "recipe.yaml")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shard in err[0] and "sha256" in err[0], err
    assert main(["data", "verify", url]) == 1
    assert shard in capsys.readouterr().err


def _dataset_bytes(local) -> int:
    """A dataset's bytes by the manifest: tokens x item size per shard, 4 bytes per document start in its index."""
    m = json.loads((local / "manifest.json").read_text())
    size = np.dtype(m["dtype"]).itemsize
    return sum(sh["tokens"] * size + sh["documents"] * 4 for s in m["splits"].values() for sh in s["shards"])


def test_cache_size_cap(tmp_path, corpus, s3_server, cache, monkeypatch):
    a, b = s3_server.url("a"), s3_server.url("b")
    for url in (a, b):
        tokenize(from_dict(_recipe(tmp_path, corpus, url, "runs")).data, quiet=True)
    tokenize(from_dict(_recipe(tmp_path, corpus, str(tmp_path / "local"), "runs")).data, quiet=True)
    one = _dataset_bytes(tmp_path / "local")
    monkeypatch.setenv(dataset_cache.CAP_ENV, str((one - 1) / 1e9))
    with pytest.raises(OSError, match="more than the node-local cache's cap"):
        dataset_cache.local_dataset(a)
    monkeypatch.setenv(dataset_cache.CAP_ENV, str(1.5 * one / 1e9))  # room for one dataset, not two
    folder_a = dataset_cache.local_dataset(a)
    assert dataset_cache.cached_bytes(cache) == one
    with pytest.raises(OSError, match="datasets in use"):  # a is still read by this process
        dataset_cache.local_dataset(b)
    dataset_cache.release_datasets()
    folder_b = dataset_cache.local_dataset(b)
    left_of_a = sum(f.stat().st_size for f in folder_a.iterdir() if f.suffix in (".bin", ".idx"))
    assert dataset_cache.cached_bytes(cache) == one + left_of_a <= 1.5 * one  # b whole, a only in part
    assert left_of_a < one
    assert main(["data", "verify", str(folder_b)]) == 0
    dataset_cache.release_datasets()
    assert dataset_cache.local_dataset(a) == folder_a  # a again: its evicted files fetched again, b's make room
    assert dataset_cache.cached_bytes(cache) <= 1.5 * one
    assert main(["data", "verify", str(folder_a)]) == 0


@pytest.mark.multiprocess
def test_ranks_on_one_node_share_the_cache(tmp_path, corpus, s3_server, cache):
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    url = s3_server.url("dataset")
    tokenize(from_dict(_recipe(tmp_path, corpus, url, "runs")).data, quiet=True)
    tokenize(from_dict(_recipe(tmp_path, corpus, str(tmp_path / "local"), "runs")).data, quiet=True)
    code = "import sys; from pipeline.tokenize.dataset_cache import local_dataset; print(local_dataset(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    folders = {o.strip() for o, _ in outs}
    assert len(folders) == 1
    folder = type(cache)(folders.pop())
    local = tmp_path / "local"
    names = sorted(f.name for f in local.iterdir() if f.suffix in (".bin", ".idx"))
    assert sorted(f.name for f in folder.iterdir() if not f.name.startswith(".")) == sorted(names + ["manifest.json"])
    for n in names:  # byte-identical to the local tokenization, no partial download left
        assert (folder / n).read_bytes() == (local / n).read_bytes(), n


@pytest.mark.multiprocess
def test_tokenize_to_s3_killed_mid_upload_leaves_no_manifest_and_the_rerun_finishes_it(tmp_path, corpus, s3_server,
                                                                                       cache):
    """`grt tokenize` to s3:// killed (SIGKILL) with 2 of the dataset's files in the store: no manifest there (it is
    the commit marker, uploaded last); the same command again gives the objects of a clean local tokenization."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from pipeline.tokenize.upload import FAULT_STOP_ENV
    from tests.test_tokenize_tasks import REPO
    from tests.test_tokenize_tasks import _stopped

    url = s3_server.url("dataset")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(_recipe(tmp_path, corpus, url, "runs")))
    cmd = [sys.executable, "-m", "pipeline.cli", "tokenize", str(tmp_path / "recipe.yaml")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, FAULT_STOP_ENV: "2"})
    try:
        deadline = time.time() + 60
        while proc.poll() is None and not _stopped(proc.pid) and time.time() < deadline:
            time.sleep(0.01)
        assert _stopped(proc.pid), f"the upload did not stop after 2 files (exit status {proc.poll()})"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(s3_server.keys("dataset")) == 2 and "dataset/manifest.json" not in s3_server.keys("dataset")
    finally:
        proc.kill()
        proc.wait()
    subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)

    tokenize(from_dict(_recipe(tmp_path, corpus, str(tmp_path / "local"), "runs_local")).data, quiet=True)
    local = tmp_path / "local"  # the reference: a clean tokenization of the same recipe to the local disk
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(names) > 4 and s3_server.keys("dataset") == [f"dataset/{n}" for n in names]
    client = s3_server.client()
    for n in names:
        body = client.get_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/dataset/{n}")["Body"].read()
        assert body == (local / n).read_bytes(), n
