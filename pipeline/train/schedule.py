"""Learning-rate schedules beyond warm-up + cosine (``train.lr_schedule``), and their recipe checks.

``lr_at(step)`` is the rate of the optimizer step that follows ``step`` finished steps (step 0 is the first). Every
schedule warms up as cosine always has: ``lr * (step + 1) / (warmup_steps + 1)`` for ``step < warmup_steps``. After
that, with W = warmup_steps, M = max_steps:

- ``cosine`` (default): ``min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (step - W) / (M - W)))``
  (:func:`pipeline.train.optim.lr_at`, unchanged).
- ``constant``: ``lr``.
- ``linear``: ``wsd`` with D = M - W and decay_shape linear: falls from lr, reaching min_lr at the last step.
- ``wsd`` (warmup-stable-decay): ``lr`` until the decay starts at step M - D, then
  ``min_lr + (lr - min_lr) * f(x)`` with ``x = (step - (M - D) + 1) / D`` in (0, 1]: the D decay steps all train
  below ``lr`` and the last (step M - 1) trains at exactly ``min_lr``. D is ``train.decay_steps``, or
  ``round(train.decay_fraction * M)`` (Python's round: a half goes to the even number, 0.25 x 10 -> 2, 0.25 x 30
  -> 8). ``train.decay_shape`` is f:

  - ``linear``:  f(x) = 1 - x
  - ``cosine``:  f(x) = 0.5 * (1 + cos(pi * x))
  - ``1-sqrt``:  f(x) = 1 - sqrt(x), the cooldown of Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training
    Beyond Fixed Training Durations"): it drops fast at first and flattens towards min_lr.
  - ``sqrt``:    f(x) = sqrt(1 - x), its mirror image: it stays near lr longest and drops steeply at the end.

A branch (``grt branch``, :mod:`pipeline.train.branch`) is a ``wsd`` run whose decay starts at its branch step.
Torch-free (the recipe's validation reads it).
"""
from __future__ import annotations

import math

SCHEDULES = ["cosine", "wsd", "constant", "linear"]
SHAPES = {"linear": lambda x: 1.0 - x,
          "cosine": lambda x: 0.5 * (1.0 + math.cos(math.pi * x)),
          "1-sqrt": lambda x: 1.0 - math.sqrt(x),
          "sqrt": lambda x: math.sqrt(1.0 - x)}


def decay_steps_of(tc) -> int:
    """D, the number of decaying steps at the end of a ``wsd`` or ``linear`` run."""
    if tc.lr_schedule == "linear":
        return tc.max_steps - tc.warmup_steps
    if tc.decay_steps is not None:
        return tc.decay_steps
    return max(1, round(tc.decay_fraction * tc.max_steps))


def scheduled_lr(step: int, tc) -> float:
    """The rate of the schedules other than cosine (see the module's docstring for each formula)."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / (tc.warmup_steps + 1)
    if tc.lr_schedule == "constant":
        return tc.lr
    if step >= tc.max_steps:
        return tc.min_lr
    decay = decay_steps_of(tc)
    start = tc.max_steps - decay
    if step < start:
        return tc.lr
    shape = SHAPES["linear" if tc.lr_schedule == "linear" else tc.decay_shape]
    return tc.min_lr + (tc.lr - tc.min_lr) * shape((step - start + 1) / decay)


def schedule_problems(tc) -> list[str]:
    """train.lr_schedule and its keys, one line per problem; train.keep_steps' form."""
    p = []
    if tc.lr_schedule not in SCHEDULES:
        p.append(f"train.lr_schedule={tc.lr_schedule!r} is not one of {SCHEDULES}")
    if tc.decay_shape not in SHAPES:
        p.append(f"train.decay_shape={tc.decay_shape!r} is not one of {list(SHAPES)}")
    given = [k for k in ("decay_fraction", "decay_steps") if getattr(tc, k) is not None]
    if tc.lr_schedule == "wsd":
        if len(given) != 1:
            p.append(f"train.lr_schedule=wsd needs exactly one of train.decay_fraction (share of max_steps) or "
                     f"train.decay_steps, got {' and '.join(given) or 'neither'}")
        elif tc.decay_fraction is not None and not 0 < tc.decay_fraction <= 1:
            p.append(f"train.decay_fraction must be in (0, 1], got {tc.decay_fraction}")
        elif tc.decay_steps is not None and (type(tc.decay_steps) is not int or tc.decay_steps < 1):
            p.append(f"train.decay_steps must be an integer >= 1, got {tc.decay_steps!r}")
        elif decay_steps_of(tc) + tc.warmup_steps > tc.max_steps:
            p.append(f"train.lr_schedule=wsd: warmup_steps={tc.warmup_steps} + {decay_steps_of(tc)} decay steps "
                     f"exceed max_steps={tc.max_steps}; shorten the decay or the warm-up")
    elif given:
        p.append(f"train.{given[0]} only applies to train.lr_schedule=wsd (got lr_schedule={tc.lr_schedule}); "
                 f"remove it or set lr_schedule: wsd")
    if tc.lr_schedule != "wsd" and tc.decay_shape != "linear" and tc.decay_shape in SHAPES:
        p.append(f"train.decay_shape={tc.decay_shape} only applies to train.lr_schedule=wsd (got lr_schedule="
                 f"{tc.lr_schedule}); remove it or set lr_schedule: wsd")
    keep = tc.keep_steps
    if not isinstance(keep, list) or not all(type(s) is int and s >= 1 for s in keep):
        p.append(f"train.keep_steps must be a list of steps >= 1 (e.g. [1000, 2000]), got {keep!r}")
    elif any(s > tc.max_steps for s in keep):
        p.append(f"train.keep_steps {[s for s in keep if s > tc.max_steps]} lie past train.max_steps="
                 f"{tc.max_steps}: the run never reaches them; drop them or raise max_steps")
    if tc.branch_from is not None and not isinstance(tc.branch_from, str):
        p.append(f"train.branch_from must be a checkpoint folder (a path), got {tc.branch_from!r}")
    return p
