"""`grt paper-table`: the paper's numbers beside runs of a fake MLflow store, deltas checked against hand arithmetic;
missing runs say "no run"; the numbers in pipeline/studies/paper_results.yaml against the paper's own arithmetic."""
import re
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from pipeline.config import load_recipe
from pipeline.studies.paper_table import TABLES
from pipeline.studies.paper_table import format_tables
from pipeline.studies.paper_table import load_results
from pipeline.studies.paper_table import paper_table

REPO = Path(__file__).resolve().parents[1]
EXP = "paper-test"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite MLflow store with runs named as the paper recipes, their metrics logged as `grt eval` logs them."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(EXP)
    clock = iter(range(1_000_000, 2_000_000, 1000))  # start times in creation order: later = newer

    def run(name, params=None, metrics=(), tags=None):
        r = client.create_run(exp, run_name=name, start_time=next(clock), tags=tags or {})
        for k, v in (params or {}).items():
            client.log_param(r.info.run_id, k, v)
        for key, value, step, ts in metrics:
            client.log_metric(r.info.run_id, key, value, timestamp=ts, step=step)
        return r.info.run_id

    # the final evaluation at step 20,000 was logged before an older checkpoint's: the largest step wins
    run("gpt2-small", {"seed": 1337, "model.n_layer": 12},
        [("eval.val_loss", 3.300, 20000, 10), ("eval.val_loss", 3.9, 10000, 20)])
    run("grt-small-isoflop", {"seed": 42, "model.n_recurrence": 10}, [("eval.val_loss", 3.100, 20000, 10)],
        tags={"shorthand": "1+1x10+1"})
    run("ouro-small-isoflop", {"seed": 1337}, [("eval.val_loss", 3.5, 20000, 10)])  # older
    run("ouro-small-isoflop", {"seed": 1337}, [("eval.val_loss", 3.25, 20000, 10)])  # newer: this one
    run("grt-large-isoflop", {"model.n_recurrence": 6, "model.n_layer": "unused"},
        [("downstream.hellaswag.acc_norm", 0.3800, 6, 10), ("downstream.hellaswag.acc", 0.30, 6, 10),
         ("downstream.hellaswag.acc_norm", 0.50, 12, 20),  # scored past the trained depth: not the paper's cell
         ("downstream.boolq.acc", 0.6218, 6, 10)])
    run("gpt2-large", {"model.n_layer": 36}, [("downstream.arc_easy.acc_norm", 0.40, 12, 10)])
    run("ablation-small-2-recurrence", {"seed": 1337}, [("loss", 5.0, 10, 10)])  # training, not evaluated yet
    run("ablation-medium-6-gate", {}, [("eval.val_loss", 3.700, 2000, 10)])
    run("grt-medium-isoflop-fineweb-edu-10bt", {}, [("eval.val_loss", 2.95, 20000, 10)])
    return uri


def rows_by_label(result):
    return {r["label"]: r for t in result["tables"] for r in t["rows"]}


def test_deltas_against_hand_arithmetic(store):
    res = rows_by_label(paper_table(load_results(), list(TABLES), store, [EXP]))
    expect = {  # label: (run value, run - paper by hand, step)
        "GPT-2 Small": (3.300, 3.300 - 3.154, 20000),
        "GRT Small (seed 42)": (3.100, 3.100 - 3.146, 20000),
        "Ouro Small": (3.25, 3.25 - 3.19, 20000),
        "HellaSwag / GRT iso-FLOPs": (38.00, 38.00 - 35.62, 6),  # acc_norm x 100 at R = 6
        "BoolQ / GRT iso-FLOPs": (62.18, 62.18 - 60.18, 6),  # no acc_norm for BoolQ: acc
        "medium 6 + gate (GRT)": (3.700, 3.700 - 3.786, 2000),
    }
    for label, (value, delta, step) in expect.items():
        r = res[label]
        assert r["status"] == "ok" and r["step"] == step, label
        assert r["value"] == pytest.approx(value, abs=1e-9) and r["delta"] == pytest.approx(delta, abs=1e-9), label
    assert res["HellaSwag / GRT iso-FLOPs"]["read"] == "downstream.hellaswag.acc_norm"
    assert res["GRT Small (seed 42)"]["shape"] == "1+1x10+1"
    # a run of that name with other params, a run without the metric, a task scored at another depth only
    assert res["GRT Small iso-FLOPs"]["status"] == "no run"  # the seed 42 run is not the seed 1337 row
    assert res["small 2 recurrence"]["status"] == "not evaluated"
    assert res["ARC-Easy / GPT-2 Large"]["status"] == "not scored at depth 36"
    assert res["HellaSwag / GPT-2 Large"]["status"] == "not scored"
    assert res["GRT Medium iso-FLOPs"]["status"] == "no run"  # only its --data run exists
    assert res["MoR Medium"]["paper"] is None and res["MoR Medium"]["delta"] is None
    ok = [label for label, r in res.items() if r["status"] == "ok"]
    assert sorted(ok) == sorted(expect)


