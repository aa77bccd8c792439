"""`grt sweep FOLDER`: recipes in name order (bases skipped), the sweep tag on every run, a failure does not stop the
others, the exit status and the summary; the experiment-grid recipe folders and the ablation row-2 shapes."""
import json
from pathlib import Path

import pytest
import yaml

from conftest import tiny_recipe
from pipeline.cli import main
from pipeline.config import load_recipe
from pipeline.studies.sweep import run_sweep
from pipeline.studies.sweep import sweep_command
from pipeline.studies.sweep import sweep_recipes
from pipeline.studies.sweep import tag_override

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "recipes" / "sweeps" / "toy-tau"
GRID = ["fig6-data-efficiency", "b4-gate-temperature", "b5-state-noise", "b6-gate-bias", "b6-state-noise",
        "depth-sampling"]


def never_called(*args):
    raise AssertionError(f"a dry run ran {args}")


def test_dry_run_lists_the_toy_sweep_in_order_and_runs_nothing(capsys):
    assert main(["sweep", str(TOY), "train.max_steps=3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln[:2] in ("1.", "2.", "3.", "4.")]
    assert [ln.split(" -> ")[1].split(":")[0] for ln in lines] == ["toy-tau-0.5", "toy-tau-1.0", "toy-tau-2.0"]
    assert "_toy.yaml" not in out and "3 steps" in lines[0] and "tags sweep=toy-tau" in lines[0]
    assert "3 of 3 recipe(s) would run" in out
    rows = run_sweep(TOY, dry_run=True, runner=never_called)
    assert [r.status for r in rows] == ["dry run"] * 3


def write(folder: Path, name: str, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


@pytest.fixture
def sweep_folder(tmp_path, corpus):
    """my-sweep/: _base.yaml (a tiny recipe, tag study=x), a.yaml, b.yaml (an unknown key), c.yaml, d.yaml."""
    folder = tmp_path / "my-sweep"
    base = tiny_recipe(tmp_path, corpus, tracking={"tags": {"study": "x"}})
    write(folder, "_base.yaml", yaml.safe_dump(base))
    for n in "acd":
        write(folder, f"{n}.yaml", f"base: _base.yaml\nname: run-{n}\n")
    write(folder, "b.yaml", "base: _base.yaml\nname: run-b\nmodel: {n_recurence: 2}\n")
    write(folder / "sub", "e.yaml", "base: ../_base.yaml\nname: run-e\n")  # subfolders are not part of the sweep
    return folder


def test_a_broken_recipe_and_a_failing_run_do_not_stop_the_sweep(sweep_folder, capsys):
    calls = []

    def runner(recipe, overrides, data):
        calls.append((Path(recipe).name, list(overrides)))
        if recipe.endswith("c.yaml"):
            raise RuntimeError("out of memory\nsecond line")
        cfg = load_recipe(recipe, overrides)  # what cmd_run trains: the folder's tag merged over the recipe's own
        assert cfg.tracking.tags == {"study": "x", "sweep": "my-sweep"} and cfg.train.max_steps == 3
        (cfg.run_dir / "eval").mkdir(parents=True)
        val_loss = 4.25 if Path(recipe).name == "a.yaml" else 5.5
        (cfg.run_dir / "eval" / "exits.json").write_text(json.dumps({"val_loss": val_loss}))

    code = sweep_command(str(sweep_folder), ["train.max_steps=3"], runner=runner)
    out, err = capsys.readouterr()
    assert code == 1
    assert [c[0] for c in calls] == ["a.yaml", "c.yaml", "d.yaml"]  # b fails to load, before anything runs
    assert calls[0][1] == ['tracking.tags.sweep="my-sweep"', "train.max_steps=3"]  # the user's overrides last
    table = out[out.index("sweep my-sweep: 2 ok, 2 failed"):].splitlines()
    assert [ln.split()[:3] for ln in table[3:7]] == [["a.yaml", "run-a", "ok"], ["b.yaml", "-", "failed"],
                                                     ["c.yaml", "run-c", "failed"], ["d.yaml", "run-d", "ok"]]
    assert table[3].split()[3] == "4.2500" and table[6].split()[3] == "5.5000" and table[4].split()[3] == "-"
    assert "did you mean 'model.n_recurrence'" in out and "c.yaml: out of memory | second line" in out
    assert "grt compare --tag sweep=my-sweep" in out
    assert "c.yaml failed: out of memory" in err


def test_every_recipe_ok_exits_zero(sweep_folder):
    (sweep_folder / "b.yaml").unlink()
    assert sweep_command(str(sweep_folder), [], runner=lambda *a: None) == 0
    assert [p.name for p in sweep_recipes(sweep_folder)] == ["a.yaml", "c.yaml", "d.yaml"]


def test_a_stop_ends_the_sweep_after_its_summary(sweep_folder, capsys):
    def runner(recipe, overrides, data):
        if recipe.endswith("c.yaml"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep_folder, runner=runner)
    out = capsys.readouterr().out
    assert [ln.split()[2] for ln in out.splitlines() if ln.startswith(("a.yaml", "c.yaml", "d.yaml"))] == \
        ["ok", "stopped", "not"]  # d: "not run"


def test_not_a_folder_or_an_empty_one_is_an_error(tmp_path, capsys):
    assert main(["sweep", str(TOY / "tau-1.0.yaml")]) == 1
    assert "not a folder" in capsys.readouterr().err
    (tmp_path / "_only-a-base.yaml").write_text("name: x\n")
    assert main(["sweep", str(tmp_path)]) == 1
    assert "no recipe in it" in capsys.readouterr().err


def test_real_sweep_tags_its_runs_so_compare_finds_them(tmp_path, corpus, capsys):
    """One tiny recipe through the real `grt run`: the MLflow run carries sweep=<folder>, `grt compare --tag` finds
    it, and the summary shows the val loss `grt eval` saved."""
    folder = tmp_path / "tiny-sweep"
    recipe = tiny_recipe(tmp_path, corpus, tracking={"enabled": True}, eval={"diagnostics": False})
    write(folder, "one.yaml", yaml.safe_dump({**recipe, "name": "tiny-one"}))
    assert main(["sweep", str(folder)]) == 0
    saved = json.loads((tmp_path / "runs" / "tiny-one" / "eval" / "exits.json").read_text())["val_loss"]
    out = capsys.readouterr().out
    assert f"{saved:.4f}" in out.splitlines()[-2]
    assert main(["compare", "--tracking-uri", recipe["tracking"]["uri"], "--experiment", "tests",
                 "--tag", "sweep=tiny-sweep", "--out", str(tmp_path / "cmp")]) == 0
    assert "tiny-one" in capsys.readouterr().out
    # the run folder is held to the same tag (its recipe.yaml's tracking.tags, as MLflow holds its run)
    from pipeline.config import TrackingConfig
    from pipeline.eval.results import collect
    run_dir = str(tmp_path / "runs" / "tiny-one")
    assert [r["name"] for r in collect([run_dir], TrackingConfig(), tags={"sweep": "tiny-sweep"})] == ["tiny-one"]
    assert main(["compare", run_dir, "--tag", "sweep=other"]) == 1
    assert "does not carry --tag sweep=other (its recipe.yaml gives sweep=tiny-sweep)" in capsys.readouterr().err
    # the same command again: the real checkpoint's recipe.yaml equals the recipe, so the run is skipped
    assert main(["sweep", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "tiny-one trained and evaluated at step" in out and "0 ok (+1 done before)" in out


# ------------------------------------------------------------------------------------- the experiment grid
def test_every_grid_folder_loads_tagged_with_its_own_name():
    names = []
    for folder in [REPO / "recipes" / "paper" / g for g in GRID] + [TOY]:
        recipes = sweep_recipes(folder)
        assert len(recipes) >= 2, folder
        for p in recipes:
            cfg = load_recipe(p)
            assert cfg.tracking.tags.get("sweep") == folder.name, p  # `grt run` alone tags it too
            names.append(cfg.name)
    assert len(names) == len(set(names)), "two recipes of the grid share a run name"


def test_run_names_are_unique_over_every_shipped_recipe():
    names = {}
    for p in (REPO / "recipes").rglob("*.yaml"):
        if not p.name.startswith("_") and "data" not in p.parts:
            name = load_recipe(p).name
            assert name not in names, f"{p} and {names.get(name)} both name their run {name}"
            names[name] = p


@pytest.mark.parametrize("folder,steps", [("b4-gate-temperature", 5000), ("b5-state-noise", 5000),
                                          ("b6-gate-bias", 20000), ("b6-state-noise", 20000),
                                          ("depth-sampling", 20000), ("fig6-data-efficiency", 40000)])
def test_grid_budgets(folder, steps):
    assert {load_recipe(p).train.max_steps for p in sweep_recipes(REPO / "recipes" / "paper" / folder)} == {steps}


def test_grid_sweeps_change_only_their_variable():
    def model(p):
        return load_recipe(p).model
    paper = REPO / "recipes" / "paper"
    assert [model(p).tau for p in sweep_recipes(paper / "b4-gate-temperature")] == [0.5, 1.0, 2.0]
    assert [model(p).sigma_x for p in sweep_recipes(paper / "b5-state-noise")] == [0.0, 0.05, 0.1, 0.2]
    assert [model(p).gate_bias_init for p in sweep_recipes(paper / "b6-gate-bias")] == [4.0, 2.0, 0.0, -2.0]
    b6_noise = [model(p) for p in sweep_recipes(paper / "b6-state-noise")]
    assert [m.sigma_x for m in b6_noise] == [0.0, 0.1, 0.2]
    assert {(m.reinject, m.gate, m.state_noise) for m in b6_noise} == {(False, "none", "every_step")}  # row 4
    assert [model(p).depth_sampling for p in sweep_recipes(paper / "depth-sampling")] == ["uniform", "fixed"]
    isoflop = load_recipe(paper / "grt-medium-isoflop.yaml").model
    for p in sweep_recipes(paper / "b5-state-noise"):
        m = model(p)
        assert {k: v for k, v in vars(m).items() if k != "sigma_x"} == \
            {k: v for k, v in vars(isoflop).items() if k != "sigma_x"}


def test_ablation_row_2_keeps_row_3s_block_executions():
    """Small: 0+3x4+0 against 1+1x10+1: 12 executions, 3 unique blocks each (R cannot match: 10 n = 12 has no integer
    n). Medium: 0+6x4+0 against 2+5x4+2: 24 executions, R = 4 each (9 blocks cannot: 9 does not divide 24)."""
    def shape(p):
        m = load_recipe(REPO / "recipes" / "paper" / "ablation" / p).model
        return m.n_prelude, m.n_core, m.n_recurrence, m.n_coda

    def executions(s):
        return s[0] + s[1] * s[2] + s[3]

    small2, small3 = shape("2-recurrence.yaml"), shape("3-prelude-coda.yaml")
    assert small2 == (0, 3, 4, 0) and small3 == (1, 1, 10, 1)
    assert executions(small2) == executions(small3) == 12
    assert small2[0] + small2[1] + small2[3] == small3[0] + small3[1] + small3[3] == 3
    # the training depths r ~ U{1..R}: the same range 3..12 and the same mean 7.5 executions
    def depths(s):
        return [s[0] + s[1] * r + s[3] for r in range(1, s[2] + 1)]
    assert (min(depths(small2)), max(depths(small2))) == (min(depths(small3)), max(depths(small3))) == (3, 12)
    assert sum(depths(small2)) / len(depths(small2)) == sum(depths(small3)) / len(depths(small3)) == 7.5
    medium2, medium3 = shape("medium-2k/2-recurrence.yaml"), shape("medium-2k/3-prelude-coda.yaml")
    assert medium2 == (0, 6, 4, 0) and medium3 == (2, 5, 4, 2)
    assert executions(medium2) == executions(medium3) == 24 and medium2[2] == medium3[2] == 4


def test_a_finished_and_evaluated_run_is_skipped_unless_rerun(sweep_folder, capsys):
    """run-a trained to its max_steps and evaluated there (eval/exits.json at that step, its checkpoint's recipe.yaml
    this recipe) is skipped, so the same command continues an interrupted sweep; run-d evaluated at an earlier step
    (stopped before the end) runs; run-c evaluated at max_steps from a checkpoint of another recipe (a changed lr)
    runs again, saying why; --rerun runs every one."""
    import yaml

    cfgs = {k: load_recipe(sweep_folder / f"{k}.yaml", [tag_override(sweep_folder)]) for k in "acd"}
    cfgs["c"].train.lr *= 2  # the checkpoint of c was trained with another lr
    for k, step in (("a", cfgs["a"].train.max_steps), ("c", cfgs["c"].train.max_steps),
                    ("d", cfgs["d"].train.max_steps - 1)):
        ckpt = cfgs[k].run_dir / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "recipe.yaml").write_text(yaml.safe_dump(cfgs[k].to_dict()))
        (cfgs[k].run_dir / "eval").mkdir(parents=True)
        (cfgs[k].run_dir / "eval" / "exits.json").write_text(
            json.dumps({"step": step, "val_loss": 3.25, "checkpoint": str(ckpt / "state.pt")}))
        (ckpt / "state.pt").write_bytes(b"")
    calls = []
    rows = run_sweep(sweep_folder, runner=lambda recipe, *a: calls.append(Path(recipe).name))
    assert calls == ["c.yaml", "d.yaml"]  # b.yaml fails to load (its unknown key), a.yaml is done
    assert rows[0].status == "done before" and rows[0].val_loss == 3.25
    out = capsys.readouterr().out
    assert "run-a trained and evaluated at step" in out
    assert f"(the recipe changed since its checkpoint (train.lr: {cfgs['c'].train.lr!r} -> " in out
    last = cfgs["d"].train.max_steps
    assert f"(evaluated at step {last - 1} of {last}: running it again)" in out
    calls.clear()
    run_sweep(sweep_folder, runner=lambda recipe, *a: calls.append(Path(recipe).name), rerun=True)
    assert calls == ["a.yaml", "c.yaml", "d.yaml"]

@pytest.mark.parametrize("second, overrides, pair, run", [
    ("name: run-a\n", [], ("a.yaml", "a2.yaml"), "run-a"),  # the same name
    ("name: run-a\nout_dir: runs\n", [], ("a.yaml", "a2.yaml"), "run-a"),  # out_dir spelled relative to the cwd
    ("name: run-e\n", ["name=shared"], ("a.yaml", "a2.yaml"), "shared"),  # one name= for the whole sweep
])
def test_two_recipes_with_one_run_folder_are_refused_before_anything_runs(sweep_folder, tmp_path, monkeypatch,
                                                                          capsys, second, overrides, pair, run):
    """The second recipe would resume the first's run folder, train nothing and report the first's val loss as its
    own: `--dry-run` and the sweep itself refuse in one line naming both files, the folder and the fix."""
    monkeypatch.chdir(tmp_path)
    write(sweep_folder, "a2.yaml", "base: _base.yaml\n" + second)
    folder = (tmp_path / "runs" / run).resolve()  # tiny_recipe's out_dir is tmp_path/runs
    assert main(["sweep", str(sweep_folder), *overrides, "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert "1. " not in out and len(err.strip().splitlines()) == 1, (out, err)
    assert all(str(sweep_folder / f) in err for f in pair) and f"run folder {folder}" in err, err
    assert ("drop the name= override" if overrides else "give each recipe a distinct `name:`") in err
    with pytest.raises(ValueError, match="both train into the run folder"):
        sweep_command(str(sweep_folder), overrides, runner=never_called)
    assert not (tmp_path / "runs").exists()
