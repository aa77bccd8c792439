"""A run folder on object storage (``out_dir: s3://bucket/prefix``): the store keeps the run, each node works in a
copy of it on its own disk (``storage.local_copy``).

- **Checkpoints** are written by every rank into the node's staging folder as on a filesystem, then uploaded to
  ``RUN/checkpoints/step_N/`` on the store: each file once, by one of the ranks that see it (so a node-local disk and
  a shared one both work), hashed while it is uploaded. The integrity index (``index.json``: size and sha256 of every
  file) is uploaded last and is the commit marker: a folder on the store without it is an unfinished upload, never
  loaded, and removed by the next save or resume. Then each node publishes its local copy (renamed, indexed), and old
  checkpoints are pruned on the store and locally by ``train.keep_checkpoints``.
- **Resume**: the newest checkpoint on the store whose files all match its index is downloaded where a node's copy
  lacks or differs from it (every file checked against the index); a damaged one (a truncated or altered object) is
  moved aside on the store as ``damaged_step_N`` with a warning and the next older one is tried. Local checkpoints the
  store does not hold intact are dropped: the store decides what the run has.
- **Run files** (recipe.yaml, metrics.jsonl, run.json, restarts.jsonl, stopped.json, eval_curve.png, the tokenizer
  copy, ...) are uploaded by rank 0 at the start, after each checkpoint and at the end, and downloaded at a resume.
- ``grt eval / generate / export / checkpoint convert`` on ``s3://.../NAME`` work on a copy fetched the same way
  (:func:`fetch_run`); ``grt checkpoint verify s3://...`` checks the objects themselves (:func:`verify_in_store`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from pipeline.runtime import storage
from pipeline.runtime.locking import FALLBACK_FILE
from pipeline.runtime.locking import LOCK_FILE
from pipeline.runtime.locking import launch_job_id
from pipeline.train import faults
from pipeline.train.checkpoint import INDEX
from pipeline.train.checkpoint import INDEX_PARTS
from pipeline.train.checkpoint import INDEX_VERSION
from pipeline.train.checkpoint import STEP_DIR
from pipeline.train.checkpoint import sha256_and_size
from pipeline.train.checkpoint import size_problem

CHECKPOINTS = "checkpoints"
LOCAL_ONLY = (LOCK_FILE, FALLBACK_FILE)
NOT_RUN_FILES = (CHECKPOINTS, "exports")  # the checkpoints travel apart; exports are this node's own outputs
UPLOADING = ".grt_upload.json"  # written first into a checkpoint folder on the store: grt's own upload


def _attempt(fn, *args) -> list[str]:
    """``fn(*args)``'s problems, or the one it raised as a problem: a rank's failure never skips a collective."""
    try:
        return fn(*args)
    except (OSError, ValueError, storage.StorageError) as e:
        return [f"{type(e).__name__}: {e}"]


def store_steps(url: str) -> dict[int, dict[str, int]]:
    """{step: {file: bytes}} of the checkpoint folders under ``url/checkpoints`` (committed or not)."""
    out: dict[int, dict[str, int]] = {}
    for name, size in storage.sizes_under(storage.join(url, CHECKPOINTS)).items():
        folder, _, rest = name.partition("/")
        m = STEP_DIR.match(folder)
        if m and rest:
            out.setdefault(int(m.group(1)), {})[rest] = size
    return dict(sorted(out.items()))


def committed_steps(url: str) -> list[int]:
    """The steps whose checkpoint on the store has its index (the commit marker), oldest first."""
    return [s for s, files in store_steps(url).items() if INDEX in files]


def step_url(url: str, step: int) -> str:
    return storage.join(url, CHECKPOINTS, f"step_{step:08d}")


def read_index(ckpt_url: str) -> dict:
    return json.loads(storage.read_text(storage.join(ckpt_url, INDEX)))


def verify_in_store(ckpt_url: str, files: dict[str, int] | None = None, checksums: bool = True) -> list[str]:
    """What is wrong with the checkpoint at ``ckpt_url`` against its index, reading the objects (sizes from one
    listing; with ``checksums`` every object streamed and hashed). Empty: intact."""
    files = storage.sizes_under(ckpt_url) if files is None else files
    if INDEX not in files:
        return [f"{INDEX} is missing (an upload that never finished: it is never loaded)"]
    try:
        entries = read_index(ckpt_url)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{INDEX} is unreadable ({type(e).__name__}: {e})"]
    problems = []
    for name, e in entries.items():
        if name not in files:
            problems.append(f"{name} is missing")
        elif files[name] != e["bytes"]:
            problems.append(size_problem(name, files[name], e["bytes"]))
        elif checksums:
            h = hashlib.sha256()
            with storage.open_file(storage.join(ckpt_url, name)) as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
            if h.hexdigest() != e["sha256"]:
                problems.append(f"{name}'s sha256 differs from the index (its bytes changed after the save)")
    return problems


def download_checkpoint(ckpt_url: str, local: Path, stored: dict[str, int] | None = None) -> list[str]:
    """Make ``local`` a checked copy of the checkpoint at ``ckpt_url``: each file the index names that the copy lacks
    or holds with other bytes is downloaded and checked against the index. What is wrong (empty: the copy is whole
    and intact); the index is written into the copy last, only when nothing is. ``stored``: the objects' sizes on
    the store ({name: bytes}, from one listing), which must match the index too, whatever the copy holds."""
    try:
        entries = read_index(ckpt_url)["files"]
    except FileNotFoundError:
        return [f"{INDEX} is missing (an upload that never finished: it is never loaded)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{INDEX} is unreadable ({type(e).__name__}: {e})"]
    if stored is not None:  # the store's own copy is what every other node resumes from
        problems = verify_in_store(ckpt_url, stored, checksums=False)
        if problems:
            return problems
    local.mkdir(parents=True, exist_ok=True)
    (local / INDEX).unlink(missing_ok=True)  # written back below once every file matches
    problems = []
    for name, e in entries.items():
        f = local / name
        if f.is_file() and f.stat().st_size == e["bytes"] and sha256_and_size(f)[0] == e["sha256"]:
            continue
        try:
            storage.download(storage.join(ckpt_url, name), f)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        sha, size = sha256_and_size(f)
        if size != e["bytes"]:
            problems.append(size_problem(name, size, e["bytes"]))
        elif sha != e["sha256"]:
            problems.append(f"{name}'s sha256 differs from the index (its bytes changed after the save)")
    if not problems:
        (local / INDEX).write_text(json.dumps({"version": INDEX_VERSION, "files": entries}, indent=1))
    return problems


def set_aside_in_store(url: str, step: int) -> str:
    """Move a damaged checkpoint on the store out of the way (``damaged_step_N``, kept for inspection); its URL."""
    names = storage.listdir(storage.join(url, CHECKPOINTS))
    base = f"damaged_step_{step:08d}"
    target, n = base, 1
    while target in names:
        n += 1
        target = f"{base}.{n}"
    dst = storage.join(url, CHECKPOINTS, target)
    storage.move(step_url(url, step), dst)
    return dst


def run_files(local: Path) -> list[Path]:
    """The files of a run folder the store keeps besides its checkpoints (not the lock, not temporary files)."""
    if not local.is_dir():
        return []
    return [f for f in sorted(local.rglob("*")) if f.is_file() and f.relative_to(local).parts[0] not in
            NOT_RUN_FILES and f.name not in LOCAL_ONLY and not f.name.startswith(".") and not f.name.endswith(".part")]


def fetch_run_files(url: str, local: Path) -> None:
    """The store's run files into the local copy. The store's version replaces the local one, except a local file
    that extends it (metrics.jsonl, restarts.jsonl written past the last upload before a kill: the resume cuts the
    history back to its step itself)."""
    for name in storage.sizes_under(url):
        if name.split("/", 1)[0] in NOT_RUN_FILES or name.rsplit("/", 1)[-1] in LOCAL_ONLY:
            continue
        mine = local / name
        stored = mine.with_name(f".{mine.name}.{os.getpid()}.stored")
        storage.download(storage.join(url, name), stored)
        if mine.is_file() and mine.stat().st_size > stored.stat().st_size and \
                mine.read_bytes().startswith(stored.read_bytes()):
            stored.unlink()
        else:
            os.replace(stored, mine)


def split_url(url: str) -> tuple[str, int | None]:
    """(the run's URL, the step) of ``s3://.../NAME/checkpoints/step_N``; (the URL, None) of a run's."""
    url = url.rstrip("/")
    parent, _, leaf = url.rpartition("/")
    if STEP_DIR.match(leaf) and parent.endswith("/" + CHECKPOINTS):
        return parent.rpartition("/")[0], int(STEP_DIR.match(leaf).group(1))
    return url, None


def fetch_run(url: str) -> Path:
    """For `grt eval / generate / export` on ``s3://.../NAME`` (a run) or ``.../checkpoints/step_N``: this node's copy
    (run files and that checkpoint, or the run's newest intact one, each file checked against the index)."""
    run, step = split_url(url)
    steps = [step] if step is not None else list(reversed(committed_steps(run)))
    local = storage.local_copy(run, reader=True)  # never the copy a training on this node works in
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {url}: expected a run folder on the store (s3://.../NAME) with "
                                f"checkpoints/step_*/{INDEX}, or one such step folder; train first with out_dir= "
                                f"its parent")
    fetch_run_files(run, local)
    for step in steps:
        problems = download_checkpoint(step_url(run, step), local / CHECKPOINTS / f"step_{step:08d}")
        if not problems:
            return local / CHECKPOINTS / f"step_{step:08d}"
        print(f"warning: checkpoint {step_url(run, step)} on the store is damaged ({'; '.join(problems)}); "
              f"{'trying the next older one' if step != steps[-1] else 'no older one is left'}",
              file=sys.stderr, flush=True)
    raise ValueError(f"no intact checkpoint under {url} (see the warnings): `grt checkpoint verify {url}` lists them")


def push_results(url: str, local_run: Path, folder: Path) -> str:
    """A folder written into the local copy of the run at ``url`` (`grt eval`'s results) uploaded to the same place
    on the store; its URL there."""
    target = storage.join(split_url(url)[0], folder.relative_to(local_run).as_posix())
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            storage.upload(f, storage.join(target, f.relative_to(folder).as_posix()))
    return target


class RunStore:
    """The store side of a training run whose ``out_dir`` is on object storage (see the module's text). Every rank
    holds one; which rank does what is said at each method."""

    def __init__(self, url: str, local: Path, backend):
        self.url, self.local, self.be = url.rstrip("/"), local, backend
        self._pushed: dict[str, tuple[int, int]] = {}  # run file -> (size, mtime_ns) last uploaded

    @property
    def leads_node(self) -> bool:
        """The rank that fills and prunes this node's copy (one per node: GRT_RUN_CACHE must be node-local)."""
        return self.be.local_rank == 0

    # ------------------------------------------------------------------------------------------ resume
    def pull_for_resume(self) -> int | None:
        """Every rank, before the local resume: each node's copy holds the store's newest intact checkpoint (and the
        run files), and no local checkpoint the store does not hold intact. Returns its step (None: none)."""
        be = self.be
        steps = store_steps(self.url)
        committed = [s for s, files in steps.items() if INDEX in files]
        if be.is_main:
            self.drop_unfinished(steps, keep=None)
        chosen = None
        for step in reversed(committed):
            problems = self._fill_local(step, steps[step]) if self.leads_node else []
            if be.all_true(not problems, patient=True):
                chosen = step
                break
            # damaged on the store, or only a node's copy failed? rank 0 reads the objects themselves
            on_store = _attempt(verify_in_store, step_url(self.url, step), steps[step]) if be.is_main else []
            if be.all_true(not on_store, patient=True):
                raise OSError(f"checkpoint {step_url(self.url, step)} is intact on the store, but "
                              f"{'this node' if problems else 'another node'} could not fetch it"
                              f"{': ' + '; '.join(problems) if problems else ' (see its error)'}. Fix that node's "
                              f"disk (its copy of the run: {self.local}, under {storage.RUN_CACHE_ENV}) or network, "
                              f"then run the same command again")
            if be.is_main:
                moved = set_aside_in_store(self.url, step)
                print(f"warning: checkpoint step {step} on the store is damaged ({'; '.join(on_store)}); moved it "
                      f"aside to {moved} and trying the next older one", file=sys.stderr, flush=True)
            if self.leads_node:
                shutil.rmtree(self._local_step(step), ignore_errors=True)
            be.barrier(patient=True)
        error = None
        if self.leads_node:
            try:
                fetch_run_files(self.url, self.local)
            except (OSError, storage.StorageError) as e:
                error = e
            ckpts = self.local / CHECKPOINTS
            for c in (list(ckpts.iterdir()) if ckpts.is_dir() else []):
                m = STEP_DIR.match(c.name)
                if (m and int(m.group(1)) != chosen) or c.name.startswith(".tmp_step_"):
                    shutil.rmtree(c, ignore_errors=True)  # the store does not hold it intact (or it is a staging)
        if not be.all_true(error is None, patient=True):
            raise error or OSError(f"another node could not fetch the run files of {self.url} (see its error)")
        aside = [n for n in storage.listdir(storage.join(self.url, CHECKPOINTS)) if n.startswith("damaged_step_")]
        if chosen is None and aside:  # a relaunch after "every checkpoint is damaged" must not quietly start over
            where = storage.join(self.url, CHECKPOINTS)
            raise ValueError(f"{where} holds only checkpoints set aside as damaged ({', '.join(aside)}, see the "
                             f"warnings): nothing to resume from. Start the run over under another name=, or remove "
                             f"{where} to train this one from scratch")
        return chosen

    def _fill_local(self, step: int, stored: dict[str, int] | None = None) -> list[str]:
        return _attempt(download_checkpoint, step_url(self.url, step), self._local_step(step), stored)

    def drop_unfinished(self, steps: dict[int, dict[str, int]], keep: int | None) -> None:
        """Rank 0: remove the checkpoint folders on the store that grt began to upload (its marker is there) and
        never committed, but ``keep`` (the one being uploaded); a folder without index and marker is not grt's
        upload: it is named, never removed."""
        for s, files in steps.items():
            if INDEX in files or s == keep:
                continue
            where = step_url(self.url, s)
            if UPLOADING in files:
                storage.remove(where)
                print(f"note: removed {where}: an upload of a checkpoint that a kill interrupted (no {INDEX})",
                      file=sys.stderr, flush=True)
            elif keep is None:
                print(f"warning: ignored {where}: it has no {INDEX} and was not uploaded by grt. If it is a "
                      f"checkpoint you trust, copy it to a disk, index it there (`grt checkpoint verify DIR --adopt`) "
                      f"and upload it with its index", file=sys.stderr, flush=True)

    def complete_local(self, step: int) -> None:
        """Every rank: each node's copy of the checkpoint of ``step`` made whole (a node-local disk holds only the
        files its own ranks wrote) before it is loaded again (train.spike's rollback)."""
        problems = self._fill_local(step) if self.leads_node else []
        if not self.be.all_true(not problems, patient=True):
            raise ValueError(f"the checkpoint {step_url(self.url, step)} could not be fetched from the store: "
                             f"{'; '.join(problems) or 'see another node'}")

    # ------------------------------------------------------------------------------------------ save
    def begin_upload(self, step: int) -> None:
        """Rank 0, before any rank uploads a file of ``step``'s checkpoint: the marker that makes the folder grt's
        own upload (removable until its index commits it)."""
        storage.write_text(storage.join(step_url(self.url, step), UPLOADING),
                           json.dumps({"step": step, "job": launch_job_id(), "pid": os.getpid()}))

    def upload_share(self, staging: Path, step: int) -> dict:
        """Every rank: upload its share of the staged files (each file once: the ranks that see it take turns) and
        return their digests {name: {bytes, sha256}}."""
        try:
            mine = ({f.relative_to(staging).as_posix(): f.stat().st_size for f in sorted(staging.rglob("*"))
                     if f.is_file() and f.name != INDEX and INDEX_PARTS not in f.relative_to(staging).parts}
                    if staging.is_dir() else {})  # (DDP's full format: rank 0 alone writes)
            error = None
        except OSError as e:
            mine, error = None, e
        seen = self.be.gather(mine)  # every rank, whatever happened above
        if error is not None:
            raise error
        if any(files is None for files in seen):
            raise OSError(f"another rank could not list its part of the checkpoint of step {step} (see its error)")
        owners: dict[str, list[int]] = {}
        for rank, files in enumerate(seen):
            for name in files:
                owners.setdefault(name, []).append(rank)
        digests = {}
        target = step_url(self.url, step)
        for i, (name, ranks) in enumerate(sorted(owners.items())):
            if ranks[i % len(ranks)] != self.be.rank:
                continue
            f = staging / name
            sha, size = sha256_and_size(f)
            digests[name] = {"bytes": size, "sha256": sha}
            storage.upload(f, storage.join(target, name))
            faults.after_upload(step, len(digests))
        return digests

    def commit(self, staging: Path, step: int, digests: dict) -> None:
        """Rank 0, once every rank's share is uploaded: the index into the staged folder and onto the store, last."""
        index = {"version": INDEX_VERSION, "files": dict(sorted(digests.items()))}
        (staging / INDEX).write_text(json.dumps(index, indent=1))
        storage.upload(staging / INDEX, storage.join(step_url(self.url, step), INDEX))

    def prune(self, step: int, keep: int, keep_steps) -> None:
        """Rank 0, after the commit of ``step``: the store's checkpoints beyond ``keep`` (never ``keep_steps``) and
        grt's unfinished uploads removed. A failure is a warning: ``step`` is committed, training goes on."""
        try:
            steps = store_steps(self.url)
            done = [s for s, files in steps.items() if INDEX in files and s <= step and s not in keep_steps]
            for s in done[:-keep]:
                storage.remove(storage.join(step_url(self.url, s), INDEX))  # the marker first: never half an intact
                storage.remove(step_url(self.url, s))
            self.drop_unfinished(steps, keep=step)
        except (OSError, storage.StorageError) as e:
            print(f"warning: pruning the checkpoints of {self.url} failed ({e}); step {step} is saved, the next save "
                  f"tries again", file=sys.stderr, flush=True)

    def publish_local(self, staging: Path, step: int, index: dict, keep: int, keep_steps) -> Path:
        """The node leaders: the staged folder renamed ``step_N`` in the node's copy (made, with only the index, on
        a node that wrote no file of it: its newest checkpoint is the job's, the files come when loaded), with the
        committed index; the local copies beyond ``keep`` dropped (the store holds them)."""
        final = self._local_step(step)
        if self.leads_node:
            if staging.is_dir():
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staging, final)
            final.mkdir(parents=True, exist_ok=True)
            (final / INDEX).write_text(json.dumps(index, indent=1))
            local = sorted(int(STEP_DIR.match(c.name).group(1)) for c in (self.local / CHECKPOINTS).iterdir()
                           if STEP_DIR.match(c.name))
            for s in [s for s in local if s <= step and s not in keep_steps][:-keep]:
                shutil.rmtree(self._local_step(s), ignore_errors=True)
        return final

    def _local_step(self, step: int) -> Path:
        return self.local / CHECKPOINTS / f"step_{step:08d}"

    # ------------------------------------------------------------------------------------------ run files
    def push_run_files(self) -> None:
        """Rank 0: upload the run files that changed since the last push."""
        for f in run_files(self.local):
            stat = f.stat()
            name = f.relative_to(self.local).as_posix()
            if self._pushed.get(name) != (stat.st_size, stat.st_mtime_ns):
                storage.upload(f, storage.join(self.url, name))
                self._pushed[name] = (stat.st_size, stat.st_mtime_ns)

