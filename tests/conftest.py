"""Shared fixtures: a tiny corpus written on the fly and tiny recipes, so every test runs on a fresh clone."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import types
from pathlib import Path

# Triton's kernels run on a CPU only in its interpreter, which must be chosen before triton is imported. A machine
# with an NVIDIA driver runs them for real (the `gpu` tests).
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import zstandard

from pipeline.config import from_dict
from s3_server import s3_server  # noqa: F401  (the moto S3 server fixture, for every test module)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TESTS = Path(__file__).resolve().parent

# ------------------------------------------------------------------------------------------------------ test tiers
# `make test-quick` runs -m "not slow and not multiprocess and not gpu and not further_case". A test is marked
# multiprocess here when its code, a fixture's, or a function of tests/ that either calls (followed by name, to any
# depth) names one of these: it starts other processes (torchrun ranks, `grt` commands, servers, worker scripts).
# Explicit marks add what this cannot see (processes started by code outside tests/).
STARTS_PROCESSES = frozenset({"subprocess", "Popen", "subprocess_env", "spawn", "get_context"})


def starts_processes(func, seen: set) -> bool:
    code = getattr(func, "__code__", None)
    if code is None or code in seen or not Path(code.co_filename).resolve().is_relative_to(TESTS):
        return False
    seen.add(code)
    names, stack = set(), [code]
    while stack:  # nested functions and lambdas are constants of the code that holds them
        c = stack.pop()
        names |= set(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return bool(names & STARTS_PROCESSES) or any(
        starts_processes(g, seen) for g in (func.__globals__.get(n) for n in names) if inspect.isfunction(g))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    represented = set()  # parametrized tests with a case in the quick tier: their further cases are marked
    for item in items:
        funcs = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)  # a Function's fixtures (pytest's own attribute)
        funcs += [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
        if not item.get_closest_marker("multiprocess") and any(starts_processes(f, set()) for f in funcs if f):
            item.add_marker(pytest.mark.multiprocess)
        if hasattr(item, "callspec") and not any(item.get_closest_marker(m) for m in ("slow", "multiprocess", "gpu")):
            test = (item.path, item.cls, item.originalname)
            if test in represented:
                item.add_marker(pytest.mark.further_case)
            represented.add(test)


WORDS = ("the gate decides how much of the state is kept while the shared core proposes an update and the prelude "
         "anchors every step so that depth can grow without new weights").split()


def make_corpus(root: Path, n_docs: int = 60) -> Path:
    """Plain-text files, a .jsonl and a .jsonl.zst with deterministic pseudo-random English-like documents."""
    root.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        words = [WORDS[(i * 7 + j * 13 + (j * j) % 5) % len(WORDS)] for j in range(150 + (i % 9) * 20)]
        docs.append(f"Document {i}. " + " ".join(words) + ".")
    third = n_docs // 3
    (root / "txt").mkdir(exist_ok=True)
    for i, d in enumerate(docs[:third]):
        (root / "txt" / f"doc{i:03d}.txt").write_text(d)
    (root / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[third:2 * third]))
    raw = "".join(json.dumps({"text": d, "meta": {"i": i}}) + "\n" for i, d in enumerate(docs[2 * third:]))
    (root / "part.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw.encode()))
    return root


SESSION_DIRS: set[Path] = set()  # scratch folders that session fixtures made: kept until the session ends


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    SESSION_DIRS.add(root)
    return make_corpus(root)


@pytest.fixture(scope="module", autouse=True)
def module_scratch_is_removed(request, tmp_path_factory):
    """The folders a module's fixtures made under pytest's scratch root are removed when the module ends with no
    failure (pytest.ini's tmp_path_retention_policy does this for each test's tmp_path). A full run kept ~7 GB of
    checkpoints otherwise, enough to fill a CI machine's disk."""
    root = tmp_path_factory.getbasetemp()
    before, failed = set(root.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(root.iterdir()) - before - SESSION_DIRS:
            if path.is_symlink():  # pytest's "<name>current" link to the newest folder of that name
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)


def tiny_recipe(tmp: Path, corpus: Path, model: dict | None = None, **sections) -> dict:
    """A recipe dict for a model small enough to train in seconds on a CPU."""
    m = {"type": "grt", "block_size": 32, "d_model": 32, "n_head": 2, "n_prelude": 1, "n_core": 1, "n_coda": 1,
         "n_recurrence": 3}
    m.update(model or {})
    recipe = {
        "name": "tiny", "seed": 7, "out_dir": str(tmp / "runs"), "model": m,
        "data": {"sources": [{"kind": "files", "paths": [str(corpus / "txt" / "*.txt"), str(corpus / "part.jsonl"),
                                                          str(corpus / "part.jsonl.zst")]}],
                 "dataset_dir": str(tmp / "dataset"), "val_fraction": 0.2, "shard_tokens": 4096},
        "train": {"device": "cpu", "micro_batch_size": 4, "grad_accum_steps": 2, "max_steps": 4, "lr": 1e-3,
                  "min_lr": 1e-4, "warmup_steps": 1, "log_interval": 1, "eval_interval": 2, "eval_batches": 2,
                  "checkpoint_interval": 2},
        "eval": {"val_tokens": 256, "batch_size": 4},
        "tracking": {"enabled": False, "uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests"},
    }
    for k, v in sections.items():
        recipe[k] = {**recipe.get(k, {}), **v} if isinstance(v, dict) else v
    return recipe


