"""`grt sweep FOLDER --status`: one line per recipe, the state of its run, read from its run folder (and the SLURM
job `grt sweep --launcher slurm` submitted for it, when there is one):

- finished: `grt eval` evaluated it at max_steps with this recipe (as `grt sweep` skips it), with its val loss;
- running: its run folder's lock is held; the step is the last row of metrics.jsonl;
- stopped: stopped.json (a signal stopped it short of max_steps; the same command resumes it);
- queued: its job is pending (squeue), or was submitted and has not written its run folder yet;
- failed: its job ended without finishing the run, with the last ``error:`` line of its log (else the log's last
  line); without a job, a run folder trained part way and held by no one;
- not started: no job and no run folder (without SLURM, "queued" reads "not started").

With tracking on, each line also gives its MLflow run's status and last logged step (the run of that name with the
sweep's tag, newest first): the one view of a run whose folder is on another node's disk. A run folder this node
cannot see then takes its state from MLflow (running, failed for FAILED / KILLED, trained for FINISHED without an
evaluation here).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

from pipeline.runtime.exit_status import OK

PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}  # squeue also lists an ended job for a while
# (MinJobAge) in its final state: COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, ...


def lock_held(run_dir: Path) -> bool:
    """True when a process holds the run folder's lock (pipeline.runtime.locking's flock on ``.lock``), read from
    /proc/locks without touching the lock: a probe that took it, even for a moment, could make a run starting at
    that moment stop as "in use by another job". Where /proc/locks is absent (not Linux), a non-blocking try."""
    from pipeline.runtime.locking import LOCK_FILE

    lock = Path(run_dir) / LOCK_FILE
    try:
        st = lock.stat()
    except OSError:
        return False
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return _try_lock(lock)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(f[1] == "FLOCK" and ident in f for f in (line.split() for line in table.splitlines()) if len(f) > 5)


def _try_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (releases the lock if we took it)
    return False


def last_step(run_dir: Path) -> int | None:
    """The step of metrics.jsonl's last row with one, None without."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            return row["step"]
    return None


def job_state(job: str) -> str | None:
    """squeue's state of the job (PENDING, RUNNING, ...), None when squeue is absent or no longer lists it."""
    if not shutil.which("squeue"):
        return None
    p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    state = p.stdout.strip().splitlines()
    return state[0].strip() if p.returncode == 0 and state and state[0].strip() else None


