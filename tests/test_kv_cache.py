"""KV-cache strategies (full | last | first | averaged), left-padded batches and the preallocated cache, against a
reference written here from the strategies' definitions: no cache, the attention of every block written out per
query in float64, each token's per-step K/V kept and compacted by hand.

Definition the reference implements (issue #13): the first forward over a prompt attends step by step (each step's
queries see that step's keys of the prompt); every later forward's step-s queries of block l see the earlier tokens'
cached K/V of block l and the new tokens' own step-s K/V. Cached K/V of a token: full = its step-s K/V (step
min(s, r'-1) when it ran only r' steps: the fill rule); last / first / averaged = its last / first / mean K/V over
the steps it ran (MoR: the steps it was chosen at; it is a key when chosen at any). Note that a decoded token's K/V
come from its own forward against the compacted past, not from a full-attention recomputation of the whole
sequence: the reference therefore feeds the tokens one forward at a time, as a decoder does, but computes every
attention from the stored per-token history without any cache code."""
import math
import types
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.eval.lm_eval.harness import GRTLM
from pipeline.eval.lm_eval.scoring import decode_loglikelihoods
from pipeline.eval.lm_eval.scoring import greedy_generate
from pipeline.eval.lm_eval.scoring import loglikelihoods
from pipeline.infer.generate import generate
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import MoRConfig
from pipeline.model.configs import OuroConfig
from pipeline.model.configs import PoissonConfig
from pipeline.model.configs import RRTConfig
from pipeline.model.kv_cache import KV_STRATEGIES
from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_cache import at_step
from pipeline.model.layers import CausalSelfAttention
from pipeline.model.llama import LlamaAttention
from pipeline.model.rrt import RRTAttention
from pipeline.model.rrt import RRTLlamaAttention

BASE = dict(vocab_size=64, block_size=64, d_model=32, n_head=2)
CONFIGS = {
    "gpt": GPTConfig(**BASE, n_layer=2),
    "grt": GRTConfig(**BASE, n_prelude=1, n_core=2, n_coda=1, n_recurrence=3),
    "poisson": PoissonConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=3),
    "mor": MoRConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=3, router_alpha=1.0),
    "rrt": RRTConfig(**BASE, n_prelude=1, n_core=1, n_coda=1, n_recurrence=3, lora_rank=4),
    "ouro": OuroConfig(**BASE, n_layer=2, n_recurrence=3),
}
# the llama block (rotary positions, grouped-query attention with ONE key/value head of two, QK-norm) in the types
# whose models take it: "<type>-llama"
LLAMA = dict(block="llama", bias=False, n_kv_head=1, qk_norm=True, mlp_multiple=16, rope_theta=500.0)
CONFIGS.update({f"{t}-llama": type(CONFIGS[t])(**{**CONFIGS[t].__dict__, **LLAMA})
                for t in ("gpt", "grt", "poisson", "mor", "rrt", "ouro")})
MODEL_TYPES = list(CONFIGS)
RECURRENT = [t for t in MODEL_TYPES if not t.startswith("gpt")]
_MODELS: dict = {}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread


def model_of(model_type: str):
    """A float64 model, weights moved off the GPT-2 init so that every step's K/V differ (GRT's gate opened, RRT's
    LoRAs non-zero, MoR's routers of both signs); MoR routes by its causal threshold."""
    if model_type not in _MODELS:
        torch.manual_seed(3)
        m = build_model(CONFIGS[model_type]).double().eval()
        kind = model_type.split("-")[0]
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
            if kind == "grt":
                m.recur.gate.fc2.bias.normal_(0.0, 1.0)
        if kind == "mor":
            m.routing = "threshold"
        _MODELS[model_type] = m
    return _MODELS[model_type]