def test_printed_table_shows_paper_run_delta_and_no_run(store, capsys):
    assert main(["paper-table", "--tracking-uri", store, "--experiment", EXP, "--table", "table1"]) == 0
    out = capsys.readouterr().out
    cells = {c[0]: c for c in (re.split(r"\s{2,}", ln.strip()) for ln in out.splitlines())}  # columns: 2+ spaces
    # row, paper config, run, run shape, paper, run value, delta, at step, source
    assert cells["GPT-2 Small"][2:8] == ["gpt2-small", "-", "3.154", "3.300", "+0.146", "20,000"]
    assert cells["Ouro Small"][4:7] == ["3.19", "3.250", "+0.060"]
    assert cells["GRT Small (seed 42)"][3:7] == ["1+1x10+1", "3.146", "3.100", "-0.046"]
    assert cells["GPT-2 Medium"][4:7] == ["2.84", "no run", "-"] and cells["Ouro Large"][5] == "no run"
    assert cells["GRT Medium iso-FLOPs"][4] == "~2.89"  # derived from a stated difference: marked
    assert "Figure 5 / Table 7" not in out and "3 of 24 rows have a run value." in out  # --table table1 only


def test_data_runs_are_matched_with_data(store):
    res = rows_by_label(paper_table(load_results(), ["table1"], store, [EXP], data_stem="fineweb-edu-10bt"))
    r = res["GRT Medium iso-FLOPs"]
    assert r["run_name"] == "grt-medium-isoflop-fineweb-edu-10bt" and r["delta"] == pytest.approx(2.95 - 2.89)
    assert res["GPT-2 Small"]["status"] == "no run"


def test_no_store_no_experiment_every_row_says_no_run(tmp_path, store):
    db = tmp_path / "none" / "mlflow.db"
    res = paper_table(load_results(), ["figure5"], f"sqlite:///{db}", ["grt-pipeline"])
    assert {r["status"] for r in res["tables"][0]["rows"]} == {"no run"} and not db.exists()
    assert "does not exist" in format_tables(res)
    res = paper_table(load_results(), ["figure5"], store, ["no-such-experiment"])
    assert {r["status"] for r in res["tables"][0]["rows"]} == {"no run"}
    assert "no MLflow experiment 'no-such-experiment'" in format_tables(res, "markdown")


# ------------------------------------------------------------------------------------------ the numbers
def test_every_row_names_a_shipped_recipe():
    names = {load_recipe(p).name for p in (REPO / "recipes").rglob("*.yaml")
             if not p.name.startswith("_") and "data" not in p.parts}
    for key, table in load_results().items():
        for row in table["rows"]:
            assert row["run"] in names, f"{key}: {row['label']}: no recipe is named {row['run']}"


def test_derived_numbers_follow_the_papers_arithmetic():
    """Every derived number re-derived here from the differences the paper states (§4, §5, B.4, B.5)."""
    paper = {row["label"]: row["paper"] for t in load_results().values() for row in t["rows"]}
    fig5 = [3.157 + d for d in (0, 0.107, 0.107 - 0.035, 0.107 - 0.035 - 0.018, 0.107 - 0.035 - 0.018 - 0.022,
                                0.107 - 0.035 - 0.018 - 0.022 - 0.048)]
    assert [paper[f"small {i} {s}"] for i, s in enumerate(["dense", "recurrence", "+ prelude/coda", "+ state noise",
                                                             "+ re-injection", "+ gate (GRT)"], 1)] == \
        pytest.approx(fig5, abs=1e-9)
    assert fig5[-1] == pytest.approx(paper["GRT Small iso-FLOPs"], abs=1e-9)  # lands on Table 6's seed 1337
    assert paper["GRT Medium iso-FLOPs"] == pytest.approx(2.84 + 0.05)
    assert paper["RRT Medium"] == pytest.approx(2.84 + 0.05 + 0.06)
    assert paper["GPT-2 Medium"] - paper["GRT Medium iso-Params"] == pytest.approx(0.08)
    assert paper["GPT-2 Large"] == pytest.approx(2.68 - 0.06) and paper["RRT Large"] == pytest.approx(2.68 + 0.08)
    assert paper["GRT Large iso-Params"] == pytest.approx(2.68 - 0.06 - 0.06)
    assert (paper["B.5 sigma_x 0"], paper["B.5 sigma_x 0.1"], paper["B.5 sigma_x 0.2"]) == \
        pytest.approx((3.60 + 0.031, 3.60, 3.60 + 0.018))
    # B.6's sigma_x table is Figure 5's rows 3 and 4 (why recipes/paper/b6-state-noise drops re-injection and gate)
    assert (paper["B.6 sigma_x 0"], paper["B.6 sigma_x 0.1"]) == pytest.approx((fig5[2], fig5[3]), abs=1e-9)


def test_malformed_rows_are_all_reported(tmp_path):
    bad = {"tables": {"t": {"metric": "eval.val_loss", "rows": [
        {"label": "a", "run": "x", "paper": "3.1", "source": "Table 1"},
        {"label": "b", "paper": 3.1},
        {"label": "c", "run": "y", "paper": None, "derived": "1 + 2", "source": "§4"}]}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError) as e:
        load_results(tmp_path / "r.yaml")
    msg = str(e.value)
    assert "rows[0] (a): paper must be a number or null, got '3.1'" in msg
    assert "rows[1] (b): no 'run'" in msg and "rows[1] (b): no 'source'" in msg
    assert "rows[2] (c): 'derived' explains a number, but paper is null" in msg
