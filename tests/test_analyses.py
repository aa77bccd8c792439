"""`grt eval`'s Appendix E analyses wired together (pipeline/eval/analyses/suite.py): the names the recipe accepts,
which analyses a model gets, one traced pass against states computed by hand from the model's own step, and a trained
tiny run evaluated with every analysis (JSON, plots, MLflow), with eval.noise on and off."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_recipe
from pipeline.config import ANALYSES
from pipeline.config import ANALYSIS_NAMES
from pipeline.config import from_dict
from pipeline.eval.analyses.representation import linear_cka
from pipeline.eval.analyses.suite import resolve
from pipeline.eval.analyses.suite import traced_pass
from pipeline.model import build_model


def test_default_and_all_resolve_from_the_one_list_of_analyses():
    assert ANALYSIS_NAMES == tuple(ANALYSES)  # the recipe's names are the table's
    default, _ = resolve(["default"], "grt", True)
    assert {"anchor_ablation", "cka", "attention"}.isdisjoint(default)  # the costly ones are asked for by name
    assert {"steps", "deciles", "similarity", "trace"} <= set(default)
    everything, skipped = resolve(["all"], "grt", True)
    assert everything == list(ANALYSES) and skipped == {}
    assert from_dict({"eval": {"analyses": "all"}}).eval.analyses == ["all"]  # `eval.analyses=all` on the command line


def test_a_model_gets_only_the_analyses_it_has_and_is_told_why_not():
    assert resolve(["default"], "gpt", False)[1] == {}  # what the default implies is left out quietly
    chosen, skipped = resolve(["all"], "gpt", False)
    assert set(chosen) == {"bands", "deciles", "relative_improvement", "trace"}
    assert set(skipped) == set(ANALYSES) - set(chosen)
    assert "model type 'gpt' has none" in skipped["cka"]
    chosen, skipped = resolve(["steps", "gate_attribution", "gate_difficulty"], "grt", False)
    assert chosen == ["steps"] and "model.gate=none" in skipped["gate_attribution"]


def tiny_grt(seed: int = 3):
    cfg = from_dict(tiny_recipe(Path("/tmp"), Path("/tmp"),
                                {"vocab_size": 96, "d_model": 32, "n_head": 2, "block_size": 16}))
    torch.manual_seed(seed)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # off the +4 gate init so that steps differ
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        model.recur.gate.fc2.bias.normal_(0.0, 1.0)
    return model, cfg


@torch.no_grad()
def hand_states(model, x, n):
    """h^(0..n) by the model's own forward path (RecurrentStep.forward), not trace_steps."""
    h_pre = model.encode(x)
    h, anchor, states = model.initial_state(h_pre, noise=False), None, []
    states.append(h)
    for _ in range(n):
        h, _, anchor = model.recur(h, h_pre, False, None, anchor)
        states.append(h)
    return states


def test_one_traced_pass_gives_the_figures_of_the_hand_computed_states():
    model, cfg = tiny_grt()
    batches = [(torch.randint(0, 96, (2, 16)), None) for _ in range(2)]
    n = 3
    res = traced_pass(model, batches, n, torch.device("cpu"),
                      ["steps", "similarity", "cka", "effective_rank", "gate_difficulty", "attention"], False,
                      analysis_tokens=40)
    per_batch = [hand_states(model, x, n) for x, _ in batches]
    for r in range(1, n + 1):  # mean per-token cosine of successive states over both batches
        cos = torch.cat([torch.nn.functional.cosine_similarity(s[r], s[r - 1], dim=-1).flatten() for s in per_batch])
        assert res["similarity"]["cosine"][r - 1] == pytest.approx(cos.double().mean().item(), rel=1e-4)
    # CKA over the first 40 token rows: 32 from batch 1, 8 from batch 2
    rows = [torch.cat([per_batch[0][r].reshape(-1, 32), per_batch[1][r].reshape(-1, 32)])[:40] for r in range(n + 1)]
    X, Y = (rows[1] - rows[1].mean(0)).double(), (rows[3] - rows[3].mean(0)).double()
    hand = (Y.T @ X).norm() ** 2 / ((X.T @ X).norm() * (Y.T @ Y).norm())
    assert res["cka"]["within"]["cka"][1][3] == pytest.approx(hand.item(), rel=1e-5)
    assert res["cka"]["within"]["cka"][1][3] == pytest.approx(linear_cka(rows[1], rows[3]), rel=1e-5)
    assert res["cka"]["cross"] is None  # no baseline given
    assert res["effective_rank"]["step"] == [0, 1, 2, 3] and res["effective_rank"]["tokens"] == 40
    assert res["steps"]["step"] == [1, 2, 3] and len(res["attention"]["mean_entropy"]) == n
    assert res["_gates"].steps() == [1, 2, 3]  # the per-token gate means, for run_analyses' E.5


