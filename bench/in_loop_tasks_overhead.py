"""What `train.eval_tasks` costs: one tiny GRT run (d 32, R 3, gpt2 vocabulary, context 32) on the CPU scoring
downstream tasks at each eval (`task_eval_s`, default `train.eval_task_limit`), its median optimizer-step time
measured in the same process; the share is the task eval time over the training time between two evals at the
default `train.eval_interval` (500 steps).

    python -m bench.in_loop_tasks_overhead --data ../shared/data/eval [--tasks piqa,arc_easy,hellaswag,lambada_openai]

Prints one JSON object (the run's console output goes to stderr).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.in_loop_eval_overhead import tiny_run
from pipeline.config import TrainConfig
from pipeline.train.in_loop_tasks_check import DEFAULT_LIMIT


def measure(tmp: Path, data: Path, tasks: list[str], steps: int, threads: int) -> dict:
    cfg, rows, step_s = tiny_run(tmp, steps, threads, {"eval_batches": 2, "eval_tasks": tasks},
                                 {"task_data_dir": str(data)})
    evals = [r["task_eval_s"] for r in rows if "task_eval_s" in r]
    interval = TrainConfig().eval_interval
    return {"device": "cpu", "threads": threads, "tasks": tasks, "limit": cfg.train.eval_task_limit or DEFAULT_LIMIT,
            "median_step_s": step_s, "task_eval_s": evals,
            "task_share_at_default_interval": statistics.median(evals) / (interval * step_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a task data folder laid out like shared/data/eval")
    ap.add_argument("--tasks", default="piqa,arc_easy,hellaswag,lambada_openai")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(Path(tmp), args.data.resolve(), args.tasks.split(","), args.steps, args.threads),
                         indent=2))


if __name__ == "__main__":
    main()
