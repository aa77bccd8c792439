"""The trainer's checkpoint save and resume times with ``out_dir`` on a local disk vs on an S3-compatible server, on
the same checkpoint (one recipe, one process, the same step).

For each place and each repeat: a fresh run trains one step and saves its checkpoint (the trainer's own
``checkpoint_s``: write, index and, on S3, upload with the index last), then a new trainer resumes it, timed around
the checkpointer's resume (on S3 from an empty node disk: download, every file checked against the index, then the
load). Prints JSON: the median seconds of each and S3 over local. The server is ``moto_server`` on 127.0.0.1 in its
own process (or the one AWS_ENDPOINT_URL names, with ``--url``), so the S3 figures measure the protocol path
(HTTP, signing, multipart uploads, moto's storage), not a network.

    python bench/run_store.py --d-model 256 --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.config import from_dict  # noqa: E402
from pipeline.runtime import storage  # noqa: E402
from pipeline.tokenize import tokenize  # noqa: E402
from pipeline.train.callbacks import Callback  # noqa: E402
from pipeline.train.checkpointer import Checkpointer  # noqa: E402
from pipeline.train.trainer import Trainer  # noqa: E402


def recipe(tmp: Path, out_dir: str, d_model: int, fmt: str = "full") -> dict:
    corpus = tmp / "corpus"
    if not corpus.is_dir():
        corpus.mkdir()
        rng = random.Random(0)
        words = ["gate", "state", "core", "loop", "token", "depth", "prelude", "coda", "shard", "store", "model"]
        for i in range(8):
            (corpus / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(4000)))
    return {"name": "bench", "seed": 1, "out_dir": out_dir,
            "model": {"type": "grt", "block_size": 64, "d_model": d_model, "n_head": 4, "n_prelude": 1, "n_core": 2,
                      "n_coda": 1, "n_recurrence": 2},
            "data": {"sources": [{"kind": "files", "paths": [str(corpus / "*.txt")]}],
                     "dataset_dir": str(tmp / "dataset"), "val_fraction": 0.1},
            "train": {"device": "cpu", "micro_batch_size": 2, "grad_accum_steps": 1, "max_steps": 1,
                      "warmup_steps": 1, "log_interval": 1, "eval_interval": 1, "eval_batches": 1,
                      "checkpoint_interval": 1, "checkpoint_format": fmt},
            "tracking": {"enabled": False}}


class SaveTime(Callback):
    def __init__(self):
        self.info = None

    def on_checkpoint(self, trainer, path, info: dict) -> None:
        self.info = info


def timed_resume() -> list[float]:
    """Checkpointer.resume wrapped to record its seconds (the resume a new Trainer does in its constructor)."""
    seconds, resume = [], Checkpointer.resume

    def wrapped(self, trainer):
        t = time.perf_counter()
        resume(self, trainer)
        seconds.append(time.perf_counter() - t)
    Checkpointer.resume = wrapped
    return seconds


def measure(tmp: Path, out_dir: str, d_model: int, repeats: int, fmt: str) -> dict:
    saves, resumes, size = [], [], 0
    resumed = timed_resume()
    for i in range(repeats):
        cfg = from_dict(recipe(tmp, out_dir, d_model, fmt) | {"name": f"bench{i}_{fmt}"})
        os.environ[storage.RUN_CACHE_ENV] = str(tmp / f"node_{i}_a")
        cb = SaveTime()
        Trainer(cfg, callbacks=[cb]).fit()
        saves.append(cb.info["checkpoint_s"])
        folder = cfg.run_dir / "checkpoints" / "step_00000001"
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        os.environ[storage.RUN_CACHE_ENV] = str(tmp / f"node_{i}_b")  # another node: an empty disk
        Trainer(cfg, callbacks=[]).fit()  # at max_steps: resumes, trains nothing
        resumes.append(resumed[-1])
    s, r = statistics.median(saves), statistics.median(resumes)
    return {"save_s": round(s, 3), "resume_s": round(r, 3), "save_all_s": [round(x, 3) for x in saves],
            "resume_all_s": [round(x, 3) for x in resumes], "checkpoint_MB": round(size / 2 ** 20, 1)}


def start_moto() -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    for _ in range(100):
        try:
            boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="grt-bench")
            return server
        except Exception:  # noqa: BLE001 — not listening yet
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("moto_server did not start on 127.0.0.1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256, help="model width (the 50,257-token embedding dominates)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format", default="full", choices=["full", "sharded"], help="train.checkpoint_format")
    ap.add_argument("--url", help="an s3:// prefix on the server of AWS_ENDPOINT_URL (default: start moto here)")
    args = ap.parse_args()
    server = None if args.url else start_moto()
    url = args.url or "s3://grt-bench/runs"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            tokenize(from_dict(recipe(tmp, str(tmp / "runs"), args.d_model)).data, quiet=True)
            with contextlib.redirect_stdout(sys.stderr):  # the trainers' lines: stdout is the JSON
                local = measure(tmp, str(tmp / "runs"), args.d_model, args.repeats, args.format)
                s3 = measure(tmp, url, args.d_model, args.repeats, args.format)
            out = {"repeats": args.repeats, "d_model": args.d_model, "format": args.format, "local_disk": local,
                   "s3": s3,
                   "s3_server": "moto_server (own process, 127.0.0.1)" if server else "AWS_ENDPOINT_URL"}
    finally:
        if server:
            server.kill()
    out["s3_over_local"] = {"save": round(out["s3"]["save_s"] / out["local_disk"]["save_s"], 1),
                            "resume": round(out["s3"]["resume_s"] / out["local_disk"]["resume_s"], 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
