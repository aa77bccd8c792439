"""Configuration of a Gated Recurrent Transformer exported by grt-pipeline (`grt export RUN --format hf --out DIR`).

Self-contained (only ``transformers``): this file is copied next to ``modeling_grt.py`` into every exported folder.
The fields are grt-pipeline's ``model:`` section (pipeline/model/configs.py GRTConfig) under the same names, plus two
inference settings: ``n_steps`` (recurrence steps run per token; None = ``n_recurrence``, the trained depth R) and
``kv_strategy`` (how generation caches the core's keys and values, see modeling_grt.py).
"""
from transformers import PretrainedConfig

KV_STRATEGIES = ("full", "last", "first", "averaged")


class GRTHFConfig(PretrainedConfig):
    model_type = "grt"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_head", "max_position_embeddings": "block_size"}

    def __init__(self, vocab_size=50257, block_size=1024, d_model=768, n_head=12, dropout=0.0, bias=True,
                 n_prelude=2, n_core=5, n_coda=2, n_recurrence=4, reinject=True, gate="elementwise",
                 state_noise="every_step", sigma_x=0.1, sigma_g=0.1, tau=1.0, gate_bias_init=4.0, init_state="prelude",
                 depth_sampling="uniform", n_steps=None, kv_strategy="full", use_cache=True, bos_token_id=50256,
                 eos_token_id=50256, tie_word_embeddings=False, block="gpt2", n_kv_head=None, rope_theta=10000.0,
                 mlp_ratio=None, mlp_multiple=256, qk_norm=False, vocab_multiple=1, **kwargs):
        self.vocab_size = vocab_size
        self.block_size = block_size  # learned positions: the longest sequence the model reads
        self.d_model = d_model
        self.n_head = n_head
        self.dropout = dropout
        self.bias = bias  # biases in the blocks' Linears and in every LayerNorm
        # the blocks: gpt2 (pre-LN, learned positions, GELU MLP) | llama (RMSNorm, rotary positions, SwiGLU with
        # hidden size mlp_ratio (null: 8/3) * d_model rounded up to mlp_multiple, n_kv_head key/value heads (null:
        # n_head), RMSNorm over each head's q and k when qk_norm)
        self.block = block
        self.n_kv_head = n_kv_head
        self.rope_theta = rope_theta
        self.mlp_ratio = mlp_ratio
        self.mlp_multiple = mlp_multiple
        self.qk_norm = qk_norm
        self.vocab_multiple = vocab_multiple  # training only: the exported embedding holds the vocab_size real rows
        self.n_prelude = n_prelude
        self.n_core = n_core
        self.n_coda = n_coda
        self.n_recurrence = n_recurrence  # R
        self.reinject = reinject  # W_proj [h, h_pre] at every step; off: the core reads h
        self.gate = gate  # elementwise: h = g h + (1 - g) o; none: h = o
        self.tau = tau  # gate temperature
        self.init_state = init_state  # h^(0): prelude -> h_pre; zeros and noise -> 0 (noise is drawn in training only)
        # training-only settings, kept so that the folder documents how the model was trained
        self.state_noise = state_noise
        self.sigma_x = sigma_x
        self.sigma_g = sigma_g
        self.gate_bias_init = gate_bias_init
        self.depth_sampling = depth_sampling
        # inference settings, overridable per call: model(..., n_steps=r), model.generate(..., kv_strategy="last")
        self.n_steps = n_steps
        self.kv_strategy = kv_strategy
        self.use_cache = use_cache
        # the head reads the token embedding itself (tied by construction), so there is no lm_head weight to tie
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        problems = []
        if kv_strategy not in KV_STRATEGIES:
            problems.append(f"kv_strategy={kv_strategy!r}: choose one of {', '.join(KV_STRATEGIES)}")
        if gate not in ("elementwise", "none"):
            problems.append(f"gate={gate!r}: choose elementwise or none")
        if init_state not in ("prelude", "zeros", "noise"):
            problems.append(f"init_state={init_state!r}: choose prelude, zeros or noise")
        if block not in ("gpt2", "llama"):
            problems.append(f"block={block!r}: choose gpt2 or llama")
        if d_model % n_head:
            problems.append(f"d_model={d_model} is not divisible by n_head={n_head}")
        if n_steps is not None and n_steps < 0:
            problems.append(f"n_steps={n_steps}: must be >= 0 (or null for n_recurrence={n_recurrence})")
        if problems:
            raise ValueError("invalid GRT config: " + "; ".join(problems))
