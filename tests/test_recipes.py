"""Recipe parsing: inheritance, overrides, and errors that list every problem and name the nearest valid key."""
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import RecipeError
from pipeline.config import load_recipe
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig

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


# ------------------------------------------------------------------------------------- validation never raises
def _numeric_keys():
    """(dotted key, type) of every int and float key of every section, read from the dataclasses."""
    import dataclasses
    import typing

    from pipeline.config import DataConfig
    from pipeline.config import EvalConfig
    from pipeline.config import RunConfig
    from pipeline.config import TrackingConfig
    from pipeline.config import TrainConfig

    sections = {"": RunConfig, "model": GRTConfig, "data": DataConfig, "train": TrainConfig, "eval": EvalConfig,
                "tracking": TrackingConfig}
    out = []
    for prefix, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # Optional[int] -> int
            if tp in (int, float):
                out.append((f"{prefix}.{f.name}" if prefix else f.name, tp))
    return out


def test_validation_reports_any_numeric_value_and_never_raises_anything_else():
    """Every int and float key set to zero, negative, a non-number or a non-finite number: a RecipeError naming that
    key, or a valid recipe — never ZeroDivisionError, TypeError, ... from inside a validator."""
    keys = _numeric_keys()
    assert {"model.n_head", "model.d_model", "train.lr", "data.val_fraction", "seed"} <= {k for k, _ in keys}
    nested = {"data.sources[0].max_bytes": "data.sources=[{{kind: stdlib, max_bytes: {}}}]",
              "data.mixture[0].weight": "data.mixture=[{{dataset_dir: d, weight: {}}}]"}
    for key, override in [(k, f"{k}={{}}") for k, _ in keys] + list(nested.items()):
        for value in ("0", "-1", "x", "[1]", ".nan", ".inf", "-.inf"):
            try:
                load_recipe(QUICK, [override.format(value)])
            except RecipeError as e:
                assert any(key in p for p in e.problems), (key, value, e.problems)


def test_n_head_zero_is_a_recipe_error_not_a_division(capsys):
    code = main(["info", QUICK, "model.n_head=0"])
    err = capsys.readouterr().err
    assert code == 2 and "model.n_head must be >= 1, got 0" in err and "Traceback" not in err
    assert "divisible" not in err  # the divisibility needs n_head >= 1 to mean anything


def test_every_float_key_refuses_nan_and_infinity_all_at_once():
    floats = [k for k, tp in _numeric_keys() if tp is float]
    assert {"train.lr", "model.dropout", "model.tau", "data.val_fraction"} <= set(floats)
    values = [".nan", ".inf", "-.inf", "nan", "inf"]  # YAML floats and the strings YAML 1.1 leaves as text
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICK, [f"{k}={values[i % len(values)]}" for i, k in enumerate(floats)])
    assert sorted(p.split(" ")[0] for p in e.value.problems) == sorted(floats)
    assert all("must be a finite number" in p for p in e.value.problems)
    with pytest.raises(RecipeError, match=r"data.mixture\[0\].weight must be a finite number, got nan"):
        load_recipe(QUICK, ["data.mixture=[{dataset_dir: d, weight: .nan}]"])


def test_optimizer_and_seed_ranges_are_checked_before_torch_sees_them():
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICK, ["train.beta1=1", "train.beta2=-0.1", "train.weight_decay=-1", "train.threads=0",
                            "seed=-1"])
    assert [p.split(" ")[0] for p in e.value.problems] == ["seed", "train.weight_decay", "train.beta1",
                                                           "train.beta2", "train.threads"]


def test_dense_eval_depth_past_its_layers_is_a_recipe_error():
    dense = str(REPO / "recipes" / "quickstart-dense.yaml")
    with pytest.raises(RecipeError, match=r"past the deepest exit of model.type=gpt \(6\)"):
        load_recipe(dense, ["eval.max_steps=8"])
    with pytest.raises(RecipeError, match=r"past the deepest exit of model.type=gpt \(6\)"):
        load_recipe(dense, ["eval.task_depths=[2,7]"])
    assert load_recipe(dense, ["eval.max_steps=6", "eval.task_depths=[2,6]"]).eval.max_steps == 6
    assert load_recipe(QUICK, ["eval.max_steps=12"]).eval.max_steps == 12  # a GRT may go past its trained R


@pytest.mark.parametrize("text,says", [("", "is empty"), ("# nothing set yet\n\n   \n", "is empty"),
                                       ("{}\n", "is empty"), ("- model\n- train\n", "got a list"),
                                       ("quickstart\n", "got a str")])
def test_empty_or_non_mapping_recipe_is_refused(tmp_path, capsys, text, says):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    code = main(["train", str(path), "train.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
    assert "mine.yaml" in err and ("recipes/quickstart-grt.yaml" in err or "mapping of sections" in err)
    assert not (tmp_path / "runs").exists()


def test_empty_base_is_refused_naming_it(tmp_path):
    (tmp_path / "empty-base.yaml").write_text("# to do\n")
    (tmp_path / "r.yaml").write_text("base: empty-base.yaml\nname: r\n")
    with pytest.raises(RecipeError, match="empty-base.yaml is empty"):
        load_recipe(tmp_path / "r.yaml")