# ------------------------------------------------------------------------------------------------- the reference
class StrategyReference:
    """One sequence fed forward by forward without a cache; every attention computed by hand from ``history``:
    per attention module, per token so far, [(k, v, ran) at each step it ran] ([H, hd], [H, hd], bool)."""

    def __init__(self, model, kv: str):
        self.model, self.kv = model, kv
        self.history = defaultdict(list)  # module -> per token: (steps, compacted (k, v, is_key))
        self.n_tokens = 0

    def compact(self, steps):
        if self.kv == "full":
            return None
        ran = [(k, v) for k, v, r in steps if r]  # the steps the token ran (MoR: was chosen at)
        pick = {"first": ran[:1], "last": ran[-1:], "averaged": ran}[self.kv]
        return (torch.stack([k for k, _ in pick]).mean(0), torch.stack([v for _, v in pick]).mean(0), bool(ran))

    def past(self, module, step):
        rows = []
        for steps, compacted in self.history[module]:
            rows.append(steps[min(step, len(steps) - 1)] if self.kv == "full" else compacted)
        return rows

    def attend(self, per_step, module, x, key_mask, lora):
        T, C = x.shape[1:]
        H = module.n_head
        hd = C // H
        if isinstance(module, (LlamaAttention, RRTLlamaAttention)):
            q, k, v = self.llama_qkv(module, x[0], lora)
        else:
            q, k, v = (t.reshape(T, H, hd) for t in module.c_attn(x, *lora)[0].split(C, dim=-1))
        ran = key_mask[0] if key_mask is not None else torch.ones(T, dtype=torch.bool)
        past = self.past(module, len(per_step[module]))
        per_step[module].append((k, v, ran))
        keys = torch.cat([torch.stack([p[0] for p in past]), k]) if past else k  # [P + T, H, hd]
        values = torch.cat([torch.stack([p[1] for p in past]), v]) if past else v
        is_key = torch.tensor([p[2] for p in past] + ran.tolist())
        P, out = len(past), []
        for t in range(T):  # query t at position P + t: the earlier keys that are keys, and itself
            n = P + t + 1
            seen = is_key[:n].clone()
            seen[-1] = True
            scores = torch.einsum("hd,nhd->hn", q[t], keys[:n]) / math.sqrt(hd)
            w = torch.softmax(scores.masked_fill(~seen, -math.inf), dim=-1)
            out.append(torch.einsum("hn,nhd->hd", w, values[:n]).reshape(C))
        if isinstance(module, RRTLlamaAttention):
            return module.o_proj(torch.stack(out)[None], *lora)
        if isinstance(module, LlamaAttention):
            return torch.stack(out)[None] @ module.o_proj.weight.T
        return module.c_proj(torch.stack(out)[None], *lora)

    def llama_qkv(self, module, x, lora=()):
        """q, k, v [T, H, hd] of the llama block at this sequence's absolute positions: QK-norm, the rotation by
        angle p theta^(-2i/hd) of each pair (i, i + hd/2) written out, the key/value heads repeated for the query
        heads that share them (grouped-query attention)."""
        T, H, Hkv, hd = x.shape[0], module.n_head, module.n_kv_head, module.head_dim
        if lora:  # RRT's LoRA'd projections (W x + (alpha / rank) B_r A_r x), as its gpt2 reference calls them
            q, k, v = (proj(x, *lora) for proj in (module.q_proj, module.k_proj, module.v_proj))
            q, k, v = q.view(T, H, hd), k.view(T, Hkv, hd), v.view(T, Hkv, hd)
        else:
            q = (x @ module.q_proj.weight.T).view(T, H, hd)
            k = (x @ module.k_proj.weight.T).view(T, Hkv, hd)
            v = (x @ module.v_proj.weight.T).view(T, Hkv, hd)
        if module.q_norm is not None:
            q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * module.q_norm.weight
            k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * module.k_norm.weight
        theta = self.model.cfg.rope_theta
        angle = torch.arange(self.n_tokens, self.n_tokens + T, dtype=torch.float64)[:, None, None] * torch.tensor(
            [theta ** (-2 * i / hd) for i in range(hd // 2)], dtype=torch.float64)

        def rotate(t):
            a, b = t[..., :hd // 2], t[..., hd // 2:]
            return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)

        group = H // Hkv
        return rotate(q), rotate(k).repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    @contextmanager
    def patched(self, per_step):
        ref, embed = self, self.model.embed
        offset = self.n_tokens

        def attn_forward(module, x, kv=None, key_mask=None, layout=None):
            return ref.attend(per_step, module, x, key_mask, ())

        def rrt_attn_forward(module, x, r, kv=None, layout=None):
            return ref.attend(per_step, module, x, None, (r,))

        def embed_forward(module, idx, start=0, layout=None):
            if module.wpe is None:  # the llama block: rotary positions, applied by llama_qkv
                return module.wte(idx)
            return module.wte(idx) + module.wpe(torch.arange(offset, offset + idx.shape[1]))

        attention = (CausalSelfAttention, RRTAttention, LlamaAttention, RRTLlamaAttention)
        patched = [m for m in self.model.modules() if isinstance(m, attention)]
        for m in patched:
            fn = rrt_attn_forward if isinstance(m, (RRTAttention, RRTLlamaAttention)) else attn_forward
            m.forward = types.MethodType(fn, m)
        embed.forward = types.MethodType(embed_forward, embed)
        try:
            yield
        finally:
            for m in patched + [embed]:
                del m.forward

    @torch.no_grad()
    def forward(self, tokens: list[int], n_steps=None) -> torch.Tensor:
        """Logits [T, V] of the new ``tokens`` given all tokens fed before."""
        per_step = defaultdict(list)
        with self.patched(per_step):
            logits = self.model(torch.tensor([tokens]), n_steps=n_steps)[0][0]
        for module, steps in per_step.items():
            for t in range(len(tokens)):
                token_steps = [(k[t], v[t], bool(r[t])) for k, v, r in steps]
                self.history[module].append((token_steps, self.compact(token_steps)))
        self.n_tokens += len(tokens)
        return logits


def reference_decode(model, prompt, n_new, kv, depths=None):
    """(greedy tokens, logits of each) decoded from ``prompt`` by the reference; ``depths[i]``: the depth of forward
    i (0 = the prompt)."""
    depths = depths or [None] * n_new
    ref = StrategyReference(model, kv)
    logits = [ref.forward(list(prompt), depths[0])[-1]]
    tokens = [int(logits[-1].argmax())]
    for i in range(1, n_new):
        logits.append(ref.forward([tokens[-1]], depths[i])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@torch.no_grad()
def cached_decode(model, prompts, n_new, kv, depths=None):
    """(greedy tokens [B, n], logits [B, n, V]) of a left-padded batch decoded through the model's KV cache."""
    depths = depths or [None] * n_new
    cache, feed = KVCache.left_padded(prompts, model.cfg.block_size, kv)
    logits = [model(feed, n_steps=depths[0], cache=cache)[0][:, -1]]
    for i in range(1, n_new):
        logits.append(model(logits[-1].argmax(-1)[:, None], n_steps=depths[i], cache=cache)[0][:, -1])
    logits = torch.stack(logits, 1)
    return logits.argmax(-1), logits


def ref_tol(model_type: str) -> dict:
    """Tolerance against the float64 reference: the llama block holds its rotary cos/sin in fp32 (as Hugging Face's
    Llama), so its rotation of float64 states is exact to ~1e-7 only; the rest is float64 throughout."""
    return dict(rtol=1e-6, atol=1e-6) if model_type.endswith("-llama") else dict(rtol=1e-9, atol=1e-9)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("kv", KV_STRATEGIES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cached_greedy_decode_equals_the_strategy_recomputed_from_scratch(model_type, kv):
    m, prompt = model_of(model_type), prompt_of(8)
    want_tokens, want_logits = reference_decode(m, prompt, 32, kv)
    tokens, logits = cached_decode(m, [prompt], 32, kv)
    assert tokens[0].tolist() == want_tokens
    torch.testing.assert_close(logits[0], want_logits, **ref_tol(model_type))
    plain = torch.stack([m(torch.tensor([prompt + want_tokens[:i]]))[0][0, -1] for i in range(32)])
    if kv == "full" or model_type.startswith("gpt"):  # one step per block: every strategy is the exact model
        torch.testing.assert_close(logits[0], plain, rtol=1e-9, atol=1e-9)
    else:  # the strategy changes what decoding attends to, so the equality above is not the exact model's
        assert (logits[0] - plain).abs().max() > 1e-6


@pytest.mark.parametrize("kv", KV_STRATEGIES)
@pytest.mark.parametrize("model_type", RECURRENT)
def test_forwards_of_fewer_and_more_steps(model_type, kv):
    """Per-forward depths below and (where the model allows) above the prompt's: full fills the steps a token did
    not run with its last computed step, the compact strategies compact over the steps it ran."""
    m = model_of(model_type)
    R, deeper = m.cfg.n_recurrence, model_type.split("-")[0] in ("grt", "poisson", "ouro")
    depths = [R, 1, 2, R, 1] + ([R + 1, 2, R + 1] if deeper else [R, 2, 1])
    want_tokens, want_logits = reference_decode(m, prompt_of(6, 1), len(depths), kv, depths)
    tokens, logits = cached_decode(m, [prompt_of(6, 1)], len(depths), kv, depths)
    assert tokens[0].tolist() == want_tokens
    torch.testing.assert_close(logits[0], want_logits, **ref_tol(model_type))


def test_full_fill_rule_on_the_cache_itself():
    m = model_of("grt")
    cache = KVCache(m.cfg.block_size, "full")
    with torch.no_grad():
        m(torch.tensor([prompt_of(5)]), cache=cache)  # 3 steps
        m(torch.tensor([[7]]), n_steps=1, cache=cache)  # position 5 runs step 0 only
    for block in m.recur.blocks:
        slots = cache.layers[block]
        assert len(slots) == 3
        for s in (1, 2):
            torch.testing.assert_close(slots[s].k[:, :, 5], slots[0].k[:, :, 5], rtol=0, atol=0)
            torch.testing.assert_close(slots[s].v[:, :, 5], slots[0].v[:, :, 5], rtol=0, atol=0)
            assert not torch.equal(slots[s].k[:, :, 4], slots[0].k[:, :, 4])  # the prompt ran every step


@pytest.mark.parametrize("kv", KV_STRATEGIES)
@torch.no_grad()
def test_a_step_loop_reading_every_exit_leaves_the_forwards_cache(kv):
    """What early exit at decode does: GRT's steps run one at a time through ``at_step``, the coda run again after
    each step to read that exit (a repeated step overwrites its K/V), stopped at r: the same logits and cache as
    forward(n_steps=r)."""
    m, prompt = model_of("grt"), torch.tensor([prompt_of(6)])
    plain, looped = KVCache(m.cfg.block_size, kv), KVCache(m.cfg.block_size, kv)
    m(prompt, cache=plain)
    m(prompt, cache=looped)
    for tok, r in ((5, 2), (9, 3), (11, 1), (3, 4)):
        idx = torch.tensor([[tok]])
        want = m(idx, n_steps=r, cache=plain)[0]
        h_pre = m.encode(idx, looped.begin(idx), looped)
        h, anchor = m.initial_state(h_pre, noise=False), None
        for step in range(r):
            h, _, anchor = m.recur(h, h_pre, False, at_step(looped, step), anchor)
            got = m.lm_head(m.readout(h, looped))
        looped.advance()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for layer, slots in plain.layers.items():
        assert len(slots) == len(looped.layers[layer])
        for a, b in zip(slots, looped.layers[layer]):
            torch.testing.assert_close(a.k[:, :, :plain.pos], b.k[:, :, :looped.pos], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(a.v[:, :, :plain.pos], b.v[:, :, :looped.pos], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kv", KV_STRATEGIES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_left_padded_batch_gives_each_prompt_what_it_gives_alone(model_type, kv):
    m = model_of(model_type)
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 40)]
    tokens, logits = cached_decode(m, prompts, 8, kv)
    for row, p in enumerate(prompts):
        alone_tokens, alone_logits = cached_decode(m, [p], 8, kv)
        assert tokens[row].tolist() == alone_tokens[0].tolist()
        torch.testing.assert_close(logits[row], alone_logits[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_type", ["grt", "mor"])
def test_greedy_generate_batches_any_lengths_and_slides_with_padding(model_type):
    """greedy_generate with left padding and the sliding re-encode (block_size 24 < the tokens generated) against
    the uncached model on each row's window: every row restarts from its last block_size // 2 tokens whenever the
    batch would exceed block_size columns (the longest row decides)."""
    m, block_size, n_new = model_of(model_type), 24, 30
    prompts = [prompt_of(n, seed=n) for n in (3, 10, 17)]
    got = greedy_generate(m, prompts, n_new, None, block_size)
    seqs, start = [list(p) for p in prompts], [0, 0, 0]
    for i in range(n_new):
        if i > 0 and max(len(s) - a for s, a in zip(seqs, start)) > block_size:
            start = [max(len(s) - block_size // 2, 0) for s in seqs]
        for s, a in zip(seqs, start):
            s.append(int(m(torch.tensor([s[a:]]))[0][0, -1].argmax()))
    assert start != [0, 0, 0]  # it slid
    assert got == [s[len(p):] for s, p in zip(seqs, prompts)]
    assert greedy_generate(m, prompts, 8, None, 64, kv="averaged") == [
        greedy_generate(m, [p], 8, None, 64, kv="averaged")[0] for p in prompts]


SHORT_CONTEXT = {  # block_size 16: a prompt and its continuation pass the model's learned positions many times over
    "gpt": GPTConfig(vocab_size=64, block_size=16, d_model=32, n_head=2, n_layer=2),
    "grt": GRTConfig(vocab_size=64, block_size=16, d_model=32, n_head=2, n_prelude=1, n_core=2, n_coda=1,
                     n_recurrence=3),
}


@pytest.mark.parametrize("kv", KV_STRATEGIES)
@pytest.mark.parametrize("model_type", list(SHORT_CONTEXT))
def test_generation_past_the_models_block_size_slides_as_documented(model_type, kv):
    """docs/inference.md, Context: positions are learned up to model.block_size, a prompt keeps its last
    block_size - 1 tokens, and when the batch would pass block_size columns every row is re-encoded from its last
    block_size // 2 tokens (a new prefill). generate() at the model's own block_size (16), prompts of 21 tokens (past
    the context) and 5, 40 new tokens: 55 tokens through a 16-position model. The reference decodes each row's
    windows from scratch without any cache code: kv=full the uncached model on the window, token by token; the
    compact strategies StrategyReference (the window's prefill step by step, then one token per forward against the
    strategy's compacted per-token history). Tokens equal, and the logits of every step to 1e-9 (float64)."""
    torch.manual_seed(5)
    m = build_model(SHORT_CONTEXT[model_type]).double().eval()
    with torch.no_grad():  # far off init, so that greedy decoding wanders instead of repeating one token
        for p in m.parameters():
            p.add_(0.5 * torch.randn_like(p))
        if model_type == "grt":
            m.recur.gate.fc2.bias.normal_(0.0, 1.0)
    bs, n_new = m.cfg.block_size, 40
    prompts = [prompt_of(21, seed=21), prompt_of(5, seed=5)]
    seen = []  # the logits generate() picks each step's tokens from

    def greedy(logits):
        seen.append(logits.clone())
        return logits.argmax(dim=-1)
    got = generate(m, prompts, n_new, bs, kv=kv, sampler=greedy).tokens

    seqs = [p[-(bs - 1):] for p in prompts]  # what the model can read of each prompt
    start, refs, want, slides = [0] * len(seqs), [None] * len(seqs), [], 0
    with torch.no_grad():
        for _ in range(n_new):
            if max(len(s) - a for s, a in zip(seqs, start)) > bs:  # the longest row's window would pass block_size
                start, refs, slides = [max(len(s) - bs // 2, 0) for s in seqs], [None] * len(seqs), slides + 1
            step = []
            for row, s in enumerate(seqs):
                if kv == "full":
                    logits = m(torch.tensor([s[start[row]:]]))[0][0]
                elif refs[row] is None:  # a new window: its prefill
                    refs[row] = StrategyReference(m, kv)
                    logits = refs[row].forward(s[start[row]:])
                else:
                    logits = refs[row].forward(s[-1:])
                step.append(logits[-1])
                s.append(int(logits[-1].argmax()))
            want.append(torch.stack(step))
    assert slides >= 4  # re-encoded again and again
    assert got == [s[len(s) - n_new:] for s in seqs]
    torch.testing.assert_close(torch.stack(seen), torch.stack(want), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kv", KV_STRATEGIES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cache_bytes_per_token_follow_the_layer_count(model_type, kv):
    m, B = model_of(model_type), 2
    cfg = m.cfg
    model_type = model_type.split("-")[0]
    cache, idx = KVCache.left_padded([prompt_of(5), prompt_of(9)], cfg.block_size, kv)
    with torch.no_grad():
        m(idx, cache=cache)
    if model_type == "gpt":
        layers = cfg.n_layer
    elif model_type == "ouro":
        layers = cfg.n_layer * (cfg.n_recurrence if kv == "full" else 1)
    else:
        layers = cfg.n_prelude + cfg.n_core * (cfg.n_recurrence if kv == "full" else 1) + cfg.n_coda
    flags = layers - cfg.n_prelude - cfg.n_coda if model_type == "mor" else 0  # MoR's core keeps a key flag
    assert cache.n_layer_caches() == layers
    kv_width = cfg.kv_dim()  # grouped-query attention caches n_kv_head heads
    assert cache.nbytes() == (layers * 2 * kv_width * 8 + flags) * B * cfg.block_size  # K and V in float64


@pytest.mark.parametrize("kv", KV_STRATEGIES)
def test_decode_writes_in_place_no_reallocation(kv):
    m = model_of("grt")
    cache = KVCache(m.cfg.block_size, kv)
    with torch.no_grad():
        m(torch.tensor([prompt_of(4)]), cache=cache)
        buffers = [(t, t.untyped_storage().data_ptr()) for slots in cache.layers.values() for s in slots
                   for t in (s.k, s.v)]
        for tok in range(10):
            m(torch.tensor([[tok]]), cache=cache)
    after = [t for slots in cache.layers.values() for s in slots for t in (s.k, s.v)]
    assert len(after) == len(buffers) and cache.pos == 14
    assert all(a is b and a.untyped_storage().data_ptr() == ptr for a, (b, ptr) in zip(after, buffers))
    assert all(t.shape[2] == m.cfg.block_size for t in after)


def test_cache_errors_name_the_fix():
    m = model_of("grt")
    with pytest.raises(ValueError, match="averaged"):
        KVCache(16, "mean")
    cache = KVCache(6, "last")
    with torch.no_grad():
        m(torch.tensor([prompt_of(5)]), cache=cache)
        with pytest.raises(ValueError, match="max_len=6"):
            m(torch.tensor([[1, 2]]), cache=cache)


@pytest.mark.parametrize("kv", ["full", "averaged"])
def test_decode_loglikelihoods_against_the_reference(kv):
    """Context prefilled, continuation teacher-forced one token per forward: full is the one-forward score; a
    compact strategy is the reference's log-probs fed the same tokens."""
    m = model_of("grt")
    requests = [(prompt_of(5, 1), prompt_of(3, 2)), (prompt_of(11, 3), prompt_of(3, 4)),
                (prompt_of(2, 5), prompt_of(6, 6)), ([], prompt_of(4, 7)), (prompt_of(70, 8), prompt_of(2, 9))]
    requests[3] = ([9], requests[3][1])
    got = decode_loglikelihoods(m, requests, None, 2, m.cfg.block_size, kv)
    if kv == "full":
        want = loglikelihoods(m, requests, [3], 2, m.cfg.block_size)[3]
        for (a, ga), (b, gb) in zip(got, want):
            assert a == pytest.approx(b, abs=1e-5) and ga == gb  # its head runs in float32
        return
    for (ctx, cont), (ll, greedy) in zip(requests, got):
        whole = (ctx + cont)[-(m.cfg.block_size + 1):]
        ctx = whole[:len(whole) - len(cont)]
        ref = StrategyReference(m, kv)
        logits = [ref.forward(ctx)[-1]] + [ref.forward([t])[-1] for t in cont[:-1]]
        logp = torch.log_softmax(torch.stack(logits), -1)
        assert ll == pytest.approx(logp[range(len(cont)), cont].sum().item(), abs=1e-9)
        assert greedy == (logp.argmax(-1).tolist() == cont)


def test_lm_eval_adapter_kv_argument_and_mixed_length_batches():
    torch.manual_seed(1)
    cfg = from_dict(tiny_recipe(Path("/tmp"), Path("/tmp"), {"d_model": 16, "n_head": 2, "block_size": 48}))
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        model.recur.gate.fc2.bias.normal_(0.0, 1.0)

    class Req:
        def __init__(self, *args):
            self.args = args

    reqs = [Req(text, {"until": ["\u2603"], "max_gen_toks": 6}) for text in
            ("a", "the gate decides how much of the state", "one two three four")]
    with pytest.raises(ValueError, match="averaged"):
        GRTLM(model=model, cfg=cfg, kv="mean")
    for kv in ("full", "averaged"):
        batched = GRTLM(model=model, cfg=cfg, batch_size=3, kv=kv).generate_until(reqs, disable_tqdm=True)
        alone = GRTLM(model=model, cfg=cfg, batch_size=1, kv=kv).generate_until(reqs, disable_tqdm=True)
        assert batched == alone and all(batched)
    lm = GRTLM(model=model, cfg=cfg, batch_size=2, kv="last")
    assert lm.get_model_info()["grt_kv"] == "last"
    pairs = [("The gate decides how much", " of the state"), ("one two", " three")]
    got = lm.loglikelihood([Req(c, t) for c, t in pairs], disable_tqdm=True)
    enc = lm.tokenizer
    want = decode_loglikelihoods(model, [(enc.encode(c), enc.encode(t)) for c, t in pairs],
                                 lm.depth, 1, cfg.model.block_size, "last")
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
