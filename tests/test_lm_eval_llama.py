"""The lm-eval adapter with llama-block models (rotary positions, grouped-query attention, a vocabulary padded to a
multiple of 128 whose padding rows would win every softmax if they were read): scores equal one forward per request
written out here, on both scoring paths (one right-padded forward for every depth; the left-padded KV-cache path,
whose rows start their rotary positions at their first real token), and batched generation equals the uncached
greedy continuation of each prompt alone."""
from pathlib import Path

import pytest
import torch

from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.eval.lm_eval.harness import GRTLM
from pipeline.eval.lm_eval.scoring import decode_loglikelihoods
from pipeline.eval.lm_eval.scoring import greedy_generate
from pipeline.model import build_model
from pipeline.tokenize.bpe import gpt2_encoding
from test_eval import PAIRS
from test_eval import Req
from test_eval import direct_loglikelihood

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread

ENC = gpt2_encoding()
LLAMA = {"block": "llama", "bias": False, "n_kv_head": 1, "qk_norm": True, "mlp_multiple": 16, "vocab_multiple": 128}
MODELS = {"gpt": {"type": "gpt", "n_layer": 2},
          "grt": {"type": "grt", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3}}


def small(model_type: str):
    torch.manual_seed(1)
    recipe = tiny_recipe(Path("/tmp"), Path("/tmp"), {"d_model": 16, "n_head": 2})
    recipe["model"] = {"block_size": 32, "d_model": 16, "n_head": 2, **MODELS[model_type], **LLAMA}
    cfg = from_dict(recipe)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        if model_type == "grt":
            model.recur.gate.fc2.bias.normal_(0.0, 1.0)
        model.embed.wte.weight[cfg.model.vocab_size:] = 50.0  # padding rows: huge logits if anything read them
    assert model.embed.wte.weight.shape[0] == 50304
    return model, cfg


@pytest.mark.parametrize("model_type", list(MODELS))
def test_llama_scores_equal_a_forward_per_request_on_both_paths(model_type):
    model, cfg = small(model_type)
    bs = cfg.model.block_size
    with torch.no_grad():
        want = [direct_loglikelihood(model, c, t, None, bs) for c, t in PAIRS]
    for batch_size in (1, 4):  # one right-padded forward for every depth (the adapter's kv=full)
        got = GRTLM(model=model, cfg=cfg, batch_size=batch_size).loglikelihood([Req(c, t) for c, t in PAIRS],
                                                                              disable_tqdm=True)
        assert [g[1] for g in got] == [w[1] for w in want]
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    # the KV-cache path: contexts left-padded into one prefill, the continuation decoded token by token
    reqs = []
    for c, t in PAIRS:
        c, t = (c.rstrip(), c[len(c.rstrip()):] + t) if c else (c, t)
        whole, ctx = ENC.encode_ordinary(c + t), ENC.encode_ordinary(c) if c else []
        reqs.append((ctx or [ENC.eot_token], whole[len(ctx):] if ctx else whole))
    got = decode_loglikelihoods(model, reqs, None, 4, bs, "full")
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    # a compact strategy on that path: a batch gives each request what it gives alone
    lm = GRTLM(model=model, cfg=cfg, batch_size=4, kv="averaged")
    alone = GRTLM(model=model, cfg=cfg, batch_size=1, kv="averaged")
    pairs = [Req(c, t) for c, t in PAIRS]
    assert [g[0] for g in lm.loglikelihood(pairs, disable_tqdm=True)] == pytest.approx(
        [g[0] for g in alone.loglikelihood(pairs, disable_tqdm=True)], abs=1e-5)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_llama_batched_generation_equals_uncached_greedy(model_type):
    model, cfg = small(model_type)
    prompts = [ENC.encode_ordinary("the gate decides how much of"), ENC.encode_ordinary("a")[:1],
               ENC.encode_ordinary("one two three")]
    got = greedy_generate(model, prompts, 10, None, cfg.model.block_size)
    with torch.no_grad():
        for p, g in zip(prompts, got):
            seq = list(p)
            for _ in range(10):
                seq.append(model(torch.tensor([seq]))[0][0, -1].argmax().item())
            assert g == seq[len(p):]
            assert all(t < cfg.model.vocab_size for t in g)
