"""Truncated backprop for GRT (``model.backprop_steps`` k; ``train.bptt_k`` is its deprecated alias): in training only
the last k recurrence steps get gradient. Checked against a hand-written loop that detaches the state after r - k
steps, with the same noise draws, and against the FLOPs count by hand."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import RecipeError
from pipeline.config import from_dict
from pipeline.model.configs import GRTConfig
from pipeline.model.grt import GRT
from pipeline.model.layers import head_output

D, T, R = 32, 12, 5


def tiny(backprop_steps=None) -> GRT:
    cfg = GRTConfig(vocab_size=64, block_size=T, d_model=D, n_head=2, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=R, dropout=0.0, backprop_steps=backprop_steps)
    torch.manual_seed(0)
    model = GRT(cfg).double()
    model.init_weights(seed=3)
    return model


def grads(model: GRT, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=False)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def detached_reference(model: GRT, idx, targets, n: int, k: int) -> torch.Tensor:
    """The definition: every step with the training noise (seeds drawn in the training order), the state cut from
    the graph after the first n - k steps; the anchor terms (W_a h_pre, f_g's anchor half) recomputed at each step
    with gradient (the same values)."""
    h_pre = model.encode(idx)
    h = model.initial_state(h_pre, noise=True)
    for r in range(n):
        h, _, _ = model.recur(h, h_pre, True, None, None, seeds=model.recur.draw_seeds(True))
        if r == n - k - 1:
            h = h.detach()
    return head_output(model.lm_head, model.readout(h), targets)[1]


@pytest.mark.parametrize("n, k", [(5, 2), (5, 1), (3, 3), (2, 4)])
def test_only_the_last_k_steps_get_gradient(n, k):
    """Gradients (float64) equal the hand-written detached loop's to 1e-12, prelude and W_proj's anchor half
    included (they are reached through the last k steps' re-injection); with n - k > 0 they differ from full
    backprop's, so the test sees whether truncation happened at all."""
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(2))
    model = tiny(backprop_steps=k).train()
    torch.manual_seed(7)
    got = grads(model, model(idx, targets, n_steps=n)[1])
    torch.manual_seed(7)
    want = grads(model, detached_reference(model, idx, targets, n, k))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)
    assert got["prelude.0.attn.c_attn.weight"].abs().max() > 0 and got["recur.proj.weight"][:, D:].abs().max() > 0
    model.cfg.backprop_steps = None
    torch.manual_seed(7)
    full = grads(model, model(idx, targets, n_steps=n)[1])
    differs = (full["recur.blocks.0.mlp.c_fc.weight"] - want["recur.blocks.0.mlp.c_fc.weight"]).abs().max()
    assert (differs > 1e-6) == (n > k), differs


def test_eval_mode_keeps_every_step_differentiable():
    """Truncation is a training rule: in eval mode a forward with grad enabled (e.g. an analysis taking gradients)
    backpropagates through every step, as the untruncated model does."""
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    truncated, full = tiny(backprop_steps=1).eval(), tiny().eval()
    a = grads(truncated, truncated(idx, idx, n_steps=4)[1])
    b = grads(full, full(idx, idx, n_steps=4)[1])
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_training_flops_leave_out_the_no_grad_steps_backward():
    """3 x forward (head included) minus 2 x the forward of each no-grad step: a step is n_core blocks
    (24d^2 + 4Sd) plus W_proj and f_g (10d^2), by hand."""
    cfg = GRTConfig(vocab_size=50, block_size=16, d_model=8, n_head=2, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=6, backprop_steps=2)
    d, S, V = 8, 16, 50
    block, step = 24 * d * d + 4 * S * d, 2 * (24 * d * d + 4 * S * d) + 10 * d * d
    for n in range(1, 7):
        forward = (1 + 1) * block + n * step + 2 * d * V
        assert GRT.training_flops_per_token(cfg, n) == 3 * forward - 2 * max(n - 2, 0) * step
    cfg.backprop_steps = None
    assert GRT.training_flops_per_token(cfg, 6) == 3 * GRT.flops_per_token(cfg, 6, with_head=True)


