"""URL-aware file operations: a local path, or ``s3://bucket/prefix`` through fsspec/s3fs.

API (small and stable; every function takes a ``str`` or ``Path``; a local path behaves exactly as ``pathlib``):

- ``is_remote(path)`` -> bool: a URL with a scheme other than ``file`` (``s3://...``).
- ``join(base, *parts)`` -> str | Path: ``base/part/...``; a local base gives a ``Path`` back.
- ``filesystem(path)`` -> (fsspec filesystem, path inside it).
- ``exists``, ``isdir``, ``size``, ``listdir`` (names, sorted), ``makedirs``, ``remove`` (file or tree).
- ``read_bytes``, ``read_text``, ``write_bytes``, ``write_text``: a write replaces the whole object (a local write goes
  through a temporary file and ``os.replace``; an S3 PUT is atomic by itself).
- ``create_exclusive(path, data)`` -> bool: write only if the object does not exist (local ``O_EXCL``; S3 PUT with
  ``If-None-Match: *``); False when it already existed.
- ``open_file(path, mode)``: a file object (ranged reads on S3 for ``"rb"``).
- ``upload(local, url)`` / ``download(url, local)``: one file, streamed (multipart on S3); a download lands under a
  temporary name and is renamed into place, so a killed one never leaves a partial file.
- ``sizes_under(path)`` -> {relative name: bytes} of every file below a folder; ``move(src, dst)``: a tree.
- ``local_copy(url)`` -> Path: where this node keeps its working copy of a run folder on the store.
- ``display(path)``: the path as shown to users (never with credentials: they are not part of the URL).
- ``storage_options(path)`` -> dict: the keyword arguments for fsspec (``endpoint_url``), for libraries that open
  the URL themselves (torch.distributed.checkpoint's FsspecWriter / FsspecReader).

S3 settings come only from the standard environment variables, read by botocore: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` (an S3-compatible server such as MinIO or moto), or a profile. Nothing here prints or stores them.
"""
from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path

REMOTE_SCHEMES = ("s3",)


class StorageError(RuntimeError):
    """An object store could not be reached or refused a request (one line: cause and fix)."""


class DiskFullError(OSError):
    """This node's disk filled while downloading from the store (errno ENOSPC / EDQUOT kept)."""


def is_remote(path) -> bool:
    text = str(path)
    return "://" in text and not text.startswith("file://")


def _scheme(path) -> str:
    return str(path).split("://", 1)[0]


def join(base, *parts):
    if not is_remote(base):
        return Path(base).joinpath(*parts)
    text = str(base).rstrip("/")
    for part in parts:
        text += "/" + str(part).strip("/")
    return text


def storage_options(path) -> dict:
    return _storage_options(_scheme(path)) if is_remote(path) else {}


def _storage_options(scheme: str) -> dict:
    if scheme != "s3":
        return {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"endpoint_url": endpoint} if endpoint else {}


def filesystem(path):
    """(fsspec filesystem, path inside it) for ``path``."""
    import fsspec

    if not is_remote(path):
        return fsspec.filesystem("file"), str(Path(path))
    scheme = _scheme(path)
    if scheme not in REMOTE_SCHEMES:
        raise StorageError(f"unsupported storage URL {display(path)}: use a local path or s3://bucket/prefix")
    try:
        fs = fsspec.filesystem(scheme, **_storage_options(scheme))
    except ImportError as e:
        raise StorageError(f"{scheme}:// needs the s3fs package ({e}): pip install s3fs") from None
    return fs, fs._strip_protocol(str(path))


def display(path) -> str:
    return str(path)


def _call(what: str, path, fn, write: bool = False):
    try:
        return fn()
    except FileNotFoundError as e:
        if write:  # nothing is missing before a PUT but the bucket
            bucket = str(path).split("://", 1)[-1].split("/", 1)[0]
            raise StorageError(f"{what} {display(path)} failed: {e} (bucket {bucket}); create the bucket or fix the "
                               "URL") from None
        raise
    except (FileExistsError, IsADirectoryError, NotADirectoryError, DiskFullError):
        raise
    except PermissionError as e:
        raise StorageError(f"{what} {display(path)}: access denied ({e}); check AWS_ACCESS_KEY_ID / "
                           "AWS_SECRET_ACCESS_KEY and the bucket's policy") from None
    except OSError as e:
        raise StorageError(f"{what} {display(path)} failed: {e}; check the bucket name and "
                           "AWS_ENDPOINT_URL") from None
    except Exception as e:  # botocore's own errors (no credentials, endpoint unreachable) are not OSErrors
        if type(e).__module__.split(".")[0] != "botocore":
            raise
        if type(e).__name__ == "NoCredentialsError":
            raise StorageError(f"{what} {display(path)}: no S3 credentials found; set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)") from None
        raise StorageError(f"{what} {display(path)} failed: {e}; check AWS_ENDPOINT_URL and the network") from None


def _fresh(what: str, path, ask):
    """``ask(fs, p)`` about an S3 object, past s3fs's listing cache (another node may have written it since)."""
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    return _call(what, path, lambda: ask(fs, p))


def exists(path) -> bool:
    return Path(path).exists() if not is_remote(path) else _fresh("checking", path, lambda fs, p: fs.exists(p))


def isdir(path) -> bool:
    return Path(path).is_dir() if not is_remote(path) else _fresh("checking", path, lambda fs, p: fs.isdir(p))


def size(path) -> int:
    if not is_remote(path):
        return Path(path).stat().st_size
    return _fresh("reading the size of", path, lambda fs, p: fs.size(p))


