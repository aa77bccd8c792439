"""One MLflow server for every node: a real `mlflow server` (sqlite store, local artifact root) on 127.0.0.1.

- a server that is down at start-up stops training before the first step, naming the URI and the fix;
- killed mid-run: training finishes with a warning, the run folder's buffer holds the rest, `grt track sync`
  replays it and every step is in the metric history exactly once; a resumed run appends to the same MLflow run;
- a run SIGKILLed between checkpoints (sqlite store) resumes in the same MLflow run: one run, params of the first
  launch, each step's metrics once, except the steps after the checkpoint, trained and logged again (documented);
  one SIGKILLed before its first checkpoint trains again from step 1 in the same MLflow run;
- an outage that ends mid-run is replayed at the next flush (warned once each way), leftovers on resume;
- a host name the server refuses (MLflow 3.x's --allowed-hosts) is named before training;
- tags (git SHA, hosts, launcher, world size, SLURM job id), the tokenized dataset as the run's input, the
  experiment's type and system metrics; under torchrun only global rank 0 logs and the hosts of both ranks are there.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port
from conftest import make_corpus
from conftest import printed_steps
from conftest import step_losses
from conftest import subprocess_env
from conftest import tiny_recipe
from pipeline import cli
from pipeline import tracking
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train.callbacks import Callback
from pipeline.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


class MlflowServer:
    """`mlflow server` with a sqlite store and a local artifact folder, in its own process group."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"
        self.artifacts = str(root / "artifacts")  # or an s3:// URL (tests/test_storage_mlflow.py)

    def start(self, timeout: float = 180) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", self.artifacts, "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1", "--allowed-hosts", "127.0.0.1:*"],  # "localhost" is refused
            stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            if tracking.server_answers(self.uri, timeout=1) is None:
                return
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"mlflow server not up after {timeout} s: {(self.root / 'server.log').read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this fixture started: the server and its worker
            self.proc.wait(timeout=30)
        self.proc = None

    def ensure_up(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracking")
    corpus = make_corpus(tmp / "corpus")
    base = tiny_recipe(tmp, corpus)
    tokenize(from_dict(base).data, quiet=True)
    server = MlflowServer(tmp)
    try:
        yield tmp, corpus, server
    finally:
        server.kill()


def recipe(tmp, corpus, uri, name, **train) -> dict:
    r = tiny_recipe(tmp, corpus, tracking={"enabled": True, "uri": uri, "experiment": "scale-out"})
    r["name"] = name
    r["train"].update(train)
    return r


@pytest.fixture
def fast_flush(monkeypatch):
    """A request at every log call and a server looked for again at once: the test sees every transition."""
    monkeypatch.setattr(tracking.tracker, "FLUSH_EVERY_S", 0.0)
    monkeypatch.setattr(tracking.tracker, "RETRY_DOWN_S", 0.0)
    monkeypatch.setattr(tracking.tracker, "SYSTEM_METRICS_INTERVAL_S", 0.1)
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE"):
        monkeypatch.delenv(var, raising=False)


class At(Callback):
    """Calls ``fn(trainer)`` once step ``step`` is logged."""

    def __init__(self, step, fn):
        self.step, self.fn = step, fn

    def on_step_end(self, trainer, metrics):
        if metrics["step"] == self.step:
            self.fn(trainer)


def client_for(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def steps(client, run_id, key) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def run_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]


# ----------------------------------------------------------------------------------------------- no server
def test_launcher_hosts_and_git_sha(tmp_path):
    assert tracking.detect_launcher({}) == "none"
    assert tracking.detect_launcher({"TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert tracking.detect_launcher({"CROSS_RANK": "0", "CROSS_SIZE": "2", "RANK": "0"}) == "deepspeed"
    assert tracking.detect_launcher({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "x"}) == "slurm+torchrun"
    assert tracking.detect_launcher({"SLURM_JOB_ID": "42", "SLURM_PROCID": "3"}) == "slurm"
    assert tracking.host_summary(["gpu-a", "gpu-a", "gpu-b", "gpu-b", "gpu-b"]) == "gpu-a x2,gpu-b x3"
    many = tracking.host_summary([f"node-{i:04d}" for i in range(2000) for _ in range(8)])
    assert len(many) <= 8000 and many.startswith("node-0000 x8,node-0001 x8,") and many.endswith(",... (2000 nodes)")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert tracking.git_sha().split("+")[0] == head.stdout.strip()
    assert tracking.git_sha(tmp_path) == "unknown"  # not a checkout


def test_buffer_keeps_lines_and_skips_a_torn_one(tmp_path):
    path = tmp_path / "tracking_buffer.jsonl"
    buf = tracking.TrackingBuffer(path)
    buf.append({"op": "metrics", "items": [["loss", 1.5, 1000, 1]]})
    buf.close()
    with open(path, "ab") as f:  # a job killed in the middle of its next append
        f.write(b'{"op": "metrics", "ite')
    buf = tracking.TrackingBuffer(path)
    buf.append({"op": "metrics", "items": [["loss", 1.25, 2000, 2]]})

    class Recorder:
        def __init__(self):
            self.metrics = []

        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            self.metrics += [(m.key, m.value, m.timestamp, m.step) for m in metrics]

    rec = Recorder()
    assert buf.replay(rec, "run") == 2
    assert rec.metrics == [("loss", 1.5, 1000, 1), ("loss", 1.25, 2000, 2)]
    assert path.stat().st_size == 0 and buf.replay(rec, "run") == 0
    buf.close()
    assert not path.exists()  # nothing left to sync


def test_a_refused_line_is_set_aside_and_a_concurrent_sync_loses_nothing(tmp_path, capsys):
    """A line the store refuses for good (HTTP 400) goes to tracking_rejected.jsonl and the lines around it are sent;
    a connection error on the way keeps what was not sent; a `grt track sync` that empties and removes the journal
    while the trainer holds it open does not swallow the trainer's next lines."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from pipeline.tracking.journal import REJECTED_FILE
    from pipeline.tracking.journal import TrackingBuffer

    class Store:
        def __init__(self, down_after: int | None = None):
            self.metrics, self.calls, self.down_after = [], 0, down_after

        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            self.calls += 1
            if self.down_after is not None and self.calls > self.down_after:
                raise MlflowException("API request to http://x failed with exception ConnectionError")  # 500
            if any(p.key == "bad" for p in params):
                raise MlflowException("param 'bad' already logged with another value", INVALID_PARAMETER_VALUE)
            # like MLflow's stores, a metric equal in (key, value, timestamp, step) to one the run has is dropped
            self.metrics += [(m.key, m.step) for m in metrics if (m.key, m.step) not in self.metrics]

        def get_run(self, run_id):
            return type("Run", (), {"data": type("Data", (), {"params": {}})()})()

    path = tmp_path / "tracking_buffer.jsonl"
    lines = [{"op": "metrics", "items": [["loss", 1.0, 1, 1]]}, {"op": "params", "items": {"bad": "x"}},
             {"op": "metrics", "items": [["loss", 0.5, 2, 2]]}]
    buf = TrackingBuffer(path)
    for line in lines:
        buf.append(line)
    store = Store()
    assert buf.replay(store, "run") == 3
    assert store.metrics == [("loss", 1), ("loss", 2)] and path.stat().st_size == 0
    aside = [json.loads(x) for x in (tmp_path / REJECTED_FILE).read_text().splitlines()]
    assert [a["line"] for a in aside] == [lines[1]] and "refused a buffered 'params' line" in capsys.readouterr().err

    for line in lines:  # the server goes away after the first line of the one-by-one pass: the rest is kept
        buf.append(line)
    with pytest.raises(MlflowException):
        buf.replay(Store(down_after=3), "run")  # batch: A, P refused; one by one: A, then down
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[1:]

    sync = TrackingBuffer(path)  # `grt track sync` in another process: sends, empties, removes the file
    sync.replay(Store(), "run")
    sync.close()
    assert not path.exists()
    buf.append(lines[2])  # the trainer's next line lands in a journal that exists
    assert [json.loads(x) for x in path.read_text().splitlines()] == [lines[2]]
    buf.close()


def test_server_down_at_start_fails_before_training(tmp_path, corpus, capsys):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = recipe(tmp_path, corpus, uri, "nostart")
    cfg = from_dict(r)
    tokenize(cfg.data, quiet=True)
    t0 = time.monotonic()
    with pytest.raises(tracking.TrackingUnavailableError) as e:
        tracking.open_tracker(cfg.tracking, cfg.name, run_dir=tmp_path)
    assert time.monotonic() - t0 < 5
    for part in (uri, "mlflow server", "tracking.enabled=false"):
        assert part in str(e.value)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    assert cli.main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert uri in err and "tracking.enabled=false" in err and "Traceback" not in err
    assert not (cfg.run_dir / "metrics.jsonl").exists() and not (cfg.run_dir / "checkpoints").exists()


# ------------------------------------------------------------------------------------------- real server
@pytest.mark.slow
def test_killed_server_buffer_sync_and_resume(setup, fast_flush, capsys):
    tmp, corpus, server = setup
    server.ensure_up()
    cfg = from_dict(recipe(tmp, corpus, server.uri, "outage", max_steps=10, checkpoint_interval=5))
    trainer = Trainer(cfg)
    trainer.callbacks.append(At(4, lambda t: server.kill()))
    assert trainer.fit()["step"] == 10  # training went on
    err = capsys.readouterr().err
    assert err.count("is unreachable") == 1, err
    buffer = cfg.run_dir / "tracking_buffer.jsonl"
    assert buffer.stat().st_size > 0

    server.start()  # the same sqlite store
    client, run_id = client_for(server.uri), run_id_of(cfg.run_dir)
    assert len(steps(client, run_id, "loss")) < 10  # the rest is in the buffer
    assert cli.main(["track", "sync", str(cfg.run_dir)]) == 0
    assert steps(client, run_id, "loss") == list(range(1, 11))  # every step exactly once
    assert steps(client, run_id, "val_loss") == [2, 4, 6, 8, 10]
    assert not buffer.exists() and client.get_run(run_id).info.status == "FINISHED"
    assert cli.main(["track", "sync", str(cfg.run_dir)]) == 0  # nothing left: harmless
    assert steps(client, run_id, "loss") == list(range(1, 11))

    # requeued / resumed: the same MLflow run, two more steps, system metrics on
    cfg = from_dict(recipe(tmp, corpus, server.uri, "outage", max_steps=12, checkpoint_interval=5)
                    | {"tracking": {"enabled": True, "uri": server.uri, "experiment": "scale-out",
                                    "system_metrics": True}})
    Trainer(cfg).fit()
    assert run_id_of(cfg.run_dir) == run_id
    run = client.get_run(run_id)
    assert steps(client, run_id, "loss") == list(range(1, 13)) and run.info.status == "FINISHED"
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)

    tags = run.data.tags
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert tags["git_sha"].split("+")[0] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert tags["hosts"] == f"{socket.gethostname()} x1" and tags["nodes"] == "1" and tags["world_size"] == "1"
    assert tags["launcher"] == "none" and tags["slurm_job_id"] == "none" and tags["model.type"] == "grt"

    manifest = Path(cfg.data.dataset_dir) / "manifest.json"
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.digest == hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]
    source = json.loads(inp.dataset.source)
    assert inp.dataset.source_type == "local" and source["uri"] == str(Path(cfg.data.dataset_dir).resolve())
    assert any(str(corpus / "part.jsonl") in s for s in source["sources"])
    train_tokens = json.loads(manifest.read_text())["splits"]["train"]["tokens"]
    assert json.loads(inp.dataset.profile)["train_tokens"] == train_tokens
    assert {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "train"}
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_outage_that_ends_is_replayed_at_the_next_flush(setup, fast_flush, capsys):
    """The server's address goes dead after step 3 and comes back after step 6 (a network outage, the server never
    stopped); dead again after step 8 to the end: the resumed run sends what was left first."""
    tmp, corpus, server = setup
    server.ensure_up()
    cfg = from_dict(recipe(tmp, corpus, server.uri, "blip", max_steps=10, checkpoint_interval=5))
    trainer = Trainer(cfg)
    dead = f"http://127.0.0.1:{free_port()}"

    def point_to(uri):
        def fn(t):
            t.tracker.client, t.tracker.uri = client_for(uri), uri
        return fn

    trainer.callbacks += [At(3, point_to(dead)), At(6, point_to(server.uri)), At(8, point_to(dead))]
    trainer.fit()
    err = capsys.readouterr().err
    assert err.count("is unreachable") == 2 and err.count("is back after") == 1, err
    client, run_id = client_for(server.uri), run_id_of(cfg.run_dir)
    # steps 3..5 were replayed when it was back; 9 and 10 are buffered (a step is sent before At's callback runs)
    assert steps(client, run_id, "loss") == list(range(1, 9))

    cfg = from_dict(recipe(tmp, corpus, server.uri, "blip", max_steps=12, checkpoint_interval=5))
    Trainer(cfg).fit()
    assert "lines buffered by a previous attempt" in capsys.readouterr().err
    assert steps(client, run_id, "loss") == list(range(1, 13))
    assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_host_name_the_server_refuses_is_named_before_training(setup):
    tmp, corpus, server = setup
    server.ensure_up()
    tracking.check_server(server.uri)  # 127.0.0.1 is allowed
    with pytest.raises(tracking.TrackingUnavailableError) as e:  # /health answers any host name; the API does not
        tracking.check_server(f"http://localhost:{server.port}")
    assert "Invalid Host header" in str(e.value) and "--allowed-hosts 'localhost,localhost:*'" in str(e.value)


@pytest.mark.slow
def test_run_that_died_before_its_first_checkpoint_continues(setup, capsys):
    """docs/tracking.md: a rerun continues the same MLflow run "also when it died before its first checkpoint".
    `grt train` SIGKILLed right after step 1 (first checkpoint due at 2), then run again (here, in this process):
    it trains from step 1 in the first launch's MLflow run: one run in the store, FINISHED, step 1 logged by both
    launches with equal values (same seed, from scratch), each value the one metrics.jsonl holds."""
    from collections import Counter

    tmp, corpus, _ = setup
    uri = f"sqlite:///{tmp / 'resume.db'}"  # the store of the test below (a new sqlite store costs ~7 s to create)
    r = recipe(tmp, corpus, uri, "early", max_steps=2, checkpoint_interval=2, eval_interval=2)
    r["tracking"]["experiment"] = "died-early"  # its own experiment: the test below counts the runs of its own
    path = tmp / "early.yaml"
    path.write_text(yaml.safe_dump(r))
    killed = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(path)], cwd=REPO,
                            env=subprocess_env(GRT_FAULT_KILL_AT_STEP="1"), capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = from_dict(r).run_dir
    assert not list((run_dir / "checkpoints").glob("step_*"))  # died before its first checkpoint
    first_id = run_id_of(run_dir)
    capsys.readouterr()
    assert cli.main(["train", str(path)]) == 0
    assert printed_steps(capsys.readouterr().out) == [1, 2]
    client = client_for(uri)
    runs = client.search_runs([client.get_experiment_by_name("died-early").experiment_id])
    assert [x.info.run_id for x in runs] == [first_id] and runs[0].info.status == "FINISHED"
    logged = client.get_metric_history(first_id, "loss")
    assert Counter(m.step for m in logged) == {1: 2, 2: 1}
    local = step_losses(run_dir)
    assert all(m.value == local[m.step] for m in logged), [(m.step, m.value, local[m.step]) for m in logged]


@pytest.mark.slow
def test_torchrun_two_ranks_log_once_with_both_hosts(setup, fast_flush):
    tmp, corpus, server = setup
    server.ensure_up()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)

    def torchrun(uri):
        path = tmp / "dist.yaml"
        path.write_text(yaml.safe_dump(recipe(tmp, corpus, uri, "dist", max_steps=4, backend="ddp",
                                              collective_timeout_s=300)))
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), "-m", "pipeline.cli", "train", str(path)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    down = torchrun(f"http://127.0.0.1:{free_port()}")  # rank 1 stops too, told by rank 0, not by a timeout
    assert down.returncode != 0 and "rank 0 could not open the MLflow run" in down.stderr, down.stderr[-3000:]
    assert "no MLflow server answers" in down.stderr

    p = torchrun(server.uri)
    assert p.returncode == 0, p.stderr[-3000:]
    client = client_for(server.uri)
    exp = client.get_experiment_by_name("scale-out")
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'dist'")
    assert len(runs) == 1  # rank 1 opened no run
    tags = runs[0].data.tags
    assert tags["hosts"] == f"{socket.gethostname()} x2" and tags["world_size"] == "2"
    assert tags["launcher"] == "torchrun"
    assert steps(client, runs[0].info.run_id, "loss") == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_killed_run_resumes_in_the_same_mlflow_run(setup):
    """`grt train` SIGKILLed right after step 6 (checkpoint at 4, the metrics still in the journal: sent every 10 s)
    and started again: one MLflow run in the store, the same id in run.json, FINISHED; the params are the first
    launch's, once; each step's loss is in the history once, except steps 5 and 6, trained and logged by both
    launches (docs/tracking.md: "Steps after the last checkpoint are trained, and logged, again") with equal values
    (exact resume), and every value is the one metrics.jsonl holds."""
    from collections import Counter

    from pipeline.tracking import MAX_PARAM_LEN

    tmp, corpus, _ = setup
    uri = f"sqlite:///{tmp / 'resume.db'}"
    r = recipe(tmp, corpus, uri, "resumed", max_steps=10, checkpoint_interval=4, eval_interval=2)
    path = tmp / "resumed.yaml"
    path.write_text(yaml.safe_dump(r))
    cmd = [sys.executable, "-m", "pipeline.cli", "train", str(path)]
    killed = subprocess.run(cmd, cwd=REPO, env=subprocess_env(GRT_FAULT_KILL_AT_STEP="6"), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = from_dict(r).run_dir
    first_id = run_id_of(run_dir)
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resumed at step 4 on single x1" in p.stdout and printed_steps(p.stdout) == list(range(5, 11)), p.stdout

    client = client_for(uri)
    exp = client.get_experiment_by_name("scale-out")
    runs = client.search_runs([exp.experiment_id])
    assert [x.info.run_id for x in runs] == [first_id] and run_id_of(run_dir) == first_id
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert not (run_dir / "tracking_buffer.jsonl").exists() and not (run_dir / "tracking_rejected.jsonl").exists()

    logged = client.get_metric_history(first_id, "loss")
    assert Counter(m.step for m in logged) == {**{s: 1 for s in range(1, 11)}, 5: 2, 6: 2}
    local = step_losses(run_dir)  # the one history of metrics.jsonl (a resume cuts the killed run's 5, 6 back)
    assert sorted(local) == list(range(1, 11))
    assert all(m.value == local[m.step] for m in logged), [(m.step, m.value, local[m.step]) for m in logged]
    assert sorted(m.step for m in client.get_metric_history(first_id, "val_loss")) == [2, 4, 6, 8, 10]

    cfg = from_dict(r)
    want = {k: str(v)[:MAX_PARAM_LEN] for k, v in cfg.flat().items()}
    assert {k: v for k, v in run.data.params.items() if not k.startswith("info.")} == want
    assert {"info.params", "info.tokens_per_step"} <= set(run.data.params)
