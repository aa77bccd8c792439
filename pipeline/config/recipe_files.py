"""Recipe files: YAML with ``base:`` chains, ``key.sub=value`` overrides, and the folders a regular file blocks.
The schema they are read into is :mod:`pipeline.config.schema`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RecipeError(ValueError):
    """Every problem found in a recipe, one per line."""

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        head = f"{source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}"
        super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in problems))


def load_yaml_with_bases(path: str | Path, _seen: tuple = (), example: str = "recipes/quickstart-grt.yaml") -> dict:
    """Read a recipe file, resolving ``base:`` chains (relative to the file that names them)."""
    import yaml  # imported where used: machines without PyYAML (gpu-check) import the recipe code too

    path = Path(path).resolve()
    if path in _seen:
        raise RecipeError([f"base: cycle {' -> '.join(str(s) for s in (*_seen, path))}"], str(path))
    if path.is_dir():
        raise RecipeError([f"{path} is a folder, not a recipe: run every recipe in it with `grt sweep {path}`, or "
                           f"name one of its .yaml files"], str(path))
    if not path.is_file():
        raise RecipeError([f"recipe file not found: {path}"], str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError([f"YAML syntax error: {e}"], str(path)) from None
    if data is None or data == {}:  # it would train the 106M default model with every default setting
        raise RecipeError([f"{path.name} is empty (nothing but blanks and comments): write the settings to change, "
                           f"or start from a copy of {example}"], str(path))
    if not isinstance(data, dict):
        raise RecipeError([f"the top level must be a mapping of sections (model:, train:, ...), got a "
                           f"{type(data).__name__}: {str(data)[:60]!r}"], str(path))
    base = data.pop("base", None)
    if base is None:
        return data
    bases = base if isinstance(base, list) else [base]
    merged: dict = {}
    for b in bases:
        merged = deep_merge(merged, load_yaml_with_bases(path.parent / b, (*_seen, path), example))
    return deep_merge(merged, data)


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def flat(d: dict | list, prefix: str = "", lists: bool = False) -> dict:
    """``{"train.lr": 0.001, ...}``: nested dicts as dotted keys; with ``lists`` nested lists too
    (``data.mixture[0].weight``), else a list is one value. An empty dict or list is one value."""
    if isinstance(d, dict):
        items = ((f"{prefix}.{k}" if prefix else k, v) for k, v in d.items())
    else:
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(d))
    out = {}
    for key, v in items:
        if isinstance(v, (dict, list) if lists else dict) and v:
            out.update(flat(v, key, lists))
        else:
            out[key] = v
    return out


def changed_keys(a: dict, b: dict) -> list[str]:
    """The keys, sorted, whose values differ between ``a`` and ``b`` (a key one side lacks counts as None there)."""
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """Apply ``a.b.c=value`` (value parsed as YAML). Returns the new dict and syntax problems."""
    import yaml

    problems = []
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for ov in overrides:
        if "=" not in ov:
            problems.append(f"override {ov!r} is not of the form key.sub=value")
            continue
        key, raw = ov.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data, problems


def file_in_the_way(path: str | Path) -> Path | None:
    """The regular file (or other non-folder) at ``path`` or at one of its parents, which stops a folder being made
    there; None when the nearest existing part of the path is a folder."""
    path = Path(path).expanduser()
    for part in (path, *path.parents):
        try:
            if part.is_dir():
                return None
            if part.exists() or part.is_symlink():
                return part
        except OSError:  # unreadable: the job's own error will say more
            return None
    return None


def folder_problem(key: str, path: str | Path, value: Any = None) -> str | None:
    """One line naming ``key`` (shown as ``value``, default the path) and the file in the way when no folder can be
    made at ``path``; None when one can."""
    blocker = file_in_the_way(path)
    if blocker is None:
        return None
    return (f"{key}={str(path if value is None else value)!r}: {blocker} is a file, not a folder, so nothing can be "
            f"written there; point {key} at a folder (or move {blocker} away)")


SQLITE = "sqlite:///"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` tracking URI (relative to the working folder unless absolute);
    None for any other kind of store."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None
