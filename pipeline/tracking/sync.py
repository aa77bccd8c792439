"""`grt track sync RUN`: replay a run folder's tracking journal to the run's MLflow run (the journal's own
docstring, pipeline/tracking/journal.py, says why replaying twice is harmless)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.tracking.journal import BUFFER_FILE
from pipeline.tracking.journal import TrackingBuffer
from pipeline.tracking.server import TrackingUnavailableError
from pipeline.tracking.server import bound_http_retries
from pipeline.tracking.server import check_server
from pipeline.tracking.server import resolve_uri


def find_run_dir(run: str) -> Path:
    """``RUN`` is a run folder, or a run name under ``runs/``."""
    for candidate in (Path(run), Path("runs") / run):
        if (candidate / "run.json").is_file():
            return candidate
    raise FileNotFoundError(f"no run folder with a run.json at {run!r} or runs/{run}: give the run folder "
                            f"(out_dir/name) of a run trained with tracking.enabled=true")


def sync(run: str, tracking_uri: str | None = None) -> int:
    """Replay the run folder's buffer to the run's MLflow run; 0 when everything was sent."""
    run_dir = find_run_dir(run)
    info = json.loads((run_dir / "run.json").read_text())
    uri = resolve_uri(tracking_uri or info["tracking_uri"])
    path = run_dir / BUFFER_FILE
    if not path.is_file() or path.stat().st_size == 0:
        print(f"track sync: nothing buffered in {run_dir}; MLflow run {info['mlflow_run_id']} at {uri} is complete")
        return 0
    bound_http_retries()
    from mlflow.tracking import MlflowClient

    try:
        check_server(uri)
    except TrackingUnavailableError as e:
        print(f"track sync: {e}", file=sys.stderr)
        return 1
    buffer = TrackingBuffer(path)
    try:
        pending = buffer.pending
        sent = buffer.replay(MlflowClient(tracking_uri=uri), info["mlflow_run_id"])
    except Exception as e:  # noqa: BLE001 (any store error: say which, keep the buffer)
        print(f"track sync: replay to {uri} failed ({type(e).__name__}: {e}); the {pending} buffered lines are kept "
              f"in {path}, run `grt track sync {run}` again", file=sys.stderr)
        return 1
    finally:
        buffer.close()
    print(f"track sync: replayed {sent} buffered lines from {path} to MLflow run {info['mlflow_run_id']} at {uri}")
    return 0


def add_track_parser(sub) -> None:
    s = sub.add_parser("track", help="tracking tools").add_subparsers(dest="track_command", required=True)
    c = s.add_parser("sync", help="replay metrics buffered while the tracking server was down",
                     description="Replay what the run folder's tracking_buffer.jsonl holds (metrics, params, tags, "
                                 "the final status, ...) to the run's MLflow run, then empty it. Safe to repeat.")
    c.add_argument("run", help="run folder (out_dir/name) or run name under runs/")
    c.add_argument("--tracking-uri", default=None,
                   help="send to this MLflow URI instead of the one in the run's run.json (a server that moved)")
    c.set_defaults(fn=lambda args: sync(args.run, args.tracking_uri))
