"""Checks of a recipe beyond its sections' own ``validate()``: the folders it names that a file blocks."""
from __future__ import annotations

from pipeline.config.recipe_files import folder_problem
from pipeline.config.recipe_files import sqlite_file
from pipeline.config.schema import RunConfig
from pipeline.runtime import storage


def path_problems(cfg: RunConfig) -> list[str]:
    """The recipe's folders that a file blocks, one line each."""
    folders = [("out_dir", cfg.out_dir), ("out_dir/name", cfg.run_dir), ("data.dataset_dir", cfg.data.dataset_dir)]
    folders += [(f"data.mixture[{i}].dataset_dir", m.dataset_dir) for i, m in enumerate(cfg.data.mixture)]
    if cfg.eval.task_data_dir:
        folders.append(("eval.task_data_dir", cfg.eval.task_data_dir))
    if sqlite_file(cfg.tracking.uri) is not None:  # the MLflow database file's folder
        folders.append(("tracking.uri", sqlite_file(cfg.tracking.uri).parent, cfg.tracking.uri))
    if storage.is_remote(cfg.out_dir):  # a prefix on the store: no file can block it; the working copy can
        folders = [f for f in folders if f[0] not in ("out_dir", "out_dir/name")] + [("out_dir/name", cfg.run_dir)]
    problems = [p for key, path, *value in folders if (p := folder_problem(key, path, *value))]
    if len(problems) > 1 and problems[0].startswith("out_dir=") and problems[1].startswith("out_dir/name="):
        del problems[1]  # the same file in the way
    return problems
