"""In-loop evaluation at every depth (``train.eval_exits``): at each ``train.eval_interval``, beside the validation
loss, the loss at every exit (the same :func:`~pipeline.eval.exit_losses.exit_curve` as ``grt eval``), bits per byte
from the tokenizer's byte lengths, and ``runs/NAME/eval_curve.png`` redrawn.

Sharded by batch: rank k scores validation batches k, k + W, ...; one all-reduce of the sums. ``train.eval_budget``
caps its wall time at that share of the training time between two evals: the batches are cut to fit (said once).
"""
from __future__ import annotations

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


def byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes of every token id (ids past the tokenizer's vocabulary, padding: 0)."""
    n = min(tokenizer.n_vocab, vocab_size)
    return torch.tensor([len(tokenizer.token_bytes(t)) for t in range(n)] + [0] * (vocab_size - n), dtype=torch.long)


def bits_per_byte(loss_nats_sum: float, n_bytes: int) -> float:
    """Summed cross-entropy in nats over the bytes those tokens spell, in bits."""
    return loss_nats_sum / math.log(2) / n_bytes


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
        self.bytes = self._byte_table()
        self._since = time.perf_counter()  # the training time between evals, for train.eval_budget

    def _byte_table(self) -> torch.Tensor | None:
        from pipeline.tokenize.tokenizers import dataset_tokenizer
        try:
            return byte_lengths(dataset_tokenizer(self.cfg), self.cfg.model.vocab_size)
        except (OSError, ValueError) as e:  # no tokenizer to count bytes with: bpb is skipped, said once
            if self.backend.is_main:
                print(f"note: val_bpb skipped (no tokenizer to count bytes: {e})", file=sys.stderr, flush=True)
            return None

    def run(self, trainer) -> dict:
        """Score this rank's share of the validation batches at every exit, reduce once, log and plot."""
        t0 = time.perf_counter()
        train_s = t0 - self._since
        cfg, world, rank = self.cfg, self.backend.world_size, self.backend.rank
        batches = list(validation_batches(trainer.val_data, cfg.model.block_size, cfg.train.micro_batch_size,
                                          max_batches=self.max_batches, vocab_size=cfg.model.vocab_size,
                                          document_masking=cfg.data.document_masking))
        mine = batches[rank::world]
        n_bytes = sum(int(self.bytes[b[1].reshape(-1).clamp(min=0)].sum()) for b in mine) if self.bytes is not None \
            else 0
        model = trainer.raw_model
        sums = torch.zeros(len(self.exits) + 2, dtype=torch.float64)
        if mine:
            with routing(model, "topk"):
                curve = exit_curve(model, mine, self.exits, self.ref, trainer.device, dtype=cfg.eval.dtype)
            model.train()
            sums[:-2] = torch.tensor(curve["loss"], dtype=torch.float64) * curve["val_tokens"]
            sums[-2], exits = curve["val_tokens"], curve["exit"]
        else:
            exits = sorted(set(self.exits) | {self.ref})
        sums[-1] = n_bytes
        if world > 1 and dist.is_initialized():  # one reduction: every rank's sums (gloo on the CPU)
            dist.all_reduce(sums)
        tokens, total_bytes = sums[-2].item(), sums[-1].item()
        losses = (sums[:-2] / tokens).tolist()
        out = {"exit": exits, "exit_loss": losses, "exit_tokens": int(tokens)}
        ref_sum = sums[exits.index(self.ref)].item()
        if self.bytes is not None and total_bytes > 0:
            out["val_bpb"] = bits_per_byte(ref_sum, int(total_bytes))
        self._fit_budget(time.perf_counter() - t0, train_s, len(batches))
        out["exit_eval_s"] = time.perf_counter() - t0
        if self.backend.is_main:
            self.history.append((trainer.step, exits, losses))
            plot_history(self.history, trainer.run_dir / "eval_curve.png", cfg.model.type)
        self._since = time.perf_counter()
        return out

    def _fit_budget(self, eval_s: float, train_s: float, n_batches: int) -> None:
        """train.eval_budget: fewer batches next time when this eval took more than its share (said once)."""
        share = self.cfg.train.eval_budget
        if share is None or n_batches == 0 or eval_s <= share * train_s:
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
