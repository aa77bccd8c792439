"""What `train.eval_exits` costs: one tiny GRT run (d 32, R 3, gpt2 vocabulary, context 32) on the CPU with the
in-loop exit eval on, its median optimizer-step time and each eval's time (`exit_eval_s`: 20 batches x 4 x 32
tokens at 7 exits), measured side by side in the same process; the share is the eval time over the training time
between two evals at the default `train.eval_interval` (500 steps).

    python -m bench.in_loop_eval_overhead [--steps 10] [--eval-batches 20] [--threads 1]

Prints one JSON object (the run's console output goes to stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pipeline.config import TrainConfig
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train.trainer import train as train_run

WORDS = ("the gate decides how much of the state is kept while the shared core proposes an update and the prelude "
         "anchors every step so that depth can grow without new weights").split()


def corpus(root: Path, n_docs: int = 90) -> Path:
    """Deterministic English-like documents, one text file each (the tests' tiny corpus)."""
    root.mkdir(parents=True)
    for i in range(n_docs):
        words = [WORDS[(i * 7 + j * 13 + (j * j) % 5) % len(WORDS)] for j in range(150 + (i % 9) * 20)]
        (root / f"doc{i:03d}.txt").write_text(f"Document {i}. " + " ".join(words) + ".")
    return root


def tiny_run(tmp: Path, steps: int, threads: int, train: dict, eval_section: dict | None = None) -> tuple:
    """Tokenize the tiny corpus and train the tiny GRT for ``steps`` (evaluating twice) with the ``train`` keys over
    the defaults; its console output to stderr. Returns (cfg, metrics.jsonl rows, median step seconds)."""
    recipe = {
        "name": "bench", "seed": 7, "out_dir": str(tmp / "runs"),
        "model": {"type": "grt", "block_size": 32, "d_model": 32, "n_head": 2, "n_prelude": 1, "n_core": 1,
                  "n_coda": 1, "n_recurrence": 3},
        "data": {"sources": [{"kind": "files", "paths": [str(corpus(tmp / "corpus") / "*.txt")]}],
                 "dataset_dir": str(tmp / "dataset"), "val_fraction": 0.2, "shard_tokens": 4096},
        "train": {"device": "cpu", "micro_batch_size": 4, "grad_accum_steps": 2, "max_steps": steps, "lr": 1e-3,
                  "warmup_steps": 1, "log_interval": 1, "eval_interval": max(1, steps // 2),
                  "checkpoint_interval": steps, "threads": threads, **train},
        "eval": eval_section or {},
        "tracking": {"enabled": False},
    }
    cfg = from_dict(recipe)
    with contextlib.redirect_stdout(sys.stderr):
        tokenize(cfg.data, quiet=True)
        train_run(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, rows, statistics.median(r["step_time_s"] for r in rows if "step_time_s" in r)


def measure(tmp: Path, steps: int, eval_batches: int, threads: int) -> dict:
    _, rows, step_s = tiny_run(tmp, steps, threads, {"eval_batches": eval_batches, "eval_exits": True})
    evals = [r for r in rows if "exit_eval_s" in r]
    eval_s = statistics.median(r["exit_eval_s"] for r in evals)
    interval = TrainConfig().eval_interval
    return {"device": "cpu", "threads": threads, "steps": steps, "median_step_s": step_s,
            "exit_eval_s": [r["exit_eval_s"] for r in evals], "median_exit_eval_s": eval_s,
            "exit_tokens": evals[-1]["exit_tokens"], "exits": len(evals[-1]["exit"]),
            "default_eval_interval": interval, "eval_share_at_default_interval": eval_s / (interval * step_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(Path(tmp), args.steps, args.eval_batches, args.threads), indent=2))


if __name__ == "__main__":
    main()