def recipe(model: dict, train: dict) -> dict:
    return {"model": {"block_size": 16, "d_model": 32, "n_head": 2, **model}, "train": train}


def test_train_bptt_k_is_the_models_backprop_steps():
    """train.bptt_k (deprecated) sets model.backprop_steps of grt and poisson (Poisson's own default 8 included); a
    disagreeing model.backprop_steps, a model without truncation, and k < 1 are errors naming the fix."""
    assert from_dict(recipe({"type": "grt"}, {"bptt_k": 3})).model.backprop_steps == 3
    assert from_dict(recipe({"type": "grt"}, {})).model.backprop_steps is None
    assert from_dict(recipe({"type": "poisson"}, {"bptt_k": 3})).model.backprop_steps == 3
    assert from_dict(recipe({"type": "poisson", "backprop_steps": 3}, {"bptt_k": 3})).model.backprop_steps == 3
    with pytest.raises(RecipeError) as e:
        from_dict(recipe({"type": "poisson", "backprop_steps": 2}, {"bptt_k": 3}))
    assert ("train.bptt_k=3 and the recipe's model.backprop_steps=2 disagree: they are the same k; set "
            "model.backprop_steps=3 instead of train.bptt_k") in str(e.value)
    with pytest.raises(RecipeError) as e:
        from_dict(recipe({"type": "gpt", "n_layer": 2}, {"bptt_k": 3}))
    assert "model.type=gpt has no truncated backprop (grt and poisson do); remove train.bptt_k" in str(e.value)
    with pytest.raises(RecipeError) as e:
        from_dict(recipe({"type": "grt", "reinject": False, "gate": "none"}, {"bptt_k": 2}))
    assert "model.backprop_steps=2 with reinject=false and gate=none: nothing after the no-grad steps reads h_pre" \
        in str(e.value)
    with pytest.raises(RecipeError) as e:
        from_dict(recipe({"type": "grt", "backprop_steps": 0}, {"bptt_k": 0}))
    assert "train.bptt_k must be >= 1" in str(e.value) and "model.backprop_steps must be >= 1" in str(e.value)


def test_train_bptt_k_is_a_deprecated_alias(capsys, monkeypatch):
    """model.backprop_steps is the one key: the alias train.bptt_k maps onto it with one note on stderr (rank 0
    only), is no field of its own, and a null one (every old run folder's saved recipe.yaml has it) says nothing."""
    from pipeline.config import loading

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(loading, "_BPTT_NOTED", set())  # no source noted yet in this process
    cfg = from_dict(recipe({"type": "grt"}, {"bptt_k": 3, "lr": 1e-3}), "r.yaml")
    assert cfg.model.backprop_steps == 3 and cfg.train.lr == 1e-3 and "bptt_k" not in cfg.to_dict()["train"]
    assert capsys.readouterr().err == ("note: r.yaml: train.bptt_k is deprecated, read as model.backprop_steps=3; "
                                       "write model.backprop_steps in the recipe instead\n")
    assert from_dict(recipe({"type": "grt", "backprop_steps": 3}, {"lr": 1e-3})) == cfg  # the real key: the same run
    assert capsys.readouterr().err == ""
    saved = from_dict(recipe({"type": "poisson"}, {})).to_dict()
    saved["train"]["bptt_k"] = None  # what runs saved before train.bptt_k became an alias
    assert from_dict(saved).to_dict() == from_dict(recipe({"type": "poisson"}, {})).to_dict()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")  # torchrun: one note per job, from rank 0
    assert from_dict(recipe({"type": "grt"}, {"bptt_k": 3})).model.backprop_steps == 3
    assert capsys.readouterr().err == ""
    with pytest.raises(RecipeError) as e:  # both keys, different values: one error naming both
        from_dict(recipe({"type": "grt", "backprop_steps": 2}, {"bptt_k": 4}))
    assert e.value.problems == ["train.bptt_k=4 and the recipe's model.backprop_steps=2 disagree: they are the same k; "
                                "set model.backprop_steps=4 instead of train.bptt_k, or remove backprop_steps from "
                                "the model section"]
    with pytest.raises(RecipeError) as e:
        from_dict(recipe({"type": "grt"}, {"bptt_k": "three"}))
    assert e.value.problems == ["train.bptt_k must be an integer, got 'three'"]


