"""In-loop evaluation at every depth (``train.eval_exits``): at each ``train.eval_interval``, beside the validation
loss, the loss at every exit (the same :func:`~pipeline.eval.exit_losses.exit_curve` as ``grt eval``), bits per byte
from the tokenizer's byte lengths, and ``runs/NAME/eval_curve.png`` redrawn.

Sharded by batch: rank k scores validation batches k, k + W, ...; one all-reduce of the sums. Under FSDP and ZeRO-3
the parameters are sharded too (:func:`gathered`, :func:`head`): the blocks gather in their own forwards, and a rank
with fewer batches runs uncounted padding forwards so that every rank runs as many (each forward is a sequence of
all-gathers every rank must join). bpb follows nanochat: special targets (EOS, ...) count 0 bytes and no nats.
``train.eval_budget`` caps its wall time at that share of the training time between two evals: the batches are cut
to fit (said once). After a resume the curve's history is read back from metrics.jsonl (up to the resumed step).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time

import torch
import torch.distributed as dist

from pipeline.eval.analyses.methods import routing
from pipeline.eval.exit_losses import exit_curve
from pipeline.eval.exit_losses import exit_range
from pipeline.model import model_class
from pipeline.train.data import validation_batches


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special token ids: EOS, BOS and any other it registers as special (HF, tiktoken)."""
    ids = {i for i in (getattr(tokenizer, "eos_id", None), getattr(tokenizer, "bos_id", None)) if i is not None}
    impl = getattr(tokenizer, "impl", None)
    if hasattr(impl, "get_added_tokens_decoder"):  # tokenizers (HF): the added tokens marked special
        ids |= {i for i, t in impl.get_added_tokens_decoder().items() if t.special}
    ids |= set(getattr(impl, "_special_tokens", {}).values())  # tiktoken
    return ids


def byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes of every token id; 0 for special tokens (an ``<|endoftext|>`` spells no text) and for ids past the
    tokenizer's vocabulary (padding)."""
    n = min(tokenizer.n_vocab, vocab_size)
    special = special_ids(tokenizer)
    return torch.tensor([0 if t in special else len(tokenizer.token_bytes(t)) for t in range(n)] +
                        [0] * (vocab_size - n), dtype=torch.long)


def bits_per_byte(loss_nats_sum: float, n_bytes: int) -> float:
    """Summed cross-entropy in nats over the bytes those tokens spell, in bits."""
    return loss_nats_sum / math.log(2) / n_bytes


def zero3(backend) -> bool:
    """DeepSpeed at ZeRO stage 3: the parameters partitioned across ranks."""
    return backend.name == "deepspeed" and backend.cfg.zero_stage == 3


