"""The one resume rule of a job that starts again by itself on its own run folder: a torchrun restart of the worker
group (`grt launch --max-restarts N`: a worker died, torchrun's agent started the group again) and a requeued SLURM
job (`grt launch --launcher slurm`: the job saved on SIGTERM and requeued itself) both run `grt train` again, and
both resume the same way, through :meth:`Checkpointer.resume`:

- from the newest intact checkpoint of the run folder (a damaged one is moved aside and the one before it tried),
  with the data-loader position and the MLflow run id saved in it (none yet: the run id in run.json, from step 0);
- whatever ``train.resume`` says: a relaunch resumes the checkpoints its own job wrote (``never`` only guards a
  *new* job against a folder that already holds a run).

What tells a relaunch is the launcher's own count, in the workers' environment: ``TORCHELASTIC_RESTART_COUNT``
(with ``TORCHELASTIC_MAX_RESTARTS``) set by torchrun's agent, ``SLURM_RESTART_COUNT`` set by SLURM on a requeue.
Each relaunch is logged in one line on rank 0, appended to ``RUN/restarts.jsonl`` and set as MLflow tags.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

RESTARTS = "restarts.jsonl"


@dataclass(frozen=True)
class Relaunch:
    """Why this job is a relaunch: which launcher started it again, how many times, out of how many allowed."""

    kind: str  # "restart" (torchrun's agent) or "requeue" (SLURM)
    count: int
    limit: int | None  # torchrun's --max-restarts; SLURM requeues have none
    counters: str  # the variables it was read from, as logged: "TORCHELASTIC_RESTART_COUNT=1"

    def line(self, resumed_from: Path | None, step: int) -> str:
        of = f" of {self.limit}" if self.limit is not None else ""
        where = f"resumed from {resumed_from.name}" if resumed_from else "no checkpoint yet: started over from step 0"
        return f"{self.kind} {self.count}{of}: {where} at step {step} ({self.counters})"


COUNTS = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "SLURM_RESTART_COUNT")


def local_counts(environ=os.environ) -> dict[str, int]:
    """This process's view of :data:`COUNTS` (0 where unset)."""
    out = {}
    for key in COUNTS:
        try:
            out[key] = int(environ.get(key) or 0)
        except ValueError:
            out[key] = 0
    return out


def relaunch_from_env(environ=os.environ, backend=None) -> Relaunch | None:
    """The relaunch this job's worker group is in, or None for a job's first start (a torchrun restart inside a
    requeued SLURM job is logged as the restart, with both counts). With ``backend``, a collective: every rank takes
    the highest count of any rank, because torchrun's agents count differently: the agent whose worker died counts a
    restart, an agent whose workers were healthy restarts them for the new round without counting (its ranks see
    TORCHELASTIC_RESTART_COUNT=0), and the node ranks are handed out anew each round."""
    counts = local_counts(environ)
    if backend is not None:
        counts = {k: int(backend.reduce_max(float(v))) for k, v in counts.items()}
    restarts, requeues = counts["TORCHELASTIC_RESTART_COUNT"], counts["SLURM_RESTART_COUNT"]
    counters = ", ".join(f"{k}={n}" for k, n in (("TORCHELASTIC_RESTART_COUNT", restarts),
                                                 ("SLURM_RESTART_COUNT", requeues)) if n)
    if restarts:
        return Relaunch("restart", restarts, counts["TORCHELASTIC_MAX_RESTARTS"], counters)
    if requeues:
        return Relaunch("requeue", requeues, None, counters)
    return None


def record_relaunch(relaunch: Relaunch, run_dir: Path, resumed_from: Path | None, step: int) -> str:
    """Rank 0: print the relaunch's line and append it to ``run_dir/restarts.jsonl``. Returns the line."""
    line = relaunch.line(resumed_from, step)
    print(line, flush=True)
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kind": relaunch.kind, "count": relaunch.count,
             "limit": relaunch.limit, "resumed_from": resumed_from.name if resumed_from else None, "step": step,
             "counters": relaunch.counters, "line": line}
    with open(run_dir / RESTARTS, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return line


def relaunch_tags(relaunch: Relaunch, line: str) -> dict[str, str]:
    """The MLflow tags of the latest relaunch (the run's params cannot change; its tags can)."""
    return {f"grt.{relaunch.kind}s": str(relaunch.count), f"grt.last_{relaunch.kind}": line}
