"""Activation checkpointing changes memory, not numbers; the loader survives a world-size change."""
import copy
from collections import Counter

import pytest
import torch

from conftest import tiny_recipe
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.tokenize import tokenize
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards
from pipeline.train.parallelize import apply_activation_checkpointing

R = 3


def grads(model, idx, targets, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the noise of this forward
    _, loss = model(idx, targets, n_steps=R)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_storages(model, idx, targets, n_steps, params=frozenset()) -> tuple[int, int]:
    """Bytes autograd keeps for backward during one forward, as bench/train.py's saved_activation_mb counts them
    (unique storages), and how many of them are the storages in ``params`` (the parameters, kept anyway)."""
    seen, keep = {}, []

    def pack(t):
        keep.append(t)  # held until the count is done: a storage freed mid-forward cannot lend its address to another
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets, n_steps=n_steps)
    return sum(seen.values()), sum(n for ptr, n in seen.items() if ptr in params)


def saved_bytes(model, idx, targets, n_steps) -> int:
    return saved_storages(model, idx, targets, n_steps)[0]


def count_calls(model, names) -> Counter:
    """A live count of the forward calls of the named submodules (their recomputation in backward included)."""
    calls = Counter()
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda *_, name=name: calls.update([name]))
    return calls


@pytest.mark.parametrize("mode", ["core_step", "blocks"])
def test_checkpointing_gives_identical_gradients_with_noise_on(mode):
    """Bit-identical gradients with and without checkpointing (noise and dropout on: the recomputation redraws the
    forward's noise), and checkpointing in effect: the checkpointed parts run their forward again in backward and
    their activations are not kept. core_step: the step (its gate and core blocks) runs 2R times, and the forward
    keeps exactly one state per step (R B T d floats: the step's input h, h_pre at r = 1) beside what the model
    keeps at depth 0 (embeddings, prelude, coda, head). blocks: every block runs twice, the gate (not
    checkpointed) once per step, and each of the 1 + 2R + 1 block executions drops at least its 14 B T d floats
    of internals (LN outputs, q k v, attention output, MLP 4d + 4d: launch/memory_rows.py's count)."""
    torch.manual_seed(0)
    base = build_model(GRTConfig(vocab_size=200, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2,
                                 n_coda=1, n_recurrence=R, dropout=0.1)).train()
    ckpt = copy.deepcopy(base)
    apply_activation_checkpointing(ckpt, mode)
    idx, targets = torch.randint(0, 200, (2, 16)), torch.randint(0, 200, (2, 16))
    once = {"prelude.0.attn": 1, "recur.blocks.0.attn": R, "recur.blocks.1.attn": R, "recur.gate": R,
            "coda.0.attn": 1}  # forward calls in one forward at depth R
    recomputed = {"core_step": ["recur.blocks.0.attn", "recur.blocks.1.attn", "recur.gate"],
                  "blocks": ["prelude.0.attn", "recur.blocks.0.attn", "recur.blocks.1.attn", "coda.0.attn"]}[mode]
    calls_a, calls_b = count_calls(base, once), count_calls(ckpt, once)
    loss_a, ga = grads(base, idx, targets, 5)
    loss_b, gb = grads(ckpt, idx, targets, 5)
    assert calls_a == once
    assert calls_b == {k: n * (2 if k in recomputed else 1) for k, n in once.items()}, calls_b
    assert loss_a == loss_b
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name  # bit-identical: the recomputation saw the same noise
    assert [n for n, _ in base.named_parameters()] == [n for n, _ in ckpt.named_parameters()]  # same checkpoints
    BTd = 4 * 2 * 16 * 32  # bytes of one float32 B x T x d tensor
    kept = saved_bytes(ckpt, idx, targets, R)
    if mode == "core_step":
        at_depth_0 = saved_bytes(base, idx, targets, 0)
        assert kept == at_depth_0 + R * BTd, (kept, at_depth_0)
    else:
        everything = saved_bytes(base, idx, targets, R)
        assert everything - kept >= (1 + 2 * R + 1) * 14 * BTd, (everything, kept)


def test_core_step_keeps_30_percent_of_the_activations_at_r10():
    """docs: "`bench/train.py`: at R = 10, `core_step` keeps 30% of the activations": arm (b) at the bench's CPU
    shape (d 128, 4 heads, T 128, B 8, the GPT-2 vocabulary; 1+1x10+1 at depth 10), counted as the bench counts
    (saved_activation_mb: the unique storages autograd saves in one forward, parameters included). Each arm, less
    its parameters, equals launch/memory_rows.py's hand count exactly, up to one term each that the two counts treat
    differently: without checkpointing the gate op also saves its int64 seed per step (8 bytes; memory_rows.py leaves it
    out); with core_step (one fp32 state per step, the outer blocks, the head) the two anchor terms are held by the
    checkpoint as arguments of the recomputation, outside autograd's saved tensors (memory_rows.py counts them, the
    bench cannot see them)."""
    from launch import memory_rows

    d, heads, T, B, V = 128, 4, 128, 8, 50257  # bench/train.py main(): the CPU shapes
    cfg = GRTConfig(vocab_size=V, block_size=T, d_model=d, n_head=heads, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=10)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    ckpt = copy.deepcopy(model)
    apply_activation_checkpointing(ckpt, "core_step")
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        p.untyped_storage().data_ptr() for p in ckpt.parameters()}
    (none, none_params), (core, core_params) = (saved_storages(m, idx, targets, 10, params) for m in (model, ckpt))
    BTd = 4 * B * T * d
    assert none - none_params == memory_rows.activation_bytes(cfg, B, "none").saved + 10 * 8
    assert core - core_params == memory_rows.activation_bytes(cfg, B, "core_step").saved - 2 * BTd
    assert round(core / none, 2) == 0.30, core / none  # measured 0.3006 (torch 2.13, CPU)


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


@pytest.mark.slow
@pytest.mark.parametrize("model_type, mode", [("gpt", "none"), ("gpt", "blocks"), ("grt", "core_step"),
                                              ("grt", "blocks")])
def test_compiled_checkpointed_llama_blocks_take_each_document_layout_without_recompiling(model_type, mode):
    """Llama blocks with document masking, checkpointed and compiled (the loop eager): no graph break, no new graph
    after the first batch although every batch has other documents, and the gradients of the eager model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from pipeline.model.layout import documents_from_eos
    from pipeline.train.parallelize import apply_compile
    from test_document_masking import EOS
    from test_document_masking import small

    cfg = small(model_type, "llama")
    eager, compiled = build_model(cfg, seed=0), build_model(cfg, seed=0)
    apply_activation_checkpointing(compiled, mode)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(compiled, backend="aot_eager")
    kw = {"n_steps": R} if model_type == "grt" else {}
    frames = []
    for step in range(3):
        idx = torch.randint(0, EOS, (2, 24), generator=torch.Generator().manual_seed(step))
        idx[0, 3 + 4 * step], idx[1, 17 - 3 * step] = EOS, EOS  # the documents move every batch
        docs = documents_from_eos(idx, EOS)
        got = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # GRT's noise
            model(idx, idx, docs=docs, **kw)[1].backward()
            got[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for n, g in got["eager"].items():
            torch.testing.assert_close(got["compiled"][n], g, rtol=1e-4, atol=1e-6, msg=n)
        frames.append(counters["frames"]["total"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert frames[0] == frames[-1] > 0, frames  # the graphs of the first batch serve the next ones
