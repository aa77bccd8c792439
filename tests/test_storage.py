"""The storage layer against a real S3 server (moto on 127.0.0.1) and on a local disk: the same operations, the same
results, checked against what boto3 (an independent client) sees in the bucket."""
from __future__ import annotations

import pytest

from pipeline.runtime import storage


def roundtrip(base):
    storage.makedirs(storage.join(base, "d"))
    storage.write_text(storage.join(base, "d", "a.txt"), "hello")
    storage.write_bytes(storage.join(base, "d", "b.bin"), b"\x00" * 10)
    assert storage.read_text(storage.join(base, "d", "a.txt")) == "hello"
    assert storage.size(storage.join(base, "d", "b.bin")) == 10
    assert storage.listdir(storage.join(base, "d")) == ["a.txt", "b.bin"]
    assert storage.exists(storage.join(base, "d", "a.txt")) and not storage.exists(storage.join(base, "d", "zz"))
    assert storage.isdir(storage.join(base, "d"))
    assert storage.create_exclusive(storage.join(base, "lock"), b"first") is True
    assert storage.create_exclusive(storage.join(base, "lock"), b"second") is False
    assert storage.read_bytes(storage.join(base, "lock")) == b"first"
    with storage.open_file(storage.join(base, "d", "a.txt")) as f:
        f.seek(1)
        assert f.read(3) == b"ell"
    storage.remove(storage.join(base, "d"))
    assert storage.listdir(storage.join(base, "d")) == []


def test_local_paths(tmp_path):
    assert storage.join(tmp_path, "x") == tmp_path / "x"
    roundtrip(tmp_path)


def test_s3(s3_server):
    base = s3_server.url("run")
    roundtrip(base)
    assert s3_server.keys() == ["run/lock"]  # boto3's own listing
    body = s3_server.client().get_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/run/lock")["Body"].read()
    assert body == b"first"


def test_s3_errors_are_one_line(s3_server):
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(s3_server.url("missing"))
    with pytest.raises(storage.StorageError, match="unsupported storage URL"):
        storage.exists("gs://b/x")


def test_errors_and_output_never_show_credentials(s3_server, capfd):
    from s3_server import ACCESS_KEY
    from s3_server import SECRET

    with pytest.raises(storage.StorageError) as err:
        storage.write_text("s3://no-such-bucket-grt/x.txt", "x")
    out = capfd.readouterr()
    text = str(err.value) + out.out + out.err
    assert "s3://no-such-bucket-grt/x.txt" in text and "\n" not in str(err.value)
    assert SECRET not in text and ACCESS_KEY not in text


def test_an_s3_out_dir_runs_in_a_local_copy_of_the_url(tmp_path, monkeypatch):
    from pipeline.config import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    monkeypatch.setenv("GRT_RUN_CACHE", str(tmp_path / "cache"))
    cfg = load_recipe(recipe, ["out_dir=s3://bkt/team/runs/"])
    assert cfg.run_url == "s3://bkt/team/runs/r"
    assert cfg.run_dir == tmp_path / "cache" / "s3" / "bkt" / "team" / "runs" / "r"
    monkeypatch.delenv("GRT_RUN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cfg.run_dir == tmp_path / "xdg" / "grt" / "runs" / "s3" / "bkt" / "team" / "runs" / "r"
    assert load_recipe(recipe, [f"out_dir={tmp_path}"]).run_url is None
    assert not (tmp_path / "s3:").exists() and not list(tmp_path.glob("s3*"))
