"""``train.branch_budgets``: one stable run that `grt sweep` turns into several token budgets.

A recipe with ``train.branch_budgets: [B1, B2, ...]`` is a stable ``wsd`` run to its own ``max_steps`` (the largest
budget). After it trains, `grt sweep` (:mod:`pipeline.studies.sweep_branches`) starts one decay branch per budget B
(`grt branch`'s code, :func:`pipeline.train.branch.branch_recipe`) that ends at step B exactly as an independent
``wsd`` run with ``max_steps: B`` would: its decay is

    decay(B) = train.decay_steps            when the recipe gives decay_steps,
               max(1, round(decay_fraction * B))  when it gives decay_fraction (the rule of schedule.decay_steps_of),

and it branches from the stable run's checkpoint at step ``B - decay(B)``. Those steps join ``train.keep_steps``
(:func:`merge_keep_steps`, at load) so the stable run saves them and pruning never drops them. Torch-free.
"""
from __future__ import annotations

from typing import NamedTuple


class BranchPoint(NamedTuple):
    budget: int  # the branch's last step (its max_steps)
    at: int  # the stable run's step it starts from
    decay: int  # its decay steps: budget - at


def budget_decay(tc, budget: int) -> int:
    """decay(B): the decay an independent wsd run of ``budget`` steps would have under this recipe."""
    if tc.decay_steps is not None:
        return tc.decay_steps
    return max(1, round(tc.decay_fraction * budget))


def branch_points(tc) -> list[BranchPoint]:
    """One :class:`BranchPoint` per budget of ``train.branch_budgets``, by budget ([] when it is null or empty)."""
    return [BranchPoint(b, b - budget_decay(tc, b), budget_decay(tc, b)) for b in sorted(tc.branch_budgets or [])]


def _budgets_ok(budgets) -> bool:
    return isinstance(budgets, list) and all(type(b) is int and b >= 1 for b in budgets)


def _schedule_ok(tc) -> bool:
    """A wsd schedule decay(B) can be computed from (else schedule_problems or at_least names the fault)."""
    frac, steps = tc.decay_fraction, tc.decay_steps
    return (tc.lr_schedule == "wsd" and type(tc.max_steps) is int and type(tc.warmup_steps) is int
            and ((steps is None and type(frac) in (int, float) and 0 < frac <= 1)
                 or (frac is None and type(steps) is int and steps >= 1)))


def merge_keep_steps(tc) -> None:
    """Add the branch points to ``train.keep_steps`` (the user's steps kept too), so the stable run keeps them."""
    if tc.branch_budgets and _budgets_ok(tc.branch_budgets) and _schedule_ok(tc) and isinstance(tc.keep_steps, list):
        tc.keep_steps = sorted(set(tc.keep_steps) | {p.at for p in branch_points(tc) if p.at >= 1})


def budget_problems(tc) -> list[str]:
    """train.branch_budgets' checks, one line each (none when it is null, the default, or empty)."""
    budgets = tc.branch_budgets
    if budgets is None or budgets == []:
        return []
    if not _budgets_ok(budgets):
        return [f"train.branch_budgets must be a list of step counts >= 1 (e.g. [60]), got {budgets!r}"]
    if tc.branch_from is not None:
        return [f"train.branch_budgets={budgets} on a branch (train.branch_from is set): a branch is one budget; "
                f"drop it from the recipe (`grt branch` does)"]
    if tc.lr_schedule != "wsd":
        return [f"train.branch_budgets needs train.lr_schedule=wsd (got {tc.lr_schedule}): each branch's decay "
                f"comes from its decay_fraction or decay_steps; set lr_schedule: wsd and one of them"]
    if not _schedule_ok(tc):
        return []  # schedule_problems (or at_least) names the fault
    p = []
    if len(set(budgets)) != len(budgets):
        p.append(f"train.branch_budgets {budgets} lists a budget twice; list each once")
    big = [b for b in budgets if b >= tc.max_steps]
    if big:
        p.append(f"train.branch_budgets {big} are not below train.max_steps={tc.max_steps} (the stable run's own "
                 f"budget, evaluated as it is); list only smaller budgets")
    stable = tc.max_steps - budget_decay(tc, tc.max_steps)
    for b, at, decay in branch_points(tc):
        if b in big:
            continue
        if not tc.warmup_steps <= at <= stable or at < 1:
            p.append(f"train.branch_budgets: budget {b} would branch at step {at} (= {b} - {decay} decay steps), "
                     f"outside the stable phase (steps {max(1, tc.warmup_steps)}..{stable}); raise the budget or "
                     f"shorten the warm-up or the decay")
    return p
