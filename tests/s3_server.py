"""A real S3-compatible server for tests: moto's ThreadedMotoServer on 127.0.0.1, a free port, in this process.

Why moto: pure Python and pip-installable (the `test` extra), speaks the S3 HTTP API (ranged GETs, multipart uploads,
conditional PUT with ``If-None-Match: *``), so the pipeline runs unchanged against it through s3fs/botocore.

API:
- ``s3_server`` (pytest fixture, function scope): starts the server, creates the bucket ``grt-test``, sets the
  standard AWS environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_DEFAULT_REGION``) for this process and the subprocesses it starts (through ``monkeypatch``), and yields an
  :class:`S3Server`. Stopped at the end of the test. tests/conftest.py imports it: any test can name it.
- ``S3Server.url(*parts)``: ``s3://grt-test/<unique prefix>/<parts>`` (a fresh prefix per test);
  ``S3Server.env``: the variables set; ``S3Server.client()``: a boto3 client; ``SECRET``: the secret key, to grep
  logs for.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

BUCKET = "grt-test"
ACCESS_KEY = "grt-test-access-key-AKIA1234"
SECRET = "grt-test-SECRET-do-not-log-8f3d2c"


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    prefix: str
    env: dict

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}/{self.prefix}", *(p.strip("/") for p in parts)])

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def keys(self, under: str = "") -> list[str]:
        """Every key under this test's prefix (relative to it), sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/{under}".rstrip("/"))
        return sorted(o["Key"][len(self.prefix) + 1:] for page in pages for o in page.get("Contents", []))


def start_server():
    """(ThreadedMotoServer, endpoint URL); the caller stops it."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request in the test output
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@pytest.fixture
def s3_server(monkeypatch):
    from s3fs import S3FileSystem

    server, endpoint = start_server()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1"}
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        S3FileSystem.clear_instance_cache()  # no client bound to an earlier test's endpoint
        srv = S3Server(endpoint, BUCKET, f"t-{uuid.uuid4().hex[:12]}", env)
        srv.client().create_bucket(Bucket=BUCKET)
        yield srv
    finally:
        server.stop()
        S3FileSystem.clear_instance_cache()
