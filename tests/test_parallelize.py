"""Activation checkpointing changes memory, not numbers; the loader survives a world-size change."""
import copy

import pytest
import torch

from pipeline.config import GPTConfig, GRTConfig
from pipeline.model import build_model
from pipeline.tokenize import tokenize
from pipeline.train.data import SequenceLoader, TokenShards
from pipeline.train.parallelize import apply_activation_checkpointing

from conftest import tiny_recipe


def grads(model, idx, targets, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the noise of this forward
    _, loss = model(idx, targets, n_steps=3)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["core_step", "blocks"])
def test_checkpointing_gives_identical_gradients_with_noise_on(mode):
    torch.manual_seed(0)
    base = build_model(GRTConfig(vocab_size=200, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2,
                                 n_coda=1, n_recurrence=3, dropout=0.1)).train()
    ckpt = copy.deepcopy(base)
    apply_activation_checkpointing(ckpt, mode)
    idx, targets = torch.randint(0, 200, (2, 16)), torch.randint(0, 200, (2, 16))
    loss_a, ga = grads(base, idx, targets, 5)
    loss_b, gb = grads(ckpt, idx, targets, 5)
    assert loss_a == loss_b
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name  # bit-identical: the recomputation saw the same noise
    assert [n for n, _ in base.named_parameters()] == [n for n, _ in ckpt.named_parameters()]  # same checkpoints


def test_core_step_checkpointing_needs_a_recurrent_model():
    with pytest.raises(ValueError, match="core_step needs a recurrent model"):
        apply_activation_checkpointing(build_model(GPTConfig(vocab_size=50, block_size=8, d_model=16, n_head=2,
                                                             n_layer=2)), "core_step")


def test_loader_resumes_exactly_once_across_a_2_to_1_world_size_change(tmp_path, corpus):
    from pipeline.config import from_dict

    cfg = from_dict(tiny_recipe(tmp_path, corpus))
    tokenize(cfg.data, quiet=True)
    shards = TokenShards(cfg.data.dataset_dir, "train")
    two = [SequenceLoader(shards, 16, 3, seed=9, rank=r, world_size=2) for r in range(2)]
    n = two[0].n_samples[0]
    seen = []
    for _ in range(n // 12):  # part of the epoch on 2 ranks
        for ld in two:
            seen += [i for _k, i in ld.next_indices()]
    one = SequenceLoader(shards, 16, 3, seed=9, rank=0, world_size=1)
    one.load_state_dict(two[0].state_dict())  # then resume on 1 rank
    while len(seen) < n:
        seen += [i for _k, i in one.next_indices()]
    assert sorted(seen[:n]) == list(range(n))  # every window exactly once over the epoch
