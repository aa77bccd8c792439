"""Experiment tracking: the MLflow tracker, its offline journal, server checks and `grt track sync`.

tracker.py opens and logs to one MLflow run (``NullTracker`` when tracking is off); journal.py keeps every call in
the run folder until the store has it; server.py reaches the store (the trainer, the preflight and the commands that
only read runs share it); sync.py replays a journal. Imports run one way: tracker and sync use journal and server.
"""
from pipeline.tracking.journal import BUFFER_FILE
from pipeline.tracking.journal import REJECTED_FILE
from pipeline.tracking.journal import TrackingBuffer
from pipeline.tracking.server import TrackingUnavailableError
from pipeline.tracking.server import bound_http_retries
from pipeline.tracking.server import check_server
from pipeline.tracking.server import is_http
from pipeline.tracking.server import reading_store
from pipeline.tracking.server import resolve_uri
from pipeline.tracking.server import server_answers
from pipeline.tracking.sync import add_track_parser
from pipeline.tracking.sync import sync
from pipeline.tracking.tracker import MAX_PARAM_LEN
from pipeline.tracking.tracker import NullTracker
from pipeline.tracking.tracker import Tracker
from pipeline.tracking.tracker import detect_launcher
from pipeline.tracking.tracker import git_sha
from pipeline.tracking.tracker import host_summary
from pipeline.tracking.tracker import open_tracker
from pipeline.tracking.tracker import open_training_tracker
from pipeline.tracking.tracker import run_tags

__all__ = ["BUFFER_FILE", "MAX_PARAM_LEN", "REJECTED_FILE", "NullTracker", "Tracker", "TrackingBuffer",
           "TrackingUnavailableError", "add_track_parser", "bound_http_retries", "check_server", "detect_launcher",
           "git_sha", "host_summary", "is_http", "open_tracker", "open_training_tracker", "reading_store",
           "resolve_uri", "run_tags", "server_answers", "sync"]
