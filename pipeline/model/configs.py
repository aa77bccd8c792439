"""Model configs by ``model.type``: one dataclass per architecture, each with its own ``validate()``. Torch-free and
below :mod:`pipeline.config`, so reading a recipe needs no torch and the registry needs no recipe loader. A new
architecture adds its class here and one line to :data:`MODEL_CONFIGS` (and its ``module:Class`` to the registry)."""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any
from typing import Optional


def at_least(obj: Any, section: str, names: tuple[str, ...], minimum: int) -> list[str]:
    return [f"{section}.{n} must be >= {minimum}, got {getattr(obj, n)}" for n in names if getattr(obj, n) < minimum]


def choice(key: str, value: str, allowed: list[str]) -> list[str]:
    if value in allowed:
        return []
    near = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" — did you mean '{near[0]}'?" if near else ""
    return [f"{key}={value!r} is not one of {allowed}{hint}"]


def swiglu_hidden(d_model: int, mlp_ratio: float, multiple: int) -> int:
    """The SwiGLU hidden size: mlp_ratio * d rounded up to a multiple of ``multiple`` (Llama: 8/3 d, multiple 256,
    so 4096 -> 11008)."""
    return multiple * math.ceil(mlp_ratio * d_model / multiple)


LLAMA_KEYS = ("n_kv_head", "rope_theta", "mlp_ratio", "mlp_multiple", "qk_norm")  # read by the llama block only