def listdir(path) -> list[str]:
    """Names (not paths) in a folder, sorted; [] when it does not exist."""
    if not is_remote(path):
        return sorted(q.name for q in Path(path).iterdir()) if Path(path).is_dir() else []
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    try:
        entries = _call("listing", path, lambda: fs.ls(p, detail=False))
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != p.rstrip("/"))


def makedirs(path) -> None:
    """Create a folder (a no-op on S3, where a prefix exists once an object is under it)."""
    if not is_remote(path):
        Path(path).mkdir(parents=True, exist_ok=True)


def remove(path) -> None:
    """Remove a file, or a folder with everything under it; a missing path is not an error."""
    if not is_remote(path):
        import shutil
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        return
    fs, p = filesystem(path)
    try:
        _call("removing", path, lambda: fs.rm(p, recursive=True))
    except FileNotFoundError:
        pass
    fs.invalidate_cache(p)


def read_bytes(path) -> bytes:
    if not is_remote(path):
        return Path(path).read_bytes()
    fs, p = filesystem(path)
    return _call("reading", path, lambda: fs.cat_file(p))


def read_text(path) -> str:
    return read_bytes(path).decode()


def write_bytes(path, data: bytes) -> None:
    if not is_remote(path):
        p = Path(path)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    fs, p = filesystem(path)
    _call("writing", path, lambda: fs.pipe_file(p, data), write=True)
    fs.invalidate_cache(p)


def write_text(path, text: str) -> None:
    write_bytes(path, text.encode())


def create_exclusive(path, data: bytes) -> bool:
    """Write ``data`` only if ``path`` does not exist; False when it already existed."""
    if not is_remote(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    fs, p = filesystem(path)
    for attempt in range(CONFLICT_RETRIES + 1):
        try:
            _call("creating", path, lambda: fs.pipe_file(p, data, mode="create"), write=True)
            return True
        except FileExistsError:
            return False
        except StorageError as e:
            if "PreconditionFailed" in str(e) or "Precondition" in str(e):  # 412: it exists
                return False
            # 409 ConditionalRequestConflict: another conditional write of this key is in flight; ask again once it
            # has landed (then: 412)
            if "ConditionalRequestConflict" not in str(e) and "409" not in str(e) or attempt == CONFLICT_RETRIES:
                raise
            time.sleep(0.2 * (attempt + 1))
        finally:
            fs.invalidate_cache(p)
    return False  # (not reached)


CONFLICT_RETRIES = 8


def upload(local, url) -> None:
    fs, p = filesystem(url)
    _call("uploading to", url, lambda: fs.put_file(str(local), p), write=True)
    fs.invalidate_cache(p)


def download(url, local) -> None:
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{os.getpid()}.part")
    fs, p = filesystem(url)

    def get():
        try:
            fs.get_file(p, str(tmp))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # this node's disk, not the store: say so, not "check URL"
                raise DiskFullError(e.errno, f"no space left on the disk of {local.parent} to download {url}: free "
                                    f"space there, or point {RUN_CACHE_ENV} / GRT_DATASET_CACHE at a larger "
                                    f"node-local disk", str(tmp)) from None
            raise
    try:
        _call("downloading", url, get)
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def sizes_under(path) -> dict[str, int]:
    """{name relative to ``path``: bytes} of every file below the folder ``path`` ({} when there is none)."""
    if not is_remote(path):
        root = Path(path)
        return ({f.relative_to(root).as_posix(): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}
                if root.is_dir() else {})
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    try:
        found = _call("listing", path, lambda: fs.find(p, detail=True))
    except FileNotFoundError:
        return {}
    prefix = p.rstrip("/") + "/"
    return {k[len(prefix):]: int(v["size"]) for k, v in sorted(found.items())
            if k.startswith(prefix) and v.get("type") != "directory"}


def move(src, dst) -> None:
    """Move a folder and everything under it (on S3: a copy of each object, then its removal)."""
    if not is_remote(src):
        os.replace(src, dst)
        return
    fs, p = filesystem(src)
    _, q = filesystem(dst)
    for name in sizes_under(src):  # object by object (s3fs's recursive mv also copies the folder markers it lists)
        _call("copying", f"{src}/{name}", lambda name=name: fs.copy(f"{p}/{name}", f"{q}/{name}"))
    remove(src)
    fs.invalidate_cache(q)


RUN_CACHE_ENV = "GRT_RUN_CACHE"


def local_copy(url, reader: bool = False) -> Path:
    """This node's working copy of the folder at ``url`` on the store: ``$GRT_RUN_CACHE/<scheme>/<bucket>/<prefix>``
    (default ``$XDG_CACHE_HOME/grt/runs``, i.e. ``~/.cache/grt/runs``). Training writes the run there first and the
    store keeps what counts (docs/object-storage.md). ``reader``: the copy `grt eval` / `export` read from, apart
    (``.../read/<scheme>/...``), so that they never touch the files of a training on the same node."""
    if os.environ.get(RUN_CACHE_ENV):
        root = Path(os.environ[RUN_CACHE_ENV]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grt" / "runs"
    scheme, rest = str(url).split("://", 1)
    root = root / "read" if reader else root
    return root.joinpath(scheme, *[part for part in rest.split("/") if part not in ("", ".", "..")])


def open_file(path, mode: str = "rb"):
    if not is_remote(path):
        return open(path, mode)
    fs, p = filesystem(path)
    return _call("opening", path, lambda: fs.open(p, mode))
