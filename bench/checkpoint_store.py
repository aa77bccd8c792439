"""Checkpoint save and load times: a local disk vs an S3-compatible server, on the same checkpoint.

Saves one toy model's model+optimizer state with torch.distributed.checkpoint (one process) to a local folder
(FileSystemWriter, as the trainer's `sharded` format) and to ``s3://`` (FsspecWriter through s3fs), then loads each
back (FileSystemReader / FsspecReader), ``--repeats`` times, and prints JSON: median seconds and MB/s of each.
The S3 server is moto on 127.0.0.1 started here (or any server named by AWS_ENDPOINT_URL with ``--url``), so the
figures measure the S3 protocol path (HTTP, request signing, multipart uploads), not a network.

    python bench/checkpoint_store.py --mb 32 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.runtime import storage  # noqa: E402


def toy_state(mb: float) -> dict:
    """A model of ``mb`` MB of fp32 weights (linear layers of 512 x 512) and its AdamW state (2 more copies)."""
    torch.manual_seed(0)
    layers = max(1, round(mb * 2 ** 20 / (4 * 512 * 513)))
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0


def zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    return state


def measure(state, where: str, repeats: int) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    save, load = [], []
    for i in range(repeats):
        path = storage.join(where, f"ckpt_{i}")
        opts = storage.storage_options(path)
        writer = FsspecWriter(str(path), **opts) if storage.is_remote(path) else FileSystemWriter(path)
        t = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        save.append(time.perf_counter() - t)
        target = zeros_like(state)
        reader = FsspecReader(str(path), **opts) if storage.is_remote(path) else FileSystemReader(path)
        t = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        load.append(time.perf_counter() - t)
        assert all(torch.equal(a, b) for a, b in zip(target["model"].values(), state["model"].values()))
    mb = nbytes(state) / 2 ** 20
    s, l = statistics.median(save), statistics.median(load)
    return {"save_s": round(s, 3), "load_s": round(l, 3), "save_MBps": round(mb / s, 1), "load_MBps": round(mb / l, 1),
            "save_all_s": [round(x, 3) for x in save], "load_all_s": [round(x, 3) for x in load]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=32, help="model weights in MB (the optimizer adds twice that)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--url", help="an s3:// prefix on the server of AWS_ENDPOINT_URL (default: start moto here)")
    args = ap.parse_args()
    state = toy_state(args.mb)
    server = None
    if not args.url:
        import logging

        from moto.server import ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        import boto3
        boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="grt-bench")
        args.url = "s3://grt-bench/ckpt"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = {"checkpoint_MB": round(nbytes(state) / 2 ** 20, 1), "repeats": args.repeats,
                   "local_disk": measure(state, Path(tmp), args.repeats),
                   "s3": measure(state, args.url, args.repeats),
                   "s3_server": "moto (in-process, 127.0.0.1)" if server else "AWS_ENDPOINT_URL"}
    finally:
        if server:
            server.stop()
    out["s3_over_local"] = {"save": round(out["s3"]["save_s"] / out["local_disk"]["save_s"], 1),
                            "load": round(out["s3"]["load_s"] / out["local_disk"]["load_s"], 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
