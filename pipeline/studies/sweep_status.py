"""`grt sweep FOLDER --status`: one line per recipe, the state of its run, read from its run folder (and the SLURM
job `grt sweep --launcher slurm` submitted for it, when there is one):

- finished: `grt eval` evaluated it at max_steps with this recipe (as `grt sweep` skips it), with its val loss;
- running: its run folder's lock is held; the step is the last row of metrics.jsonl;
- stopped: stopped.json (a signal stopped it short of max_steps; the same command resumes it);
- queued: its job is pending (squeue), or was submitted and has not written its run folder yet;
- failed: its job ended without finishing the run, with the last ``error:`` line of its log (else the log's last
  line); without a job, a run folder trained part way and held by no one;
- not started: no job and no run folder (without SLURM, "queued" reads "not started").
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


def lock_held(run_dir: Path) -> bool:
    """True when a process holds the run folder's lock (pipeline.runtime.locking's flock on ``.lock``)."""
    from pipeline.runtime.locking import LOCK_FILE

    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
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


def run_state(cfg, job: dict | None) -> tuple[str, str]:
    """(state, detail) of one recipe's run."""
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
    if state is not None:  # RUNNING, COMPLETING: started, not yet training (tokenizing, or between steps' lock)
        return "running", f"job {job['job']} {state.lower()}, {at}"
    if (run_dir / STOPPED).is_file():
        return "stopped", f"{at} (the same submission resumes it)"
    if job:
        log = Path(job["log"])
        if not log.is_file() and step is None:
            return "queued", f"job {job['job']}"
        return "failed", f"{at}: {last_error(log)}"
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
        state, detail = run_state(cfg, job)
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
