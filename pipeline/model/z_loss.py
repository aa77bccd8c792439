"""``train.z_loss``: the auxiliary term c * mean over predicted tokens of logsumexp(logits)^2 (PaLM, OLMo-core), a
training term only. It keeps the log-partition function near 0, which damps the logit drift behind loss spikes.

How the coefficient reaches the loss: the trainer writes it on the model's LM head (``lm_head.z_loss``, like the
``n_vocab`` the head already carries), and the fused head (:func:`ops.linear_cross_entropy`) adds the term only while
the head is in training mode. So the loss stays pure cross-entropy in validation (``model.eval()``), in ``grt eval``
and lm-eval (a freshly built model has no coefficient), and nothing is passed through ``forward``: a plain Python
attribute of a module, it survives FSDP2 (sharding swaps parameters, not modules), DeepSpeed and DDP (they wrap the
same module objects), and torch.compile (blocks are compiled; the head and its loss run eagerly).

Each training forward leaves its term, detached, on the head (``lm_head.z_term``, the value added to the loss); the
trainer takes it per micro-step (:class:`ZLossMeter`), so the logged ``loss`` stays the objective without it.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def coefficient(lm_head: nn.Module) -> float:
    """The z-loss coefficient of this forward: the trainer's ``train.z_loss`` in training mode, else 0."""
    return getattr(lm_head, "z_loss", 0.0) if lm_head.training else 0.0


def new_buffer(targets: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Where the fused head writes each token's lse^2 (``z_out``), in the loss's accumulation dtype."""
    return torch.empty(targets.shape, dtype=torch.promote_types(h.dtype, torch.float32), device=targets.device)


def record(lm_head: nn.Module, coef: float, z: torch.Tensor, targets: torch.Tensor,
           weights: torch.Tensor | None = None) -> None:
    """Leave c * mean over predicted tokens of lse^2 on the head, detached. ``z``: lse^2 per token (0 where ignored),
    or per token and exit [..., n] with ``weights`` (Ouro's p_t) summing over the exits as the loss does."""
    with torch.no_grad():
        if weights is not None:
            z = (weights.to(z.dtype) * z).sum(-1)
        valid = targets != -1
        lm_head.z_term = coef * z.sum().double() / valid.sum().clamp(min=1)


class ZLossMeter:
    """The trainer's side: sets the coefficient on the model, and per step sums the micro-steps' z terms."""

    def __init__(self, model: nn.Module, coef: float):
        self.head, self.coef, self.total = model.lm_head, coef, None
        if coef:
            self.head.z_loss = coef

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-step's loss without its z term (detached; just ``loss.detach()`` when z-loss is off)."""
        if not self.coef:
            return loss.detach()
        z, self.head.z_term = getattr(self.head, "z_term", None), None
        if z is None:
            raise RuntimeError("train.z_loss is on but the training forward left no z term: its loss does not go "
                               "through the fused head (pipeline/model/z_loss.py)")
        self.total = z if self.total is None else self.total + z
        return loss.detach().double() - z

    def step_metrics(self, backend, accum: int) -> dict:
        """{"z_loss": the step's mean term over micro-steps and ranks} when on, else {}."""
        if not self.coef:
            return {}
        total, self.total = self.total.item(), None
        return {"z_loss": backend.reduce_mean(total / accum)}
