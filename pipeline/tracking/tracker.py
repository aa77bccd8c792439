"""The MLflow side, behind one small interface: ``Tracker`` (and ``NullTracker`` when tracking is off).

One MLflow server serves every node (``tracking.uri: http://HEAD:5000``, docs/tracking.md); only global rank 0
opens a tracker. Everything logged goes through the run folder's journal (pipeline/tracking/journal.py) and is sent
in batches with ``log_batch`` every ``FLUSH_EVERY_S`` seconds (one ``log_metric`` costs ~12 ms on a sqlite store):
a server that is down when training starts is an error before the first step; one that goes away later costs the
run nothing but a warning — the journal keeps what it could not send and replays it when the server is back.
The client talks to the store directly (``MlflowClient``), so there is no global "active run" to leak between runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.config import TrackingConfig
from pipeline.tracking.journal import BUFFER_FILE
from pipeline.tracking.journal import TrackingBuffer
from pipeline.tracking.server import SERVER_HINT
from pipeline.tracking.server import TrackingUnavailableError
from pipeline.tracking.server import bound_http_retries
from pipeline.tracking.server import check_server
from pipeline.tracking.server import is_http
from pipeline.tracking.server import resolve_uri
from pipeline.tracking.server import server_answers
from pipeline.tracking.server import short_error

MAX_PARAM_LEN = 6000
MAX_TAG_LEN = 8000  # MLflow's limit on a tag value
FLUSH_EVERY_S, FLUSH_EVERY_METRICS = 10.0, 500  # never a request per step
RETRY_DOWN_S = 60.0  # while the server is away, look for it again this often (a probe costs <= PROBE_TIMEOUT_S)
SYSTEM_METRICS_INTERVAL_S = 10.0  # MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it
# MLflow 3.x marks an experiment's type with this tag (what the UI's experiment-type selector writes, see
# mlflow/server/js: setExperimentTag "mlflow.experimentKind"); "custom_model_development" is its "Machine learning"
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


class NullTracker:
    run_id: str | None = None
    uri = None
    ui_url = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_datasets(self, dataset_dirs: list[str | Path], context: str = "train",
                     uris: list[str] | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def start_system_metrics(self) -> None: ...
    def flush(self) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


# ------------------------------------------------------------------------------------------- run context
def git_sha(repo: Path = Path(__file__).resolve().parents[2]) -> str:
    """HEAD of the checkout this code runs from ("+dirty" with uncommitted changes to tracked files); "unknown" when
    it is not a git checkout (an installed package: a git repository around site-packages is not ours)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != repo.resolve():
            return "unknown"
        sha = git("rev-parse", "HEAD")
        return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def detect_launcher(env=os.environ) -> str:
    """What started this process, from the variables each launcher sets: deepspeed (its launch.py sets CROSS_RANK
    and CROSS_SIZE), torchrun (TORCHELASTIC_RUN_ID), slurm (SLURM_JOB_ID; "slurm+torchrun" when srun started
    torchrun), or none."""
    inner = ("deepspeed" if "CROSS_RANK" in env and "CROSS_SIZE" in env else
             "torchrun" if "TORCHELASTIC_RUN_ID" in env else None)
    if "SLURM_JOB_ID" in env:
        return f"slurm+{inner}" if inner else "slurm"
    return inner or "none"


def gather_hostnames() -> list[str]:
    """Every rank's hostname, in rank order (a collective: every rank calls it); this host alone without a
    process group."""
    import torch.distributed as dist

    host = socket.gethostname()
    if not (dist.is_available() and dist.is_initialized()):
        return [host]
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    return hosts


def host_summary(hosts: list[str]) -> str:
    """``["a", "a", "b"]`` -> ``"a x2,b x1"``: the nodes in order of their first rank, with their rank counts."""
    counts: dict[str, int] = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    text = ",".join(f"{h} x{n}" for h, n in counts.items())
    if len(text) > MAX_TAG_LEN:  # MLflow refuses longer tag values
        text = text[:MAX_TAG_LEN - 40].rsplit(",", 1)[0] + f",... ({len(counts)} nodes)"
    return text


def run_tags(extra: dict, hosts: list[str], env=os.environ) -> dict[str, str]:
    """The tags every training run carries: ``extra`` (tracking.tags, model.type), the code (git SHA), where it
    ran (hosts, world size) and how it was started (launcher, SLURM job id)."""
    sha = git_sha()
    return {**{k: str(v) for k, v in extra.items()}, "git_sha": sha, "mlflow.source.git.commit": sha,
            "hosts": host_summary(hosts), "nodes": str(len(set(hosts))), "world_size": str(len(hosts)),
            "launcher": detect_launcher(env), "slurm_job_id": env.get("SLURM_JOB_ID", "none")}


