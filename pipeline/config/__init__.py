"""The recipe: typed dataclasses, YAML in, validated once, overrides as ``a.b.c=value``.

A recipe is a YAML file. ``base: other.yaml`` (relative to the file) inherits and deep-merges; command-line overrides
``key.sub=value`` apply last. Every problem is collected and reported together (:class:`RecipeError`), and an unknown
key names the nearest valid one. The sections are :mod:`.schema` (the ``model:`` section's classes are
:mod:`pipeline.model.configs`), reading them :mod:`.loading`, the folder checks :mod:`.checks`, the files (YAML,
``base:`` chains, overrides) :mod:`.recipe_files`.
"""
from pipeline.config.checks import path_problems
from pipeline.config.loading import from_dict
from pipeline.config.loading import load_recipe
from pipeline.config.recipe_files import RecipeError
from pipeline.config.schema import ANALYSES
from pipeline.config.schema import ANALYSIS_NAMES
from pipeline.config.schema import LOCAL_TASKS
from pipeline.config.schema import DataConfig
from pipeline.config.schema import EvalConfig
from pipeline.config.schema import MixtureEntry
from pipeline.config.schema import RunConfig
from pipeline.config.schema import SourceConfig
from pipeline.config.schema import TrackingConfig
from pipeline.config.schema import TrainConfig
from pipeline.config.schema import config_hash

__all__ = ["ANALYSES", "ANALYSIS_NAMES", "LOCAL_TASKS", "DataConfig", "EvalConfig", "MixtureEntry", "RecipeError",
           "RunConfig", "SourceConfig", "TrackingConfig", "TrainConfig", "config_hash", "from_dict", "load_recipe",
           "path_problems"]
