"""What the ranks of one job know about each other: at start-up, that every node runs the same recipe and the same
code (:func:`compare_job`); while training, a heartbeat per rank in the launcher's store, so that when a collective
fails the survivors can name the rank that stopped answering (:class:`Heartbeat`)."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

from pipeline.config.recipe_files import flat

# Recipe keys that may differ between the nodes of one job, so they are not compared. Everything else must be equal:
# the model, the optimizer, the schedule, the batch, the seed and the run name decide what every rank computes.
PER_NODE_KEYS = (
    "out_dir",                       # where this node mounts the run folder (name= below it is compared)
    "data.dataset_dir",              # a node-local copy of the tokenized dataset (its tokenizer is checked per rank)
    "data.mixture[].dataset_dir",    # the same, per mixture entry (the weights are compared)
    "data.sources",                  # where `grt tokenize` read the raw text: training reads the tokenized dataset
    "data.validation_sources",
    "data.workers",                  # tokenizer processes: a per-machine choice, the output does not depend on it
    "train.threads",                 # CPU threads per rank: nodes may have different CPU counts
    "tracking.uri",                  # only rank 0 logs; a sqlite path may be spelled differently per node
    "eval.task_data_dir",            # a path, read by `grt eval` only
)
CODE_DIRS = ("pipeline", "ops")  # the training code whose source every node must share
SHOWN_KEYS = 8  # differing keys named in the one-line error (the rest counted)


class JobMismatch(ValueError):
    """The nodes of one job were started with different recipes or code."""


def compared_recipe(recipe: dict) -> dict:
    """The resolved recipe's keys that must be the same on every node (PER_NODE_KEYS, and all below them, left
    out; ``[]`` stands for any list index)."""
    def per_node(key: str) -> bool:
        key = re.sub(r"\[\d+\]", "[]", key)
        return any(key == pat or key.startswith((pat + ".", pat + "[")) for pat in PER_NODE_KEYS)

    return {k: v for k, v in flat(recipe, lists=True).items() if not per_node(k)}


def code_digest(root: Path | None = None) -> str:
    """sha256 of the training code's Python sources (CODE_DIRS, paths and bytes): the same checkout, or the same
    installed package, on every node. Not ``git describe``: an installed copy has no .git, and a checkout with
    uncommitted edits describes as the same commit."""
    root = root or Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for name in CODE_DIRS:
        for path in sorted((root / name).rglob("*.py")):
            if "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def job_identity(recipe: dict) -> dict:
    """What this rank compares with the others: the recipe's compared keys, the code, torch's version."""
    import torch

    return {**compared_recipe(recipe), "code (sha256 of pipeline/, ops/)": code_digest()[:16],
            "torch version": torch.__version__}


def digest(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def this_node() -> tuple[int | None, str]:
    """(node rank if the launcher says it, host name). torchrun: GROUP_RANK; DeepSpeed: CROSS_RANK; SLURM: NODEID."""
    for var in ("GROUP_RANK", "CROSS_RANK", "NODE_RANK", "SLURM_NODEID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value), socket.gethostname()
    return None, socket.gethostname()


def rank_list(ranks: list[int]) -> str:
    """``0-3, 6``: runs of consecutive ranks."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def where(rank: int, nodes: list[tuple[int | None, str]]) -> str:
    """``node 1, host gpu7`` (or ``host gpu7`` where the launcher gave no node rank) of ``rank``."""
    node, host = nodes[rank]
    return f"node {node}, host {host}" if node is not None else f"host {host}"


def mismatch_report(identities: list[dict], nodes: list[tuple[int | None, str]]) -> str:
    """One line: each differing key and which node's ranks hold which value, e.g.
    ``train.lr: node 0 (ranks 0-1) = 0.001, node 1 (ranks 2-3) = 0.05``."""
    keys = sorted({k for ident in identities for k in ident}
                  - {k for k in identities[0] if all(k in i and i[k] == identities[0][k] for i in identities)})
    parts = []
    for key in keys[:SHOWN_KEYS]:
        groups: dict[tuple[str, str], list[int]] = {}
        for rank, ident in enumerate(identities):
            node, host = nodes[rank]
            label = f"node {node}" if node is not None else f"host {host}"
            value = json.dumps(ident[key], default=str) if key in ident else "(absent)"
            groups.setdefault((label, value), []).append(rank)
        held = ", ".join(f"{label} (rank{'s' if len(r) > 1 else ''} {rank_list(r)}) = {value}"
                         for (label, value), r in groups.items())
        parts.append(f"{key}: {held}")
    more = f"; and {len(keys) - SHOWN_KEYS} more key(s)" if len(keys) > SHOWN_KEYS else ""
    return "; ".join(parts) + more


def compare_job(recipe: dict, rank: int, world_size: int, group) -> list[tuple[int | None, str]]:
    """Every rank: gather each rank's (node, host, digest of recipe + code); on any difference gather the full
    identities and raise :class:`JobMismatch` on every rank (the same data everywhere: the same decision). Returns
    the ranks' (node, host), for naming a rank later."""
    import torch.distributed as dist

    ident = job_identity(recipe)
    mine = (*this_node(), digest(ident))
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    nodes = [(n, h) for n, h, _ in everyone]
    if len({d for _, _, d in everyone}) == 1:
        return nodes
    identities: list = [None] * world_size
    dist.all_gather_object(identities, ident, group=group)
    raise JobMismatch(f"the nodes of this job were started differently, so none of them trains: "
                      f"{mismatch_report(identities, nodes)}. Start every node with the same recipe, overrides and "
                      f"code (keys that may differ per node: {', '.join(PER_NODE_KEYS)})")


