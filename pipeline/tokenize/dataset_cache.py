"""A tokenized dataset on object storage (``data.dataset_dir: s3://bucket/prefix``), read through a node-local cache.

Training memory-maps its shards (pipeline/train/data.py) and reads windows at random offsets: over ranged reads that
would be one request per window, and a shard's sha256 can only be checked on all of its bytes anyway. So each file
of the dataset (shards, their indexes, the tokenizer copy) is downloaded once per node into a cache folder, checked
against the manifest's sha256 (downloaded again once on a mismatch, then refused), and renamed into place: a file in
the cache is a checked file. The manifest is written into the cache folder last.

- Where: ``$GRT_DATASET_CACHE``, else ``$XDG_CACHE_HOME/grt/datasets`` (``~/.cache/grt/datasets``); one folder per
  dataset URL and manifest (a re-tokenized dataset gets a new folder).
- Size cap: ``$GRT_DATASET_CACHE_GB`` (default 100). Before a download, the least recently used files of datasets that
  no process is reading are removed until the new files fit; a dataset larger than the cap is refused.
- Concurrency: one process per node fills the cache at a time (an exclusive ``flock`` on ``.lock``); the others wait
  and then find the files in place. A reading process holds a shared ``flock`` on its folder's ``.in-use`` for its
  lifetime, and eviction skips every folder whose ``.in-use`` it cannot lock exclusively.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

from pipeline.runtime import storage
from pipeline.tokenize.writer import MANIFEST
from pipeline.tokenize.writer import atomic_write
from pipeline.tokenize.writer import manifest_problems

CACHE_ENV = "GRT_DATASET_CACHE"
CAP_ENV = "GRT_DATASET_CACHE_GB"
DEFAULT_CAP_GB = 100.0
_HELD: list[int] = []  # shared locks on the .in-use files of the folders this process reads (kept open)


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grt" / "datasets"


def cache_cap() -> int:
    """The cache's size cap in bytes."""
    text = os.environ.get(CAP_ENV, "")
    try:
        gb = float(text) if text else DEFAULT_CAP_GB
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise ValueError(f"{CAP_ENV}={text!r} is not a positive number of gigabytes: set it to the node-local "
                         f"dataset cache's size cap, e.g. {CAP_ENV}=100")
    return int(gb * 1e9)


def _fix_for(url: str, e: BaseException) -> str:
    name = type(e).__name__
    if "Credential" in name:
        return (f"no credentials for {url} ({name}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
                f" in the environment")
    if isinstance(e, FileNotFoundError) and "bucket" in str(e).lower():
        return f"the bucket of {url} does not exist ({e}): create it, or fix data.dataset_dir"
    return f"reading {url} failed ({name}: {e}); check data.dataset_dir, the credentials and AWS_ENDPOINT_URL"


def _fetch(url: str, what):
    try:
        return what()
    except storage.StorageError as e:
        raise OSError(str(e)) from None
    except FileNotFoundError as e:
        if "bucket" in str(e).lower():
            raise OSError(_fix_for(url, e)) from None
        raise
    except Exception as e:  # botocore's NoCredentialsError, EndpointConnectionError ...: not OSErrors
        raise OSError(_fix_for(url, e)) from None


def read_remote_manifest(dataset_dir: str) -> tuple[bytes, dict]:
    """The manifest's bytes and its parsed form; a missing or damaged one is a one-line error naming the URL."""
    url = str(storage.join(dataset_dir, MANIFEST))
    try:
        data = _fetch(url, lambda: storage.read_bytes(url))
    except FileNotFoundError:
        raise FileNotFoundError(f"no tokenized dataset at {dataset_dir} ({MANIFEST} missing): run `grt tokenize "
                                f"RECIPE` with this data.dataset_dir first, or fix data.dataset_dir") from None
    fix = "re-tokenize the dataset with `grt tokenize RECIPE --force`"
    try:
        m = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{url} is not valid JSON ({e}): damaged or cut short; {fix}") from None
    problems = manifest_problems(m)
    if problems:
        raise ValueError(f"{url} is not a usable manifest: {'; '.join(problems[:5])}; {fix}")
    return data, m


def dataset_files(m: dict) -> list[tuple[str, str]]:
    """(file name, sha256) of every file a manifest names: tokenizer copy, shards, their indexes."""
    out = [(m["tokenizer"]["file"], m["tokenizer"]["vocab_hash"])] if m["tokenizer"].get("file") else []
    for info in m["splits"].values():
        for sh in info["shards"]:
            out += [(sh["file"], sh["sha256"]), (sh["index_file"], sh["index_sha256"])]
    return out


