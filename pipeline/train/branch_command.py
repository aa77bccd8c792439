"""`grt branch RUN --at STEP --decay-steps N [--name NAME] [overrides]`: a decay branch of a stable run, trained
at once (:mod:`pipeline.train.branch`)."""
from __future__ import annotations


def register(sub) -> None:
    s = sub.add_parser("branch", help="a new run decaying the learning rate from a stable run's checkpoint")
    s.add_argument("run", help="the stable run's folder (runs/NAME), or its name")
    s.add_argument("--at", type=int, required=True, metavar="STEP", help="the checkpoint step to branch from")
    s.add_argument("--decay-steps", type=int, required=True, metavar="N", help="steps of decay to min_lr")
    s.add_argument("--name", default=None, help="the branch's run name (default: RUN-decayN@STEP)")
    s.add_argument("overrides", nargs="*", help="recipe overrides key.sub=value (not model.*: the weights carry on)")
    s.set_defaults(fn=cmd_branch)


def cmd_branch(args) -> int:
    from pipeline.train.branch import branch_recipe
    from pipeline.train.trainer import train

    train(branch_recipe(args.run, args.at, args.decay_steps, args.name, args.overrides))
    return 0
