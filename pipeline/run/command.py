"""`grt run RECIPE`: tokenize (reused when up to date) -> train (resumes) -> eval, as one command."""
from __future__ import annotations

import os

from pipeline.config import load_recipe
from pipeline.config.arguments import add_recipe_arguments


def register(sub) -> None:
    s = add_recipe_arguments(sub.add_parser("run", help="tokenize + train + eval"))
    s.set_defaults(fn=cmd_run)


def cmd_run(args) -> int:
    run_recipe(args.recipe, args.overrides, args.data)
    return 0


def run_recipe(recipe: str, overrides: list, data: str | None = None) -> None:
    """tokenize (reused when up to date) -> train (resumes) -> eval of one recipe: `grt run`, and `grt sweep`'s
    runner for each recipe of its folder."""
    from pipeline.eval.stage import check_inputs
    from pipeline.eval.stage import evaluate
    from pipeline.eval.stage import results_folder
    from pipeline.tokenize import tokenize
    from pipeline.tokenize.stage import wait_for_dataset
    from pipeline.train.trainer import train

    cfg = load_recipe(recipe, list(overrides), data=data)
    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun: rank 0 tokenizes and evaluates
    if first:
        ev = cfg.eval  # what eval will need, before anything trains
        check_inputs(cfg, cfg.run_dir / results_folder(ev.noise, ev.block_size or cfg.model.block_size,
                                                       cfg.model.block_size))
        tokenize(cfg.data)
    else:  # rank 0 tokenizes (a failure there ends the job); the others wait for its dataset
        wait_for_dataset(cfg.data)
    train(cfg)  # a pre-empted or interrupted run stops here (TrainingStopped: exit 143 / 130), never evaluated
    if first:  # one evaluation (in one process) per run, not one per rank
        evaluate(cfg.run_dir, store=cfg.run_url)  # a run on object storage: its results go to the store too
