"""Testing hooks, set by environment variables (GRT_FAULT_*), that make the trainer fail the way real jobs do at a
chosen point: a rank killed, a signal, a slow or full disk during a save, non-finite losses. Read once at import;
the tests set them in the environment of the processes they start (or monkeypatch this module's constants before
the trainer is built). The trainer adds the :class:`FaultInjection` callback only when one is set (:func:`requested`).
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import signal
import time
from pathlib import Path

import torch

from pipeline.train.callbacks import Callback

# Testing hooks: every rank (or only GRT_FAULT_KILL_RANK) SIGKILLs itself right after logging this step; not in a
# group that torchrun restarted (the kill would strike again at the same step after every restart)
FAULT_KILL_AT_STEP = int(os.environ.get("GRT_FAULT_KILL_AT_STEP", "0") or 0)
FAULT_KILL_RANK = int(os.environ["GRT_FAULT_KILL_RANK"]) if os.environ.get("GRT_FAULT_KILL_RANK") else None
# ... with this signal instead of SIGKILL (SIGSTOP: a frozen rank whose sockets stay open, as after a power loss)
FAULT_KILL_SIGNAL = getattr(signal, os.environ.get("GRT_FAULT_KILL_SIGNAL") or "SIGKILL")
# ... or raise a (simulated) torch.OutOfMemoryError on rank RANK right after logging STEP: "STEP:RANK"
_fault_raise = os.environ.get("GRT_FAULT_RAISE_AT_STEP", "").partition(":")
FAULT_RAISE_AT_STEP = (int(_fault_raise[0] or 0), int(_fault_raise[2] or 0))


def raise_at_step(step: int, rank: int) -> None:
    if step == FAULT_RAISE_AT_STEP[0] and rank == FAULT_RAISE_AT_STEP[1]:
        raise torch.OutOfMemoryError(f"simulated out of memory at step {step} on rank {rank} (GRT_FAULT_RAISE_AT_STEP)")
# ... or while saving the checkpoint of this step (its files written, not yet published)
FAULT_KILL_IN_SAVE = int(os.environ.get("GRT_FAULT_KILL_IN_SAVE", "0") or 0)
# ... or in the upload of this step's checkpoint to object storage, once this rank has uploaded N of its files:
# "STEP[:N]" (default 1)
_fault_upload = os.environ.get("GRT_FAULT_KILL_IN_UPLOAD", "").partition(":")
FAULT_KILL_IN_UPLOAD = (int(_fault_upload[0] or 0), int(_fault_upload[2] or 1))


def after_upload(step: int, uploaded: int) -> None:
    if step == FAULT_KILL_IN_UPLOAD[0] and uploaded >= FAULT_KILL_IN_UPLOAD[1]:
        os.kill(os.getpid(), signal.SIGKILL)


# ... or send this signal (name or number; default SIGINT) to rank 0 itself right after this step: "STEP[:SIGNAL]"
_fault_signal = os.environ.get("GRT_FAULT_SIGNAL_AT_STEP", "").partition(":")
FAULT_SIGNAL_AT_STEP = (int(_fault_signal[0] or 0), getattr(signal, _fault_signal[2] or "SIGINT", None)
                        or signal.Signals(int(_fault_signal[2])))
# ... or make rank 0's first torch.save of each checkpoint (state.pt; DeepSpeed's model states) take this many seconds
# longer, after any gather the save does first: slow network storage
FAULT_SLOW_SAVE_S = float(os.environ.get("GRT_FAULT_SLOW_SAVE_S", "0") or 0)


@contextlib.contextmanager
def slowed_first_write(seconds: float):
    if not seconds:
        yield
        return
    save, slowed = torch.save, []

    def slow_save(*args, **kwargs):
        if not slowed:
            slowed.append(True)
            time.sleep(seconds)
        return save(*args, **kwargs)
    torch.save = slow_save
    try:
        yield
    finally:
        torch.save = save


# ... or fill the disk during the save of a step: once this rank has written BYTES bytes into that step's staging
# folder, every further write there fails with ENOSPC, from inside torch.save and DCP's writer ("STEP:BYTES[:RANK]",
# every rank without RANK)
_fault_disk = os.environ.get("GRT_FAULT_DISK_FULL", "").split(":")
FAULT_DISK_FULL = (int(_fault_disk[0] or 0), int(_fault_disk[1]) if len(_fault_disk) > 1 else 0,
                   int(_fault_disk[2]) if len(_fault_disk) > 2 else None)


class FillingDisk:
    """While entered, files opened for writing under ``folder`` take ``budget`` bytes in all, then fail as a full disk
    does: the bytes that fit are written, then OSError(ENOSPC). Every file write of a save goes through ``open``
    (``Path.open`` calls ``io.open``), so the error rises where a real one would."""

    def __init__(self, folder: Path, budget: int):
        self.folder, self.left = str(folder) + os.sep, budget

    def __enter__(self):
        self._open = io.open

        def opener(file, mode="r", *args, **kwargs):
            f = self._open(file, mode, *args, **kwargs)
            if (isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+")
                    and os.path.abspath(file).startswith(self.folder)):
                return _FillingFile(f, self)
            return f
        builtins.open = io.open = opener
        return self

    def __exit__(self, *exc):
        builtins.open = io.open = self._open


class _FillingFile:
    """A file under a FillingDisk: its writes spend the disk's budget."""

    def __init__(self, f, disk: FillingDisk):
        self._f, self._disk = f, disk

    def write(self, data):
        n = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if n > self._disk.left:
            fits, self._disk.left = self._disk.left, 0
            self._f.write(data[:fits] if isinstance(data, str) else memoryview(data).cast("B")[:fits])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
        self._disk.left -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