def failure_line(e: BaseException) -> str:
    """One line for an exception that ends a rank: what `grt` prints as ``error: ...`` and what the other ranks
    name (a real or simulated torch.OutOfMemoryError gets the recipe keys that lower the memory)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and torch.cuda.is_initialized()
                  else "the CPU")
        return (f"out of memory on {device}: lower train.micro_batch_size (raise train.grad_accum_steps to keep the "
                f"batch) or set train.activation_checkpointing=core_step (or blocks)")
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class Heartbeat:
    """A counter per rank in the launcher's TCP store (torchrun's agent, or rank 0's store under other launchers),
    raised every ``interval`` seconds by a daemon thread. It runs while the main thread waits in a collective, so
    after a collective fails, the ranks whose counters stand still are the ones that died (or whose node did); a
    store that cannot be reached means its host, node 0, is gone. A rank whose training fails with an error leaves its
    one line under ``grt/heartbeat/failed/<rank>``, so that the others name the error rather than a silence.

    :meth:`watch` makes the same thread judge the others as well: on NCCL a collective with a dead or frozen peer does
    not fail in Python (the survivors wait for the collective timeout, then NCCL's watchdog aborts them), so the
    thread itself reports a peer that failed, fell silent or took the store with it, and ends the process."""

    WATCH_EVERY_S = 5.0  # how often a watching rank reads the others' counters (one multi_get of world_size keys)

    def __init__(self, rank: int, world_size: int, interval: float = 1.0):
        import torch.distributed as dist

        self.rank, self.world_size, self.interval = rank, world_size, interval
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.address = f"{self.host}:{self.port}"
        self._watch: tuple[float, object] | None = None  # (timeout_s, on_lost) once watch() is called
        self._reported = threading.Lock()  # held by whichever thread reports a lost peer: one report per process
        # a connection of its own: the training's store client is never shared with this thread
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
        self.store = dist.PrefixStore("grt/heartbeat/", client)
        self.store.add(str(rank), 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="grt-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, rank: int, world_size: int):
        """A heartbeat where the process group was created from MASTER_ADDR/MASTER_PORT; None elsewhere."""
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        try:
            return cls(rank, world_size)
        except Exception:  # noqa: BLE001 — no heartbeat costs only the naming of a dead rank, never the run
            return None

    def store_up(self) -> bool:
        """A plain socket connect to the store: torch's client, asked while the server is gone, prints a C++ stack
        trace before it raises."""
        try:
            socket.create_connection((self.host, self.port), timeout=2).close()
            return True
        except OSError:
            return False

    def watch(self, timeout_s: float, on_lost) -> None:
        """From now on the heartbeat thread calls ``on_lost(state)`` (once, then it is up to ``on_lost`` to end the
        process) when another rank failed (``("failed", {rank: line})``), its counter stood still for ``timeout_s``
        (``("silent", [ranks])``) or the store stayed unreachable that long (``("store", None)``). 0: off."""
        if timeout_s > 0:
            self._watch = (timeout_s, on_lost)

    def claim_report(self) -> bool:
        """True for the first caller only: the main thread after a failed collective, or the watching thread."""
        return self._reported.acquire(blocking=False)

    def _beat(self) -> None:
        last_seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        store_gone_since, next_look = None, time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if not self.store_up():  # node 0 is gone: its survivors' report names it, not a C++ trace here
                store_gone_since = store_gone_since or now
                if self._watch and now - store_gone_since >= self._watch[0]:
                    self._lost(("store", None))
                continue
            store_gone_since = None
            try:
                self.store.add(str(self.rank), 1)
                if self._watch is None or now < next_look:
                    continue
                next_look = now + min(self.WATCH_EVERY_S, self._watch[0] / 2)
                failed = self.failures()
                if failed:
                    self._lost(("failed", failed))
                counters = self.counters()
            except Exception:  # noqa: BLE001 — the store went between the connect and the call: the next look says
                continue
            for r, c in enumerate(counters):
                if r != self.rank and (r not in last_seen or last_seen[r][0] != c):
                    last_seen[r] = (c, now)
            silent = [r for r, (_, t) in sorted(last_seen.items()) if now - t >= self._watch[0]]
            if silent:
                self._lost(("silent", silent))

    def _lost(self, state) -> None:
        if not self._stop.is_set() and self.claim_report():
            self._watch[1](state)  # ends the process
        self._stop.wait()  # another thread reports (or the run ended): this one has nothing left to do

    def counters(self) -> list[int]:
        keys = [str(r) for r in range(self.world_size)]
        if hasattr(self.store, "multi_get"):
            return [int(v) for v in self.store.multi_get(keys)]
        return [self.store.add(k, 0) for k in keys]

    def fail(self, line: str) -> None:
        """This rank's training ends with an error: leave its one line for the others (best effort)."""
        try:
            if self.store_up():
                self.store.set(f"failed/{self.rank}", line)
                self.store.add("failed", 1)
        except Exception:  # noqa: BLE001 — the others then report a silence instead
            pass

    def failures(self) -> dict[int, str]:
        """{rank: its one line} of the other ranks that failed with an error."""
        if self.store.add("failed", 0) == 0:
            return {}
        found = [r for r in range(self.world_size) if r != self.rank and self.store.check([f"failed/{r}"])]
        return {r: self.store.get(f"failed/{r}").decode(errors="replace") for r in found}

    def silent_ranks(self) -> list[int] | None:
        """The other ranks whose counter did not move over three intervals; None: the store cannot be reached."""
        if not self.store_up():
            return None
        try:
            before = [self.store.add(str(r), 0) for r in range(self.world_size)]
            time.sleep(3 * self.interval)
            after = [self.store.add(str(r), 0) for r in range(self.world_size)]
        except Exception:  # noqa: BLE001
            return None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def stop(self) -> None:
        self._stop.set()