def last_error(log: Path) -> str:
    """The last ``error:`` line of a job's log, else its last line, else why there is none."""
    try:
        lines = [x.strip() for x in Path(log).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return f"no log ({log})"
    errors = [x for x in lines if x.startswith("error:")]
    return (errors or lines or [f"empty log ({log})"])[-1]


def mlflow_view(cfg, tag: str) -> tuple[str, int | None] | None:
    """(status, last step with a ``loss``) of the newest MLflow run named ``cfg.name`` with the tag ``sweep=tag``;
    None with tracking off or no such run; ("unreachable: WHY", None) when the store does not answer."""
    from pipeline.config.recipe_files import sqlite_file

    db = sqlite_file(cfg.tracking.uri)
    if not cfg.tracking.enabled or (db is not None and not db.is_file()):  # (a status never creates a store)
        return None
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a status line, not a training run: no retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.server import short_error

    try:
        client = MlflowClient(tracking_uri=cfg.tracking.uri)
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        if exp is None:
            return None
        if "'" in cfg.name + tag:  # MLflow's filter strings cannot quote a quote
            return None
        runs = client.search_runs([exp.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                                  filter_string=f"tags.`mlflow.runName` = '{cfg.name}' and "
                                                f"tags.sweep = '{tag}'")
        if not runs:
            return None
        history = client.get_metric_history(runs[0].info.run_id, "loss")
    except Exception as e:  # noqa: BLE001 (any store error: the line says so, the table goes on)
        return f"unreachable: {short_error(e)}", None
    return runs[0].info.status, max((m.step for m in history), default=None)


def run_state(cfg, job: dict | None, tag: str | None = None) -> tuple[str, str]:
    """(state, detail) of one recipe's run; with ``tag``, MLflow's view is added (:func:`mlflow_view`)."""
    state, detail = folder_state(cfg, job)
    view = mlflow_view(cfg, tag) if tag is not None else None
    if view is None:
        return state, detail
    status, step = view
    seen = f"MLflow {status}" + (f" at step {step}" if step is not None else "")
    if state in ("not started", "queued") and step is not None:  # the run folder is on a disk this node cannot see
        at = f"step {step}/{cfg.train.max_steps}"
        state = {"RUNNING": "running", "FAILED": "failed", "KILLED": "failed", "FINISHED": "trained"}.get(status, state)
        return state, f"{at} ({seen}; its run folder is not visible here)"
    return state, f"{detail} ({seen})" if detail != "-" else seen


def folder_state(cfg, job: dict | None) -> tuple[str, str]:
    """(state, detail) of one recipe's run from its run folder and its SLURM job."""
    from pipeline.eval.results import saved_val_loss
    from pipeline.studies.sweep import finished
    from pipeline.train.run_folder import STOPPED

    run_dir, max_steps = Path(cfg.run_dir), cfg.train.max_steps
    done, _ = finished(cfg)
    if done:
        loss = saved_val_loss(run_dir)
        return "finished", f"step {max_steps}/{max_steps}" + ("" if loss is None else f", val loss {loss:.4f}")
    step = last_step(run_dir)
    at = f"step {step if step is not None else 0}/{max_steps}"
    if lock_held(run_dir):
        return "running", at
    state = job_state(job["job"]) if job else None
    if state in PENDING:
        return "queued", f"job {job['job']} {state.lower()}" + (f", {at}" if step else "")
    if state in RUNNING:  # started, not yet training (tokenizing, or between steps' lock)
        return "running", f"job {job['job']} {state.lower()}, {at}"
    ended = f"job {job['job']} {state.lower()}: " if state is not None else ""  # its final state, while listed
    if (run_dir / STOPPED).is_file():
        return "stopped", f"{at} (the same submission resumes it)"
    if job:
        log = Path(job["log"])
        if not log.is_file() and step is None:
            return "queued", f"job {job['job']}"
        return "failed", f"{at}: {ended}{last_error(log)}"
    if step is not None:
        return "failed", f"{at}, stopped short and held by no one (run it again to resume)"
    return "not started", "-"


def status_rows(folder: str | Path, overrides: list, data: str | None) -> list[list[str]]:
    from pipeline.studies.sweep import _load
    from pipeline.studies.sweep import _one_line
    from pipeline.studies.sweep import sweep_recipes
    from pipeline.studies.sweep import sweep_tag
    from pipeline.studies.sweep import tag_override
    from pipeline.studies.sweep_submit import JOBS
    from pipeline.studies.sweep_submit import sweep_dir

    recipes = sweep_recipes(folder)
    cfgs = [_load(p, [tag_override(folder), *overrides], data) for p in recipes]
    loaded = [c for c in cfgs if not isinstance(c, BaseException)]
    jobs = {}
    if loaded:
        try:
            jobs = json.loads((sweep_dir(loaded[0], sweep_tag(folder)) / JOBS).read_text()).get("runs", {})
        except (OSError, ValueError):
            jobs = {}
    rows = []
    for path, cfg in zip(recipes, cfgs):
        if isinstance(cfg, BaseException):
            rows.append([path.name, "-", "broken", "-", _one_line(cfg)])
            continue
        job = jobs.get(cfg.name)
        state, detail = run_state(cfg, job, sweep_tag(folder))
        rows.append([path.name, cfg.name, state, job["job"] if job else "-", detail])
    return rows


def status_table(rows: list[list[str]], folder: str | Path) -> str:
    from pipeline.studies.sweep import sweep_tag

    head = ["recipe", "run", "state", "job", "detail"]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    counts = {}
    for r in rows:
        counts[r[2]] = counts.get(r[2], 0) + 1
    out = [f"sweep {sweep_tag(folder)}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(rows)}",
           line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    return "\n".join(out)


def status_command(folder: str, overrides: list, data: str | None) -> int:
    print(status_table(status_rows(folder, overrides, data), folder))
    return OK
