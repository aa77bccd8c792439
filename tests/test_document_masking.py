"""Document masking (``data.document_masking``) for every model type, with both blocks: attention (and every other
path between tokens: a self-KV memory, a loop memory, a router) stays inside each document of the window.

The reference is independent of the masking code: each document run as a batch of its own, with no ``docs`` at all.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.layout import document_positions
from pipeline.model.layout import documents_from_eos
from pipeline.model.layout import documents_from_starts
from pipeline.model.registry import build_model

EOS = 61
V = 64
LLAMA = dict(block="llama", bias=False, n_kv_head=2, qk_norm=True, mlp_multiple=16)
# each type small, with every layer kind it has; dropout 0, so training and eval differ only by the model's noise
SHAPES = {
    "gpt": dict(n_layer=2),
    "grt": dict(n_prelude=1, n_core=2, n_coda=1, n_recurrence=3),
    "poisson": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3, backprop_steps=2),
    "mor": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3),
    "rrt": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3, lora_rank=4, lora_alpha=4.0),
    "ouro": dict(n_layer=2, n_recurrence=3),
    "recurrent_transformer": dict(n_layer=2, tile=4),
    "recurtrace": dict(n_prelude=1, n_core=1, n_coda=1, n_recurrence=3),
}
BLOCKS = ["gpt2", "llama"]


def small(model_type: str, block: str):
    cfg = MODEL_CONFIGS[model_type](type=model_type, vocab_size=V, block_size=32, d_model=32, n_head=4,
                                    **SHAPES[model_type], **(LLAMA if block == "llama" else {}))
    assert not cfg.validate(), cfg.validate()
    return cfg


def window() -> torch.Tensor:
    """Two rows of 24 tokens: row 0 holds three documents (ends after 6 and 15), row 1 two (end after 9)."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, EOS, (2, 24), generator=g)
    idx[0, 6], idx[0, 15], idx[1, 9] = EOS, EOS, EOS
    return idx


def exits_of(model) -> list[int]:
    top = model.full_depth(model.cfg)
    low = 1 if model.exits_are_layers else 0
    return list(range(low, top + 1))


def test_document_index_and_positions_from_eos_and_from_starts():
    idx = window()
    docs = documents_from_eos(idx, EOS)
    assert docs[0].tolist() == [0] * 7 + [1] * 9 + [2] * 8  # the EOS belongs to the document it ends
    assert docs[1].tolist() == [0] * 10 + [1] * 14
    assert document_positions(docs)[0].tolist() == list(range(7)) + list(range(9)) + list(range(8))
    # the same from a shard's document start offsets: the window starts mid-document at offset 100
    starts = [40, 107, 116, 300]
    assert documents_from_starts(100, 24, starts).tolist() == docs[0].tolist()


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("model_type", list(SHAPES))
def test_each_document_sees_only_itself_at_every_exit(model_type, block):
    """Masked exit states equal each document run alone (float64), and changing one document's tokens leaves every
    other document's states bit-identical, at every exit depth."""
    torch.manual_seed(0)
    model = build_model(small(model_type, block), seed=0).double().eval()
    idx = window()
    docs = documents_from_eos(idx, EOS)
    exits = exits_of(model)
    with torch.no_grad():
        masked = dict(model.exit_states(idx, exits, docs=docs))
        for b in range(idx.shape[0]):
            for d in docs[b].unique().tolist():
                where = (docs[b] == d).nonzero().flatten()
                alone = dict(model.exit_states(idx[b:b + 1, where], exits))
                for e in exits:
                    torch.testing.assert_close(masked[e][b, where], alone[e][0], rtol=0, atol=1e-10,
                                               msg=lambda m: f"{model_type}/{block} exit {e} row {b} doc {d}: {m}")
        changed = idx.clone()
        changed[0, 8:14] = (changed[0, 8:14] + 5) % EOS  # inside row 0's second document only
        after = dict(model.exit_states(changed, exits, docs=docs))
    others = docs[0] != 1
    for e in exits:
        assert torch.equal(after[e][0, others], masked[e][0, others]), (model_type, block, e)
        assert torch.equal(after[e][1], masked[e][1]), (model_type, block, e)
        assert not torch.equal(after[e][0, ~others], masked[e][0, ~others]) or e == 0


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("model_type", list(SHAPES))
def test_masked_loss_and_gradients_equal_separate_documents(model_type, block):
    """The masked forward's loss and every gradient equal the token-weighted sum over separate per-document
    forwards (eval mode: no noise; the training depth is the full depth)."""
    torch.manual_seed(0)
    model = build_model(small(model_type, block), seed=0).double().eval()
    idx = window()
    targets = torch.roll(idx, -1, dims=1)
    docs = documents_from_eos(idx, EOS)
    _, loss = model(idx, targets, docs=docs)
    loss.backward()
    masked = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    n_tokens = idx.numel()
    for b in range(idx.shape[0]):
        for d in docs[b].unique().tolist():
            where = (docs[b] == d).nonzero().flatten()
            _, part = model(idx[b:b + 1, where], targets[b:b + 1, where])
            total = total + part * where.numel() / n_tokens
    total.backward()
    torch.testing.assert_close(loss, total, rtol=0, atol=1e-10)
    separate = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert masked.keys() == separate.keys()
    for n in masked:
        torch.testing.assert_close(masked[n], separate[n], rtol=1e-9, atol=1e-11, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("block", BLOCKS)
def test_mor_training_aux_loss_within_documents_by_hand(block):
    """MoR's training loss under masking: CE + coef * sum_r BCE_r, where BCE_r is the mean over every candidate of
    the window of BCE(router logit, 1[the token is among the top k_r(L) of its own document]); rebuilt by hand from
    each document's router logits run alone (k_r(L) = max(1, floor((N - r) L / N)))."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    cfg = small("mor", block)
    cfg.aux_loss_coef = 0.5  # large enough that a wrong BCE moves the loss far past float64 noise
    model = build_model(cfg, seed=0).double()
    idx = window()
    targets, docs = torch.roll(idx, -1, dims=1), documents_from_eos(idx, EOS)
    N = cfg.n_recurrence
    logits: dict[int, torch.Tensor] = {}
    hooks = [router.register_forward_hook(lambda _m, _a, out, r=r: logits.__setitem__(r, out.squeeze(-1).detach()))
             for r, router in enumerate(model.recur.routers)]
    bce_sum, candidates = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    model.train()
    with torch.no_grad():
        for b in range(idx.shape[0]):
            for d in docs[b].unique().tolist():
                where = (docs[b] == d).nonzero().flatten()
                model(idx[b:b + 1, where], targets[b:b + 1, where])
                for r in range(N):
                    z = logits[r][0]  # this recursion's candidates (what recursion r - 1 chose), in order
                    k = max(1, (N - r) * where.numel() // N)
                    member = torch.zeros_like(z).scatter(0, z.topk(k).indices, 1.0)
                    bce_sum[r] += F.binary_cross_entropy_with_logits(z, member, reduction="sum")
                    candidates[r] += z.numel()
        for h in hooks:
            h.remove()
        _, trained = model(idx, targets, docs=docs)
        model.eval()
        _, ce = model(idx, targets, docs=docs)  # the same routing without the aux term (dropout 0, no noise)
    torch.testing.assert_close(trained - ce, cfg.aux_loss_coef * (bce_sum / candidates).sum(), rtol=0, atol=1e-10)