@contextlib.contextmanager
def gathered(model, backend):
    """The parameters the exit pass uses outside their modules' forwards, gathered for the duration; the blocks
    gather in their own forwards as in training. FSDP2: the root's (embeddings, head, final norm). ZeRO-3: the
    model's own (its submodules' are fetched by their forward hooks; the head's weight per batch, :func:`head`).
    Anything else: as it is."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule):
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
    elif zero3(backend) and list(model.parameters(recurse=False)):
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(model.parameters(recurse=False)), modifier_rank=None):
            yield
    else:
        yield


def head(model, backend):
    """ZeRO-3: each batch's head reads the LM head's weight gathered (every rank gathers it: padded batches pair
    up); None elsewhere (the weight read once, as ``grt eval`` does)."""
    if not zero3(backend):
        return None
    import deepspeed
    return lambda: deepspeed.zero.GatheredParameters([model.lm_head.weight], modifier_rank=None)


def eval_history(metrics_path, up_to_step: int) -> list[tuple[int, list[int], list[float]]]:
    """The (step, exits, losses) of the evals metrics.jsonl holds at steps <= ``up_to_step`` (a resumed run's past;
    a discarded future after a rollback is left out), the last row of a step winning."""
    rows = {}
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a kill: skipped
                continue
            if "exit_loss" in row and row.get("step", up_to_step + 1) <= up_to_step:
                rows[row["step"]] = (row["step"], row["exit"], row["exit_loss"])
    return [rows[s] for s in sorted(rows)]


class InLoopEval:
    """The exit curve and bpb of the model being trained; :meth:`run` returns the metrics to add to the eval's."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.cfg, self.backend = cfg, trainer.backend
        self.exits = exit_range(cfg)
        self.ref = model_class(cfg.model.type).full_depth(cfg.model)
        self.history: list[tuple[int, list[int], list[float]]] = []
        self.max_batches = cfg.train.eval_batches
        self.cut_said = False
        self.bytes = self._byte_table()  # UTF-8 bytes per id, 0 for special tokens (their targets left out of bpb)
        self._since = time.perf_counter()  # the training time between evals, for train.eval_budget

    def _byte_table(self) -> torch.Tensor | None:
        from pipeline.tokenize.tokenizers import dataset_tokenizer
        try:
            return byte_lengths(dataset_tokenizer(self.cfg), self.cfg.model.vocab_size)
        except (OSError, ValueError) as e:  # no tokenizer to count bytes with: bpb is skipped, said once
            if self.backend.is_main:
                print(f"note: val_bpb skipped (no tokenizer to count bytes: {e})", file=sys.stderr, flush=True)
            return None

    def resumed(self, trainer) -> None:
        """After a resume: the curve's history from metrics.jsonl, the evals up to the resumed step."""
        if self.backend.is_main:
            self.history = eval_history(trainer.run_dir / "metrics.jsonl", trainer.step)

    def run(self, trainer) -> dict:
        """Score this rank's share of the validation batches at every exit, reduce once, log and plot."""
        t0 = time.perf_counter()
        train_s = t0 - self._since
        cfg, world, rank = self.cfg, self.backend.world_size, self.backend.rank
        batches = list(validation_batches(trainer.val_data, cfg.model.block_size, cfg.train.micro_batch_size,
                                          max_batches=self.max_batches, vocab_size=cfg.model.vocab_size,
                                          document_masking=cfg.data.document_masking))
        mine = batches[rank::world]
        model = trainer.raw_model
        # sharded parameters: every rank runs ceil(n / W) forwards (the all-gathers pair up), the extra ones uncounted
        sharded = self.backend.name == "fsdp" or zero3(self.backend)
        padding = -(-len(batches) // world) - len(mine) if sharded else 0
        sums = torch.zeros(len(self.exits) + 3, dtype=torch.float64)  # exits' nats, tokens, bytes, bpb's nats
        exits = sorted(set(self.exits) | {self.ref})
        with routing(model, "topk"), gathered(model, self.backend):
            if mine:
                curve = exit_curve(model, mine, self.exits, self.ref, trainer.device, dtype=cfg.eval.dtype,
                                   keep_tokens=self.bytes is not None, head=head(model, self.backend))
                sums[:-3] = torch.tensor(curve["loss"], dtype=torch.float64) * curve["val_tokens"]
                sums[-3], exits = curve["val_tokens"], curve["exit"]
                if self.bytes is not None:  # special targets: 0 bytes, and their nats left out (nanochat's bpb)
                    n_bytes = self.bytes[curve["token_ids"].clamp(min=0)]
                    sums[-2] = n_bytes.sum()
                    sums[-1] = curve["token_losses"][:, exits.index(self.ref)][n_bytes > 0].double().sum()
            if padding:
                exit_curve(model, batches[:1] * padding, self.exits, self.ref, trainer.device, dtype=cfg.eval.dtype,
                           head=head(model, self.backend))
        model.train()
        if world > 1 and dist.is_initialized():  # one reduction: every rank's sums (gloo on the CPU)
            dist.all_reduce(sums)
        tokens, total_bytes = sums[-3].item(), sums[-2].item()
        losses = (sums[:-3] / tokens).tolist()
        out = {"exit": exits, "exit_loss": losses, "exit_tokens": int(tokens)}
        if self.bytes is not None and total_bytes > 0:
            out["val_bpb"] = bits_per_byte(sums[-1].item(), int(total_bytes))
        self._fit_budget(time.perf_counter() - t0, train_s, len(batches))
        out["exit_eval_s"] = time.perf_counter() - t0
        if self.backend.is_main:  # (a rollback re-runs steps: their old evals make way)
            self.history = [h for h in self.history if h[0] < trainer.step] + [(trainer.step, exits, losses)]
            plot_history(self.history, trainer.run_dir / "eval_curve.png", cfg.model.type)
        self._since = time.perf_counter()
        return out

    def _fit_budget(self, eval_s: float, train_s: float, n_batches: int) -> None:
        """train.eval_budget: fewer batches next time when this eval took more than its share (said once)."""
        share = self.cfg.train.eval_budget
        if share is None:
            return
        # every rank the same decision (each its own clock): else the ranks would score different batch counts, and
        # under FSDP / ZeRO-3 their forwards would no longer pair up
        eval_s, train_s = self.backend.reduce_max(eval_s), self.backend.reduce_max(train_s)
        if n_batches == 0 or eval_s <= share * train_s:
            return
        per_batch = eval_s / n_batches
        fit = max(self.backend.world_size, int(share * train_s / per_batch))
        if fit < n_batches:
            self.max_batches = fit
            if self.backend.is_main and not self.cut_said:
                print(f"note: in-loop eval took {eval_s:.2f} s against {train_s:.2f} s of training "
                      f"(train.eval_budget={share}): cut to {fit} validation batches", file=sys.stderr, flush=True)
                self.cut_said = True


def plot_history(history, path, model_type: str) -> None:
    """Loss against exit, one line per eval step (matplotlib, headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for step, exits, losses in history:
        ax.plot(exits, losses, marker=".", label=f"step {step}")
    ax.set_xlabel("exit (layer)" if model_type == "dense" else "exit (recurrence step)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize="small")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
