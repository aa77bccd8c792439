"""YAML -> objects: a recipe's plain data built into :class:`~pipeline.config.schema.RunConfig` with every problem
collected (:class:`RecipeError`), values coerced to the schema's types, an unknown key naming the nearest valid one,
and the deprecated aliases of keys mapped to the keys they stand for."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any
from typing import Optional

from pipeline.config.checks import path_problems
from pipeline.config.recipe_files import RecipeError
from pipeline.config.recipe_files import apply_overrides
from pipeline.config.recipe_files import load_yaml_with_bases
from pipeline.config.schema import RunConfig
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import ModelConfig


def _build(cls: type, data: Any, where: str, problems: list[str]) -> Any:
    """Turn plain data into dataclass ``cls``, collecting problems instead of stopping at the first."""
    if not isinstance(data, dict):
        problems.append(f"{where or 'recipe'} must be a mapping, got {type(data).__name__}")
        return cls()
    if cls is ModelConfig or (isinstance(cls, type) and issubclass(cls, ModelConfig) and where == "model"):
        registry = MODEL_CONFIGS
        mtype = data.get("type", "grt")
        if mtype not in registry:
            near = difflib.get_close_matches(str(mtype), list(registry), n=1)
            hint = f" — did you mean '{near[0]}'?" if near else ""
            problems.append(f"model.type={mtype!r} is not a registered model {sorted(registry)}{hint}")
            return GRTConfig()
        cls = registry[mtype]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else key
        if key not in fields:
            names = [f"{where}.{n}" if where else n for n in fields]
            near = difflib.get_close_matches(full, names, n=1, cutoff=0.6)
            hint = f" — did you mean '{near[0]}'?" if near else f" (valid keys: {', '.join(sorted(fields))})"
            problems.append(f"unknown key '{full}'{hint}")
            continue
        kwargs[key] = _coerce(hints[key], value, full, problems)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where} must be a mapping, got {value!r}")
            return {}
        return value
    if origin is list:
        if isinstance(value, str) and args and args[0] is str:  # `eval.analyses=all`: a list of one
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where} must be a list, got {value!r}")
            return []
        return [_coerce(args[0], v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where} must be true or false, got {value!r}")
        return bool(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            problems.append(f"{where} must be an integer, got {value!r}")
            return 0
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where} must be a number, got {value!r}")
            return 0.0
        if not math.isfinite(value):  # every float key: a NaN or infinity passes every range check below
            problems.append(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where} must be a string, got {value!r}")
        return str(value)
    return value


# Truncated backprop has one key, model.backprop_steps: the model runs it, and its default is the model's own (Poisson:
# 8, GRT: null, none for models without truncation). train.bptt_k is its deprecated alias, still read.
BPTT_ALIAS = "train.bptt_k"


def _take_bptt_alias(data: Any) -> tuple[Any, Any]:
    """The recipe without ``train.bptt_k``, and that key's value (None when absent or null: old run folders' saved
    recipes carry ``bptt_k: null``, which says nothing)."""
    train = data.get("train") if isinstance(data, dict) else None
    if not isinstance(train, dict) or "bptt_k" not in train:
        return data, None
    train = dict(train)
    k = train.pop("bptt_k")
    return {**data, "train": train}, k


def with_current_keys(recipe: dict) -> dict:
    """A recipe's plain data (a run's saved recipe.yaml, a checkpoint's recipe) with the deprecated aliases read as
    the keys they stand for, as :func:`from_dict` reads them: what compares a saved recipe with today's reads both
    through it, so that a run trained with ``train.bptt_k: 4`` and a recipe with ``model.backprop_steps: 4`` are the
    same run while 4 -> 5 is still a change. A null ``train.bptt_k`` (every run saved before it became an alias)
    goes; a non-null one becomes ``model.backprop_steps`` where that is unset or the same, and stays where the two
    disagree (no run saved that: it was an error), so the comparison shows it. Not validated."""
    data, k = _take_bptt_alias(recipe)
    if k is None:
        return data
    model = data.get("model", {})
    if not isinstance(model, dict) or model.get("backprop_steps") not in (None, k):
        return recipe
    return {**data, "model": {**model, "backprop_steps": k}}


# The sources whose train.bptt_k note this process printed: a recipe read again (eval_recipe reads it once per
# override, a sweep once to check and once to train) says it once.
_BPTT_NOTED: set[str] = set()


def _resolve_bptt(cfg: RunConfig, data: dict, k: Any, source: str, saved: bool = False) -> list[str]:
    """train.bptt_k (deprecated) becomes model.backprop_steps of the models that truncate (grt, poisson), with a
    one-line note once per source (none for a ``saved`` recipe: see :func:`from_dict`); the model reads one field
    whichever key the recipe used."""
    if k is None:
        return []
    problems: list[str] = []
    k = _coerce(Optional[int], k, BPTT_ALIAS, problems)
    if problems:
        return problems
    if k < 1:
        return [f"train.bptt_k must be >= 1 (or null: the model's own backprop_steps), got {k}"]
    if not hasattr(cfg.model, "backprop_steps"):
        return [f"train.bptt_k={k}: model.type={cfg.model.type} has no truncated backprop (grt and poisson do); "
                f"remove train.bptt_k"]
    model = data.get("model") if isinstance(data, dict) else None
    given = model.get("backprop_steps") if isinstance(model, dict) else None
    if given is not None and given != k:
        return [f"train.bptt_k={k} and the recipe's model.backprop_steps={given} disagree: they are the same k; "
                f"set model.backprop_steps={k} instead of train.bptt_k, or remove backprop_steps from the model "
                f"section"]
    cfg.model.backprop_steps = k
    if not saved and source not in _BPTT_NOTED and os.environ.get("RANK", "0") == "0":  # one line per job, not rank
        _BPTT_NOTED.add(source)
        print(f"note: {source}: train.bptt_k is deprecated, read as model.backprop_steps={k}; write "
              f"model.backprop_steps in the recipe instead", file=sys.stderr, flush=True)
    return []


def from_dict(data: dict, source: str = "recipe", saved: bool = False) -> RunConfig:
    """Plain data -> validated :class:`RunConfig` (:class:`RecipeError` lists every problem). ``saved``: the data is
    a run's own record (a checkpoint's or run folder's recipe), read back: its deprecated aliases are read without
    the note, which asks for an edit that a record of a finished run neither needs nor should get."""
    problems: list[str] = []
    data, bptt_k = _take_bptt_alias(data)
    cfg = _build(RunConfig, data, "", problems)
    problems += _resolve_bptt(cfg, data, bptt_k, source, saved)
    # Validate even when the structure had problems, so that the user sees everything at once; skip messages about
    # keys already reported (their values were replaced by placeholders).
    reported = {m.split("'")[1] if m.startswith("unknown key") else m.split(" ")[0] for m in problems}
    problems += [m for m in cfg.validate() if not any(m.startswith(k) for k in reported)]
    if problems:
        raise RecipeError(problems, source)
    return cfg


def load_recipe(path: str | Path, overrides: list[str] | None = None,
                data: str | Path | None = None, saved: bool = False) -> RunConfig:
    """Recipe file (+ data recipe) + overrides -> validated :class:`RunConfig` (raises :class:`RecipeError` listing
    all problems).

    ``data`` names a data recipe (``recipes/data/*.yaml``: a ``data:`` section and optionally ``base:``). Its section
    *replaces* the recipe's whole ``data:`` section after both files' bases are resolved — a merge would keep the
    recipe's own sources next to the new ones — and the run name gets the data recipe's file stem appended, so the
    same model on other data is another run. Overrides apply last and win over both. ``saved``: ``path`` is a run's
    own saved recipe (see :func:`from_dict`).
    """
    recipe = load_yaml_with_bases(path)
    source = str(path)
    if data is not None:
        section = load_yaml_with_bases(data, example="recipes/data/openwebtext.yaml")
        extra = sorted(k for k in section if k != "data")
        problems = [f"found '{k}': a data recipe holds only a 'data:' section (and 'base:'); move '{k}' to the "
                    f"recipe or set it with a command-line override" for k in extra]
        if "data" not in section:
            problems.append("no 'data:' section: write the sources under 'data:' (see recipes/data/)")
        if problems:
            raise RecipeError(problems, str(data))
        recipe["data"] = section["data"]
        recipe["name"] = f"{recipe.get('name', RunConfig.name)}-{Path(data).stem}"
        source = f"{path} --data {data}"
    recipe, problems = apply_overrides(recipe, list(overrides or []))
    if problems:
        raise RecipeError(problems, source)
    cfg = from_dict(recipe, source, saved)
    problems = path_problems(cfg)
    if problems:
        raise RecipeError(problems, source)
    return cfg
