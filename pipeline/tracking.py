"""The MLflow side, behind one small interface: ``Tracker`` (and ``NullTracker`` when tracking is off).

Metrics are buffered and sent with ``log_batch`` (one ``log_metric`` costs ~12 ms on a sqlite store). The client
talks to the store directly (``MlflowClient``), so there is no global "active run" to leak between runs.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pipeline.config import TrackingConfig

MAX_PARAM_LEN = 6000


class NullTracker:
    run_id: str | None = None
    uri = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def flush(self) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


def resolve_uri(uri: str) -> str:
    """Make a relative sqlite path absolute, so every process (and `mlflow ui` started here) sees the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


class Tracker(NullTracker):
    def __init__(self, cfg: TrackingConfig, run_name: str, run_id: str | None = None, tags: dict | None = None):
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        from mlflow.entities import Metric, Param, RunTag  # noqa: F401 (imported here: mlflow is slow to import)
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(cfg.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
        if run_id is not None:
            try:
                self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
            except Exception:
                run_id = None  # the store was reset; start a new run
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        self.run_id, self.experiment_id = run_id, exp_id
        self._metrics: list = []
        self._last_flush = time.time()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        items = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items() if k not in existing]
        for i in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._metrics += [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        if len(self._metrics) >= 500 or time.time() - self._last_flush > 10:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self._metrics), 1000):
            self.client.log_batch(self.run_id, metrics=self._metrics[i:i + 1000])
        self._metrics, self._last_flush = [], time.time()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def close(self, status: str = "FINISHED") -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status)


def open_tracker(cfg: TrackingConfig, run_name: str, run_id: str | None = None, tags: dict | None = None):
    return Tracker(cfg, run_name, run_id, tags) if cfg.enabled else NullTracker()
