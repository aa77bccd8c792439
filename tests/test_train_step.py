"""The training step reads the device once per step, not once per micro-step, and keeps its non-finite rules: a bad
step is dropped where the backend can drop it, and the run stops before the update where it cannot. The loader pins
its batches when asked (the trainer asks on CUDA), so the non_blocking copies are asynchronous there."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train import faults
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards
from pipeline.train.trainer import BadStepsError
from pipeline.train.trainer import Trainer


@pytest.fixture
def make_trainer(tmp_path, corpus):
    made = []

    def build(accum: int, name: str = "tiny") -> Trainer:
        cfg = from_dict(tiny_recipe(tmp_path, corpus, name=name, train={"grad_accum_steps": accum}))
        tokenize(cfg.data, quiet=True)
        made.append(Trainer(cfg, callbacks=[]))
        made[-1].model.train()
        return made[-1]

    yield build
    for t in made:
        if t.run_lock is not None:
            t._release_run_folder()


def float_reads(monkeypatch, fn) -> int:
    """How many times ``fn()`` reads a floating-point tensor's value into Python (``.item()``, ``float()``): on a GPU
    each is a host sync. Integer reads (the depth draw, seeds) are host-side values and not counted."""
    count = [0]
    item, to_float = torch.Tensor.item, torch.Tensor.__float__

    def counted(original):
        def read(t):
            count[0] += t.is_floating_point()
            return original(t)
        return read

    monkeypatch.setattr(torch.Tensor, "item", counted(item))
    monkeypatch.setattr(torch.Tensor, "__float__", counted(to_float))
    fn()
    monkeypatch.undo()
    return count[0]


def test_one_read_of_the_device_per_step_whatever_the_accumulation(monkeypatch, make_trainer):
    """The loss is read once per step, not once per micro-step: 1 and 4 micro-steps give the same count (before:
    one loss.item() per micro-step, 3 more with 4). The rest is per step too: the gradient norm, and AdamW's
    per-parameter step counters (CPU tensors)."""
    reads = {accum: float_reads(monkeypatch, make_trainer(accum, name=f"a{accum}").train_step) for accum in (1, 4)}
    assert reads[1] == reads[4], reads


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_non_finite_step_is_dropped(monkeypatch, make_trainer):
    """A NaN loss in one micro-step: the step reports finite=False and a NaN loss, the weights stay as they were and
    no gradient is left behind; the next step trains again."""
    monkeypatch.setattr(faults, "FAULT_NAN_STEPS", {2})  # before the trainer is built: it adds the fault hooks
    t = make_trainer(2)
    assert t.train_step()["finite"]
    before = snapshot(t.raw_model)
    bad = t.train_step()
    assert not bad["finite"] and bad["loss"] != bad["loss"]  # NaN
    after = snapshot(t.raw_model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in t.raw_model.parameters())
    good = t.train_step()
    assert good["finite"] and not any(torch.equal(after[n], p) for n, p in t.raw_model.named_parameters())


def test_a_backend_that_cannot_drop_a_step_stops_before_the_update(monkeypatch, make_trainer):
    """DeepSpeed cannot drop a step once its engine counted the micro-steps: the run stops with BadStepsError, and
    the optimizer never stepped on the NaN gradients (the weights are those before the step)."""
    monkeypatch.setattr(faults, "FAULT_NAN_STEPS", {1})
    t = make_trainer(2)
    monkeypatch.setattr(t.backend, "can_skip", False)
    before = snapshot(t.raw_model)
    with pytest.raises(BadStepsError, match="non-finite loss at step 1: the single backend cannot skip"):
        t.train_step()
    assert all(torch.equal(before[n], p) for n, p in t.raw_model.named_parameters())


def test_loader_pins_its_batches_when_asked(monkeypatch, tmp_path, corpus):
    """pin_memory=True: every batch goes through Tensor.pin_memory (checked with a stand-in where no CUDA is there
    to pin for; on a GPU machine the batch is really page-locked), the same tokens as an unpinned loader's."""
    cfg = from_dict(tiny_recipe(tmp_path, corpus))
    tokenize(cfg.data, quiet=True)
    shards = TokenShards(cfg.data.dataset_dir, "train")
    pinned = []  # the stand-in's outputs, kept alive so that identity (not a reusable id()) tells them apart
    if not torch.cuda.is_available():
        def pin(t):
            out = t.clone()
            pinned.append(out)
            return out
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    plain_loader = SequenceLoader(shards, 16, 3, seed=9)
    pinned_loader = SequenceLoader(shards, 16, 3, seed=9, pin_memory=True)
    for _ in range(3):
        (x, y, _), (px, py, _) = plain_loader.next_batch(), pinned_loader.next_batch()
        assert torch.equal(x, px) and torch.equal(y, py)
        if torch.cuda.is_available():
            assert px.is_pinned() and py.is_pinned() and not x.is_pinned()
        else:
            def was_pinned(t):
                return any(t is p for p in pinned)
            assert was_pinned(px) and was_pinned(py) and not was_pinned(x) and not was_pinned(y)
    assert torch.cuda.is_available() or len(pinned) == 6
