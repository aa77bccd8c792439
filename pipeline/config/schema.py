"""The recipe schema: the sections of a run (data, train, eval, tracking) and :class:`RunConfig`, each validated by its
own ``validate()``. The ``model:`` section's classes are :mod:`pipeline.model.configs`, chosen by ``model.type``."""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Optional

from pipeline.config.recipe_files import flat
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import ModelConfig
from pipeline.model.configs import at_least
from pipeline.model.configs import choice
from pipeline.runtime import storage
from pipeline.tokenize.tokenizers import pattern_problems
from pipeline.train.branch_budgets import budget_problems
from pipeline.train.branch_budgets import merge_keep_steps
from pipeline.train.curriculum import batch_ramp_problems
from pipeline.train.curriculum import depth_schedule_problems
from pipeline.train.in_loop_tasks_check import eval_task_problems
from pipeline.train.schedule import schedule_problems


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
        p = choice(f"{where}.kind", self.kind, ["files", "hf", "stdlib"])
        p += choice(f"{where}.text_mode", self.text_mode, ["file", "paragraphs"])
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
    tokenizer: str = "gpt2"  # gpt2 | a Hugging Face tokenizer.json | a tiktoken .tiktoken file (tokenize/tokenizers.py)
    # A tiktoken file's split pattern: an encoding's name (r50k_base, cl100k_base, o200k_base, ...) or a regex. Needed
    # only for a file that is not one of tiktoken's public encodings (those bring their own).
    tiktoken_pattern: Optional[str] = None
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
    # Attention stays inside each document of a window and positions restart at each document (the loader reads
    # document starts from the shards' .idx files, EOS where a dataset has none; see pipeline/train/data.py).
    # false: a window is one sequence, as GPT-2 and the paper train.
    document_masking: bool = False

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
        if self.tokenizer != "gpt2" and not self.tokenizer.endswith((".json", ".tiktoken")):  # see tokenizers.py
            p.append(f"data.tokenizer={self.tokenizer!r}: give 'gpt2', a Hugging Face tokenizer.json path (*.json) or "
                     f"a tiktoken BPE file (*.tiktoken)")
        else:
            p += pattern_problems(self.tokenizer, self.tiktoken_pattern)
        p += choice("data.verify", self.verify, ["size", "full"])
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
class SpikeConfig:
    """``train.spike``: the loss-spike defence (pipeline/train/spike.py). A step's loss above the mean of the last
    ``window`` good steps' losses by more than ``threshold`` standard deviations is a spike, judged once the window
    holds ``min_steps`` losses. off (default): nothing is judged | skip: the step's update is not taken | rollback: as
    skip, and ``rollback_after`` spikes within ``rollback_within`` steps reload the newest checkpoint, the spiky
    steps' micro-batches skipped | stop: the run stops at the first spike, before its update. Under skip or rollback,
    ``max_consecutive`` spikes in a row (no update taken between them) stop the run: the window holds only good
    steps' losses, so after a lasting rise of the loss it would otherwise skip every step for ever."""

    action: str = "off"
    window: int = 128
    threshold: float = 6.0
    min_steps: int = 20
    rollback_after: int = 3
    rollback_within: int = 100
    # this many spikes in a row stop the run: the loss moved, and the window cannot follow. null: 20 (null, so that
    # a recipe saved before the key existed reads as unchanged)
    max_consecutive: Optional[int] = None

    def validate(self, backend: str) -> list[str]:
        p = choice("train.spike.action", self.action, ["off", "skip", "rollback", "stop"])
        p += at_least(self, "train.spike", ("window", "rollback_after", "rollback_within"), 1)
        if self.max_consecutive is not None and not (isinstance(self.max_consecutive, int) and self.max_consecutive
                                                     >= 1):
            p.append(f"train.spike.max_consecutive must be an integer >= 1 or null (20), got {self.max_consecutive!r}")
        elif self.action == "rollback" and (self.max_consecutive or 20) <= self.rollback_after:
            p.append(f"train.spike.max_consecutive={self.max_consecutive or 20} is not above rollback_after="
                     f"{self.rollback_after}: spikes in a row would stop the run before any rollback; raise it")
        p += at_least(self, "train.spike", ("min_steps",), 2)
        if self.min_steps > self.window:
            p.append(f"train.spike.min_steps={self.min_steps} is more than train.spike.window={self.window}: the "
                     f"window never holds that many losses; lower min_steps or raise window")
        if not self.threshold > 0:
            p.append(f"train.spike.threshold must be > 0 (standard deviations), got {self.threshold}")
        if backend == "deepspeed" and self.action in ("skip", "rollback"):
            p.append(f"train.spike.action={self.action} with train.backend=deepspeed: the DeepSpeed engine has "
                     f"counted the step's accumulation window before the loss is known and cannot drop the update; "
                     f"use train.spike.action=stop, or train.backend=ddp / fsdp")
        return p