def old_run_recipe(model_k="absent", out_dir: str = "runs") -> dict:
    """A recipe.yaml saved by a run trained with ``train.bptt_k: 4`` before that key became an alias: the model's
    backprop_steps absent (runs before GRT had it), null, or 4 (runs whose loader copied bptt_k onto it)."""
    saved = from_dict({**recipe({"type": "grt"}, {"max_steps": 10}), "out_dir": out_dir}).to_dict()
    saved["train"]["bptt_k"] = 4
    if model_k == "absent":
        del saved["model"]["backprop_steps"]
    else:
        saved["model"]["backprop_steps"] = model_k
    return saved


@pytest.mark.parametrize("model_k", ["absent", None, 4])
def test_an_old_runs_bptt_k_is_no_recipe_change(model_k, tmp_path):
    """Every comparer of a saved recipe with today's (resume's note and model check, `grt sweep`'s finished) reads
    the old run's train.bptt_k: 4 as model.backprop_steps: 4, today's key: no change; 4 -> 5 is still one."""
    import dataclasses
    import json

    import yaml

    from pipeline.studies.sweep import finished
    from pipeline.train.checkpointer import model_config_diff
    from pipeline.train.run_folder import recipe_changes

    for k, change in ((4, []), (5, ["model.backprop_steps: 4 -> 5"])):
        saved = old_run_recipe(model_k, str(tmp_path / str(k)))
        now = from_dict({**recipe({"type": "grt", "backprop_steps": k}, {"max_steps": 10}),
                         "out_dir": saved["out_dir"]})
        assert recipe_changes(saved, now.to_dict()) == change  # resume's note
        assert model_config_diff(saved, dataclasses.asdict(now.model)) == [  # resume's refusal
            c.replace(": 4 -> 5", ": checkpoint 4 != recipe 5") for c in change]
        ckpt = now.run_dir / "checkpoints" / "step_00000010"  # evaluated at max_steps: `grt sweep` skips it
        ckpt.mkdir(parents=True)
        (ckpt / "state.pt").write_bytes(b"")
        (ckpt / "recipe.yaml").write_text(yaml.safe_dump(saved))
        (now.run_dir / "eval").mkdir()
        (now.run_dir / "eval" / "exits.json").write_text(json.dumps({"step": 10, "checkpoint": str(ckpt / "state.pt")}))
        assert finished(now) == ((True, "") if k == 4 else (
            False, "the recipe changed since its checkpoint (model.backprop_steps: 4 -> 5)"))
    null = from_dict(recipe({"type": "grt"}, {"max_steps": 10})).to_dict()
    assert recipe_changes({**null, "train": {**null["train"], "bptt_k": None}}, null) == []  # a null alias: nothing


def test_the_bptt_k_note_is_said_once_per_source_and_never_for_a_saved_recipe(capsys, monkeypatch):
    """A recipe read again (a sweep checks then trains it; eval reads a checkpoint's recipe once per override) says
    the train.bptt_k note once; a run's own saved recipe, which nobody should edit, reads silently."""
    from pipeline.config import loading
    from pipeline.train.trained import eval_recipe

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(loading, "_BPTT_NOTED", set())
    for _ in range(3):
        assert from_dict(recipe({"type": "grt"}, {"bptt_k": 3}), "old.yaml").model.backprop_steps == 3
    from_dict(recipe({"type": "grt"}, {"bptt_k": 3}), "other.yaml")
    assert capsys.readouterr().err == "".join(
        f"note: {s}: train.bptt_k is deprecated, read as model.backprop_steps=3; write model.backprop_steps in the "
        f"recipe instead\n" for s in ("old.yaml", "other.yaml"))
    cfg = eval_recipe(old_run_recipe(), ["eval.batch_size=2", "eval.max_steps=3", "tracking.enabled=false"],
                      "grt eval runs/old")
    assert cfg.model.backprop_steps == 4 and cfg.eval.max_steps == 3
    assert capsys.readouterr().err == ""
