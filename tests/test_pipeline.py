"""tokenize -> train -> eval on a tiny corpus, MLflow included; checkpoint resume gives the identical next steps."""
import json
import shutil

import pytest
import torch

from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.eval.stage import evaluate
from pipeline.studies.compare import compare
from pipeline.tokenize import tokenize
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards
from pipeline.train.optim import lr_at
from pipeline.train.optim import param_groups
from pipeline.train.trainer import Trainer


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_tokenize_train_eval_mlflow(tmp_path, corpus):
    recipe = tiny_recipe(tmp_path, corpus, tracking={"enabled": True})
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    final = Trainer(cfg).fit()
    run_dir = cfg.run_dir
    assert final["step"] == 4 and final["val_loss"] > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert (run_dir / "checkpoints" / "step_00000004" / "recipe.yaml").is_file()
    res = evaluate(run_dir, quiet=True)
    assert res["exit"] == [1, 2, 3, 4, 5, 6]  # R_max defaults to 2R
    assert all(0 < v < 20 for v in res["loss"]) and len(res["gate_mean"]) == 6
    assert res["val_loss"] == res["loss"][2]
    assert (run_dir / "eval" / "early_exit.png").stat().st_size > 10_000

    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(json.loads((run_dir / "run.json").read_text())["mlflow_run_id"])
    assert run.data.params["model.n_recurrence"] == "3" and run.data.params["info.shorthand"] == "1+1x3+1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval.exit_loss")] == [1, 2, 3, 4, 5, 6]
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    assert arts == {"eval/exits.json", "eval/early_exit.png", "eval/diagnostics.png", "eval/gate_heatmap.png",
                    # the default analyses' plots (docs/analysis.md)
                    "eval/representation.png", "eval/gate_attribution.png", "eval/projection.png",
                    "eval/next_token_traces.png"}
    table, plot = compare(["tiny"], cfg.tracking, tmp_path / "cmp")
    assert "1+1x3+1" in table and f"{res['val_loss']:.4f}" in table and plot.is_file()


@pytest.mark.parametrize("model_type", ["grt", "gpt"])
def test_resume_gives_identical_next_steps(tmp_path, corpus, model_type):
    recipe = tiny_recipe(tmp_path, corpus)
    if model_type == "gpt":
        recipe["model"] = {"type": "gpt", "n_layer": 2, "block_size": 32, "d_model": 32, "n_head": 2}
    recipe["train"]["max_steps"] = 5
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    Trainer(cfg).fit()
    full = losses(cfg.run_dir)
    # a second run starts from the step-2 checkpoint of the first, then trains to the end
    recipe2 = dict(recipe, name="resumed")
    cfg2 = from_dict(recipe2)
    (cfg2.run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(cfg.run_dir / "checkpoints" / "step_00000002", cfg2.run_dir / "checkpoints" / "step_00000002")
    t = Trainer(cfg2)
    assert t.step == 2
    t.fit()
    resumed = losses(cfg2.run_dir)
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step] == full[step]  # exact: same data, same depth draws, same noise


def test_resume_refuses_a_changed_model(tmp_path, corpus):
    recipe = tiny_recipe(tmp_path, corpus)
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    Trainer(cfg).fit()
    recipe["model"]["d_model"] = 64
    with pytest.raises(ValueError, match="model.d_model: checkpoint 32 != recipe 64"):
        Trainer(from_dict(recipe))


def test_dataset_with_another_vocabulary_is_refused(tmp_path, corpus):
    recipe = tiny_recipe(tmp_path, corpus)
    recipe["model"]["vocab_size"] = 1000
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    with pytest.raises(ValueError, match="vocabulary size: dataset 50257 token ids > model.vocab_size=1000"):
        Trainer(cfg)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loader_visits_every_window_once_per_epoch(tmp_path, corpus, world):
    cfg = from_dict(tiny_recipe(tmp_path, corpus))
    tokenize(cfg.data, quiet=True)
    shards = TokenShards(cfg.data.dataset_dir, "train")
    loaders = [SequenceLoader(shards, 32, 2, seed=5, rank=r, world_size=world) for r in range(world)]
    n = loaders[0].n_samples[0]
    assert n == sum((a.size - 1) // 32 for a in shards.arrays)
    steps = -(-2 * n // (2 * world))  # two epochs, rounded up to whole global micro-batches
    seen = [int(i) for _ in range(steps) for ld in loaders for _k, i in ld.next_indices()]
    assert sorted(seen[:n]) == list(range(n))  # epoch 1: every window exactly once over all ranks
    assert sorted(seen[n:2 * n]) == list(range(n))  # epoch 2 too, in another order
    assert seen[:n] != seen[n:2 * n]
    # the batches hold those windows: inputs and targets shifted by one token
    ld = SequenceLoader(shards, 32, 2, seed=5)
    x, y, _ = ld.next_batch()
    first = [i for _k, i in SequenceLoader(shards, 32, 2, seed=5).next_indices()]
    for row, i in zip(x, first):
        s, o = shards.window_index(32)[i]
        assert row.tolist() == shards.window(int(s), int(o), 32)[:-1].tolist()
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_loader_state_refuses_another_dataset_shape(tmp_path, corpus):
    cfg = from_dict(tiny_recipe(tmp_path, corpus))
    tokenize(cfg.data, quiet=True)
    shards = TokenShards(cfg.data.dataset_dir, "train")
    state = SequenceLoader(shards, 32, 2, seed=5).state_dict()
    with pytest.raises(ValueError, match="seq_len: checkpoint 32 != now 16"):
        SequenceLoader(shards, 16, 2, seed=5).load_state_dict(state)


def test_lr_schedule_by_hand():
    import math

    from pipeline.config import TrainConfig

    c = TrainConfig(lr=6e-4, min_lr=6e-5, warmup_steps=2000, max_steps=20000)
    assert lr_at(0, c) == pytest.approx(6e-4 / 2001)
    assert lr_at(1999, c) == pytest.approx(6e-4 * 2000 / 2001)
    assert lr_at(2000, c) == pytest.approx(6e-4)
    assert lr_at(11000, c) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi * 0.5)) * (6e-4 - 6e-5))
    assert lr_at(20000, c) == pytest.approx(6e-5)


def test_no_weight_decay_on_biases_norms_embeddings(tiny):
    from pipeline.model import build_model

    m = build_model(tiny().model)
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(names[id(p)].endswith(".weight") and p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"embed.wte.weight", "embed.wpe.weight", "ln_f.weight"}
    assert not any(names[id(p)].startswith("embed") for p in decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in m.parameters())