@dataclass
class TrainConfig:
    backend: str = "single"  # single | ddp | fsdp | deepspeed (launch the last three with torchrun)
    # fsdp: world (shard over all ranks) | node (shard within a node, replicate across nodes: HSDP) | N ranks per
    # shard group; see pipeline/train/mesh.py
    fsdp_shard: object = "world"
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
    # cosine | wsd | constant | linear, each after the same warm-up (formulas: pipeline/train/schedule.py); wsd
    # decays over the last decay_steps (or decay_fraction of max_steps) with decay_shape linear|cosine|sqrt|1-sqrt
    lr_schedule: str = "cosine"
    decay_fraction: Optional[float] = None
    decay_steps: Optional[int] = None
    decay_shape: str = "linear"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # auxiliary z-loss: + z_loss * mean over predicted tokens of logsumexp(logits)^2, in training forwards only
    # (pipeline/model/z_loss.py; PaLM used 1e-4); 0: off, the loss and its code path unchanged
    z_loss: float = 0.0
    log_interval: int = 10
    eval_interval: int = 500
    eval_batches: int = 20
    # the loss at every exit and val_bpb at each eval, eval_curve.png (pipeline/train/in_loop_eval.py); off: as before
    eval_exits: bool = False
    eval_budget: Optional[float] = None  # its share of training time (eval batches cut to fit); null: no cap
    # downstream tasks scored at each eval through grt eval's lm-eval adapter (pipeline/train/in_loop_tasks.py), the
    # first eval_task_limit items of each (null: 100), at eval.task_depths from eval.task_data_dir; null or []: none
    # (null defaults: an old run's recipe reads as unchanged on resume)
    eval_tasks: Optional[list] = None
    eval_task_limit: Optional[int] = None
    checkpoint_interval: int = 1000
    keep_checkpoints: int = 3
    keep_steps: list = field(default_factory=list)  # steps always checkpointed and never pruned (branch points)
    branch_from: Optional[str] = None  # a checkpoint folder a new run starts from exactly (`grt branch` sets it)
    # smaller budgets (steps) that `grt sweep` branches off this stable wsd run, each decaying to end there; their
    # branch points join keep_steps (pipeline/train/branch_budgets.py); null: none (unset: old runs' recipes match)
    branch_budgets: Optional[list] = None
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
    # tokens per step ramped over steps: [[until_step, grad_accum_steps], ...] (steps 1..until_step use that many
    # micro-batches over all ranks, the steps after the last stage grad_accum_steps); null: no ramp
    # (pipeline/train/curriculum.py)
    batch_ramp: Optional[list] = None
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # the loss-spike defence (off by default)

    def __post_init__(self):
        merge_keep_steps(self)  # branch_budgets' branch points are kept checkpoints

    def validate(self) -> list[str]:
        p = choice("train.backend", self.backend, ["single", "ddp", "fsdp", "deepspeed"])
        fs = self.fsdp_shard
        if fs not in ("world", "node") and (not isinstance(fs, int) or isinstance(fs, bool) or fs < 1):
            p.append(f"train.fsdp_shard must be world, node or a positive number of ranks per shard group, got {fs!r}")
        elif self.fsdp_shard != "world" and self.backend != "fsdp":
            p.append(f"train.fsdp_shard={self.fsdp_shard} shards FSDP2 only; set train.backend=fsdp or remove it")
        if self.eval_budget is not None and not 0 < self.eval_budget <= 1:
            p.append(f"train.eval_budget must be in (0, 1] (a share of training time) or null, got {self.eval_budget}")
        if self.eval_budget is not None and not self.eval_exits:
            p.append("train.eval_budget only applies to train.eval_exits=true (the in-loop exit eval); remove it or "
                     "set eval_exits: true")
        p += eval_task_problems(self, LOCAL_TASKS)
        p += choice("train.depth_granularity", self.depth_granularity, ["step", "micro_step"])
        p += batch_ramp_problems(self)
        p += schedule_problems(self)
        p += budget_problems(self)
        p += self.spike.validate(self.backend)
        p += choice("train.activation_checkpointing", self.activation_checkpointing, ["none", "core_step", "blocks"])
        p += choice("train.fused_ops", self.fused_ops, ["auto", "reference", "triton"])
        if not 0 <= self.zero_stage <= 3:
            p.append(f"train.zero_stage must be 0..3, got {self.zero_stage}")
        p += choice("train.device", self.device, ["auto", "cpu", "cuda"])
        p += choice("train.dtype", self.dtype, ["auto", "float32", "bfloat16"])
        p += choice("train.resume", self.resume, ["auto", "never"])
        p += choice("train.checkpoint_format", self.checkpoint_format, ["auto", "full", "sharded"])
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
        p += at_least(self, "train", ("micro_batch_size", "grad_accum_steps", "max_steps", "log_interval",
                                        "eval_interval", "eval_batches", "checkpoint_interval", "keep_checkpoints",
                                        "collective_timeout_s", "max_bad_steps"), 1)
        p += at_least(self, "train", ("warmup_steps",), 0)
        if self.heartbeat_timeout_s != 0 and not self.heartbeat_timeout_s >= 3:
            p.append(f"train.heartbeat_timeout_s must be 0 (off) or >= 3 (seconds: the heartbeat beats every second), "
                     f"got {self.heartbeat_timeout_s}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            p.append(f"train.lr={self.lr} / train.min_lr={self.min_lr}: need 0 <= min_lr <= lr and lr > 0")
        if self.grad_clip < 0:
            p.append(f"train.grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if not self.z_loss >= 0:
            p.append(f"train.z_loss must be >= 0 (0 turns the z-loss off; PaLM used 1e-4), got {self.z_loss}")
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


@dataclass(frozen=True)
class Analysis:
    needs: str  # "exits": any model (reads the exit curve / exit_states); "grt": GRT's step trace; "gate": + a gate
    default: bool  # in eval.analyses=[default]
    what: str


# `eval.analyses`: the paper's Appendix E analyses, in the order they run (pipeline/eval/analyses/suite.py runs them)
ANALYSES = {
    "steps": Analysis("grt", True, "E.2/E.3: gate mean/std/saturation, rho (Eq. 3) and |Δh|/|o|, δ_fp (Eq. 4), norms"),
    "bands": Analysis("exits", True, "E.10: loss per target-token frequency band at every exit"),
    "deciles": Analysis("exits", True, "E.5: loss per r=0 difficulty decile, improvement to R (and to the last exit)"),
    "relative_improvement": Analysis("exits", True, "E.10: Δ_rel(r) = (L_(r-1) - L_r) / L_(r-1), overall and per band"),
    # six more forwards over every validation token (the head's vocabulary-sized work each time): ~2x the exit curve
    "anchor_ablation": Analysis("grt", False, "Table 11: h_pre replaced by zeros / embedding / h^(r-1); gate forced"),
    "gate_heatmaps": Analysis("gate", True, "Figure 8: per-token gate mean per step for eval.heatmap_prompts"),
    "similarity": Analysis("grt", True, "E.3: cos(h^(r), h^(r-1)), cos(o^(r), h^(r-1)), step gain |Δh^(r)|/|Δh^(r-1)|"),
    "cka": Analysis("grt", False, "E.4: linear CKA between step states, and vs eval.baseline's dense layers"),
    "gate_difficulty": Analysis("gate", True, "E.5: per-token gate mean vs r=0 loss: Pearson r, R² per step"),
    "effective_rank": Analysis("grt", True, "E.6: effective rank of the state and of its update at every step"),
    "gate_attribution": Analysis("gate", True, "E.7: gate first-layer variance from state vs anchor; weight spectra"),
    "projection": Analysis("grt", True, "E.8: W_proj / f_g halves: spectra, effective rank, norms, row cosine"),
    "attention": Analysis("grt", False, "E.9: attention entropy per head and step, head classes"),
    "trace": Analysis("exits", True, "Figure 4: next-token probability of the top candidates at every exit"),
}
ANALYSIS_NAMES = tuple(ANALYSES)
# Downstream tasks with local task configs (pipeline/eval/lm_eval/tasks/), named as in lm-eval.
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
    # Appendix E analyses of `grt eval` (names in ANALYSES above); [default] = the cheap set, [all]
    analyses: list[str] = field(default_factory=lambda: ["default"])
    analysis_tokens: int = 4096  # tokens whose states feed CKA / effective rank (SVDs of [tokens, d] matrices)
    trace_prompts: list[str] = field(default_factory=lambda: [  # Figure 4: next-token probability at every step
        "The capital of France is", "2 + 2 =", "Once upon a time, there was a"])
    # the validation windows' length for the exit curve and val_loss (default model.block_size); longer than trained
    # needs positions that extrapolate (model.block: llama, rotary); the gpt2 block's learned ones stop at block_size.
    # Another length than trained writes runs/NAME/eval_ctxN/ and eval_ctxN.* metrics, beside the run's own eval/.
    block_size: Optional[int] = None
    # loss against context length: the loss at the trained depth on validation windows of each of these lengths (and
    # of model.block_size), printed one line per length and saved as "context" in exits.json; [] = none
    context_lengths: list[int] = field(default_factory=list)

    def validate(self) -> list[str]:
        p = []
        if self.analysis_tokens < 2:
            p.append(f"eval.analysis_tokens must be >= 2, got {self.analysis_tokens}")
        p += choice("eval.dtype", self.dtype, ["auto", "float32", "bfloat16"])
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
        if (self.block_size is not None and self.block_size < 1) or any(n < 1 for n in self.context_lengths):
            p.append(f"eval.block_size and eval.context_lengths must be >= 1, got {self.block_size}, "
                     f"{self.context_lengths}")
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
    # MLflow run tags, e.g. {study: ablation}; `grt compare --tag` selects by them
    tags: dict = field(default_factory=dict)
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
        """The run folder this process works in: ``out_dir/name``, or for an ``out_dir`` on object storage this
        node's working copy of :attr:`run_url` (the store keeps the run: docs/object-storage.md)."""
        if storage.is_remote(self.out_dir):
            return storage.local_copy(self.run_url)
        return Path(self.out_dir) / self.name

    @property
    def run_url(self) -> str | None:
        """``out_dir/name`` on object storage (``s3://...``); None for a run folder on a filesystem."""
        return storage.join(self.out_dir, self.name) if storage.is_remote(self.out_dir) else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """``{"model.d_model": 768, ...}``: for tracker params; a list is one JSON string, an empty dict no key."""
        return {k: json.dumps(v) if isinstance(v, (list, tuple)) else v
                for k, v in flat(self.to_dict()).items() if not (isinstance(v, dict) and not v)}

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
        longest = max([self.eval.block_size or 0, *self.eval.context_lengths])
        if self.model.block == "gpt2" and longest > self.model.block_size:
            p.append(f"eval.block_size / eval.context_lengths go to {longest}, past model.block_size="
                     f"{self.model.block_size}: the gpt2 block's learned positions stop there (the llama block's "
                     f"rotary ones do not); set them to at most {self.model.block_size}")
        p += self.model.validate() + self.data.validate() + self.train.validate() + self.eval.validate()
        p += depth_schedule_problems(self.model)
        p += self.tracking.validate()
        return p


def config_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
