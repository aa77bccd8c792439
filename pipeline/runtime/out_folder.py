"""The ``--out DIR`` of a command that writes a folder (`grt export`, `grt checkpoint convert`): it replaces only a
folder it wrote itself, never anything else a user keeps there, and never a run."""
from __future__ import annotations

from pathlib import Path

RUN_FILES = ("metrics.jsonl", "checkpoints")  # what a run folder (runs/NAME) holds


def check_replaceable(out: Path, marker: str, command: str, source: Path | None = None) -> None:
    """Raise :class:`FileExistsError` unless ``out`` is new, empty, or a folder ``command`` wrote earlier (``marker``
    in it) that holds no run; ``out`` is never ``source`` (the folder read from) or a folder above it."""
    out = Path(out)
    if out.is_symlink():  # replacing it would replace the link, or delete through it: neither is asked for
        raise FileExistsError(f"--out {out} is a symbolic link (to {out.resolve()}): give the folder's own path, or a "
                              f"new folder")
    if source is not None:
        here, src = out.resolve(), Path(source).resolve()
        if here == src or here in src.parents:
            raise FileExistsError(f"--out {out} {'is' if here == src else 'holds'} the checkpoint being read ({src}): "
                                  f"choose a new folder for the output")
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / marker).is_file()):
        raise FileExistsError(f"--out {out} exists and is not an earlier `{command}`: choose a new folder or empty it")
    if out.is_dir():
        run = next((p.parent for p in out.rglob("*") if p.name in RUN_FILES), None)
        if run is not None:  # a run moved into an earlier output: not the command's to delete
            raise FileExistsError(f"--out {out} holds a run folder ({run}), which `{command}` never replaces: choose "
                                  f"a new folder")