def test_prompted_analyses_are_skipped_for_a_vocabulary_smaller_than_gpt2():
    from pipeline.eval.analyses.suite import run_analyses

    model, cfg = tiny_grt()  # vocab_size 96: GPT-2 BPE prompt ids would index past its embedding
    cfg.eval.analyses = ["trace", "gate_heatmaps"]
    out = run_analyses(model, cfg, {"exit": [0, 1, 2, 3], "loss": [5.0, 4.0, 3.5, 3.4]}, None, 3, 3,
                       torch.device("cpu"))
    assert set(out["skipped"]) == {"trace", "gate_heatmaps"} and "model.vocab_size=96" in out["skipped"]["trace"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from conftest import make_corpus
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("analyses")
    corpus = make_corpus(tmp / "corpus")
    runs = {}
    for name in ("tiny", "dense"):
        recipe = tiny_recipe(tmp, corpus, name=name, tracking={"enabled": True},
                             eval={"val_tokens": 128, "batch_size": 4, "analysis_tokens": 64})
        if name == "dense":
            recipe["model"] = {"type": "gpt", "block_size": 32, "d_model": 32, "n_head": 2, "n_layer": 3}
        cfg = from_dict(recipe)
        tokenize(cfg.data, quiet=True)
        Trainer(cfg).fit()
        runs[name] = cfg
    return runs


def test_grt_eval_with_every_analysis_writes_json_plots_and_mlflow(trained):
    from mlflow.tracking import MlflowClient

    from pipeline.eval.stage import evaluate

    dense = evaluate(trained["dense"].run_dir, quiet=True)
    cfg = trained["tiny"]
    res = evaluate(cfg.run_dir, ["eval.analyses=[all]", f"eval.baseline={trained['dense'].run_dir}"], quiet=True)
    diag = res["diagnostics"]
    assert set(ANALYSES) <= set(diag) and "skipped" not in diag
    assert len(diag["cka"]["cross"]["layer"]) == 4  # the dense baseline: embedding + 3 layers
    assert diag["deciles"]["to_exit"] == 3 and diag["deciles"]["last_exit"] == 6  # E.5 to R; the curve goes to 2R
    # summaries over steps describe the trained R = 3; the per-step curves run to 2R = 6
    assert diag["gate_difficulty"]["step"] == [1, 2, 3, 4, 5, 6] and diag["gate_difficulty"]["all_steps_through"] == 3
    assert diag["effective_rank"]["late_delta"]["step"] == 3 and diag["attention"]["classified_over_steps"] == 3
    assert diag["gate_difficulty"]["all_steps"]["tokens"] == res["val_tokens"]  # every token, aligned with its loss
    saved = json.loads((cfg.run_dir / "eval" / "exits.json").read_text())
    assert saved["diagnostics"]["similarity"] == diag["similarity"]
    names = {p.rsplit("/", 1)[-1] for p in res["plots"]}
    assert {"representation.png", "cka.png", "gate_attribution.png", "projection.png", "attention.png",
            "next_token_traces.png"} <= names
    client = MlflowClient(cfg.tracking.uri)
    for metric in ("eval.cos_successive", "eval.effective_rank_fraction", "eval.gate_state_var_frac",
                   "eval.attention_entropy", "eval.delta_rel", "eval.update_over_proposal"):
        assert len(client.get_metric_history(res["mlflow_run_id"], metric)) >= 3, metric
    assert client.get_metric_history(res["mlflow_run_id"], "eval.gate_difficulty_r2")
    # the dense run gets only what it has, and says why not for the rest when asked for all
    dense_all = evaluate(trained["dense"].run_dir, ["eval.analyses=[all]"], quiet=True)["diagnostics"]
    assert "similarity" not in dense_all and "trace" in dense_all and "cka" in dense_all["skipped"]
    assert "diagnostics" in dense


def test_eval_noise_is_seeded_and_refused_for_a_model_without_noise(trained):
    from mlflow.tracking import MlflowClient

    from pipeline.config import RecipeError
    from pipeline.eval.stage import evaluate

    cfg = trained["tiny"]
    off = evaluate(cfg.run_dir, ["eval.analyses=[steps]"], quiet=True)
    saved = (cfg.run_dir / "eval" / "exits.json").read_text()
    on = evaluate(cfg.run_dir, ["eval.noise=true", "eval.analyses=[steps]"], quiet=True)
    again = evaluate(cfg.run_dir, ["eval.noise=true", "eval.analyses=[steps]", "tracking.enabled=false"], quiet=True)
    assert on["loss"] != off["loss"] and on["loss"] == again["loss"]  # noise changes it, the seed fixes it
    assert on["diagnostics"]["steps"]["rho"] == again["diagnostics"]["steps"]["rho"]
    # beside the noise-off results, never over them: eval_noise/ and eval_noise.* metrics
    assert (cfg.run_dir / "eval" / "exits.json").read_text() == saved
    assert json.loads((cfg.run_dir / "eval_noise" / "exits.json").read_text())["noise"] is True
    client = MlflowClient(cfg.tracking.uri)
    noisy = client.get_metric_history(on["mlflow_run_id"], "eval_noise.val_loss")
    assert [m.value for m in noisy] == [on["val_loss"]]
    assert client.get_metric_history(off["mlflow_run_id"], "eval.val_loss")[-1].value == off["val_loss"]
    with pytest.raises(RecipeError, match="draws no noise"):
        evaluate(trained["dense"].run_dir, ["eval.noise=true", "tracking.enabled=false"], quiet=True)
