"""Is the tracking store there: reaching an MLflow server, bounding the client's retries, opening a store to read.

Shared by the trainer's tracker, `grt track sync`, the launch preflight and the commands that only read runs
(`grt compare`, `grt paper-table`).
"""
from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.parse
import urllib.request

from pipeline.config.recipe_files import SQLITE
from pipeline.config.recipe_files import sqlite_file

PROBE_TIMEOUT_S = 3.0
# MLflow's client retries a failed HTTP request 7 times with exponential backoff and waits 120 s for an answer
# (mlflow/environment_variables.py): minutes per flush against a dead server. These bound it to seconds; a value
# already in the environment wins.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
SERVER_HINT = ("start one on the head node: `mlflow server --backend-store-uri sqlite:///mlflow.db "
               "--artifacts-destination ./mlartifacts --host 0.0.0.0 --port 5000 --allowed-hosts '*'` "
               "(docs/tracking.md), or train without tracking: tracking.enabled=false")


class TrackingUnavailableError(ConnectionError, ValueError):
    """The tracking store cannot be reached (a ValueError too, so the CLI prints it as an error, not a trace)."""


def resolve_uri(uri: str) -> str:
    """Make a relative sqlite path absolute, so every process (and `mlflow ui` started here) sees the same file."""
    db = sqlite_file(uri)
    if db is not None and not db.is_absolute():
        return SQLITE + str(db.resolve())
    return uri


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def bound_http_retries() -> None:
    for name, value in HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)


def server_answers(uri: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the MLflow server at ``uri`` answers, else why not. Its /health endpoint answers whatever the Host
    header, so one API request checks that the server also accepts the host name ``uri`` uses."""
    base = uri.rstrip("/")
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout) as r:
            if r.status != 200:
                return f"/health answered HTTP {r.status}"
        with urllib.request.urlopen(base + "/api/2.0/mlflow/experiments/search?max_results=1", timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        body = e.read(300).decode(errors="replace")
        # other refusals (401 of a server with authentication, ...) are the client's to answer, with credentials
        return f"HTTP {e.code}: {body}" if "Invalid Host header" in body else None
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def check_server(uri: str, fix: str | None = None) -> None:
    """Raise a TrackingUnavailableError that says what to do when an http(s) tracking URI has no server (``fix``:
    what to do instead of starting it; the trainer's by default)."""
    if not is_http(uri) or not (why := server_answers(uri)):
        return
    if "Invalid Host header" in why:
        host = urllib.parse.urlsplit(uri).hostname
        raise TrackingUnavailableError(
            f"tracking.uri={uri}: the MLflow server refuses the host name {host!r} ({why}). MLflow 3.x accepts only "
            f"localhost and private IP addresses by default: restart it with --allowed-hosts '{host},{host}:*' "
            f"(or '*'), or write its IP address in tracking.uri")
    raise TrackingUnavailableError(f"tracking.uri={uri}: no MLflow server answers ({why}). Start it, or "
                                   f"{fix or SERVER_HINT}")


@contextlib.contextmanager
def reading_store(uri: str, fix: str):
    """An MlflowClient on ``uri`` for a command that only reads runs (`grt compare`, `grt paper-table`), bounded as the
    trainer's and `grt track sync`'s are: MLflow's HTTP retries cut to seconds (HTTP_BOUNDS), a server that does
    not answer refused at once, and a store error inside the block one TrackingUnavailableError naming ``uri`` and
    ``fix``, not minutes of retries ending in chained tracebacks."""
    bound_http_retries()
    check_server(uri, fix)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        yield MlflowClient(tracking_uri=uri)
    except MlflowException as e:
        raise TrackingUnavailableError(f"reading the MLflow store at {uri} failed ({short_error(e)}); {fix}") from e


def short_error(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) < 300 else text[:300] + "..."
