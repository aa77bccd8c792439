"""The one resume assertion of the suite: a run said to resume really started from its checkpoint, and its losses are
the uninterrupted run's.

A deterministic run that silently starts over (loads nothing, or ignores what it loaded) trains steps 1..last again
and logs the same losses as the uninterrupted run, so equal losses alone prove nothing: the resumed process must also
say it resumed at the saved step and train only the steps after it.
"""
from __future__ import annotations

import json
from pathlib import Path

from conftest import printed_steps


def assert_resumed(stdout: str, step: int, last: int, run_dir: Path | None = None,
                   reference: dict[int, float] | None = None, rel: float = 0.0, on: str | None = None) -> None:
    """The process whose console output is ``stdout`` (log_interval 1) resumed from the checkpoint at ``step``: its
    start-up line says "resumed at step ``step``" (on ``on``, e.g. ``fsdp x2``, if given) and it printed exactly the
    steps ``step`` + 1 .. ``last``. With ``run_dir``: metrics.jsonl holds one history, each of steps 1..``last`` once
    and in order (the steps after the checkpoint that a killed run had logged were cut back, not doubled), and no
    earlier history was moved aside as a fresh start does. With ``reference`` ({step: loss} of the uninterrupted run):
    the losses of steps ``step`` + 1 .. ``last`` equal it, exactly unless ``rel`` is given."""
    tail = stdout[-3000:]
    where = f"resumed at step {step} on {on} " if on else f"resumed at step {step} on "
    assert where in stdout, f"no '{where.strip()}' start-up line: {tail}"
    assert printed_steps(stdout) == list(range(step + 1, last + 1)), f"not steps {step + 1}..{last}: {tail}"
    if run_dir is None:
        return
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = [r["step"] for r in rows if "loss" in r]
    assert history == list(range(1, last + 1)), history
    assert not list(run_dir.glob("metrics.before-*.jsonl")), "the history was moved aside: the run started over"
    if reference is None:
        return
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    for s in range(step + 1, last + 1):
        got, want = losses[s], reference[s]
        assert (got == want) if rel == 0 else abs(got - want) <= rel * abs(want), (s, got, want)
