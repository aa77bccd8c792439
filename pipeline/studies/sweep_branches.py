"""`grt sweep`'s decay branches: after a recipe with ``train.branch_budgets`` trains (a stable wsd run), one branch per
budget (:mod:`pipeline.train.branch_budgets` gives the rule), started by `grt branch`'s code and then trained and
evaluated like any run: its own folder, MLflow run and ``branch.*`` tags, so `grt fit-phi` counts it as a point of the
law labelled as a branch. A branch trained and evaluated at its budget already is skipped; one stopped half-way
resumes from its own folder (its saved recipe), as `grt train runs/BRANCH/recipe.yaml` would.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.train.branch_budgets import BranchPoint
from pipeline.train.branch_budgets import branch_points


def branch_name(parent_cfg, point: BranchPoint) -> str:
    """`grt branch`'s default name: PARENT-decayN@STEP."""
    return f"{parent_cfg.name}-decay{point.decay}@{point.at}"


def branch_folder(parent_cfg, point: BranchPoint) -> Path:
    return parent_cfg.run_dir.parent / branch_name(parent_cfg, point)


def describe_branch(parent_cfg, point: BranchPoint) -> str:
    """The dry run's line for one branch."""
    tc = parent_cfg.train
    tokens = point.decay * tc.micro_batch_size * tc.grad_accum_steps * parent_cfg.model.block_size
    return (f"   + branch {branch_name(parent_cfg, point)}: budget {point.budget} steps, from step {point.at} of the "
            f"stable run, {point.decay} decay steps ({tokens / 1e6:.3g}M tokens trained); run folder "
            f"{branch_folder(parent_cfg, point)}")


def branch_config(parent_cfg, point: BranchPoint):
    """The branch's config: its own saved recipe once started (resumed as it is), else a new one from the stable
    run's kept checkpoint (:func:`pipeline.train.branch.branch_recipe`)."""
    from pipeline.config import load_recipe
    from pipeline.train.branch import branch_recipe

    saved = branch_folder(parent_cfg, point) / "recipe.yaml"
    if saved.is_file():
        return load_recipe(saved, saved=True)
    return branch_recipe(str(parent_cfg.run_dir), point.at, point.decay, branch_name(parent_cfg, point), [])


def run_branch(cfg) -> None:
    """Train (resuming) and evaluate one branch, as `grt run` does a recipe (its data is the stable run's)."""
    from pipeline.eval.stage import evaluate
    from pipeline.train.trainer import train

    train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # one evaluation per run, not one per rank
        evaluate(cfg.run_dir)


def points_of(cfg) -> list[BranchPoint]:
    return [] if isinstance(cfg, BaseException) else branch_points(cfg.train)
