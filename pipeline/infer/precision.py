"""The arithmetic of inference forwards (``grt eval``'s exit curve and downstream tasks, ``grt generate``), chosen by
name as ``train.dtype`` is:

    auto      bf16 autocast on a CUDA device with bf16 (training's rule, :func:`pipeline.train.backend.autocast_dtype`),
              fp32 elsewhere; on CUDA the matmuls left in fp32 use TF32
    bfloat16  bf16 autocast on any device (CPU included), TF32 on CUDA
    float32   IEEE fp32 everywhere, no TF32 (the reference to measure the other two against)

Only the model's forward runs under this; the head's log-probabilities, KL and argmax of the evaluation run in exact
fp32 (:func:`exact_fp32`), and their sums accumulate in fp64. On the CPU ``auto`` changes nothing at all, so CPU
results are those of a plain fp32 forward, bit for bit (generation's last-position head aside: see generate.py).
"""
from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator

import torch

from pipeline.train.backend import autocast_dtype

PRECISIONS = ("auto", "bfloat16", "float32")
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def check_precision(name: str, what: str = "dtype") -> None:
    if name not in PRECISIONS:
        near = difflib.get_close_matches(str(name), PRECISIONS, n=1)
        raise ValueError(f"{what}={name!r} is not one of {list(PRECISIONS)}"
                         + (f" — did you mean {near[0]!r}?" if near else ""))


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    # the process-wide flags are put back on exit, so code outside the context (the diagnostics, a caller's own
    # matmuls) keeps the precision it had
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@contextlib.contextmanager
def inference_precision(name: str | None, device: torch.device | str) -> Iterator[torch.dtype | None]:
    """Run the forwards inside under precision ``name`` (module docstring) on ``device``; yields the autocast dtype
    (float32: none). ``None`` leaves whatever the caller set up."""
    if name is None:
        yield None
        return
    check_precision(name)
    device = torch.device(device)
    dtype = autocast_dtype(name, device)
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(_tf32(name != "float32"))
        if dtype != torch.float32:
            stack.enter_context(torch.autocast(device.type, dtype=dtype))
        yield dtype


@contextlib.contextmanager
def exact_fp32(device: torch.device | str) -> Iterator[None]:
    """Autocast off and no TF32: for the vocabulary-sized logits math whose sums are reported (losses, KL)."""
    device = torch.device(device)
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(_tf32(False))
        if device.type in AUTOCAST_DEVICES:  # (a meta device, which tests use, has no autocast to turn off)
            stack.enter_context(torch.autocast(device.type, enabled=False))
        yield
