"""`grt tokenize` into object storage (``data.dataset_dir: s3://bucket/prefix``): tokenized locally, then uploaded.

The dataset is written into a local staging folder (``<dataset cache>/staging/<hash of the URL>``) exactly as a local
one is, so a killed job resumes there as it does on a local disk. Then every file the manifest names is uploaded, and
the manifest last: it stays the commit marker, and a reader never sees a manifest whose files are not all in the
store. A rebuild first removes the store's manifest, so an old manifest never vouches for half-replaced shards.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from pipeline.runtime import storage
from pipeline.tokenize.dataset_cache import cache_root
from pipeline.tokenize.dataset_cache import dataset_files
from pipeline.tokenize.writer import MANIFEST
from pipeline.tokenize.writer import manifest_problems

STORE_TRIES = 3  # polls in a row that may fail to read the store before waiting for a dataset there gives up
# Testing hook: the upload stops itself (SIGSTOP) once this many of the dataset's files are in the store (the manifest
# not yet), for a test to SIGKILL it at that exact point.
FAULT_STOP_ENV = "GRT_FAULT_UPLOAD_STOP_AFTER_FILES"


def staging_dir(url: str) -> Path:
    return cache_root() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:12]


def _remote_manifest(url: str) -> dict | None:
    path = storage.join(url, MANIFEST)
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # damaged: rebuilt


def wait_for_remote(url: str, fingerprint_of, poll_s: float) -> dict:
    """Wait until the store holds a finished dataset at ``url`` whose manifest carries the fingerprint
    ``fingerprint_of(manifest)``: the manifest is uploaded last, so every file it names is there by then. Another
    config's or a damaged manifest is waited past (the tokenizing rank decides about it); a store this node cannot
    read :data:`STORE_TRIES` polls in a row is an error."""
    failures = 0
    while True:
        try:
            m = _remote_manifest(url)
            failures = 0
        except storage.StorageError as e:
            failures += 1
            if failures >= STORE_TRIES:
                raise OSError(f"waiting for the dataset at {url}: {e}") from None
            m = None
        if isinstance(m, dict) and not manifest_problems(m) and m.get("fingerprint") == fingerprint_of(m):
            return m
        time.sleep(poll_s)


def tokenize_remote(cfg, tokenize_local, fingerprint: str, force: bool = False, quiet: bool = False, **kw) -> dict:
    """Tokenize ``cfg`` into the store at ``cfg.dataset_dir`` through ``tokenize_local`` (the local stage);
    ``fingerprint``: the config's data fingerprint, which a finished dataset's manifest carries."""
    url = str(cfg.dataset_dir).rstrip("/")
    try:
        existing = _remote_manifest(url)
    except storage.StorageError as e:
        raise OSError(str(e)) from None
    except FileNotFoundError as e:  # the bucket
        raise OSError(f"{url}: {e}; create the bucket, or fix data.dataset_dir") from None
    except Exception as e:  # botocore's NoCredentialsError and the like
        raise OSError(f"{url}: {type(e).__name__}: {e}; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and "
                      f"AWS_ENDPOINT_URL for an S3-compatible server)") from None
    if existing is not None and not force:
        if existing.get("fingerprint") == fingerprint:
            if not quiet:
                print(f"tokenize: {url} is up to date ({existing['splits']['train']['tokens']:,} train tokens); "
                      f"--force to rebuild")
            return existing
        raise FileExistsError(f"{url} holds a dataset made from a different data config (fingerprint "
                              f"{existing.get('fingerprint')} != {fingerprint}); choose another data.dataset_dir "
                              f"or pass --force to overwrite it")
    if existing is not None:
        storage.remove(storage.join(url, MANIFEST))  # the old commit marker goes before any shard changes
    stage = staging_dir(url)
    stage.mkdir(parents=True, exist_ok=True)
    manifest = tokenize_local(dataclasses.replace(cfg, dataset_dir=str(stage)), force=force, quiet=quiet, **kw)
    files = [name for name, _ in dataset_files(manifest)]
    if not quiet:
        print(f"tokenize: uploading {len(files)} files from {stage} to {url}", file=sys.stderr)
    stop_after = int(os.environ.get(FAULT_STOP_ENV) or 0)
    for n, name in enumerate(files, 1):
        fs, path = storage.filesystem(storage.join(url, name))
        fs.put_file(str(stage / name), path)
        if n == stop_after:
            os.kill(os.getpid(), signal.SIGSTOP)
    storage.write_bytes(storage.join(url, MANIFEST), (stage / MANIFEST).read_bytes())  # last: the commit marker
    shutil.rmtree(stage, ignore_errors=True)
    return manifest