def previous_run_id(run_dir: Path) -> str | None:
    """The MLflow run id in the run folder's run.json: a run that died before its first checkpoint continues it."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------- dataset input
def dataset_fields(dataset_dir: str | Path, context: str = "train", uri: str | None = None) -> dict:
    """The tokenized dataset as an MLflow dataset input: digest = sha256 of its manifest.json (which holds every
    shard's sha256), source = the folder (``uri``: where it lives, for one read through a local copy: s3://...) and
    the sources it was made from, profile = its token counts."""
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    class TokenizedSource(DatasetSource):
        """A tokenized dataset folder; type "local" so the UI shows its path."""

        def __init__(self, uri: str, sources: list[str]):
            self.uri, self.sources = uri, sources

        @staticmethod
        def _get_source_type() -> str:
            return "local"

        def load(self) -> str:
            return self.uri

        @staticmethod
        def _can_resolve(raw_source) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source):
            raise NotImplementedError

        def to_dict(self) -> dict:
            return {"uri": self.uri, "sources": self.sources}

        @classmethod
        def from_dict(cls, d: dict):
            return cls(d["uri"], d.get("sources", []))

    folder = Path(dataset_dir).resolve()
    raw = (folder / "manifest.json").read_bytes()
    manifest = json.loads(raw)
    sources = [f"{s['kind']}: {s['name'] or ', '.join(s['paths']) or 'python standard library'}"
               for s in manifest["sources"]]
    where = uri or str(folder)
    ds = MetaDataset(TokenizedSource(where, sources), name=where.rstrip("/").rsplit("/", 1)[-1],
                     digest=hashlib.sha256(raw).hexdigest()[:16])
    entity = ds._to_mlflow_entity()
    splits = manifest["splits"]
    profile = {f"{split}_tokens": splits[split]["tokens"] for split in splits}
    profile.update(documents=manifest["totals"]["documents"], tokenizer=manifest["tokenizer"]["name"],
                   shards=sum(len(s["shards"]) for s in splits.values()))
    return {"name": entity.name, "digest": entity.digest, "source_type": entity.source_type,
            "source": entity.source, "schema": entity.schema, "profile": json.dumps(profile), "context": context}


# ------------------------------------------------------------------------------------------------ tracker
class Tracker(NullTracker):
    """Opens (or continues) one MLflow run; every call goes through the journal in ``run_dir`` (in memory when
    there is none: then a store error is raised, not buffered)."""

    def __init__(self, cfg: TrackingConfig, run_name: str, run_id: str | None = None, tags: dict | None = None,
                 run_dir: Path | None = None):
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        bound_http_retries()
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(cfg.uri)
        check_server(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.buffer = TrackingBuffer(Path(run_dir) / BUFFER_FILE if run_dir is not None else None)
        try:
            self.experiment_id = self._experiment(cfg.experiment)
            self.run_id, resumed = self._run(run_id, run_name, tags or {})
            # a previous attempt's leftovers (its final status too: so they go first)
            replayed = self.buffer.replay(self.client, self.run_id)
            if replayed:
                print(f"tracking: replayed {replayed} lines buffered by a previous attempt", file=sys.stderr)
            self.client.update_run(self.run_id, status="RUNNING")
            if resumed and tags:
                self.client.log_batch(self.run_id, tags=_tags(tags))  # this attempt's hosts, job id, SHA
        except MlflowException as e:
            self.buffer.close()
            fix = (f"If it says 'Invalid Host header', restart the server with --allowed-hosts naming the host in "
                   f"tracking.uri (or '*'); otherwise {SERVER_HINT}" if is_http(self.uri) else
                   "Fix tracking.uri, or train without tracking: tracking.enabled=false")
            raise TrackingUnavailableError(f"tracking.uri={self.uri}: the MLflow store refused the run's set-up "
                                           f"({e.message}). {fix}") from e
        self.ui_url = (f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
                       f"?workflowType=machine_learning" if is_http(self.uri) else None)
        self._pending_metrics, self._last_flush = 0, time.monotonic()
        self._down_since: float | None = None
        self._last_probe = 0.0
        self._system = None

    def _experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            return self.client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
        if EXPERIMENT_KIND_TAG not in exp.tags:  # a type chosen in the UI stays
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        return exp.experiment_id

    def _run(self, run_id: str | None, run_name: str, tags: dict) -> tuple[str, bool]:
        from mlflow.exceptions import MlflowException

        if run_id is not None:
            try:
                if self.client.get_run(run_id).info.lifecycle_stage == "active":
                    return run_id, True
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            print(f"tracking: MLflow run {run_id} is not in {self.uri} (a new or reset store); starting a new run",
                  file=sys.stderr)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
        return run.info.run_id, False

    # ---------------------------------------------------------------------------------------------- logging
    def log_params(self, params: dict[str, Any]) -> None:
        self.buffer.append({"op": "params", "items": {k: str(v)[:MAX_PARAM_LEN] for k, v in params.items()}})
        self._flush_if_up()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        items = [[k, float(v), ts, step] for k, v in metrics.items() if v is not None]
        self.buffer.append({"op": "metrics", "items": items})
        self._pending_metrics += len(items)
        if self._pending_metrics >= FLUSH_EVERY_METRICS or time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self._flush_if_up()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.buffer.append({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})
        self._flush_if_up()

    def log_datasets(self, dataset_dirs: list[str | Path], context: str = "train",
                     uris: list[str] | None = None) -> None:
        uris = uris or [None] * len(dataset_dirs)
        self.buffer.append({"op": "inputs", "datasets": [dataset_fields(d, context, u)
                                                         for d, u in zip(dataset_dirs, uris)]})
        self._flush_if_up()

    def set_tags(self, tags: dict[str, str]) -> None:
        self.buffer.append({"op": "tags", "items": {k: str(v) for k, v in tags.items()}})
        self._flush_if_up()

    def start_system_metrics(self) -> None:
        """CPU, memory, disk and network as ``system/...`` metrics (GPU ones when nvidia-ml-py finds a GPU), sampled
        by MLflow's monitor thread straight to the server: not buffered, restarted when the server is back."""
        import torch
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        if torch.cuda.is_available() and "pynvml" not in sys.modules:
            try:
                import pynvml  # noqa: F401
            except ImportError:
                print("tracking: tracking.system_metrics logs no GPU metrics without nvidia-ml-py "
                      "(pip install nvidia-ml-py)", file=sys.stderr)
        self._system = SystemMetricsMonitor(self.run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S,
                                            resume_logging=True, tracking_uri=self.uri)
        self._system.start()

    # ----------------------------------------------------------------------------------------------- flushing
    def _flush_if_up(self) -> None:
        """Flush, unless the server is away and was looked for less than RETRY_DOWN_S ago (then only a /health
        probe of at most PROBE_TIMEOUT_S decides whether to try)."""
        if self._down_since is not None:
            if time.monotonic() - self._last_probe < RETRY_DOWN_S:
                return
            self._last_probe = time.monotonic()
            if is_http(self.uri) and server_answers(self.uri):
                return
        self.flush()

    def flush(self) -> None:
        """Send the journal now. A store that fails keeps it (and training goes on): warned once when the server
        goes away and once when it is back."""
        try:
            sent = self.buffer.replay(self.client, self.run_id)
        except Exception as e:  # noqa: BLE001 (whatever the store raises, the journal keeps the lines)
            if self.buffer.path is None:
                raise
            if self._down_since is None:
                self._down_since = self._last_probe = time.monotonic()
                print(f"tracking: WARNING: the MLflow store at {self.uri} is unreachable ({short_error(e)}); training "
                      f"goes on and tracking is buffered in {self.buffer.path} (sent when the server is back, or "
                      f"by `grt track sync {self.buffer.path.parent}`)", file=sys.stderr, flush=True)
            return
        finally:
            self._pending_metrics, self._last_flush = 0, time.monotonic()
        if self._down_since is not None:
            print(f"tracking: the MLflow store at {self.uri} is back after {time.monotonic() - self._down_since:.0f} "
                  f"s; {sent} buffered lines sent", file=sys.stderr, flush=True)
            self._down_since = None
            if self._system is not None:  # its thread stops when it cannot reach the server
                self._system.finish()
                self.start_system_metrics()

    def close(self, status: str = "FINISHED") -> None:
        if self._system is not None:
            self._system.finish()
        self.buffer.append({"op": "terminate", "status": status, "end_time": int(time.time() * 1000)})
        try:
            self.flush()
        finally:
            self.buffer.close()


def _tags(tags: dict) -> list:
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in tags.items()]