@contextmanager
def _exclusive(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _hold(folder: Path) -> None:
    """Mark ``folder`` in use by this process until it exits (a shared lock eviction cannot take)."""
    fd = os.open(folder / ".in-use", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _HELD.append(fd)


def release_datasets() -> None:
    """Stop marking the cached datasets this process read as in use (its memory maps must be closed first)."""
    while _HELD:
        os.close(_HELD.pop())


def _in_use(folder: Path) -> bool:
    try:
        fd = os.open(folder / ".in-use", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _data_files(root: Path) -> list[Path]:
    """The cached data files (shards, indexes, tokenizers; not manifests or lock files) under ``root``."""
    return [f for d in root.iterdir() if d.is_dir() for f in d.iterdir()
            if f.is_file() and not f.name.startswith(".") and f.name != MANIFEST]


def cached_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in _data_files(root)) if root.is_dir() else 0


def _evict(root: Path, keep: Path, need: int, cap: int) -> None:
    """Remove least recently used files of folders nobody reads until ``need`` more bytes fit under ``cap``."""
    used = cached_bytes(root)
    if used + need <= cap:
        return
    busy = {d for d in root.iterdir() if d.is_dir() and d != keep and _in_use(d)}
    candidates = sorted((f for f in _data_files(root) if f.parent != keep and f.parent not in busy),
                        key=lambda f: f.stat().st_mtime)
    for f in candidates:
        if used + need <= cap:
            break
        used -= f.stat().st_size
        f.unlink()
    if used + need > cap:
        raise OSError(f"the dataset cache {root} holds {used / 1e9:.2f} GB that datasets in use need, and "
                      f"{need / 1e9:.2f} GB more do not fit under {CAP_ENV}={cap / 1e9:g}: raise {CAP_ENV} or wait "
                      f"for the other runs on this node")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _download(dataset_dir: str, name: str, sha: str, folder: Path) -> None:
    """Download one file, check its sha256, rename it into place; once more on a mismatch, then refuse it."""
    url = str(storage.join(dataset_dir, name))
    fs, path = storage.filesystem(url)
    tmp = folder / f".{name}.{os.getpid()}.part"
    try:
        for attempt in range(2):
            try:
                _fetch(url, lambda: fs.get_file(path, str(tmp)))
            except FileNotFoundError:
                raise FileNotFoundError(f"{url} is missing, though the manifest lists it: restore it or re-tokenize "
                                        f"the dataset (grt tokenize RECIPE --force)") from None
            got = _sha256(tmp)
            if got == sha:
                os.replace(tmp, folder / name)
                return
    finally:
        tmp.unlink(missing_ok=True)  # a failed or refused download leaves nothing behind
    raise ValueError(f"{url} has sha256 {got[:16]}, the manifest says {sha[:16]} (the object is damaged, cut short "
                     f"or replaced): restore it or re-tokenize the dataset (grt tokenize RECIPE --force)")


def _cache_folder(dataset_dir: str, manifest_bytes: bytes) -> Path:
    """The cache folder of one dataset URL and manifest (a re-tokenized dataset gets a new one)."""
    return cache_root() / (hashlib.sha256(dataset_dir.encode()).hexdigest()[:12] + "-"
                           + hashlib.sha256(manifest_bytes).hexdigest()[:12])


def local_tokenizer_folder(dataset_dir: str | Path) -> Path:
    """A local folder holding ``dataset_dir``'s tokenizer copy: itself when local; for s3://, the dataset's folder in
    the node cache, where only that file is downloaded (and checked against the manifest's vocab_hash) when it is not
    there yet, so that checking a recipe against a dataset on the store does not download its shards."""
    if not storage.is_remote(dataset_dir):
        return Path(dataset_dir)
    dataset_dir = str(dataset_dir).rstrip("/")
    manifest_bytes, m = read_remote_manifest(dataset_dir)
    folder = _cache_folder(dataset_dir, manifest_bytes)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.parent / ".lock"):
        folder.mkdir(exist_ok=True)
        _hold(folder)
        name = m["tokenizer"].get("file")
        if name and not (folder / name).is_file():
            _download(dataset_dir, name, m["tokenizer"]["vocab_hash"], folder)
    return folder


def local_dataset(dataset_dir: str | Path, problems: list[str] | None = None) -> Path:
    """The local folder to read ``dataset_dir`` from: itself when local, else its checked copy in the node cache.
    A missing or damaged file is an error; with ``problems`` given it is appended there instead (and left out of
    the cache), so that ``grt data verify`` names every one."""
    if not storage.is_remote(dataset_dir):
        return Path(dataset_dir)
    dataset_dir = str(dataset_dir).rstrip("/")
    manifest_bytes, m = read_remote_manifest(dataset_dir)
    root = cache_root()
    cap = cache_cap()
    folder = _cache_folder(dataset_dir, manifest_bytes)
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / ".lock"):
        folder.mkdir(exist_ok=True)
        for stale in folder.glob(".*.part"):  # a download killed before its rename (only the lock's holder downloads)
            stale.unlink(missing_ok=True)
        _hold(folder)
        files = dataset_files(m)
        missing = [(n, s) for n, s in files if not (folder / n).is_file()]
        sizes = {}
        for n, _ in missing:
            url = str(storage.join(dataset_dir, n))
            try:
                sizes[n] = _fetch(url, lambda url=url: storage.size(url))
            except FileNotFoundError:
                gone = (f"{url} is missing, though the manifest lists it: restore it or re-tokenize the dataset "
                        f"(grt tokenize RECIPE --force)")
                if problems is None:
                    raise FileNotFoundError(gone) from None
                problems.append(gone)
        missing = [(n, s) for n, s in missing if n in sizes]
        if missing:
            present = sum((folder / n).stat().st_size for n, _ in files if (folder / n).is_file())
            if present + sum(sizes.values()) > cap:
                raise OSError(f"the dataset at {dataset_dir} needs {(present + sum(sizes.values())) / 1e9:.2f} GB, "
                              f"more than the node-local cache's cap {CAP_ENV}={cap / 1e9:g}: raise {CAP_ENV}, or "
                              f"copy the dataset to a local disk and point data.dataset_dir at it")
            _evict(root, folder, sum(sizes.values()), cap)
            for n, s in missing:
                try:
                    _download(dataset_dir, n, s, folder)
                except (ValueError, FileNotFoundError) as e:
                    if problems is None:
                        raise
                    problems.append(str(e))
        for n, _ in files:
            if (folder / n).is_file():
                os.utime(folder / n)  # recently used: evicted last
        if not (folder / MANIFEST).is_file():
            atomic_write(folder / MANIFEST, manifest_bytes)
    return folder
