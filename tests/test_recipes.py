"""Recipe parsing: inheritance, overrides, and errors that list every problem and name the nearest valid key."""
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import GPTConfig, GRTConfig, RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "recipes" / "quickstart-grt.yaml")


def test_base_inheritance_and_overrides():
    cfg = load_recipe(QUICK, ["train.max_steps=7", "model.n_recurrence=6", "train.lr=1e-3"])
    assert isinstance(cfg.model, GRTConfig)
    assert (cfg.model.n_recurrence, cfg.train.max_steps, cfg.train.lr) == (6, 7, 1e-3)
    assert cfg.model.d_model == 128  # from _quickstart-base.yaml
    assert cfg.name == "quickstart-grt"


def test_model_type_selects_schema():
    cfg = load_recipe(str(REPO / "recipes" / "quickstart-dense.yaml"))
    assert isinstance(cfg.model, GPTConfig) and cfg.model.n_layer == 6


def test_misspelt_override_names_nearest_key():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICK, ["model.n_recurence=4"])
    msg = str(e.value)
    assert "model.n_recurence" in msg and "did you mean 'model.n_recurrence'" in msg
    assert len(e.value.problems) == 1


def test_all_problems_reported_at_once():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICK, ["model.n_recurence=4", "train.max_step=3", "train.lr=fast", "model.gate=elementwize",
                            "model.n_head=5"])
    msg = str(e.value)
    assert len(e.value.problems) == 5, msg
    assert "did you mean 'train.max_steps'" in msg
    assert "train.lr must be a number" in msg
    assert "did you mean 'elementwise'" in msg
    assert "not divisible by model.n_head=5" in msg


def test_type_specific_keys_are_checked_against_the_chosen_model():
    with pytest.raises(RecipeError, match="unknown key 'model.n_layer'"):
        load_recipe(QUICK, ["model.n_layer=4"])  # a GRT has no n_layer


def test_unknown_model_type():
    with pytest.raises(RecipeError, match="did you mean 'grt'"):
        load_recipe(QUICK, ["model.type=gtr"])


def test_cli_exit_code_and_single_message(capsys):
    code = main(["info", QUICK, "model.n_recurence=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("did you mean") == 1 and "model.n_recurrence" in err


def test_base_cycle_is_reported(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_every_shipped_recipe_validates():
    recipes = [p for p in (REPO / "recipes").rglob("*.yaml") if not p.name.startswith("_")]
    assert len(recipes) >= 22
    for p in recipes:
        load_recipe(p)