def open_tracker(cfg: TrackingConfig, run_name: str, run_id: str | None = None, tags: dict | None = None,
                 run_dir: Path | None = None):
    """A Tracker when tracking is on (journal in ``run_dir``), else a NullTracker."""
    return Tracker(cfg, run_name, run_id, tags, run_dir) if cfg.enabled else NullTracker()


def open_training_tracker(cfg: RunConfig, run_dir: Path, run_id: str | None, backend):
    """The trainer's tracker, opened by global rank 0 only; every rank calls this (the hostnames are gathered, and a
    store that cannot be reached stops every rank, not rank 0 alone). ``run_id``: the checkpoint's MLflow run, else
    the one in run.json (a run that died before its first checkpoint). Returns None on the other ranks."""
    if not cfg.tracking.enabled:
        return NullTracker() if backend.is_main else None
    hosts = gather_hostnames()
    tracker, error = None, None
    if backend.is_main:
        try:
            tags = run_tags({**cfg.tracking.tags, "model.type": cfg.model.type}, hosts)
            tracker = Tracker(cfg.tracking, cfg.name, run_id or previous_run_id(run_dir), tags, run_dir)
        except Exception as e:  # noqa: BLE001 (re-raised below, after the other ranks know)
            error = e
    if not backend.all_true(error is None):
        raise error or TrackingUnavailableError(f"rank 0 could not open the MLflow run at {cfg.tracking.uri}; its "
                                                f"error says why")
    return tracker
