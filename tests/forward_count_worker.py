"""Run by tests/test_distributed.py in place of ``-m pipeline.cli`` (under torchrun): `grt train` exactly as a user runs
it, with a counter on GRT's recurrence step (``RecurrentStep.forward``) that counts the calls made with autograd on:
training forwards and the recomputations activation checkpointing makes in backward (validation runs under no_grad
and is not counted). Writes {"rank": r, "forwards": n} to $GRT_TEST_FORWARDS_DIR/rank<r>.json when training ends.

Usage: torchrun ... tests/forward_count_worker.py train RECIPE [overrides...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from pipeline.cli import main
from pipeline.model.grt import RecurrentStep

forwards = 0
_forward = RecurrentStep.forward


def counted_forward(self, *args, **kwargs):
    global forwards
    if torch.is_grad_enabled():
        forwards += 1
    return _forward(self, *args, **kwargs)


# patched on the class before the model is built: activation checkpointing wraps the bound method it finds on the
# instance (this one), and FSDP's subclass of the module inherits it
RecurrentStep.forward = counted_forward

if __name__ == "__main__":
    status = main(sys.argv[1:])
    rank = int(os.environ.get("RANK", 0))
    (Path(os.environ["GRT_TEST_FORWARDS_DIR"]) / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "forwards": forwards}))
    sys.exit(status)
