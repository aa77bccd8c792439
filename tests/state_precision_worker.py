"""Run by tests/test_state_precision.py under torchrun: ``grt train`` exactly as the CLI runs it, plus a global
forward hook that records the dtypes of every recurrence step's state h (its input and the h it returns) and writes
them, per rank, to OUT/dtypes-rank<r>.json when training ends.

Usage: python tests/state_precision_worker.py OUT train RECIPE [key=value ...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from pipeline.cli import main
from pipeline.model.grt import RecurrentStep


def run(out: Path, argv: list[str]) -> int:
    seen: set[tuple[str, str]] = set()

    def record(module, args, output):
        if isinstance(module, RecurrentStep):  # also FSDP2's FSDPRecurrentStep, a subclass
            seen.update({("h_in", str(args[0].dtype)), ("h_out", str(output[0].dtype))})

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        status = main(argv)
    finally:
        handle.remove()
    rank = int(os.environ.get("RANK", 0))
    dtypes = {k: sorted(v for key, v in seen if key == k) for k in ("h_in", "h_out")}
    (out / f"dtypes-rank{rank}.json").write_text(json.dumps(dtypes))
    return status


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
