"""Decay branches: ``grt branch RUN --at STEP --decay-steps N`` starts a new run from RUN's checkpoint at STEP that
holds the learning rate until STEP and then decays it to ``min_lr`` over N steps, so that one stable run (``wsd`` or
``constant``) gives several token budgets.

The branch is an ordinary run (``runs/<RUN>-decay<N>@<STEP>`` by default) whose recipe is its parent's checkpoint
recipe with ``train.lr_schedule: wsd``, ``train.decay_steps: N``, ``train.max_steps: STEP + N`` and
``train.branch_from: RUN/checkpoints/step_<STEP>``. While its own folder holds no checkpoint, the trainer resumes from
that folder (:func:`branch_point`) by the usual resume path: weights, optimizer, data position, step counters and
every backend's format are restored as after a restart, and the noise and depths derive from (seed, step) as ever.
From its first save on it resumes from its own checkpoints (``grt train runs/BRANCH/recipe.yaml`` after a kill).
Its MLflow run is its own (never the parent's); its tags name the parent (``branch.parent``,
``branch.parent_run_id``, ``branch.step``, ``branch.decay_steps``, and MLflow's ``mlflow.parentRunId``, which nests
it under the parent in the UI), and `grt compare` lists the family (:func:`family_lines`). The command is
:mod:`pipeline.train.branch_command`'s. Torch-free at import: `grt compare` reads the family from here.
"""
from __future__ import annotations

import json
from pathlib import Path

# set by `grt branch` from --at / --decay-steps / --name: an override of them is refused
SET_BY_BRANCH = ("train.max_steps", "train.lr_schedule", "train.decay_steps", "train.decay_fraction",
                 "train.branch_from", "name")


def set_by_branch(key: str) -> bool:
    """A dotted recipe key that `grt branch` sets itself (the branch's own schedule, name, start and tags)."""
    return (key in SET_BY_BRANCH or key in ("train.keep_steps", "train.branch_budgets")
            or key.startswith(("tracking.tags.branch.", "tracking.tags.mlflow.parentRunId")))


def stable_until(train: dict) -> int | None:
    """The last step of a recipe's stable phase (its lr is constant up to there), None for a decaying schedule."""
    if train.get("lr_schedule") == "constant":
        return train["max_steps"]
    if train.get("lr_schedule") == "wsd":
        decay = train.get("decay_steps") or max(1, round(train["decay_fraction"] * train["max_steps"]))
        return train["max_steps"] - decay
    return None


