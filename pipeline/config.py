"""The recipe schema: typed dataclasses, YAML in, validated once, overrides as ``a.b.c=value``.

A recipe is a YAML file. ``base: other.yaml`` (relative to the file) inherits and deep-merges; command-line overrides
``key.sub=value`` apply last. Every problem is collected and reported together (:class:`RecipeError`), and an unknown
key names the nearest valid one.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# the recipe files' side (YAML, base: chains, overrides, folders a file blocks), re-exported: one import for callers
from pipeline.recipe_files import (RecipeError, apply_overrides, deep_merge, file_in_the_way,  # noqa: F401
                                   folder_problem, load_yaml_with_bases, sqlite_file)

# ----------------------------------------------------------------------------------------------------------- schema
# Model sections are chosen by `model.type` through the model registry (pipeline/model/registry.py), so a new
# architecture brings its own config class; the classes below are the shared part and the two built-in models.


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

    def validate(self) -> list[str]:
        p = _at_least(self, "model", ("vocab_size", "block_size", "d_model", "n_head"), 1)
        if self.n_head >= 1 and self.d_model % self.n_head:  # n_head < 1 is reported above
            p.append(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            p.append(f"model.dropout must be in [0, 1), got {self.dropout}")
        return p

    def max_depth(self) -> Optional[int]:
        """The deepest exit this model has (None: any depth, the recurrence can run past its trained depth)."""
        return None


@dataclass
class GPTConfig(ModelConfig):
    """Dense GPT-2 baseline (nanoGPT-equivalent)."""

    type: str = "gpt"
    n_layer: int = 12

    def validate(self) -> list[str]:
        return super().validate() + _at_least(self, "model", ("n_layer",), 1)

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
        p = super().validate() + _at_least(self, "model", ("tile",), 1)
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
        p += _at_least(self, "model", ("n_prelude", "n_coda"), 0)
        return p + _at_least(self, "model", ("n_core", "n_recurrence"), 1)


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
    # no_grad), as Poisson's k; null: every step. train.bptt_k sets it (see _resolve_bptt)
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
        p += _choice("model.gate", self.gate, ["elementwise", "none"])
        p += _choice("model.state_noise", self.state_noise, ["every_step", "init", "none"])
        p += _choice("model.init_state", self.init_state, ["prelude", "zeros", "noise"])
        p += _choice("model.depth_sampling", self.depth_sampling, ["uniform", "fixed"])
        p += _at_least(self, "model", ("sigma_x", "sigma_g"), 0)
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
        p = super().validate() + _at_least(self, "model", ("backprop_steps",), 1)
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
        p = super().validate() + _at_least(self, "model", ("lora_rank",), 1)
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
        p = super().validate() + _at_least(self, "model", ("n_layer",), 1)
        if self.n_recurrence < 2:  # one loop never uses the exit gate (and DDP stops on an unused parameter)
            p.append(f"model.n_recurrence must be >= 2 for Ouro, got {self.n_recurrence}; a single loop is the dense "
                     f"model: use model.type=gpt")
        if self.entropy_beta < 0:
            p.append(f"model.entropy_beta must be >= 0, got {self.entropy_beta}")
        return p


@dataclass
class SourceConfig:
    """One input of the tokenize stage."""

    # files: paths/globs of plain text, .jsonl, .jsonl.gz, .jsonl.zst, .json.gz (JSON lines), .parquet
    # hf: a Hugging Face dataset: a folder written by save_to_disk, or a hub name / local data folder (load_dataset)
    # stdlib: the running Python's standard-library sources (the bundled default corpus)
    kind: str = "files"
    paths: list[str] = field(default_factory=list)
    text_field: str = "text"  # for JSON lines, parquet and HF rows
    text_mode: str = "file"  # plain text files: one document per file | paragraphs (split on blank lines)
    max_bytes: Optional[int] = None  # stop reading this source after this many bytes of text (whole documents)
    name: Optional[str] = None  # hf: hub name, local data folder, or a save_to_disk folder
    subset: Optional[str] = None  # hf: configuration name
    split: str = "train"  # hf: split
    streaming: bool = True  # hf: stream rows (hub names and data folders) instead of downloading/converting first

    def validate(self, where: str) -> list[str]:
        p = _choice(f"{where}.kind", self.kind, ["files", "hf", "stdlib"])
        p += _choice(f"{where}.text_mode", self.text_mode, ["file", "paragraphs"])
        if self.kind == "files" and not self.paths:
            p.append(f"{where}.paths is empty: a 'files' source needs at least one path or glob")
        if self.kind == "hf" and not self.name:
            p.append(f"{where}.name is empty: an 'hf' source needs a dataset name or folder")
        if self.max_bytes is not None and self.max_bytes <= 0:
            p.append(f"{where}.max_bytes must be positive, got {self.max_bytes}")
        return p


@dataclass
class MixtureEntry:
    dataset_dir: str = ""
    weight: float = 1.0


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig(kind="stdlib")])
    # Optional separate validation sources; when given, every document of `sources` goes to training.
    validation_sources: list[SourceConfig] = field(default_factory=list)
    dataset_dir: str = "data/stdlib"  # tokenized shards + manifest.json
    tokenizer: str = "gpt2"
    shard_tokens: int = 1 << 24  # tokens per shard file
    val_fraction: float = 0.01  # share of documents held out for validation (by content hash)
    dedup: bool = True  # drop exact duplicate documents (after whitespace normalisation), across all sources
    strict: bool = False  # any bad input record (malformed, empty, binary, ...) fails the job instead of being counted
    workers: Optional[int] = None  # tokenizer processes (default: CPU count); the output does not depend on it
    # Training on several tokenized datasets: sampled in proportion to weight. Empty: train on dataset_dir alone.
    mixture: list[MixtureEntry] = field(default_factory=list)
    # What training checks of its datasets before step 1: size (every shard's length against the manifest: cheap) |
    # full (also every shard's sha256 and every token id below the vocabulary: reads all the data once)
    verify: str = "size"

    def training_datasets(self) -> tuple[list[str], list[float]]:
        """The datasets training samples from, with weights: ``mixture`` or ``dataset_dir`` alone. The first one's
        validation split is the run's validation set."""
        if self.mixture:
            return [m.dataset_dir for m in self.mixture], [m.weight for m in self.mixture]
        return [self.dataset_dir], [1.0]

    def validate(self) -> list[str]:
        p = []
        if not self.sources:
            p.append("data.sources is empty: list at least one source")
        for i, s in enumerate(self.sources):
            p += s.validate(f"data.sources[{i}]")
        for i, s in enumerate(self.validation_sources):
            p += s.validate(f"data.validation_sources[{i}]")
        p += _choice("data.tokenizer", self.tokenizer, ["gpt2"])
        p += _choice("data.verify", self.verify, ["size", "full"])
        if self.shard_tokens < 1024:
            p.append(f"data.shard_tokens={self.shard_tokens} is too small (minimum 1024)")
        if not 0.0 < self.val_fraction < 1.0:
            p.append(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.workers is not None and self.workers < 1:
            p.append(f"data.workers must be >= 1, got {self.workers}")
        for i, m in enumerate(self.mixture):
            if not m.dataset_dir:
                p.append(f"data.mixture[{i}].dataset_dir is empty")
            if m.weight <= 0:
                p.append(f"data.mixture[{i}].weight must be > 0, got {m.weight}")
        return p


@dataclass
class TrainConfig:
    backend: str = "single"  # single | ddp | fsdp | deepspeed (launch the last three with torchrun)
    zero_stage: int = 1  # deepspeed: ZeRO stage 0..3
    deepspeed: dict = field(default_factory=dict)  # deepspeed: raw config merged over the generated one
    activation_checkpointing: str = "none"  # none | core_step (each recurrence step) | blocks (every block)
    compile: bool = False  # torch.compile each block / recurrence step; the loop over r stays eager (no recompiles)
    fused_ops: str = "auto"  # gate/noise ops: auto (Triton on CUDA) | reference (plain PyTorch) | triton (forced)
    collective_timeout_s: int = 600  # a rank that stops answering makes the others fail after this long
    # a rank whose heartbeat stood still this long (frozen, or its node gone) stops the others with one line, even
    # where a collective would wait collective_timeout_s for it (NCCL): 0 turns the watch off
    heartbeat_timeout_s: float = 60
    max_bad_steps: int = 5  # consecutive non-finite steps (skipped) before the run stops
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # autocast dtype: auto (bf16 where supported, else fp32) | float32 | bfloat16
    micro_batch_size: int = 8
    grad_accum_steps: int = 60  # micro-batches per optimizer step, over all ranks together
    max_steps: int = 20000
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    log_interval: int = 10
    eval_interval: int = 500
    eval_batches: int = 20
    checkpoint_interval: int = 1000
    keep_checkpoints: int = 3
    # auto: sharded for fsdp and deepspeed, full for single and ddp. full: one state.pt gathered on rank 0 (loads
    # anywhere); sharded: torch.distributed.checkpoint, every rank writes its own shards (deepspeed: its own format)
    checkpoint_format: str = "auto"
    async_checkpoint: bool = False  # sharded torch checkpoints: write in the background (dcp.async_save)
    resume: str = "auto"  # auto: continue from the run folder's latest checkpoint | never
    threads: Optional[int] = None  # torch intra-op threads on CPU (default: torch's choice)
    # step: one depth r per optimizer step (every micro-batch of the step); micro_step: one per micro-step, drawn from
    # (seed, step, micro-step index) as the paper's Algorithm 1 draws r inside every forward. Every rank at the same
    # micro-step runs the same r (FSDP / ZeRO-3 stay in step), so which samples meet which r depends on world size.
    depth_granularity: str = "step"
    # truncated backprop through time: only the last k recurrence steps of a training forward get gradient (the
    # abstract's "truncated backpropagation"); the run's model.backprop_steps (grt, poisson). null: the model's own
    bptt_k: Optional[int] = None

    def validate(self) -> list[str]:
        p = _choice("train.backend", self.backend, ["single", "ddp", "fsdp", "deepspeed"])
        p += _choice("train.depth_granularity", self.depth_granularity, ["step", "micro_step"])
        p += _choice("train.activation_checkpointing", self.activation_checkpointing, ["none", "core_step", "blocks"])
        p += _choice("train.fused_ops", self.fused_ops, ["auto", "reference", "triton"])
        if not 0 <= self.zero_stage <= 3:
            p.append(f"train.zero_stage must be 0..3, got {self.zero_stage}")
        p += _choice("train.device", self.device, ["auto", "cpu", "cuda"])
        p += _choice("train.dtype", self.dtype, ["auto", "float32", "bfloat16"])
        p += _choice("train.resume", self.resume, ["auto", "never"])
        p += _choice("train.checkpoint_format", self.checkpoint_format, ["auto", "full", "sharded"])
        if self.backend == "deepspeed" and self.checkpoint_format == "full":
            p.append("train.checkpoint_format=full with train.backend=deepspeed: DeepSpeed writes its own sharded "
                     "format; use checkpoint_format auto or sharded, and `grt checkpoint convert RUN --to full` for "
                     "one file")
        # the raw train.deepspeed config is merged over the generated one: its stage is the one DeepSpeed runs
        zero = self.deepspeed.get("zero_optimization") if isinstance(self.deepspeed, dict) else None
        stage = zero.get("stage", self.zero_stage) if isinstance(zero, dict) else self.zero_stage
        if self.compile and self.backend == "deepspeed" and stage == 3:
            # Measured (DeepSpeed 0.19.8, torch 2.13, 2 CPU ranks, the linear layers run inside compiled graphs
            # counted as tests/compile_count_worker.py counts them): ZeRO-3's gather/release hooks on every module
            # split each compiled block into hook fragments (72 graph breaks, the recompile limit hit) and 0 of the
            # 274 linear calls of 6 training steps ran compiled (ZeRO-1/2, ddp and fsdp: all 274). The losses
            # equalled eager's because the run was eager.
            p.append("train.compile=true with train.backend=deepspeed and ZeRO stage 3: dynamo stops at ZeRO-3's "
                     "per-module parameter hooks and compiles none of the model (it would train eagerly); use "
                     "train.zero_stage=1 or 2, train.backend=fsdp, or train.compile=false")
        if self.async_checkpoint and self.resolved_checkpoint_format() != "sharded":
            p.append(f"train.async_checkpoint=true needs sharded torch checkpoints (backend single, ddp or fsdp with "
                     f"checkpoint_format sharded), got backend={self.backend}, checkpoint_format="
                     f"{self.checkpoint_format}; set train.checkpoint_format=sharded or async_checkpoint=false")
        p += _at_least(self, "train", ("micro_batch_size", "grad_accum_steps", "max_steps", "log_interval",
                                        "eval_interval", "eval_batches", "checkpoint_interval", "keep_checkpoints",
                                        "collective_timeout_s", "max_bad_steps"), 1)
        p += _at_least(self, "train", ("warmup_steps",), 0)
        if self.heartbeat_timeout_s != 0 and not self.heartbeat_timeout_s >= 3:
            p.append(f"train.heartbeat_timeout_s must be 0 (off) or >= 3 (seconds: the heartbeat beats every second), "
                     f"got {self.heartbeat_timeout_s}")
        if self.bptt_k is not None and self.bptt_k < 1:
            p.append(f"train.bptt_k must be >= 1 (or null: the model's own backprop_steps), got {self.bptt_k}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            p.append(f"train.lr={self.lr} / train.min_lr={self.min_lr}: need 0 <= min_lr <= lr and lr > 0")
        if self.grad_clip < 0:
            p.append(f"train.grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if self.weight_decay < 0:
            p.append(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        p += [f"train.{n} must be in [0, 1), got {getattr(self, n)}" for n in ("beta1", "beta2")
              if not 0.0 <= getattr(self, n) < 1.0]
        if self.threads is not None and self.threads < 1:
            p.append(f"train.threads must be >= 1 (or null: torch's choice), got {self.threads}")
        return p

    def resolved_checkpoint_format(self) -> str:
        """What a checkpoint of this run is written as: full | sharded | deepspeed (DeepSpeed's own format)."""
        if self.backend == "deepspeed":
            return "deepspeed"
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if self.backend == "fsdp" else "full"


# Downstream tasks with local task configs (pipeline/eval/tasks/), named as in lm-eval.
# `eval.analyses` names (paper Appendix E; implemented in pipeline/eval/analyses.py, which checks it has them all)
ANALYSIS_NAMES = ("steps", "bands", "deciles", "anchor_ablation", "gate_heatmaps", "similarity", "cka",
                  "gate_difficulty", "effective_rank", "gate_attribution", "projection", "attention",
                  "relative_improvement", "trace")
LOCAL_TASKS = ("lambada_openai", "hellaswag", "arc_easy", "arc_challenge", "piqa", "boolq", "winogrande")


@dataclass
class EvalConfig:
    max_steps: Optional[int] = None  # R_max for the early-exit curve; default 2R (GRT). Dense: every layer.
    val_tokens: int = 65536  # validation-token budget: the same for every run so numbers compare
    batch_size: int = 8
    diagnostics: bool = True  # the analyses of eval.analyses (false: the exit curve only)
    heatmap_prompts: list[str] = field(default_factory=lambda: [
        "The old man sat by the", "def add(a, b):\n    return a + b", "In 1492, Columbus sailed across the"])
    baseline: Optional[str] = None  # a run folder or name whose exits are overlaid (Figure 3a: dense per-layer exits)
    tasks: list[str] = field(default_factory=list)  # downstream tasks via lm-eval, e.g. [piqa, arc_easy]
    task_depths: list[int] = field(default_factory=list)  # depths to score them at (default: the trained depth)
    task_data_dir: Optional[str] = None  # laid out like shared/data/eval (default: GRT_EVAL_DATA or a shared/ above)
    task_limit: Optional[int] = None  # items per task (default: all)
    task_batch_size: int = 64
    # the forwards' arithmetic (exit curve, downstream tasks): auto (bf16 autocast + TF32 on a bf16-capable GPU, fp32
    # on the CPU) | bfloat16 | float32 (IEEE, the reference); the head's log-probabilities stay fp32 under any
    dtype: str = "auto"
    # Algorithm 1 samples eps_x / eps_g at inference too; Appendix E evaluates with noise off (the default). true: the
    # exit curve and the traced per-step analyses run with the training noise on, from the global RNG seeded with the
    # run's seed before each pass (the prompt traces, gate maps and anchor ablation stay noise-off); the results go
    # to runs/NAME/eval_noise/ and eval_noise.* metrics, beside the noise-off ones.
    noise: bool = False
    # Appendix E analyses of `grt eval` (names in pipeline.eval.analyses.ANALYSES); [default] = the cheap set, [all]
    analyses: list[str] = field(default_factory=lambda: ["default"])
    analysis_tokens: int = 4096  # tokens whose states feed CKA / effective rank (SVDs of [tokens, d] matrices)
    trace_prompts: list[str] = field(default_factory=lambda: [  # Figure 4: next-token probability at every step
        "The capital of France is", "2 + 2 =", "Once upon a time, there was a"])

    def validate(self) -> list[str]:
        p = []
        if self.analysis_tokens < 2:
            p.append(f"eval.analysis_tokens must be >= 2, got {self.analysis_tokens}")
        p += _choice("eval.dtype", self.dtype, ["auto", "float32", "bfloat16"])
        for a in self.analyses:
            if a not in ANALYSIS_NAMES + ("default", "all"):
                near = difflib.get_close_matches(a, ANALYSIS_NAMES + ("default", "all"), n=1)
                p.append(f"eval.analyses: unknown analysis {a!r}" + (f" — did you mean {near[0]!r}?" if near else
                                                                     f"; choose from {list(ANALYSIS_NAMES)}, "
                                                                     f"'default' or 'all'"))
        if self.max_steps is not None and self.max_steps < 1:
            p.append(f"eval.max_steps must be >= 1, got {self.max_steps}")
        if self.val_tokens < 1 or self.batch_size < 1 or self.task_batch_size < 1:
            p.append("eval.val_tokens, eval.batch_size and eval.task_batch_size must be >= 1")
        if any(d < 1 for d in self.task_depths):
            p.append(f"eval.task_depths must all be >= 1, got {self.task_depths}")
        if self.task_limit is not None and self.task_limit < 1:
            p.append(f"eval.task_limit must be >= 1, got {self.task_limit}")
        for t in self.tasks:
            if t not in LOCAL_TASKS:
                near = difflib.get_close_matches(t, LOCAL_TASKS, n=1)
                p.append(f"eval.tasks: unknown task {t!r}" + (f" — did you mean {near[0]!r}?" if near else
                                                              f"; the local tasks are {list(LOCAL_TASKS)}"))
        return p


@dataclass
class TrackingConfig:
    enabled: bool = True
    # MLflow's own default store (sqlite file in the working directory), so a plain `mlflow ui` run from the same
    # folder lists these runs. Any tracking URI works (http://host:5000, databricks, ...).
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "grt-pipeline"
    tags: dict = field(default_factory=dict)  # MLflow run tags, e.g. {study: ablation}; `grt compare --tag` selects by them
    system_metrics: bool = False  # CPU/memory/disk/network (and GPU with nvidia-ml-py) as system/... metrics

    def validate(self) -> list[str]:
        p = [] if self.uri else ["tracking.uri is empty"]
        if not all(isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in self.tags.items()):
            p.append(f"tracking.tags must map names to plain values, got {self.tags!r}")
        return p


@dataclass
class RunConfig:
    """The whole recipe."""

    name: str = "run"
    seed: int = 1337
    out_dir: str = "runs"  # the run folder is out_dir/name
    model: ModelConfig = field(default_factory=GRTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """``{"model.d_model": 768, ...}``: for tracker params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, obj: Any):
            if isinstance(obj, dict):
                for k, v in obj.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = json.dumps(obj) if isinstance(obj, (list, tuple)) else obj

        walk("", self.to_dict())
        return out

    def validate(self) -> list[str]:
        p = []
        if not self.name or "/" in self.name:
            p.append(f"name={self.name!r} must be a non-empty folder name without '/'")
        if not 0 <= self.seed < 2 ** 32:
            p.append(f"seed must be in 0..{2 ** 32 - 1}, got {self.seed}")
        limit = self.model.max_depth()  # dense: exit after a layer; MoR/RRT: no recursion past the last one
        deepest = max([self.eval.max_steps or 0, *self.eval.task_depths])
        if limit is not None and deepest > limit >= 1:
            p.append(f"eval.max_steps / eval.task_depths go to {deepest}, past the deepest exit of model.type="
                     f"{self.model.type} ({limit}); set them to at most {limit}")
        p += self.model.validate() + self.data.validate() + self.train.validate() + self.eval.validate()
        p += self.tracking.validate()
        return p


def _at_least(obj: Any, section: str, names: tuple[str, ...], minimum: int) -> list[str]:
    return [f"{section}.{n} must be >= {minimum}, got {getattr(obj, n)}" for n in names if getattr(obj, n) < minimum]


def _choice(key: str, value: str, allowed: list[str]) -> list[str]:
    if value in allowed:
        return []
    near = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" — did you mean '{near[0]}'?" if near else ""
    return [f"{key}={value!r} is not one of {allowed}{hint}"]


# ------------------------------------------------------------------------------------------------ YAML -> objects


def _model_classes() -> dict[str, type]:
    from pipeline.model.registry import MODEL_CONFIGS

    return MODEL_CONFIGS


def _build(cls: type, data: Any, where: str, problems: list[str]) -> Any:
    """Turn plain data into dataclass ``cls``, collecting problems instead of stopping at the first."""
    if not isinstance(data, dict):
        problems.append(f"{where or 'recipe'} must be a mapping, got {type(data).__name__}")
        return cls()
    if cls is ModelConfig or (isinstance(cls, type) and issubclass(cls, ModelConfig) and where == "model"):
        registry = _model_classes()
        mtype = data.get("type", "grt")
        if mtype not in registry:
            near = difflib.get_close_matches(str(mtype), list(registry), n=1)
            hint = f" — did you mean '{near[0]}'?" if near else ""
            problems.append(f"model.type={mtype!r} is not a registered model {sorted(registry)}{hint}")
            return GRTConfig()
        cls = registry[mtype]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else key
        if key not in fields:
            names = [f"{where}.{n}" if where else n for n in fields]
            near = difflib.get_close_matches(full, names, n=1, cutoff=0.6)
            hint = f" — did you mean '{near[0]}'?" if near else f" (valid keys: {', '.join(sorted(fields))})"
            problems.append(f"unknown key '{full}'{hint}")
            continue
        kwargs[key] = _coerce(hints[key], value, full, problems)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where} must be a mapping, got {value!r}")
            return {}
        return value
    if origin is list:
        if isinstance(value, str) and args and args[0] is str:  # `eval.analyses=all`: a list of one
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where} must be a list, got {value!r}")
            return []
        return [_coerce(args[0], v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where} must be true or false, got {value!r}")
        return bool(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            problems.append(f"{where} must be an integer, got {value!r}")
            return 0
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where} must be a number, got {value!r}")
            return 0.0
        if not math.isfinite(value):  # every float key: a NaN or infinity passes every range check below
            problems.append(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where} must be a string, got {value!r}")
        return str(value)
    return value


def _resolve_bptt(cfg: RunConfig, data: dict) -> list[str]:
    """train.bptt_k is the run-level name of truncated backprop: it becomes model.backprop_steps of the models that
    truncate (grt, poisson), so the model reads one field whichever key the recipe used."""
    k = cfg.train.bptt_k
    if k is None or k < 1:
        return []
    if not hasattr(cfg.model, "backprop_steps"):
        return [f"train.bptt_k={k}: model.type={cfg.model.type} has no truncated backprop (grt and poisson do); "
                f"remove train.bptt_k"]
    model = data.get("model") if isinstance(data, dict) else None
    given = model.get("backprop_steps") if isinstance(model, dict) else None
    if given is not None and given != k:
        return [f"train.bptt_k={k} and the recipe's model.backprop_steps={given} disagree: they are the same k; "
                f"set model.backprop_steps={k} instead of train.bptt_k, or remove backprop_steps from the model "
                f"section"]
    cfg.model.backprop_steps = k
    return []


def from_dict(data: dict, source: str = "recipe") -> RunConfig:
    problems: list[str] = []
    cfg = _build(RunConfig, data, "", problems)
    problems += _resolve_bptt(cfg, data)
    # Validate even when the structure had problems, so that the user sees everything at once; skip messages about
    # keys already reported (their values were replaced by placeholders).
    reported = {m.split("'")[1] if m.startswith("unknown key") else m.split(" ")[0] for m in problems}
    problems += [m for m in cfg.validate() if not any(m.startswith(k) for k in reported)]
    if problems:
        raise RecipeError(problems, source)
    return cfg


def load_recipe(path: str | Path, overrides: list[str] | None = None,
                data: str | Path | None = None) -> RunConfig:
    """Recipe file (+ data recipe) + overrides -> validated :class:`RunConfig` (raises :class:`RecipeError` listing
    all problems).

    ``data`` names a data recipe (``recipes/data/*.yaml``: a ``data:`` section and optionally ``base:``). Its section
    *replaces* the recipe's whole ``data:`` section after both files' bases are resolved — a merge would keep the
    recipe's own sources next to the new ones — and the run name gets the data recipe's file stem appended, so the
    same model on other data is another run. Overrides apply last and win over both.
    """
    recipe = load_yaml_with_bases(path)
    source = str(path)
    if data is not None:
        section = load_yaml_with_bases(data, example="recipes/data/openwebtext.yaml")
        extra = sorted(k for k in section if k != "data")
        problems = [f"found '{k}': a data recipe holds only a 'data:' section (and 'base:'); move '{k}' to the "
                    f"recipe or set it with a command-line override" for k in extra]
        if "data" not in section:
            problems.append("no 'data:' section: write the sources under 'data:' (see recipes/data/)")
        if problems:
            raise RecipeError(problems, str(data))
        recipe["data"] = section["data"]
        recipe["name"] = f"{recipe.get('name', RunConfig.name)}-{Path(data).stem}"
        source = f"{path} --data {data}"
    recipe, problems = apply_overrides(recipe, list(overrides or []))
    if problems:
        raise RecipeError(problems, source)
    cfg = from_dict(recipe, source)
    problems = path_problems(cfg)
    if problems:
        raise RecipeError(problems, source)
    return cfg


def path_problems(cfg: RunConfig) -> list[str]:
    """The recipe's folders that a file blocks, one line each."""
    folders = [("out_dir", cfg.out_dir), ("out_dir/name", cfg.run_dir), ("data.dataset_dir", cfg.data.dataset_dir)]
    folders += [(f"data.mixture[{i}].dataset_dir", m.dataset_dir) for i, m in enumerate(cfg.data.mixture)]
    if cfg.eval.task_data_dir:
        folders.append(("eval.task_data_dir", cfg.eval.task_data_dir))
    if sqlite_file(cfg.tracking.uri) is not None:  # the MLflow database file's folder
        folders.append(("tracking.uri", sqlite_file(cfg.tracking.uri).parent, cfg.tracking.uri))
    problems = [p for key, path, *value in folders if (p := folder_problem(key, path, *value))]
    if len(problems) > 1 and problems[0].startswith("out_dir=") and problems[1].startswith("out_dir/name="):
        del problems[1]  # the same file in the way
    return problems


def config_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