@dataclass
class ModelConfig:
    """Fields every language model here shares."""

    type: str = "grt"
    vocab_size: int = 50257  # GPT-2 BPE
    block_size: int = 1024  # context length S
    d_model: int = 768
    n_head: int = 12
    dropout: float = 0.0
    bias: bool = True
    # the standard block every type builds its prelude/core/coda/layers from: gpt2 (pre-LN, learned positions, GELU
    # MLP x4, biases) | llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases: model.bias=false)
    block: str = "gpt2"
    n_kv_head: Optional[int] = None  # llama: key/value heads of grouped-query attention (null: n_head, plain MHA)
    rope_theta: float = 10000.0  # llama: rotary base
    mlp_ratio: Optional[float] = None  # llama: SwiGLU hidden size / d_model before rounding (null: 8/3)
    mlp_multiple: int = 256  # llama: the SwiGLU hidden size is rounded up to a multiple of this (Llama: 256)
    qk_norm: bool = False  # llama: RMSNorm on each head's q and k before the rotation (OLMo 2, Qwen 3)
    # the embedding/head rows are vocab_size rounded up to a multiple of this (128: tensor-core friendly); the padding
    # rows are never predicted (the head reads only the first vocab_size rows). 1: no padding, as GPT-2 and the paper
    vocab_multiple: int = 1
    # the sampled depth's bound grown over training, [[until_step, depth], ...] (grt, poisson; the others refuse it:
    # pipeline/train/curriculum.py); null: model.n_recurrence at every step
    depth_schedule: Optional[list] = None

    def validate(self) -> list[str]:
        p = at_least(self, "model", ("vocab_size", "block_size", "d_model", "n_head", "vocab_multiple",
                                     "mlp_multiple"), 1)
        if self.n_head >= 1 and self.d_model % self.n_head:  # n_head < 1 is reported above
            p.append(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            p.append(f"model.dropout must be in [0, 1), got {self.dropout}")
        p += choice("model.block", self.block, ["gpt2", "llama"])
        if self.block == "gpt2":
            defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
            set_keys = [k for k in LLAMA_KEYS if getattr(self, k) != defaults[k]]
            if set_keys:
                p.append(f"model.{', model.'.join(set_keys)} set with model.block=gpt2: they belong to the llama block "
                         f"(set model.block: llama, or remove them)")
        elif self.block == "llama":
            if self.bias:
                p.append("model.bias=true with model.block=llama: the llama block has no biases; set model.bias: false")
            if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
                p.append(f"model.n_kv_head={self.n_kv_head} must be >= 1 and divide model.n_head={self.n_head} "
                         f"(each key/value head serves n_head / n_kv_head query heads)")
            if self.n_head >= 1 and self.d_model % self.n_head == 0 and (self.d_model // self.n_head) % 2:
                p.append(f"model.d_model / model.n_head = {self.d_model // self.n_head} is odd: rotary positions "
                         f"rotate pairs of dimensions, so the head size must be even")
            if self.rope_theta <= 0:
                p.append(f"model.rope_theta must be > 0, got {self.rope_theta}")
            if self.mlp_ratio is not None and self.mlp_ratio <= 0:
                p.append(f"model.mlp_ratio must be > 0, got {self.mlp_ratio}")
        return p

    def kv_heads(self) -> int:
        """Key/value heads of each attention layer (n_head unless grouped-query attention)."""
        return self.n_kv_head or self.n_head

    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def kv_dim(self) -> int:
        """Width of each attention layer's keys (and values): kv heads x head size."""
        return self.kv_heads() * self.head_dim()

    def mlp_hidden(self) -> int:
        """The llama block's SwiGLU hidden size (mlp_ratio, default 8/3, x d rounded up to mlp_multiple)."""
        return swiglu_hidden(self.d_model, 8 / 3 if self.mlp_ratio is None else self.mlp_ratio, self.mlp_multiple)

    def embedding_rows(self) -> int:
        """Rows of the token embedding and the tied head: vocab_size rounded up to a multiple of vocab_multiple."""
        m = max(self.vocab_multiple, 1)
        return -(-self.vocab_size // m) * m

    def max_depth(self) -> Optional[int]:
        """The deepest exit this model has (None: any depth, the recurrence can run past its trained depth)."""
        return None


@dataclass
class GPTConfig(ModelConfig):
    """Dense GPT-2 baseline (nanoGPT-equivalent)."""

    type: str = "gpt"
    n_layer: int = 12

    def validate(self) -> list[str]:
        return super().validate() + at_least(self, "model", ("n_layer",), 1)

    def max_depth(self) -> Optional[int]:
        return self.n_layer


@dataclass
class RecurrentTransformerConfig(GPTConfig):
    """Recurrent Transformer (layer-wise self-KV memory): GPT-2 whose layer l attends to keys/values computed from
    layer l's own outputs at earlier positions (pipeline/model/recurrent_transformer.py)."""

    type: str = "recurrent_transformer"
    prefill: str = "tiled"  # tiled: the exact divide-and-conquer algorithm; reference: token by token
    tile: int = 64  # positions per tile of the tiled algorithm
    own_key: str = "input"  # input: position t also attends to its own input's key/value; none: only earlier outputs

    def validate(self) -> list[str]:
        p = super().validate() + at_least(self, "model", ("tile",), 1)
        if self.prefill not in ("tiled", "reference"):
            p.append(f"model.prefill must be tiled or reference, got {self.prefill!r}")
        if self.own_key not in ("input", "none"):
            p.append(f"model.own_key must be input or none, got {self.own_key!r}")
        return p


@dataclass
class RecurrentConfig(ModelConfig):
    """The layout every recurrent-depth model here shares, shorthand ``n_prelude + n_core x n_recurrence + n_coda``:
    prelude blocks run once, a core of ``n_core`` blocks looped ``n_recurrence`` times, coda blocks."""

    n_prelude: int = 2
    n_core: int = 5  # n_rec: blocks in the shared core
    n_coda: int = 2
    n_recurrence: int = 4  # R: maximum (and default evaluation) number of recurrence steps

    def validate(self) -> list[str]:
        p = super().validate()
        p += at_least(self, "model", ("n_prelude", "n_coda"), 0)
        return p + at_least(self, "model", ("n_core", "n_recurrence"), 1)


@dataclass
class GRTConfig(RecurrentConfig):
    """Gated Recurrent Transformer, shorthand ``n_prelude + n_core x n_recurrence + n_coda``."""

    type: str = "grt"
    # Ablation switches (paper Fig. 5 / Table 7). All on = full GRT.
    reinject: bool = True  # h~ = W_proj([h + eps_x, h_pre]); off: h~ = h + eps_x
    gate: str = "elementwise"  # elementwise: h = g*h + (1-g)*o ; none: h = o
    # n parallel residual streams inside the looped core, mixed by static hyper-connections (Zhu et al. 2024,
    # pipeline/model/hyper_connections.py); 1: off, the plain residual core
    hyper_streams: int = 1
    state_noise: str = "every_step"  # every_step | init (once, on h^(0)) | none
    sigma_x: float = 0.1  # paper §4: state noise
    sigma_g: float = 0.1  # paper §4: gate noise
    tau: float = 1.0  # paper §3.3: gate temperature
    gate_bias_init: float = 4.0  # paper §3.3: +4 -> g ~ sigmoid(4) = 0.982 at init
    init_state: str = "prelude"  # h^(0): prelude | zeros | noise (see pipeline/model/grt.py)
    depth_sampling: str = "uniform"  # training depth: uniform r ~ U{1..R} (paper §3.4) | fixed (always R)
    # truncated backprop: in training only the last k recurrence steps get gradient (the first max(r - k, 0) run under
    # no_grad), as Poisson's k; null: every step. The one key for it (train.bptt_k is its deprecated alias)
    backprop_steps: Optional[int] = None

    def validate(self) -> list[str]:
        p = super().validate()
        if self.backprop_steps is not None and self.backprop_steps < 1:
            p.append(f"model.backprop_steps must be >= 1 (or null: backprop through every step), got "
                     f"{self.backprop_steps}")
        if self.backprop_steps is not None and not self.reinject and self.gate == "none":
            p.append(f"model.backprop_steps={self.backprop_steps} with reinject=false and gate=none: nothing after the "
                     f"no-grad steps reads h_pre, so the prelude and embeddings would get no gradient (and DDP "
                     f"fails); turn reinject or the gate on, or set backprop_steps to null")
        p += choice("model.gate", self.gate, ["elementwise", "none"])
        p += choice("model.state_noise", self.state_noise, ["every_step", "init", "none"])
        p += choice("model.init_state", self.init_state, ["prelude", "zeros", "noise"])
        p += choice("model.depth_sampling", self.depth_sampling, ["uniform", "fixed"])
        p += at_least(self, "model", ("sigma_x", "sigma_g"), 0)
        if self.hyper_streams < 1:
            p.append(f"model.hyper_streams must be >= 1 (1: the plain residual core; n > 1: n hyper-connected "
                     f"streams), got {self.hyper_streams}")
        if self.tau <= 0:
            p.append(f"model.tau must be > 0, got {self.tau}")
        return p


# ---- the paper's recurrent competitors (Table 1 / Table 8); pipeline/model/<type>.py says how each is built


@dataclass
class PoissonConfig(RecurrentConfig):
    """Heavy-tail Poisson depth (Geiping et al.): random initial state, linear adapter A[h, h_pre], depth per step
    p = Poisson(LogNormal(log R - sigma^2/2, sigma)) + 1 with gradients through the last ``backprop_steps`` only."""

    type: str = "poisson"
    backprop_steps: int = 8  # k: truncated backprop through the last k steps (their release: 8)
    depth_sigma: float = 0.5  # sigma of the log-normal rate
    init_std: Optional[float] = None  # std of the truncated-normal initial state; null: sqrt(2 / (5 d)) as theirs

    def validate(self) -> list[str]:
        p = super().validate() + at_least(self, "model", ("backprop_steps",), 1)
        if self.depth_sigma < 0:
            p.append(f"model.depth_sigma must be >= 0, got {self.depth_sigma}")
        if self.init_std is not None and self.init_std < 0:
            p.append(f"model.init_std must be >= 0 (or null: sqrt(2/(5d))), got {self.init_std}")
        return p


@dataclass
class MoRConfig(RecurrentConfig):
    """Mixture-of-Recursions, expert-choice routing, middle-cycle sharing: ``n_prelude`` first unique layers, the
    ``n_core`` middle blocks cycled ``n_recurrence`` = N_r times, ``n_coda`` last unique layers."""

    type: str = "mor"
    n_prelude: int = 1
    n_core: int = 1
    n_coda: int = 1
    n_recurrence: int = 3  # N_r
    router_alpha: float = 0.1  # alpha in h <- h + alpha * sigmoid(router(h)) * block(h)
    aux_loss_coef: float = 0.001  # BCE(router logits, top-k membership): lets causal inference threshold at 0.5

    def validate(self) -> list[str]:
        p = super().validate()
        if self.router_alpha <= 0:
            p.append(f"model.router_alpha must be > 0, got {self.router_alpha}")
        if self.aux_loss_coef < 0:
            p.append(f"model.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        return p

    def max_depth(self) -> Optional[int]:
        return self.n_recurrence  # recursion r has capacity (N_r - r + 1)/N_r: none is left after N_r


@dataclass
class RecurTraceConfig(RecurrentConfig):
    """RecurTrace (companion abstract): a looped middle block whose layers also attend over their own states of the
    earlier iterations (Loop Memory Attention), and a halting head trained from an oracle of when one more iteration
    still lowers the loss (pipeline/model/recurtrace.py)."""

    type: str = "recurtrace"
    n_prelude: int = 1
    n_core: int = 1
    n_coda: int = 1
    n_recurrence: int = 4  # the most loops (training runs all of them)
    loop_memory: str = "union"  # union: one softmax over positions and earlier iterations; separate: two, added; none
    halt_coef: float = 0.1  # weight of the halting head's BCE against the oracle
    halt_threshold: float = 0.5  # inference: stop when P(continue) < threshold (0: never stop; 1: after one loop)
    halt_mode: str = "token"  # token: each token stops on its own; sequence: all stop when the mean P(continue) does
    halt_detach: bool = True  # the halting head reads a detached state (it learns to read the trunk, not steer it)

    def validate(self) -> list[str]:
        p = super().validate()
        if self.loop_memory not in ("union", "separate", "none"):
            p.append(f"model.loop_memory must be union, separate or none, got {self.loop_memory!r}")
        if self.halt_coef <= 0:
            p.append(f"model.halt_coef must be > 0 (default 0.1), got {self.halt_coef}: the halting head learns only "
                     f"from its BCE, so with 0 it stays untrained and gets no gradient (DDP fails on it); for a loop "
                     f"without halting use loop_memory with halt_threshold=0, or model.type=grt")
        if self.n_recurrence < 2:
            p.append(f"model.n_recurrence must be >= 2 for recurtrace, got {self.n_recurrence}: the halting oracle "
                     f"compares the loss after loop i + 1 with loop i, so one loop leaves nothing to halt or learn")
        if not 0.0 <= self.halt_threshold <= 1.0:
            p.append(f"model.halt_threshold must be in [0, 1], got {self.halt_threshold}")
        if self.halt_mode not in ("token", "sequence"):
            p.append(f"model.halt_mode must be token or sequence, got {self.halt_mode!r}")
        return p

    def max_depth(self) -> Optional[int]:
        return None


@dataclass
class RRTConfig(RecurrentConfig):
    """Relaxed Recursive Transformer: the core strictly shared across recursions plus one LoRA per recursion on its
    attention and MLP projections (B = 0 at init: every recursion starts identical)."""

    type: str = "rrt"
    lora_rank: int = 64
    lora_alpha: float = 64.0  # the LoRA update is scaled by lora_alpha / lora_rank

    def validate(self) -> list[str]:
        p = super().validate() + at_least(self, "model", ("lora_rank",), 1)
        if self.lora_rank > self.d_model >= 1:
            p.append(f"model.lora_rank={self.lora_rank} exceeds model.d_model={self.d_model}")
        if self.lora_alpha <= 0:
            p.append(f"model.lora_alpha must be > 0, got {self.lora_alpha}")
        return p

    def max_depth(self) -> Optional[int]:
        return self.n_recurrence  # one LoRA per recursion: no recursion past the last one


@dataclass
class OuroConfig(ModelConfig):
    """Ouro (looped LM): the whole stack of ``n_layer`` blocks looped ``n_recurrence`` = T times, the final norm at the
    end of every loop, an exit gate per loop and the entropy-regularised expected loss over the loops."""

    type: str = "ouro"
    n_layer: int = 6
    n_recurrence: int = 4  # T: loops in training (and the default evaluation depth)
    entropy_beta: float = 0.1  # beta in sum_t p_t CE_t - beta H(p)

    def validate(self) -> list[str]:
        p = super().validate() + at_least(self, "model", ("n_layer",), 1)
        if self.n_recurrence < 2:  # one loop never uses the exit gate (and DDP stops on an unused parameter)
            p.append(f"model.n_recurrence must be >= 2 for Ouro, got {self.n_recurrence}; a single loop is the dense "
                     f"model: use model.type=gpt")
        if self.entropy_beta < 0:
            p.append(f"model.entropy_beta must be >= 0, got {self.entropy_beta}")
        return p


# type -> config class: the one map (pipeline/model/registry.py names each type's model class)
MODEL_CONFIGS: dict[str, type[ModelConfig]] = {
    "gpt": GPTConfig,
    "grt": GRTConfig,
    # the paper's recurrent competitors (Table 1, Table 8)
    "poisson": PoissonConfig,
    "mor": MoRConfig,
    "rrt": RRTConfig,
    "ouro": OuroConfig,
    # the companion abstracts' systems
    "recurrent_transformer": RecurrentTransformerConfig,
    "recurtrace": RecurTraceConfig,
}
