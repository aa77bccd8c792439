"""MLflow artifacts in the object store: a tracking server started with ``--artifacts-destination s3://...`` (its
proxied artifacts, MLFLOW_S3_ENDPOINT_URL pointing at the moto server) receives a training run's artifacts there;
the run's own output, files and MLflow params never hold the S3 credentials."""
from __future__ import annotations

import pytest

from conftest import make_corpus
from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train.trainer import Trainer
from s3_server import ACCESS_KEY
from s3_server import SECRET
from test_tracking import MlflowServer
from test_tracking import client_for
from test_tracking import run_id_of


@pytest.mark.multiprocess
@pytest.mark.slow
def test_run_artifacts_go_to_s3_and_credentials_are_never_logged(tmp_path, s3_server, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_server.endpoint)
    corpus = make_corpus(tmp_path / "corpus", n_docs=20)
    server = MlflowServer(tmp_path)
    server.artifacts = s3_server.url("mlartifacts")
    server.start()
    try:
        r = tiny_recipe(tmp_path, corpus, tracking={"enabled": True, "uri": server.uri, "experiment": "s3"})
        r["train"].update(max_steps=2, checkpoint_interval=2)
        cfg = from_dict(r)
        tokenize(cfg.data, quiet=True)
        Trainer(cfg).fit()
        client, run_id = client_for(server.uri), run_id_of(cfg.run_dir)
        run = client.get_run(run_id)
        uploaded = s3_server.keys("mlartifacts")
        assert any(k.endswith(f"/{run_id}/artifacts/recipe.yaml") for k in uploaded), uploaded
        out = capfd.readouterr()
        logged = [out.out, out.err, str(run.data.params), str(run.data.tags)]
        logged += [f.read_text(errors="replace") for f in cfg.run_dir.rglob("*") if f.is_file() and f.suffix in
                   (".jsonl", ".json", ".yaml", ".log", ".txt")]
        assert not any(SECRET in text or ACCESS_KEY in text for text in logged)
    finally:
        server.kill()