def model_recipes(tmp: Path, models: dict, train: dict, eval_max_steps: dict | None = None) -> dict[str, Path]:
    """One tiny recipe per entry of ``models`` (d 32, 2 heads, context 32, the model section's keys over that) with
    ``train`` settings, written as tmp/NAME.yaml over one tokenized corpus; ``eval_max_steps``: the exit curve's end
    per model name (default: the model's own). The multi-process method tests share it."""
    import yaml

    from pipeline.tokenize import tokenize

    corpus = make_corpus(tmp / "corpus", n_docs=90)
    out = {}
    for name, model in models.items():
        recipe = tiny_recipe(tmp, corpus)
        recipe["model"] = {"block_size": 32, "d_model": 32, "n_head": 2, **model}
        recipe["train"].update(log_interval=1, collective_timeout_s=30, **train)
        recipe["eval"].update(diagnostics=False)
        if name in (eval_max_steps or {}):
            recipe["eval"]["max_steps"] = eval_max_steps[name]
        out[name] = tmp / f"{name}.yaml"
        out[name].write_text(yaml.safe_dump(recipe))
    tokenize(from_dict(yaml.safe_load(next(iter(out.values())).read_text())).data, quiet=True)
    return out


@pytest.fixture
def tiny(tmp_path, corpus):
    def build(model=None, **sections):
        return from_dict(tiny_recipe(tmp_path, corpus, model, **sections))
    return build


def subprocess_env(**extra) -> dict:
    """The environment of a launched training process: one thread per rank, unbuffered output, no launcher
    variables inherited from the calling shell (a stray RANK would make `grt train` think it runs under torchrun)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not shutil.which("nvidia-smi"):
        e.setdefault("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        e.pop(k, None)
    return {**e, **extra}


def load_bench(name: str, as_name: str | None = None):
    """A script of bench/ as a module (bench/ is scripts, not a package), once per test session, under ``as_name``
    (default its own name; e.g. bench/train.py as "bench_train", not to shadow another "train")."""
    import importlib.util
    import sys

    mod_name = as_name or name
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, Path(__file__).resolve().parents[1] / "bench" /
                                                      f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[mod_name]


def free_port() -> int:
    """A TCP port nobody listens on, for a launched job's rendezvous or a server: random in 20000..32767 (below
    Linux's ephemeral range, so no outgoing connection takes it meanwhile), checked by binding it. A fixed port
    collides with a job of another test session on the same host, and torch's store then joins the stranger's
    rendezvous and waits."""
    import random
    import socket

    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free TCP port in 20000..32767")


def step_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses from metrics.jsonl; for a resumed run, the last time each step was logged."""
    return step_values(run_dir, "loss")


def launched_recipe(tmp: Path, **train) -> Path:
    """A tiny recipe for runs launched as subprocesses (torchrun, grt launch): its corpus tokenized, written to
    tmp/recipe.yaml with these ``train`` settings over 2-sample micro-batches logged every step."""
    import yaml

    recipe = tiny_recipe(tmp, make_corpus(tmp / "corpus", n_docs=90))
    recipe["train"].update(micro_batch_size=2, log_interval=1, **train)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    from pipeline.tokenize import tokenize

    tokenize(from_dict(recipe).data, quiet=True)
    return path


@contextlib.contextmanager
def single_thread():
    """One intra-op thread inside the block, as a launched process has (``subprocess_env``: OMP_NUM_THREADS=1). A
    reference trained in the test's process that a launched run must equal bit for bit needs it: with two threads,
    MKL's GEMMs may split their work differently on a loaded machine and move the last bits of a loss."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny (float64) ops: a second intra-op thread only adds synchronisation, ~10x slower on a loaded 2-core box.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with single_thread():
        yield


def step_values(run_dir: Path, key: str) -> dict[int, float]:
    """Per-step values of one training metric (``grad_norm``, ``depth``, ...) from metrics.jsonl; for a resumed run,
    the last time each step was logged. A step row without the key fails (KeyError): no metric is skipped silently."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row[key]
    return out


def printed_steps(stdout: str) -> list[int]:
    """The steps whose console line (``step  9/20 | loss ...``) a run printed, in order."""
    import re

    return [int(m.group(1)) for m in re.finditer(r"^step\s+(\d+)/\d+ \| loss ", stdout, re.MULTILINE)]
