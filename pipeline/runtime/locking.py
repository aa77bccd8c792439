"""One job per folder: an exclusive lock on a run folder (training) or a dataset folder (tokenizing).

The lock is ``FOLDER/.lock``, held with ``flock`` for the life of the job: the kernel (or the NFS lock manager)
drops it when the process dies, however it dies, so a lock is never left behind by a crash. The file also holds a
record of the holder (host, pid, start time, command, Slurm job); a record found under a lock that could be taken
belongs to a job that died without releasing it, and is reported as taken over. On a filesystem without ``flock``
(some parallel filesystems mounted without lock support) the lock falls back to creating ``FOLDER/.lock.excl``
exclusively; a leftover one of a dead process on this host is taken over, one of another host must be removed by
hand (the error says which file). A folder on an object store (``s3://...``) always uses that exclusive create, as a
conditional PUT (``If-None-Match: *``), so two jobs never both get it; as there is no flock, a job killed on another
host leaves the lock object behind, to be deleted by hand (the error names it).

:func:`locked_file` is the other mode: a blocking ``flock`` on one open file that several processes write (the
tracking journal: the trainer and `grt track sync`), held only around each read or write.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from pipeline.runtime import storage

LOCK_FILE = ".lock"
FALLBACK_FILE = ".lock.excl"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# folders this process holds: a nested acquire (two Trainers on one run folder in one notebook) shares the lock,
# which is dropped when the last of them releases it
_held: dict[Path, "FolderLock"] = {}


class FolderLockedError(FileExistsError):
    """Another live job holds the folder."""


def launch_job_id(environ=os.environ) -> str | None:
    """The launcher's job this process belongs to, which its relaunches keep: the SLURM job id (kept across
    requeues), else torchrun's rendezvous id (kept across restarts; not its default ``none``). None when neither
    tells. Recorded with the lock and in each checkpoint."""
    if environ.get("SLURM_JOB_ID"):
        return f"slurm job {environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun rendezvous {run_id}" if run_id and run_id != "none" else None


def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "job": launch_job_id()}


def describe_holder(record: dict | None) -> str:
    if not record:
        return "a job that is starting (no holder record yet)"
    job = f", Slurm job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    return (f"pid {record.get('pid')} on host {record.get('host')} since {record.get('started')}{job} "
            f"(`{record.get('command')}`)")


def _read_record(fd_or_path) -> dict | None:
    try:
        if isinstance(fd_or_path, int):
            os.lseek(fd_or_path, 0, os.SEEK_SET)
            text = os.read(fd_or_path, 1 << 16).decode(errors="replace")
        else:
            text = storage.read_bytes(fd_or_path).decode(errors="replace")
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FolderLock:
    """``with FolderLock(folder, "run folder"):`` — or :meth:`acquire` / :meth:`release`. Creates the folder."""

    def __init__(self, folder: str | Path, what: str, fix: str = ""):
        self.remote = storage.is_remote(folder)
        self.folder = str(folder).rstrip("/") if self.remote else Path(folder).resolve()
        self.what, self.fix = what, fix
        self._fd: int | None = None
        self._fallback: Path | None = None
        self._outer: FolderLock | None = None  # the holder this acquire is nested in
        self._count = 0  # acquires sharing this holder's lock, itself included
        self.took_over: dict | None = None  # the dead holder's record when a stale lock was taken over

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _refuse(self, record: dict | None, where: Path) -> FolderLockedError:
        return FolderLockedError(
            f"the {self.what} {self.folder} is in use by another job: {describe_holder(record)}. One folder belongs "
            f"to one job: wait for that job to end or stop it{self.fix} (lock file: {where})")

    def acquire(self) -> "FolderLock":
        if self.folder in _held:
            self._outer = _held[self.folder]
            self._outer._count += 1
            return self
        if self.remote:  # no flock on an object store: the exclusive-create lock (a conditional PUT)
            self._acquire_fallback()
        else:
            self._acquire_flock()
        if self.took_over:
            print(f"note: took over the {self.what} {self.folder} from a job that ended without releasing it: "
                  f"{describe_holder(self.took_over)}", file=sys.stderr, flush=True)
        self._count = 1
        _held[self.folder] = self
        return self

    def _acquire_flock(self) -> None:
        path = self.folder / LOCK_FILE
        for _ in range(10):  # again while the file we locked was removed or replaced meanwhile (not the lock then)
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the folder was removed meanwhile
                continue
            try:
                if os.environ.get("GRT_LOCK_FALLBACK"):  # testing hook: behave as on a filesystem without flock
                    raise OSError(errno.ENOLCK, "flock disabled by GRT_LOCK_FALLBACK")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(fd)
                os.close(fd)
                raise self._refuse(record, path) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_FLOCK:
                    raise
                self._acquire_fallback()
                break
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                break
            os.close(fd)
        else:
            raise FolderLockedError(f"the lock file {path} keeps being removed or replaced by another process; stop "
                                    f"whatever deletes {self.folder} and try again")
        if self._fd is not None:
            self.took_over = _read_record(fd)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(_holder_record()) + "\n").encode())
            os.fsync(fd)

    def _acquire_fallback(self) -> None:
        path = storage.join(self.folder, FALLBACK_FILE)
        mine = {**_holder_record(), "nonce": os.urandom(8).hex()}
        for _ in range(2):
            if not storage.create_exclusive(path, (json.dumps(mine) + "\n").encode()):
                record = _read_record(path)
                local = record and record.get("host") == socket.gethostname()
                if record and record.get("nonce") == mine["nonce"]:  # our own create, retried after it landed
                    self._fallback = path
                    return
                relaunch = record and record.get("job") and record["job"] == launch_job_id()
                if relaunch or (local and isinstance(record.get("pid"), int) and not _pid_alive(record["pid"])):
                    # a dead holder here, or an earlier start of this same job on any host (a torchrun restart
                    # or a SLURM requeue, whose rank 0 may run on another node now)
                    self.took_over = record
                    storage.remove(path)
                    continue
                err = self._refuse(record, path)
                if record and not local:
                    kind = "An object store" if self.remote else "This filesystem"
                    err = FolderLockedError(f"{err}. {kind} has no flock, so a job on another host cannot "
                                            f"be checked: if it is gone, delete {path}")
                raise err from None
            self._fallback = path
            return
        raise self._refuse(_read_record(path), path)

    def release(self) -> None:
        holder, self._outer = self._outer or self, None
        if holder._count == 0:  # not held (released already)
            return
        holder._count -= 1
        if holder._count:
            return
        holder._unlock()

    def _unlock(self) -> None:
        _held.pop(self.folder, None)
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # emptied, never unlinked: a job opening it now must lock the same file
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._fallback is not None:
            storage.remove(self._fallback)
            self._fallback = None

    def close_in_child(self) -> None:
        """In a forked child: drop the inherited descriptor so that the lock dies with the parent, not the child."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def locked_file(f):
    """Hold an exclusive ``flock`` on the open file ``f`` for the block, waiting for it if another process holds it
    (for a file several processes append to: each writer's read-modify-write stays whole)."""
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
        yield f
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def forked_child_cleanup() -> None:
    """For a fork-started worker's initializer: drop every inherited lock descriptor."""
    for lock in list(_held.values()):
        lock.close_in_child()
    _held.clear()
