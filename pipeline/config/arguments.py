"""A recipe named on the command line: the arguments every recipe command takes (``RECIPE [key.sub=value ...]
[--data DATA_RECIPE]``) and the :class:`RunConfig` they name."""
from __future__ import annotations

import argparse

from pipeline.config.loading import load_recipe

OVERRIDES_HELP = "recipe overrides key.sub=value (e.g. train.max_steps=100 model.n_recurrence=6)"


def add_recipe_arguments(s: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """RECIPE, its overrides and ``--data``; returns ``s`` for the command's own options."""
    s.add_argument("recipe", help="YAML recipe (recipes/...)")
    s.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    s.add_argument("--data", metavar="DATA_RECIPE", default=None,
                   help="a data recipe (recipes/data/*.yaml) whose data: section replaces the recipe's; the run "
                        "name gets its file stem appended; overrides still win")
    return s


def recipe_of(args: argparse.Namespace):
    """The :class:`RunConfig` of the parsed recipe arguments."""
    return load_recipe(args.recipe, args.overrides, data=getattr(args, "data", None))