def branch_recipe(run: str, step: int, decay_steps: int, name: str | None, overrides: list[str]):
    """The branch's :class:`RunConfig`, or a one-line refusal (ValueError / FileExistsError / RecipeError)."""
    import yaml

    from pipeline.config import RecipeError
    from pipeline.config.loading import from_dict
    from pipeline.config.recipe_files import apply_overrides
    from pipeline.train.checkpoint import list_checkpoints

    if "://" in run:
        raise ValueError(f"grt branch {run}: branching from a run on object storage is not supported; copy the run to "
                         f"a disk first (e.g. `aws s3 sync {run} runs/NAME`) and branch from that folder")
    run_dir = Path(run)
    if not (run_dir / "checkpoints").is_dir() and (Path("runs") / run / "checkpoints").is_dir():
        run_dir = Path("runs") / run  # a run's name, as grt compare takes it
    if not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{run} is not a run folder with checkpoints (neither {run}/checkpoints nor "
                                f"runs/{run}/checkpoints exists); give the stable run's folder, e.g. runs/NAME")
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    have = [int(c.name.split("_")[1]) for c in list_checkpoints(run_dir / "checkpoints")]
    if step not in have:
        raise FileNotFoundError(f"{run_dir} has no checkpoint at step {step} (it has: "
                                f"{', '.join(map(str, have)) or 'none'}); branch from one of those, and keep branch "
                                f"points with train.keep_steps")
    if decay_steps < 1:
        raise ValueError(f"--decay-steps must be >= 1, got {decay_steps}")
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    # model.depth_schedule is a curriculum, not the weights (resume allows changing it too)
    refused = [k for k in keys if (k == "model" or k.startswith("model.")) and k != "model.depth_schedule"]
    if refused:
        raise ValueError(f"grt branch: {', '.join(refused)}: a branch continues its parent's weights, so the model "
                         f"cannot change; drop the model override")
    refused = [k for k in keys if k in SET_BY_BRANCH or k == "train"]
    if refused:
        raise ValueError(f"grt branch: {', '.join(refused)} are set from --at / --decay-steps / --name; drop them")
    data = yaml.safe_load((folder / "recipe.yaml").read_text())
    parent = data.get("name", run_dir.name)
    tc = data.get("train") or {}
    stable = stable_until(tc)
    if stable is None or not tc.get("warmup_steps", 0) <= step <= stable:
        why = (f"its schedule is {tc.get('lr_schedule', 'cosine')}" if stable is None else
               f"its stable phase is steps {tc.get('warmup_steps', 0)}..{stable}")
        raise ValueError(f"grt branch: step {step} of {parent} is not in a stable phase ({why}); branch a run "
                         f"trained with train.lr_schedule wsd or constant, at a step after its warm-up and before "
                         f"its own decay")
    data.setdefault("train", {})["keep_steps"] = []  # the parent's branch points are its own; an override sets new
    data["train"]["branch_budgets"] = None  # a branch is one budget (the parent's budgets are grt sweep's)
    data, problems = apply_overrides(data, list(overrides))
    if problems:
        raise RecipeError(problems, "grt branch")
    name = name or f"{parent}-decay{decay_steps}@{step}"
    target = Path(data.get("out_dir", "runs")) / name
    started = (target / "recipe.yaml").exists() or (target / "checkpoints").exists()
    if started:  # (a folder with only the run lock: a start killed before it wrote anything, begun again here)
        raise FileExistsError(f"{target} exists: a branch named {name} was started already (resume it with `grt "
                              f"train {target / 'recipe.yaml'}`), or choose another --name")
    parent_id = parent_run_id(run_dir)
    tags = {"branch.parent": parent, "branch.step": step, "branch.decay_steps": decay_steps,
            **({"branch.parent_run_id": parent_id, "mlflow.parentRunId": parent_id} if parent_id else {})}
    data["name"] = name
    data["train"].update(lr_schedule="wsd", decay_steps=decay_steps, decay_fraction=None,
                         max_steps=step + decay_steps, branch_from=str(folder.resolve()))
    data.setdefault("tracking", {})
    data["tracking"]["tags"] = {**(data["tracking"].get("tags") or {}), **tags}
    return from_dict(data, f"grt branch {run} --at {step}", saved=True)


def parent_run_id(run_dir: Path) -> str | None:
    """The parent's MLflow run id (its run.json), None where it was trained without tracking."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        return None


def branch_point(cfg, backend) -> Path:
    """The checkpoint a branch starts from (``train.branch_from``), checked against its index on every rank (each
    hashing its share) and never moved: it is the parent's."""
    from pipeline.train.checkpoint import verify_checkpoint

    folder = Path(cfg.train.branch_from)
    problems = (verify_checkpoint(folder, share=(backend.rank, backend.world_size)) if folder.is_dir()
                else [f"{folder} does not exist"])
    if not backend.all_true(not problems, patient=True):
        raise ValueError(f"train.branch_from={folder}: {'; '.join(problems) or 'damaged (see another rank)'}; the "
                         f"branch cannot start from it. Branch from another checkpoint of the parent")
    return folder


# ------------------------------------------------------------------------------------------------ compare
def family_of(tags: dict) -> dict:
    """A run's place in a family from its tags (MLflow's, or its recipe's tracking.tags): {} for a run that is no
    branch."""
    if "branch.parent" not in tags:
        return {}
    return {"branch_parent": str(tags["branch.parent"]), "branch_step": int(tags["branch.step"]),
            "branch_decay_steps": int(tags["branch.decay_steps"])}


def folder_family(run_dir: Path) -> dict:
    """:func:`family_of` a run folder, read from its recipe.yaml ({} without one)."""
    import yaml

    recipe = run_dir / "recipe.yaml"
    data = yaml.safe_load(recipe.read_text()) if recipe.is_file() else None
    return family_of(((data or {}).get("tracking") or {}).get("tags") or {}) if isinstance(data, dict) else {}


def family_lines(results: list[dict]) -> list[str]:
    """``family of PARENT: BRANCH (from step S, N decay steps), ...`` for each parent some compared run branches."""
    parents: dict[str, list[dict]] = {}
    for r in results:
        if r.get("branch_parent"):
            parents.setdefault(r["branch_parent"], []).append(r)
    shown = {r["name"] for r in results}
    return [f"family of {p}{'' if p in shown else ' (not compared)'}: "
            + ", ".join(f"{b['name']} (from step {b['branch_step']}, {b['branch_decay_steps']} decay steps)"
                        for b in sorted(kids, key=lambda b: (b["branch_step"], b["branch_decay_steps"])))
            for p, kids in parents.items()]