# ... or make the loss of these steps NaN (comma-separated), to exercise the non-finite path
FAULT_NAN_STEPS = {int(x) for x in os.environ.get("GRT_FAULT_NAN_STEPS", "").split(",") if x.strip()}

# ... or multiply the loss of these steps by FACTOR (a finite spike, every rank): "STEP[,STEP...]:FACTOR". Once per
# step in a process: after a spike rollback the replayed step is clean
_fault_spike = os.environ.get("GRT_FAULT_SPIKE", "").partition(":")
FAULT_SPIKE_STEPS = {int(x) for x in _fault_spike[0].split(",") if x.strip()}
FAULT_SPIKE_FACTOR = float(_fault_spike[2] or 1)


def requested() -> bool:
    """Whether any fault is set (step 0, the default, never comes: the first step the loop sees is 1)."""
    return bool(FAULT_KILL_AT_STEP or FAULT_RAISE_AT_STEP[0] or FAULT_KILL_IN_SAVE or FAULT_SIGNAL_AT_STEP[0]
                or FAULT_SLOW_SAVE_S or FAULT_DISK_FULL[0] or FAULT_NAN_STEPS
                or FAULT_SPIKE_STEPS)


class FaultInjection(Callback):
    """The hooks above, at their points of the loop: the loss of a micro-step, the end of a step (after the other
    callbacks have logged it and the non-finite-steps check), and a save (its staging folder, its first write, the
    moment its files are written)."""

    def __init__(self):
        self._filling_disk = None  # the GRT_FAULT_DISK_FULL hook while its save is in flight
        self._slowed = None
        self._spiked = {}  # GRT_FAULT_SPIKE: micro-steps spiked per step (all of one step's, once)

    def on_loss(self, trainer, loss):
        step = trainer.step + 1
        if step in FAULT_SPIKE_STEPS and self._spiked.get(step, 0) < trainer.accum:
            self._spiked[step] = self._spiked.get(step, 0) + 1
            return loss * FAULT_SPIKE_FACTOR
        return loss * float("nan") if step in FAULT_NAN_STEPS else loss

    def on_step_checked(self, trainer, metrics: dict) -> None:
        step, rank = trainer.step, trainer.backend.rank
        relaunch = getattr(getattr(trainer, "checkpointer", None), "relaunch", None)
        restarted = relaunch is not None and relaunch.kind == "restart"
        if step == FAULT_KILL_AT_STEP and FAULT_KILL_RANK in (None, rank) and not restarted:
            os.kill(os.getpid(), FAULT_KILL_SIGNAL)  # `kill -9`
        raise_at_step(step, rank)
        if step == FAULT_SIGNAL_AT_STEP[0] and rank == 0:
            os.kill(os.getpid(), FAULT_SIGNAL_AT_STEP[1])  # the tests' Ctrl-C / SIGTERM at a known step

    def on_save_start(self, trainer, step: int, staging: Path) -> None:
        if step == FAULT_DISK_FULL[0] and FAULT_DISK_FULL[2] in (None, trainer.backend.rank):
            self._filling_disk = FillingDisk(staging, FAULT_DISK_FULL[1]).__enter__()  # left by on_save_end
        self._slowed = slowed_first_write(FAULT_SLOW_SAVE_S if trainer.backend.is_main else 0)
        self._slowed.__enter__()

    def on_save_written(self, trainer, step: int) -> None:
        if self._slowed is not None:
            self._slowed.__exit__(None, None, None)
            self._slowed = None
        if step == FAULT_KILL_IN_SAVE:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save_end(self, trainer) -> None:
        if self._filling_disk is not None:
            self._filling_disk.__exit__()
            self._filling_disk = None

    def on_train_end(self, trainer, status: str) -> None:
        self.on_save_end(trainer)
