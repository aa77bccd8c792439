"""Gated Recurrent Transformer for Hugging Face transformers, exported by grt-pipeline (`grt export`).

Self-contained (torch and transformers only). The math is grt-pipeline's pipeline/model/grt.py in evaluation mode,
i.e. without the training noise; grt-pipeline's tests/test_export.py keeps the two equal (logits to 1e-5 at every
depth r = 1..2R). Parameter names are the pipeline's, so its checkpoints load here key for key.

    h_pre = prelude(wte[x] + wpe[pos])                    n_prelude GPT-2 pre-LN blocks, run once
    h^(0) = h_pre                                         (init_state=prelude; zeros and noise: 0)
    step r = 1..n:
        o = core(W_proj [h, h_pre])                       n_core blocks, the same weights at every step
        g = sigmoid(fc2(SiLU(fc1 [LN_h(h), LN_pre(h_pre)])) / tau)
        h = g * h + (1 - g) * o                           (gate=none: h = o; reinject=false: o = core(h))
    logits = LN_f(coda(h^(n))) wte^T                      n_coda blocks, then the tied head

With ``block: llama`` the prelude, core and coda blocks are Llama-style (grt-pipeline's pipeline/model/llama.py):
RMSNorm (eps 1e-6), rotary positions (``rope_theta``, Hugging Face's half-split layout, angles from the position
ids, so left padding restarts each row at 0), grouped-query attention (``n_kv_head`` key/value heads, the cache holds
only those), optional QK-norm, a SwiGLU MLP, no biases; there are no learned positions and the final norm is an
RMSNorm. W_proj and the gate (with its LayerNorms) are as above.

n = ``n_steps`` (forward / generate argument, else config.n_steps, else n_recurrence = R); any n >= 0 runs, deeper
than R included (test-time depth scaling).

Generation cache, ``kv_strategy`` (forward / generate argument or config): prelude and coda blocks keep one K/V each;
the core's blocks keep
    full      one K/V per (step, block): step r attends to the past's step-r keys; equals the uncached model
    last      one K/V per block: the past tokens' K/V of their last step n
    first     ... of their first step
    averaged  ... the mean over their n steps
The prompt is encoded with full per-step attention (compacted caches inside the prompt cost accuracy), then its cache
is compacted. Each later token, at every step, attends to the compacted past plus its own K/V of that step, then
appends its compacted K/V: n_prelude + n_core + n_coda layer caches instead of n_prelude + n_core * n + n_coda.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_grt import KV_STRATEGIES
from .configuration_grt import GRTHFConfig


def attend(q, k, v, key_valid):
    """Causal attention [B, H, T, hd] of T queries that are the last T of the S keys' positions (the first S - T
    come from the cache). ``key_valid`` ([B, S] bool, None: all) marks the keys that may be attended to (False:
    padding); a query always sees itself, so no row is empty."""
    T, S = q.shape[2], k.shape[2]
    if key_valid is None and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q_pos = torch.arange(S - T, S, device=q.device)[:, None]
    k_pos = torch.arange(S, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if key_valid is not None:
        mask = mask & (key_valid[:, None, None, :] | (k_pos == q_pos))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, d, n_head, bias):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x, past=None, key_valid=None):
        """(output, (k, v) of x's own tokens); ``past``: the cached (k, v) [B, H, S_past, hd] or None."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        y = attend(q, keys, values, key_valid)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)


class MLP(nn.Module):
    def __init__(self, d, bias):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.c_proj = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))  # exact (erf) GELU, as the pipeline trains with


class Block(nn.Module):
    """GPT-2 pre-LN block: x + attn(LN(x)), then + MLP(LN(x)). Returns the output and its tokens' (k, v)."""

    def __init__(self, d, n_head, bias):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5, bias=bias)
        self.attn = Attention(d, n_head, bias)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5, bias=bias)
        self.mlp = MLP(d, bias)

    def forward(self, x, past=None, key_valid=None):
        a, kv = self.attn(self.ln_1(x), past, key_valid)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 and cast back before the weight."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * y.to(x.dtype) if x.dtype != y.dtype else self.weight.to(y.dtype) * y


def rotary_angles(position_ids, head_dim, theta):
    """(cos, sin) [B, 1, T, head_dim/2] in fp32 of angle position * theta^(-2i/head_dim) (computed in fp64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float64)
                                / head_dim))
    angles = position_ids.to(torch.float64)[..., None] * inv_freq
    return angles.cos().float()[:, None], angles.sin().float()[:, None]


def rotate(x, rope):
    """Dimension i paired with i + hd/2, each pair rotated by its angle (Hugging Face's rotate_half layout)."""
    cos, sin = rope
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions and optional QK-norm; the cache holds the rotated keys."""

    def __init__(self, d, n_head, n_kv_head, qk_norm):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d // n_head
        self.q_proj = nn.Linear(d, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else None

    def forward(self, x, past=None, key_valid=None, rope=None):
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, rope), rotate(k, rope)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        group = self.n_head // self.n_kv_head  # query heads per key/value head
        y = attend(q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), key_valid)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd)), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)). Returns the output and its tokens' (k, v)."""

    def __init__(self, config):
        super().__init__()
        d = config.d_model
        ratio = 8 / 3 if config.mlp_ratio is None else config.mlp_ratio
        blocks = ratio * d / config.mlp_multiple
        hidden = config.mlp_multiple * (int(blocks) + (blocks > int(blocks)))  # rounded up, as math.ceil
        self.ln_1 = RMSNorm(d)
        self.attn = LlamaAttention(d, config.n_head, config.n_kv_head or config.n_head, config.qk_norm)
        self.ln_2 = RMSNorm(d)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x, past=None, key_valid=None, rope=None):
        a, kv = self.attn(self.ln_1(x), past, key_valid, rope)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv


def make_block(config):
    """One prelude / core / coda block of ``config.block``."""
    return LlamaBlock(config) if config.block == "llama" else Block(config.d_model, config.n_head, config.bias)


class Gate(nn.Module):
    """z = fc2(SiLU(fc1 [LN_h(h), LN_pre(h_pre)])); g = sigmoid(z / tau)."""

    def __init__(self, d, bias):
        super().__init__()
        self.ln_h = nn.LayerNorm(d, eps=1e-5, bias=bias)
        self.ln_pre = nn.LayerNorm(d, eps=1e-5, bias=bias)
        self.fc1 = nn.Linear(2 * d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, h, h_pre):
        return self.fc2(F.silu(self.fc1(torch.cat([self.ln_h(h), self.ln_pre(h_pre)], dim=-1))))


class Recurrence(nn.Module):
    """The looped part: W_proj (when reinject), the shared core blocks and the gate (when gate=elementwise)."""

    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.proj = nn.Linear(2 * d, d) if config.reinject else None
        self.blocks = nn.ModuleList(make_block(config) for _ in range(config.n_core))
        self.gate = Gate(d, config.bias) if config.gate == "elementwise" else None


def _append(slot, kv):
    return kv if slot is None else (torch.cat([slot[0], kv[0]], 2), torch.cat([slot[1], kv[1]], 2))


class GRTCache:
    """Keys and values of the tokens seen so far, for generation: one (k, v) [B, H, tokens, hd] per prelude and coda
    block; for the core, one per (step, block) with kv_strategy=full, else one compacted per block (module docstring).
    """

    def __init__(self, config, n_steps, kv_strategy):
        if kv_strategy not in KV_STRATEGIES:
            raise ValueError(f"kv_strategy={kv_strategy!r}: choose one of {', '.join(KV_STRATEGIES)}")
        self.n_steps, self.kv_strategy = n_steps, kv_strategy
        core_slots = n_steps if kv_strategy == "full" else min(n_steps, 1)
        self.prelude = [None] * config.n_prelude
        self.core = [[None] * config.n_core for _ in range(core_slots)]
        self.coda = [None] * config.n_coda
        self.seen = 0  # tokens cached

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def nbytes(self):
        """Bytes held by the cached keys and values."""
        slots = [*self.prelude, *(s for step in self.core for s in step), *self.coda]
        return sum(t.numel() * t.element_size() for s in slots if s is not None for t in s)


class GRTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GRTHFConfig
    base_model_prefix = "grt"
    main_input_name = "input_ids"
    _no_split_modules = ["Block", "LlamaBlock"]

    def __init__(self, config):
        super().__init__(config)
        d, bias = config.d_model, config.bias
        self.llama = config.block == "llama"
        embed = dict(wte=nn.Embedding(config.vocab_size, d))
        if not self.llama:  # the llama block has rotary positions instead
            embed["wpe"] = nn.Embedding(config.block_size, d)
        self.embed = nn.ModuleDict(embed)
        self.prelude = nn.ModuleList(make_block(config) for _ in range(config.n_prelude))
        self.recur = Recurrence(config)
        self.coda = nn.ModuleList(make_block(config) for _ in range(config.n_coda))
        self.ln_f = RMSNorm(d) if self.llama else nn.LayerNorm(d, eps=1e-5, bias=bias)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed["wte"]

    def set_input_embeddings(self, value):
        self.embed["wte"] = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                labels=None, n_steps=None, kv_strategy=None, return_dict=None, cache=None, **kwargs):
        """Logits [B, T, V] of ``input_ids`` at depth ``n_steps``; with ``labels`` also the mean next-token
        cross-entropy (labels shifted inside, -100 ignored). With a cache (``past_key_values``, or ``cache`` as
        transformers >= 5.24 names it) ``input_ids`` holds only the new tokens; ``attention_mask`` covers the cached
        and the new tokens (0: padding) and sets the positions (cumulative count of real tokens, for left padding)."""
        cfg = self.config
        n = n_steps if n_steps is not None else (cfg.n_steps if cfg.n_steps is not None else cfg.n_recurrence)
        strategy = kv_strategy or cfg.kv_strategy
        if n < 0:
            raise ValueError(f"n_steps={n}: the number of recurrence steps must be >= 0")
        past = past_key_values if past_key_values is not None else cache
        if past is None and (use_cache if use_cache is not None else cfg.use_cache):
            past = GRTCache(cfg, n, strategy)
        if past is not None and (past.n_steps, past.kv_strategy) != (n, strategy):
            raise ValueError(f"the cache was filled with n_steps={past.n_steps}, kv_strategy={past.kv_strategy}; "
                             f"continue with those (got n_steps={n}, kv_strategy={strategy}) or start a new cache")
        seen = past.seen if past is not None else 0
        T = input_ids.shape[1]
        key_valid = None
        if attention_mask is not None:
            if attention_mask.shape[1] != seen + T:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens; it must cover the "
                                 f"{seen} cached and the {T} new ones")
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            if not bool(attention_mask.all()):
                key_valid = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(seen, seen + T, device=input_ids.device)[None]
        if self.llama:  # rotary angles of this call's positions, shared by every block
            extra = {"rope": rotary_angles(position_ids.expand(input_ids.shape[0], -1), cfg.d_model // cfg.n_head,
                                           cfg.rope_theta)}
            x = self.embed["wte"](input_ids)
        else:
            if int(position_ids.max()) >= cfg.block_size:
                raise ValueError(f"position {int(position_ids.max())} is past block_size={cfg.block_size}, the "
                                 f"longest sequence this model has position embeddings for; shorten the input")
            extra = {}
            x = self.embed["wte"](input_ids) + self.embed["wpe"](position_ids)
        for i, block in enumerate(self.prelude):
            x, kv = block(x, past.prelude[i] if past is not None else None, key_valid, **extra)
            if past is not None:
                past.prelude[i] = _append(past.prelude[i], kv)
        h_pre = x
        h = h_pre if cfg.init_state == "prelude" else torch.zeros_like(h_pre)
        full = strategy == "full"
        decoding = past is not None and not full and seen > 0  # compact strategies: past K/V are compacted
        step_kv = [[] for _ in self.recur.blocks]  # compact strategies: this call's tokens' K/V at every step
        for r in range(n):
            o = self.recur.proj(torch.cat([h, h_pre], dim=-1)) if self.recur.proj is not None else h
            for j, block in enumerate(self.recur.blocks):
                if past is None:
                    slot = None
                elif full:
                    slot = past.core[r][j]
                else:  # the compacted past; none while encoding the prompt (full per-step attention inside it)
                    slot = past.core[0][j] if decoding else None
                o, kv = block(o, slot, key_valid, **extra)
                if past is not None and full:
                    past.core[r][j] = _append(slot, kv)
                elif past is not None:
                    step_kv[j].append(kv)
            if self.recur.gate is None:
                h = o
            else:  # in float32 (at least), as the pipeline's fused gate
                g = torch.sigmoid(self.recur.gate(h, h_pre).float() / cfg.tau)
                h = (o.float() + g * (h.float() - o.float())).to(h.dtype)
        if past is not None and not full and n > 0:
            for j, kvs in enumerate(step_kv):
                past.core[0][j] = _append(past.core[0][j], self._compact(kvs, strategy))
        for i, block in enumerate(self.coda):
            h, kv = block(h, past.coda[i] if past is not None else None, key_valid, **extra)
            if past is not None:
                past.coda[i] = _append(past.coda[i], kv)
        if past is not None:
            past.seen += T
        logits = F.linear(self.ln_f(h), self.embed["wte"].weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        # positional: the cache field is named past_key_values before transformers 5.24 and cache from it
        return CausalLMOutputWithPast(loss, logits, past)

    @staticmethod
    def _compact(kvs, strategy):
        """One (k, v) from the per-step list: last step's, first step's or the mean over the steps."""
        if strategy == "last":
            return kvs[-1]
        if strategy == "first":
            return kvs[0]
        return tuple(torch.stack([kv[i].float() for kv in kvs]).mean(0).to(kvs[0][i].dtype) for i in (0, 1))

    # ---- generation: the cache is this file's GRTCache, threaded through generate() by the two methods below
    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate() must not build a transformers DynamicCache: forward makes a GRTCache

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, n_steps=None,
                                      kv_strategy=None, use_cache=True, cache=None, **kwargs):
        past = past_key_values if past_key_values is not None else cache
        if past is not None and past.seen:
            input_ids = input_ids[:, past.seen:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past,
                "use_cache": use_cache, "n_steps": n_steps, "kv_strategy": kv_strategy}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1, **kwargs):
        # kept under this name, which generate() itself never reads in transformers >= 5.24 (it reads "cache")
        past = outputs.get("cache")  # transformers >= 5.24's name, past_key_values before
        model_kwargs["past_key_values"] = past if past is not None else outputs.get("past_key_values")
        model_kwargs.pop("cache", None)
        mask = model_kwargs.get("attention_mask")
        if mask is not None:
            model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], num_new_tokens))], -1)
        return model_kwargs
