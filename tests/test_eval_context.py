"""`eval.block_size` / `eval.context_lengths`: the loss at a context other than trained, on validation windows of that
length, against a hand forward over windows cut from the raw validation tokens; the gpt2 block's refusal."""
import json

import mlflow
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_recipe
from pipeline.config import RecipeError
from pipeline.config import from_dict

LLAMA = {"type": "gpt", "block": "llama", "bias": False, "n_layer": 2, "n_kv_head": 1}


def dense_recipe(tmp_path, corpus, model: dict, **sections) -> dict:
    recipe = tiny_recipe(tmp_path, corpus, **sections)
    recipe["model"] = {"block_size": 32, "d_model": 32, "n_head": 2, **model}
    return recipe


def hand_loss(model, arrays, seq_len: int, val_tokens: int) -> float:
    """Mean next-token loss over the first val_tokens // seq_len windows of seq_len + 1 tokens, cut back to back from
    each validation shard in file order, in float64."""
    windows = [a[s:s + seq_len + 1] for a in arrays for s in range(0, len(a) - seq_len, seq_len)]
    windows = windows[:val_tokens // seq_len]
    assert windows and all(len(w) == seq_len + 1 for w in windows)
    batch = torch.tensor(np.stack(windows).astype(np.int64))
    with torch.no_grad():
        logits = model.double()(batch[:, :-1])[0].double()[..., :model.cfg.vocab_size]
        model.float()
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.slow
def test_llama_scores_at_twice_the_trained_context_on_windows_of_that_length(tmp_path, corpus):
    from pipeline.eval.stage import evaluate
    from pipeline.tokenize import tokenize
    from pipeline.train.data import TokenShards
    from pipeline.train.trained import load_trained
    from pipeline.train.trainer import Trainer

    cfg = from_dict(dense_recipe(tmp_path, corpus, LLAMA, train={"max_steps": 2, "checkpoint_interval": 2},
                                eval={"val_tokens": 512, "diagnostics": False}, tracking={"enabled": True}))
    tokenize(cfg.data, quiet=True)
    Trainer(cfg).fit()
    own = evaluate(cfg.run_dir, quiet=True)  # the run's own figures, at the trained context
    res = evaluate(cfg.run_dir, ["eval.block_size=64", "eval.context_lengths=[16,64]"], quiet=True)
    model, _, _, _ = load_trained(cfg.run_dir)
    arrays = [np.asarray(a) for a in TokenShards(cfg.data.dataset_dir, "val").arrays]
    by_hand = {n: hand_loss(model, arrays, n, 512) for n in (16, 32, 64)}
    assert res["block_size"] == 64 and res["val_tokens"] == 512
    assert res["val_loss"] == pytest.approx(by_hand[64], rel=1e-5)
    # the longer context writes beside the run's own results (read by compare / paper-table), never over them
    saved = json.loads((cfg.run_dir / "eval" / "exits.json").read_text())
    assert saved["block_size"] == 32 and saved["val_loss"] == pytest.approx(by_hand[32], rel=1e-5)
    assert json.loads((cfg.run_dir / "eval_ctx64" / "exits.json").read_text())["block_size"] == 64
    client = mlflow.MlflowClient(cfg.tracking.uri)
    assert [m.value for m in client.get_metric_history(own["mlflow_run_id"], "eval.val_loss")] == \
        pytest.approx([by_hand[32]], rel=1e-5)
    assert [m.value for m in client.get_metric_history(res["mlflow_run_id"], "eval_ctx64.val_loss")] == \
        pytest.approx([by_hand[64]], rel=1e-5)
    ctx = res["context"]
    assert ctx["block_size"] == [16, 32, 64] and ctx["trained_block_size"] == 32
    assert ctx["loss"] == pytest.approx([by_hand[16], by_hand[32], by_hand[64]], rel=1e-5)
    assert len({round(v, 4) for v in by_hand.values()}) == 3  # the three lengths are three different measurements


def test_gpt2_block_refuses_a_context_past_its_learned_positions(tmp_path, corpus):
    with pytest.raises(RecipeError) as err:
        from_dict(dense_recipe(tmp_path, corpus, {"type": "gpt", "n_layer": 2}, eval={"block_size": 64}))
    assert len(err.value.problems) == 1
    assert "model.block_size=32" in err.value.problems[0] and "learned positions" in err.value.problems[0]
    from_dict(dense_recipe(tmp_path, corpus, {"type": "gpt", "n_layer": 2}, eval={"block_size": 16}))  # shorter: fine
