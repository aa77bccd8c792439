"""The loss-spike defence (``train.spike``): a rolling window of recent good steps' losses, and the decision on each
step's loss against it — take the step, skip its update, roll back to the newest checkpoint, or stop.

Every rank judges the same number: the step's mean loss, already all-reduced by the trainer (no extra collective), so
every rank takes the same decision and keeps the same window. The window holds only losses of steps whose update was
taken: a spike (or a non-finite loss) never enters it, so it cannot raise the bar for the next one. The window, the
recent spikes and the data still to skip are saved in each checkpoint (:meth:`SpikeGuard.state_dict`).

Rollback: the ``rollback_after``-th spike within ``rollback_within`` steps reloads the newest checkpoint, and the
micro-batches of the spiky steps are skipped when the loader comes to them again. A spiky step is known by its
position in the loader, the number of samples drawn over all ranks (``sum(loader.counts)``) when it began, and the
samples it drew; both are multiples of a micro-batch over all ranks, so whatever the accumulation per step (a batch
ramp), the loader stands exactly at that position before some micro-batch of the replay.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path

MAX_CONSECUTIVE = 20  # train.spike.max_consecutive when null


class LossSpikeError(FloatingPointError):
    """``train.spike.action=stop``: a spike stopped the run (one line, printed by the CLI)."""


def loader_position(loader) -> int:
    """Samples the loader has drawn over all ranks (every dataset of a mixture): the same number on every rank."""
    return sum(loader.counts)


class SpikeGuard:
    """The window and the decisions of ``train.spike`` (``cfg``: a SpikeConfig). :meth:`judge` is called once per
    step with the step's all-reduced mean loss."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.on = cfg.action != "off"
        self.window: deque[float] = deque(maxlen=cfg.window)
        self.recent: list[tuple[int, int, int]] = []  # (step, loader position, samples) of spikes not yet rolled back
        self.pending: list[tuple[int, int, int]] = []  # (step, loader position, samples) to skip when it gets there
        self.rollbacks = 0  # rollbacks so far in this run (kept over the reload)
        self.in_a_row = 0  # spikes since the last step whose update was taken (kept over the reload)
        self.max_consecutive = cfg.max_consecutive or MAX_CONSECUTIVE

    # ------------------------------------------------------------------------------------------ decisions
    def stats(self) -> tuple[float, float]:
        """The window's mean and (sample) standard deviation."""
        return statistics.fmean(self.window), statistics.stdev(self.window)

    def judge(self, step: int, loss: float, position: int, samples: int) -> str | None:
        """The decision on step ``step``'s finite mean ``loss``: None (take the step; its loss enters the window), or
        ``skip`` / ``rollback`` / ``stop`` (its update is not taken). ``position``: the loader's position when the
        step began, ``samples``: the samples it drew (both over all ranks), remembered for a rollback."""
        if not self.on:
            return None
        if len(self.window) >= self.cfg.min_steps:
            mean, std = self.stats()
            if loss > mean + self.cfg.threshold * std:
                self.in_a_row += 1
                if self.in_a_row >= self.max_consecutive:  # the window cannot follow a level shift: never skip
                    return "stop"                               # every step for ever
                if self.cfg.action != "rollback":
                    return self.cfg.action
                self.recent = [r for r in self.recent if r[0] > step - self.cfg.rollback_within]
                self.recent.append((step, position, samples))
                return "rollback" if len(self.recent) >= self.cfg.rollback_after else "skip"
        self.window.append(loss)
        self.in_a_row = 0
        return None

    def line(self, decision: str, step: int, loss: float) -> str:
        """The one line that says a decision: the step, its loss, and the window it was judged against."""
        mean, std = self.stats()
        if decision == "stop" and self.cfg.action != "stop":
            what = (f"{self.in_a_row} spikes in a row (train.spike.max_consecutive={self.max_consecutive}): "
                    f"stopping before its update")
        else:
            what = {"skip": "its update skipped", "stop": "stopping before its update",
                "rollback": f"its update skipped; {len(self.recent)} spikes within {self.cfg.rollback_within} steps: "
                            f"rolling back"}[decision]
        return (f"spike: step {step} loss {loss:.4f} > window mean {mean:.4f} + {self.cfg.threshold:g} x std "
                f"{std:.4f} ({len(self.window)} steps): {what}")

    def event(self, decision: str, step: int, loss: float) -> dict:
        """The decision as a metrics.jsonl / MLflow record (z: standard deviations above the mean)."""
        mean, std = self.stats()
        return {"spike": decision, "spike_step": step, "spike_loss": loss, "spike_mean": mean, "spike_std": std,
                "spike_z": (loss - mean) / std if std > 0 else math.inf}

    # ------------------------------------------------------------------------------------------ rollback
    def rolled_back(self, saved: dict | None) -> list[tuple[int, int, int]]:
        """After the reload: the window as the checkpoint had it, the spiky steps' micro-batches to be skipped
        (returned: (step, position, samples) each), and the rollback counted."""
        spiky, pending, rollbacks, in_a_row = self.recent, self.pending, self.rollbacks, self.in_a_row
        self.load_state_dict(saved)
        self.pending = sorted(set(pending + self.pending + spiky), key=lambda p: p[1])
        self.rollbacks, self.in_a_row = rollbacks + 1, in_a_row
        self.recent = []
        return spiky

    def skip_data(self, loader) -> list[tuple[int, int, int]]:
        """Before a micro-batch is drawn: move the loader past the spiky micro-batches it stands at (no data read).
        Returns the (step, position, samples) skipped."""
        skipped = []
        while self.pending:
            here = loader_position(loader)
            hit = next((p for p in self.pending if p[1] == here), None)
            if hit is None:
                # behind the loader: a spike before the checkpoint rolled back to (saved at a skipped step)
                self.pending = [p for p in self.pending if p[1] > here]
                break
            self.pending.remove(hit)
            per_batch = loader.batch * loader.world_size
            for _ in range(hit[2] // per_batch):
                loader.next_indices()
            skipped.append(hit)
        return skipped

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"window": list(self.window), "recent": [list(r) for r in self.recent],
                "pending": [list(p) for p in self.pending], "rollbacks": self.rollbacks, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict | None) -> None:
        """``state``: a checkpoint's (None: one written before train.spike existed, or with it off: an empty
        window)."""
        state = state or {}
        self.window = deque(state.get("window", []), maxlen=self.cfg.window)
        self.recent = [tuple(r) for r in state.get("recent", [])]
        self.pending = [tuple(p) for p in state.get("pending", [])]
        self.rollbacks = state.get("rollbacks", 0)
        self.in_a_row = state.get("in_a_row", 0)

    # ------------------------------------------------------------------------------------------ in the trainer
    def decide(self, trainer, loss: float) -> str | None:
        """:meth:`judge` for the trainer's step in progress, whose micro-batches were the last the loader drew."""
        samples = trainer.accum * trainer.loader.batch * trainer.loader.world_size
        return self.judge(trainer.step + 1, loss, loader_position(trainer.loader) - samples, samples)

    def say(self, trainer, line: str, step: int, what: str, metrics: dict | None = None) -> None:
        """A decision, on rank 0: printed in one line, and to MLflow (the line as a tag per event, named by the step,
        what happened and, after a rollback, how many came before; numbers as metrics at the step)."""
        if not trainer.backend.is_main:
            return
        print(line, flush=True)
        if trainer.tracker is not None:
            again = f".after_rollback_{self.rollbacks}" if self.rollbacks else ""
            trainer.tracker.set_tags({f"spike.step_{step:08d}.{what}{again}": line})
            if metrics:
                trainer.tracker.log_metrics(metrics, step)

    def acted(self, trainer, decision: str, loss: float, metrics: dict) -> dict:
        """After the trainer's step ``metrics["step"]`` was judged a spike (its update not taken): the decision said
        and added to the step's metrics; ``stop`` raises, ``rollback`` reloads the newest checkpoint and returns the
        metrics of the first step trained after it (the rollback recorded in them)."""
        step = metrics["step"]
        event = self.event(decision, step, loss)
        code = {"skip": 1, "rollback": 2, "stop": 3}[decision]
        self.say(trainer, self.line(decision, step, loss), step, decision,
                 {"spike_action": code, "spike_loss": loss, "spike_z": event["spike_z"]})
        if decision == "stop":
            mean, std = self.stats()
            newest = trainer.checkpointer.newest() or "none"
            if self.cfg.action != "stop":
                raise LossSpikeError(f"loss spike at step {step}: {self.in_a_row} steps in a row spiked above the "
                                     f"window's mean {mean:.4f} + {self.cfg.threshold:g} x std {std:.4f}, so the loss "
                                     f"moved and the window cannot follow (train.spike.max_consecutive="
                                     f"{self.max_consecutive}); stopped before its update. Raise "
                                     f"train.spike.threshold, or resume from {newest} with a lower train.lr")
            raise LossSpikeError(f"loss spike at step {step}: loss {loss:.4f} against the window's mean {mean:.4f} "
                                 f"and std {std:.4f} (train.spike.threshold={self.cfg.threshold:g}); stopped before "
                                 f"its update. Newest checkpoint: {newest}")
        metrics.update(event)
        trainer.skipped_steps += 1  # its update was not taken: counted with the non-finite ones (skipped_steps)
        if decision != "rollback":
            return metrics
        trainer.checkpointer.finish(trainer)  # a save in flight is published (or pruned) before the newest is chosen
        folder = trainer.checkpointer.newest()
        if folder is None and trainer.cfg.train.branch_from is not None:  # a branch before its first save: its start
            folder = Path(trainer.cfg.train.branch_from)
        if folder is None:
            raise LossSpikeError(f"loss spike rollback at step {step}: no checkpoint written yet to roll back to; "
                                 f"lower train.checkpoint_interval or use train.spike.action=skip")
        trainer.checkpointer.reload(trainer, folder)  # calls rolled_back with the checkpoint's window
        where = ", ".join(f"step {s} (samples {p}..{p + n - 1})" for s, p, n in self.pending)
        self.say(trainer, f"spike: rolled back from step {step} to {folder} (step {trainer.step}); the micro-batches "
                          f"of {where} will be skipped", step, "rolled_back")
        skip = [list(p) for p in self.pending]
        rollback = {**event, "to_step": trainer.step, "checkpoint": str(folder), "skip": skip}
        replay = trainer.train_step()
        replay["spike_rollback"] = rollback  # metrics.jsonl: the rollback rides on the first step after it
        return replay

    def skip_spiky_data(self, trainer) -> None:
        """Before the trainer draws a micro-batch: skip the spiky steps' micro-batches the loader stands at, said."""
        for step, position, samples in self.skip_data(trainer.loader):
            self.say(trainer, f"spike: skipped the {samples} samples of step {step} (loader samples {position}.."
                              f"{position + samples - 1}) at step {trainer.step + 1}", trainer.step + 1,
                     f"skipped_data_of_step_{step}")
