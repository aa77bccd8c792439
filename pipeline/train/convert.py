"""`grt checkpoint convert RUN_OR_CKPT --to full|safetensors [--out DIR]`: any checkpoint format (full, sharded
torch.distributed.checkpoint, DeepSpeed ZeRO) to one file, so evaluation and sharing never need the training
topology. Runs in one process without a process group."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.runtime import storage
from pipeline.runtime.out_folder import check_replaceable

MARKER = "grt_convert.json"  # marks a folder this command wrote (and may replace)


def default_out(ckpt_file: Path, state: dict, to: str) -> Path:
    """runs/NAME/checkpoints/step_X/state.pt -> runs/NAME/exports/step_X-<to> (beside the checkpoints, never among
    them: keep_checkpoints must not delete an export)."""
    step_dir = ckpt_file.parent
    root = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else step_dir.parent
    return root / "exports" / f"step_{state['step']:08d}-{to}"


def convert(path: str | Path, to: str, out: str | Path | None = None) -> Path:
    """Write the checkpoint at ``path`` as ``to`` (full: state.pt with model and, where the source has it in torch
    form, optimizer; safetensors: the model weights + the recipe as metadata). Returns the output folder."""
    from pipeline.train.checkpoint import checkpoint_format_of
    from pipeline.train.checkpoint import full_model_state
    from pipeline.train.checkpoint import load_checkpoint
    from pipeline.train.checkpoint import resolve_checkpoint

    if to not in ("full", "safetensors"):
        raise ValueError(f"--to {to!r}: choose full or safetensors")
    if storage.is_remote(path):  # a run on object storage: this node's checked copy (its exports/ go there)
        from pipeline.train.run_store import fetch_run

        path = fetch_run(str(path))
    ckpt = resolve_checkpoint(path)
    state = load_checkpoint(ckpt, verify=False)  # verified by resolve_checkpoint
    source = checkpoint_format_of(ckpt.parent, state)
    out = Path(out) if out else default_out(ckpt, state, to)
    check_replaceable(out, MARKER, "grt checkpoint convert", source=ckpt.parent)
    model = full_model_state(ckpt, state)
    meta = {k: state[k] for k in ("step", "recipe", "info", "skipped_steps", "world_size") if k in state}
    meta["converted_from"] = {"path": str(ckpt.parent.resolve()), "format": source}
    out.parent.mkdir(parents=True, exist_ok=True)
    # written inside a folder of a new name (nobody else's to delete), then renamed: out is never half-written
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tmp = staging / out.name
        tmp.mkdir()
        _write(tmp, to, ckpt, state, model, meta)
        if out.exists():
            shutil.rmtree(out)  # an earlier convert's output (check_replaceable)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write(tmp: Path, to: str, ckpt: Path, state: dict, model: dict, meta: dict) -> None:
    import torch
    import yaml

    from pipeline.train.checkpoint import SAFETENSORS
    from pipeline.train.checkpoint import SAFETENSORS_META
    from pipeline.train.checkpoint import full_optimizer_state
    from pipeline.train.checkpoint import tied_names
    from pipeline.train.checkpoint import write_index

    if to == "full":
        optimizer = full_optimizer_state(ckpt, state)
        keep = {k: state[k] for k in ("loader", "mlflow_run_id") if k in state}
        torch.save({**meta, **keep, "checkpoint_format": "full", "model": model, "optimizer": optimizer},
                   tmp / "state.pt")
    else:
        from safetensors.torch import save_file

        # safetensors refuses aliased tensors: a tied parameter is stored under its first name only
        aliases = tied_names(state["recipe"])
        unique = {name: t.detach().contiguous() for name, t in model.items() if name not in aliases}
        save_file(unique, str(tmp / SAFETENSORS), metadata={SAFETENSORS_META: json.dumps(meta, default=str)})
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(state["recipe"], sort_keys=False))
    (tmp / MARKER).write_text(json.dumps({"to": to, **meta["converted_from"], "step": meta.get("step")}) + "\n")
    write_index(tmp)  # the export is checked like a checkpoint when it is loaded


def cmd_convert(args) -> int:
    out = convert(args.checkpoint, args.to, args.out)
    print(f"wrote {out}/{'state.pt' if args.to == 'full' else 'model.safetensors'} and recipe.yaml; evaluate it with "
          f"`grt eval {out}`")
    return 0


def cmd_verify(args) -> int:
    """Every checkpoint of a run (or one checkpoint folder) against its integrity index: exit 1 if any is damaged."""
    from pipeline.train.checkpoint import INDEX
    from pipeline.train.checkpoint import check_loadable
    from pipeline.train.checkpoint import list_checkpoints
    from pipeline.train.checkpoint import not_a_checkpoint
    from pipeline.train.checkpoint import set_aside_names
    from pipeline.train.checkpoint import verify_checkpoint
    from pipeline.train.checkpoint import write_index

    if storage.is_remote(args.path):
        return verify_store_run(args)
    p = Path(args.path)
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        raise ValueError(not_a_checkpoint(p))
    folders = (list_checkpoints(p / "checkpoints") or list_checkpoints(p)
               or ([p] if (p / "state.pt").is_file() or (p / INDEX).is_file() else []))
    if not folders:
        aside = set_aside_names(p / "checkpoints", p)
        if aside:
            raise FileNotFoundError(f"no checkpoint under {p} but the ones set aside as damaged ({', '.join(aside)}); "
                                    f"rename one back to step_XXXXXXXX to check or --adopt it")
        raise FileNotFoundError(f"no checkpoint under {p}: expected a run folder (runs/NAME) or a checkpoint folder")
    damaged = 0
    for folder in folders:
        if args.adopt and not (folder / INDEX).is_file():
            try:
                check_loadable(folder)  # every file of its format must read in full
            except (OSError, ValueError) as e:
                damaged += 1
                print(f"{folder}: DAMAGED, not adopted: {e}")
                continue
            write_index(folder)
            print(f"{folder}: indexed (adopted as it is now)")
        problems = verify_checkpoint(folder, checksums=not args.sizes_only)
        damaged += bool(problems)
        print(f"{folder}: {'DAMAGED: ' + '; '.join(problems) if problems else 'intact'}")
    aside = set_aside_names(folders[0].parent)
    if aside:
        print(f"(set aside earlier as damaged, never loaded: {', '.join(aside)})")
    return 1 if damaged else 0


def verify_store_run(args) -> int:
    """`grt checkpoint verify s3://...`: the objects of every checkpoint of a run on the store (or of one) against
    its index, read from the store itself."""
    from pipeline.train.run_store import split_url
    from pipeline.train.run_store import step_url
    from pipeline.train.run_store import store_steps
    from pipeline.train.run_store import verify_in_store

    if args.adopt:
        raise ValueError("--adopt indexes checkpoints on a filesystem only; a checkpoint on object storage always has "
                         "its index (an upload without one never finished): drop --adopt")
    url = args.path.rstrip("/")
    run, step = split_url(url)
    found = {step: storage.sizes_under(url)} if step is not None else store_steps(url)
    steps = list(found)
    if not steps or not any(found.values()):
        raise FileNotFoundError(f"no checkpoint under {url}: expected a run folder on the store (s3://.../NAME) or "
                                f"one of its checkpoints/step_* folders")
    damaged = 0
    for step in steps:
        problems = verify_in_store(step_url(run, step), found[step], checksums=not args.sizes_only)
        damaged += bool(problems)
        print(f"{step_url(run, step)}: {'DAMAGED: ' + '; '.join(problems) if problems else 'intact'}")
    aside = [n for n in storage.listdir(storage.join(run, "checkpoints")) if n.startswith("damaged_step_")]
    if aside:
        print(f"(set aside earlier as damaged, never loaded: {', '.join(aside)})")
    return 1 if damaged else 0


def add_checkpoint_parser(sub) -> None:
    s = sub.add_parser("checkpoint", help="checkpoint tools").add_subparsers(dest="checkpoint_command", required=True)
    c = s.add_parser("convert", help="convert a checkpoint of any format (full, sharded, DeepSpeed) to one file")
    c.add_argument("checkpoint", help="run folder (latest checkpoint), step folder or state.pt")
    c.add_argument("--to", required=True, choices=["full", "safetensors"])
    c.add_argument("--out", default=None, help="output folder (default: RUN/exports/step_XXXXXXXX-<to>)")
    c.set_defaults(fn=cmd_convert)
    v = s.add_parser("verify", help="check checkpoints against their integrity index (sha256 of every file)")
    v.add_argument("path", help="run folder (every checkpoint) or one checkpoint folder")
    v.add_argument("--sizes-only", action="store_true", help="compare file sizes only (fast, catches truncation)")
    v.add_argument("--adopt", action="store_true",
                   help="write an index for checkpoints without one (written before grt indexed checkpoints), as "
                        "they are now: only for checkpoints you trust")
    v.set_defaults(fn=cmd_verify)
