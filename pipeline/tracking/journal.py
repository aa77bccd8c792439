"""The tracking journal of a run folder, and how its lines are sent to the store.

Everything the trainer sends to MLflow goes through a journal in the run folder (``tracking_buffer.jsonl``, one JSON
line per call, appended and fsynced) and leaves it once the store has taken it. A server that goes away mid-run, or
a job killed between two flushes, therefore loses nothing: the journal is replayed in order at the next flush that
reaches the server, when the run resumes, or by ``grt track sync RUN``.

Replaying twice is harmless, so no cursor is kept: MLflow drops a metric equal in (key, value, timestamp, step) to
one the run already has, params already on the run are skipped, tags, dataset inputs, artifacts and the final
status overwrite themselves. The journal is emptied only after every line in it was accepted.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipeline.runtime.locking import locked_file

BUFFER_FILE = "tracking_buffer.jsonl"
REJECTED_FILE = "tracking_rejected.jsonl"  # lines the store refused for good (HTTP 4xx): kept aside, never resent
# MLflow's limits per log_batch call
MAX_METRICS_PER_BATCH, MAX_PARAMS_PER_BATCH, MAX_TAGS_PER_BATCH = 1000, 100, 100


class TrackingBuffer:
    """The journal of one run folder (``path``), or an in-memory list when there is no run folder (``path=None``).

    Each line is ``{"op": ..., ...}`` with op one of: ``metrics`` (``items``: ``[key, value, timestamp_ms, step]``),
    ``params``, ``tags`` (``items``: a dict), ``inputs`` (``datasets``: MLflow dataset fields + ``context``),
    ``artifact`` (``path``, ``artifact_path``) and ``terminate`` (``status``, ``end_time``).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self._memory: list[dict] = []
        self._file = None
        if path is not None:
            self._file = open(path, "a+b")
            with self._locked():
                self._file.seek(0, os.SEEK_END)
                if self._file.tell() and self._last_byte() != b"\n":
                    # a job killed in the middle of an append left half a line: close it, replay skips it
                    self._file.write(b"\n")
                    self._sync()

    @property
    def pending(self) -> int:
        """Lines waiting to be sent."""
        if self._file is None:
            return len(self._memory)
        with self._locked():
            return len(self._read())

    def append(self, item: dict) -> None:
        if self._file is None:
            self._memory.append(item)
            return
        line = (json.dumps(item, separators=(",", ":")) + "\n").encode()
        while True:
            with self._locked():
                removed = os.fstat(self._file.fileno()).st_nlink == 0
                if not removed:
                    self._file.write(line)
                    self._sync()  # a killed job, or a dead node, keeps every line it appended
                    return
            # a `grt track sync` emptied the journal and removed it meanwhile: append to a new file at the path
            self._file.close()
            self._file = open(self.path, "a+b")

    def replay(self, client, run_id: str) -> int:
        """Send every pending line to ``run_id`` in order, then empty the journal; returns the number of lines sent.
        Raises whatever the client raises (the journal stays as it was: a later replay sends it again)."""
        if self._file is None:
            items, self._memory = self._memory, []
            try:
                send(client, run_id, items)
            except BaseException:
                self._memory = items + self._memory
                raise
            return len(items)
        with self._locked():
            items = self._read()
            try:
                send(client, run_id, items)
            except Exception as e:  # noqa: BLE001
                if not refused_for_good(e):
                    raise  # the server is away: keep every line for the next replay
                self._send_one_by_one(client, run_id, items)
            self._file.truncate(0)
            self._sync()
        return len(items)

    def _send_one_by_one(self, client, run_id: str, items: list[dict]) -> None:
        """The store refused something for good: find the lines it refuses, set them aside (with a warning) so
        that they never block the rest; if the server goes away meanwhile, keep what is left and re-raise."""
        for i, item in enumerate(items):
            try:
                send(client, run_id, [item])
            except Exception as e:  # noqa: BLE001
                if not refused_for_good(e):
                    self._file.truncate(0)
                    self._file.write(b"".join((json.dumps(x, separators=(",", ":")) + "\n").encode()
                                              for x in items[i:]))
                    self._sync()
                    raise
                aside = self.path.with_name(REJECTED_FILE)
                with open(aside, "a") as f:
                    f.write(json.dumps({"error": str(e)[:2000], "line": item}) + "\n")
                print(f"tracking: WARNING: the MLflow store refused a buffered {item['op']!r} line for good "
                      f"({str(e).splitlines()[0][:300]}); it is kept in {aside} and not sent again",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the journal; an empty one is removed (nothing left to sync)."""
        if self._file is not None:
            with self._locked():
                if self._file.seek(0, os.SEEK_END) == 0:
                    self.path.unlink(missing_ok=True)
            self._file.close()
            self._file = None

    # ---------------------------------------------------------------------------------------------- file
    def _locked(self):
        return locked_file(self._file)  # the trainer and a `grt track sync` of the same run never interleave

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def _last_byte(self) -> bytes:
        self._file.seek(-1, os.SEEK_END)
        return self._file.read(1)

    def _read(self) -> list[dict]:
        self._file.seek(0)
        items = []
        for n, line in enumerate(self._file.read().splitlines(), 1):
            try:
                items.append(json.loads(line))
            except ValueError:
                print(f"tracking: {self.path}:{n} is not a complete line (a job killed while appending it); "
                      f"skipped", file=sys.stderr)
        return items


def refused_for_good(e: Exception) -> bool:
    """An answer of the store that a retry will not change (HTTP 4xx: invalid value, too long, ...), as opposed to
    a server that cannot be reached (connection errors, 5xx), after which every line is kept for later."""
    from mlflow.exceptions import MlflowException

    if not isinstance(e, MlflowException):
        return False
    status = e.get_http_status_code()
    return 400 <= status < 500 and status not in (408, 429)



def send(client, run_id: str, items: list[dict]) -> None:
    """Send journal lines in order; consecutive metrics, params and tags go in as few batches as MLflow allows."""
    from mlflow.entities import Dataset as DatasetEntity
    from mlflow.entities import DatasetInput
    from mlflow.entities import InputTag
    from mlflow.entities import Metric
    from mlflow.entities import Param
    from mlflow.entities import RunTag

    metrics: list = []

    def send_metrics():
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])
        metrics.clear()

    existing_params = None
    for item in items:
        op = item["op"]
        if op == "metrics":
            metrics += [Metric(k, v, ts, step) for k, v, ts, step in item["items"]]
            continue
        send_metrics()
        if op == "params":
            if existing_params is None:  # MLflow refuses a param whose value changes: a resumed run keeps the first
                existing_params = client.get_run(run_id).data.params
            new = [Param(k, v) for k, v in item["items"].items() if k not in existing_params]
            for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
                client.log_batch(run_id, params=new[i:i + MAX_PARAMS_PER_BATCH])
            existing_params.update({p.key: p.value for p in new})
        elif op == "tags":
            tags = [RunTag(k, v) for k, v in item["items"].items()]
            for i in range(0, len(tags), MAX_TAGS_PER_BATCH):
                client.log_batch(run_id, tags=tags[i:i + MAX_TAGS_PER_BATCH])
        elif op == "inputs":
            client.log_inputs(run_id, [DatasetInput(DatasetEntity(**{k: v for k, v in d.items() if k != "context"}),
                                                    [InputTag("mlflow.data.context", d["context"])])
                                       for d in item["datasets"]])
        elif op == "artifact":
            if Path(item["path"]).exists():
                client.log_artifact(run_id, item["path"], item["artifact_path"])
            else:
                print(f"tracking: buffered artifact {item['path']} no longer exists; skipped", file=sys.stderr)
        elif op == "terminate":
            client.set_terminated(run_id, item["status"], item["end_time"])
        else:
            raise ValueError(f"unknown tracking buffer line {item!r}: written by a newer version of grt-pipeline?")
    send_metrics()
