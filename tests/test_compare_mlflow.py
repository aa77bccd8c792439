"""`grt compare` and `grt paper-table` against MLflow as a user meets it (issue #24, items 9 and 10):

- a tracking server that is down (nothing listens; or it accepts and never answers) ends both commands within
  seconds in one line naming the URI and the fix, as the trainer and `grt track sync` do, not minutes of MLflow's
  HTTP retries ending in chained tracebacks;
- a run renamed in the MLflow UI is found by its new name, its id and the name it was trained under; a name nobody
  has says "no run named", a run that exists but was never evaluated says so;
- two runs of one name are refused with both ids (the newest no longer hides the other); a run id picks one;
- with an http:// tracking URI the printed UI pointer is the server's URL, not a `mlflow ui` command;
- `--tag` holds a run folder to its recipe's tags, as MLflow holds a logged run.
"""
import json
import socket
import time

import pytest
import yaml

from pipeline.cli import main
from pipeline.config import TrackingConfig
from pipeline.eval.results import collect

HTTP_VARS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")
# measured here: 0.1 s against a closed port, 3.0 s against a silent one (the /health probe's timeout); MLflow's own
# retries take 253 s. 10 s leaves a loaded 2-core box three times the silent case.
FAST_S = 10.0


def grt(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def exits(name: str, val: float) -> dict:
    """An eval/exits.json as `grt eval` writes it (the fields compare reads)."""
    return {"name": name, "type": "grt", "shorthand": "1+1x2+1", "params": 1e6, "step": 4, "tokens_trained": 4096,
            "val_loss": val, "exit": [1, 2], "loss": [val + 0.5, val], "kl": [0.1, 0.0], "top1": [0.9, 1.0],
            "exit_flops": [1e6, 2e6], "trained_depth": 2}


@pytest.fixture(autouse=True)
def unbounded_mlflow(monkeypatch):
    """MLflow's own HTTP defaults: the bound must come from the command, not from an earlier test's environment."""
    for var in HTTP_VARS:
        monkeypatch.delenv(var, raising=False)


# ----------------------------------------------------------------------------------------- server down (item 9)
def one_error_line(err: str, uri: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert uri in lines[0] and "no MLflow server answers" in lines[0] and "--tracking-uri" in lines[0], err
    return lines[0]


def test_compare_and_paper_table_stop_at_once_when_nothing_listens(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with socket.socket() as held:  # bound, never listening: the port is ours and refuses every connection
        held.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{held.getsockname()[1]}"
        for argv in (["compare", "grt-a", "--tracking-uri", uri], ["paper-table", "--tracking-uri", uri]):
            t0 = time.monotonic()
            code, _, err = grt(capsys, *argv)
            took = time.monotonic() - t0
            assert code == 1 and took < FAST_S, (argv, took, err)
            assert "Connection refused" in one_error_line(err, uri)
    assert list(tmp_path.iterdir()) == []  # nothing written (no runs/compare, no mlruns)


def test_compare_stops_at_once_when_the_server_never_answers(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers a request
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        code, _, err = grt(capsys, "compare", "--tracking-uri", uri)
        took = time.monotonic() - t0
    assert code == 1 and took < FAST_S, (took, err)
    assert "timed out" in one_error_line(err, uri)


# ------------------------------------------------------------------------------------------ MLflow names (item 10)
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite store: experiment "names" holds a run renamed in the UI (trained as grt-a) and one never evaluated;
    experiment "twins" holds two evaluated runs of one name."""
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    clock = iter(range(1_000_000, 2_000_000, 1000))  # start times in creation order: later = newer

    def run(exp, name, val=None):
        r = client.create_run(exp, run_name=name, start_time=next(clock))
        client.log_param(r.info.run_id, "name", name)  # the trainer logs the recipe's name (cfg.flat())
        if val is not None:
            folder = tmp / r.info.run_id / "eval"
            folder.mkdir(parents=True)
            (folder / "exits.json").write_text(json.dumps(exits(name, val)))
            client.log_artifact(r.info.run_id, str(folder / "exits.json"), "eval")
        return r.info.run_id

    names = client.create_experiment("names", artifact_location=str(tmp / "art-names"))
    renamed = run(names, "grt-a", 4.25)
    client.update_run(renamed, name="grt-a-best")  # what renaming in the MLflow UI does
    unevaluated = run(names, "grt-b")
    twins = client.create_experiment("twins", artifact_location=str(tmp / "art-twins"))
    older, newer = run(twins, "twin", 4.5), run(twins, "twin", 4.0)
    return {"uri": uri, "renamed": renamed, "unevaluated": unevaluated, "older": older, "newer": newer}


def test_a_run_renamed_in_the_ui_is_found_by_new_name_id_and_trained_name(store):
    tracking = TrackingConfig(uri=store["uri"], experiment="names")
    for asked in ("grt-a-best", store["renamed"], "grt-a"):
        found = collect([asked], tracking)
        assert [(r["mlflow_run_id"], r["val_loss"]) for r in found] == [(store["renamed"], 4.25)], asked
        assert found[0]["name"] == "grt-a-best"  # shown by the name it has now


def test_missing_and_unevaluated_runs_are_told_apart(store, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = grt(capsys, "compare", "nope", "--tracking-uri", store["uri"], "--experiment", "names")
    assert code == 1 and "no run named 'nope'" in err and "evaluated" not in err, err
    assert "grt-a-best" in err and "grt-b" in err  # the names that are there
    code, _, err = grt(capsys, "compare", "grt-b", "--tracking-uri", store["uri"], "--experiment", "names")
    assert code == 1 and f"MLflow run 'grt-b' ({store['unevaluated']}) is not evaluated yet" in err, err
    assert "grt eval runs/grt-b" in err


def test_two_runs_of_one_name_are_refused_with_both_ids(store, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (["twin"], []):  # named, and every evaluated run of the experiment
        code, _, err = grt(capsys, "compare", *argv, "--tracking-uri", store["uri"], "--experiment", "twins")
        assert code == 1 and store["older"] in err and store["newer"] in err and "run id" in err, (argv, err)
        assert "'twin'" in err
    tracking = TrackingConfig(uri=store["uri"], experiment="twins")
    for run_id, val in ((store["older"], 4.5), (store["newer"], 4.0)):  # an id picks one
        assert [r["val_loss"] for r in collect([run_id], tracking)] == [val]


def test_a_server_uri_prints_its_url_not_a_mlflow_ui_command(tmp_path, capsys, monkeypatch):
    import pipeline.studies.compare

    monkeypatch.setattr(pipeline.studies.compare, "compare", lambda *a, **k: ("TABLE", tmp_path / "overlay.png"))
    code, out, _ = grt(capsys, "compare", "x", "--tracking-uri", "http://10.1.2.3:5000")
    assert code == 0 and "MLflow UI: open http://10.1.2.3:5000 (experiment(s) grt-pipeline)" in out, out
    assert "--backend-store-uri" not in out
    db = tmp_path / "mlflow.db"
    code, out, _ = grt(capsys, "compare", "x", "--tracking-uri", f"sqlite:///{db}")  # a local store: `mlflow ui`
    assert f"mlflow ui --backend-store-uri sqlite:///{db}` then open http://127.0.0.1:5000" in out, out


def test_tag_holds_a_run_folder_to_its_recipe_tags(tmp_path, capsys):
    run = tmp_path / "runs" / "swept"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "exits.json").write_text(json.dumps(exits("swept", 4.1)))
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "swept", "model": {"type": "grt"},
                                                     "tracking": {"tags": {"sweep": "toy-tau", "study": "x"}}}))
    tracking = TrackingConfig(uri=f"sqlite:///{tmp_path / 'never.db'}")
    for tags in ({"sweep": "toy-tau"}, {"sweep": "toy-tau", "model.type": "grt"}, {}):
        assert [r["val_loss"] for r in collect([str(run)], tracking, tags=tags)] == [4.1], tags
    with pytest.raises(LookupError, match=r"does not carry --tag sweep=phi \(its recipe.yaml gives sweep=toy-tau\)"):
        collect([str(run)], tracking, tags={"sweep": "phi"})
    with pytest.raises(LookupError, match="gives no 'owner' tag"):
        collect([str(run)], tracking, tags={"owner": "me"})
    code, _, err = grt(capsys, "compare", run, "--tag", "git_sha=abc123", "--out", tmp_path / "cmp")
    assert code == 1 and "does not record its run's 'git_sha' tag" in err and "MLflow name or id" in err, err
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "never.db").exists()
