"""The run-folder lock on an object store: an exclusive create by conditional PUT, checked with boto3 (an
independent client) against the moto server."""
from __future__ import annotations

import json
import os
import socket

import pytest

from pipeline.runtime.locking import FALLBACK_FILE
from pipeline.runtime.locking import FolderLock
from pipeline.runtime.locking import FolderLockedError


def put_record(srv, host, pid):
    srv.client().put_object(Bucket=srv.bucket, Key=f"{srv.prefix}/run/{FALLBACK_FILE}",
                            Body=json.dumps({"host": host, "pid": pid, "command": "grt train x"}).encode())


def test_lock_on_s3(s3_server):
    run = s3_server.url("run")
    with FolderLock(run, "run folder"):
        assert s3_server.keys() == [f"run/{FALLBACK_FILE}"]
        record = json.loads(s3_server.client().get_object(
            Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/run/{FALLBACK_FILE}")["Body"].read())
        assert record["pid"] == os.getpid()
    assert s3_server.keys() == []  # released: deleted


def test_lock_held_elsewhere_is_refused(s3_server):
    run = s3_server.url("run")
    put_record(s3_server, "node-7", 1234)  # a job on another host
    with pytest.raises(FolderLockedError, match=f"pid 1234 on host node-7.*delete {run}/{FALLBACK_FILE}"):
        FolderLock(run, "run folder").acquire()
    put_record(s3_server, socket.gethostname(), os.getpid())  # a live job on this host (this process's pid)
    with pytest.raises(FolderLockedError, match="in use by another job"):
        FolderLock(run, "run folder").acquire()


def test_dead_holder_on_this_host_is_taken_over(s3_server):
    put_record(s3_server, socket.gethostname(), 2 ** 22 + 17)  # above pid_max's default: no such process
    lock = FolderLock(s3_server.url("run"), "run folder").acquire()
    assert lock.took_over["pid"] == 2 ** 22 + 17
    lock.release()
    assert s3_server.keys() == []


def test_a_conflicting_conditional_put_is_asked_again_until_the_other_write_lands(monkeypatch):
    """AWS S3 answers 409 ConditionalRequestConflict while another conditional PUT of the key is in flight: not an
    error of the lock, a question to ask again (the other write then makes it a 412: the lock is taken)."""
    from pipeline.runtime import storage

    answers = []

    class Store:  # the S3 answers, in order, that s3fs would raise as OSErrors
        def __init__(self, script):
            self.script = list(script)

        def pipe_file(self, path, data, mode):
            answers.append(path)
            what = self.script.pop(0)
            if what == "conflict":
                raise OSError("An error occurred (ConditionalRequestConflict) when calling the PutObject operation: "
                              "409")
            if what == "exists":
                raise OSError("An error occurred (PreconditionFailed) when calling the PutObject operation: 412")

        def invalidate_cache(self, path):
            pass

    monkeypatch.setattr(storage.time, "sleep", lambda s: None)
    monkeypatch.setattr(storage, "filesystem", lambda path: (Store(["conflict", "conflict", "exists"]), "b/k"))
    assert storage.create_exclusive("s3://b/k", b"x") is False and len(answers) == 3
    monkeypatch.setattr(storage, "filesystem", lambda path: (Store(["conflict", "ok"]), "b/k"))
    assert storage.create_exclusive("s3://b/k", b"x") is True
    monkeypatch.setattr(storage, "filesystem", lambda path: (Store(["conflict"] * 20), "b/k"))
    with pytest.raises(storage.StorageError, match="ConditionalRequestConflict"):
        storage.create_exclusive("s3://b/k", b"x")


def test_an_earlier_start_of_the_same_job_on_another_host_is_taken_over(s3_server, monkeypatch, capsys):
    """A torchrun restart or SLURM requeue whose rank 0 now runs on another node: the lock object its first start
    left (killed on its host) names the same launcher job, so the relaunch takes it over; another job's is refused."""
    run = s3_server.url("run")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/run/{FALLBACK_FILE}",
                                  Body=json.dumps({"host": "node-3", "pid": 99, "job": "slurm job 777"}).encode())
    lock = FolderLock(run, "run folder").acquire()
    assert lock.took_over["host"] == "node-3" and "took over the run folder" in capsys.readouterr().err
    lock.release()
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/run/{FALLBACK_FILE}",
                                  Body=json.dumps({"host": "node-3", "pid": 99, "job": "slurm job 778"}).encode())
    with pytest.raises(FolderLockedError, match="pid 99 on host node-3"):
        FolderLock(run, "run folder").acquire()
