"""The GRT gated state update, plain PyTorch reference.

    g  = sigmoid(z / tau + eps_g),  eps_g ~ N(0, sigma_g^2) per element (training only)
    h' = g * h + (1 - g) * o

This module is the single entry point the model calls; fused Triton kernels (a later issue) plug in behind it and
are tested against :func:`gated_update_reference`.
"""
from __future__ import annotations

import torch


def gated_update_reference(z: torch.Tensor, h: torch.Tensor, o: torch.Tensor, tau: float = 1.0,
                           sigma_g: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (h', g). ``sigma_g`` > 0 draws the gate noise from the global torch RNG."""
    logits = z / tau
    if sigma_g > 0:
        logits = logits + sigma_g * torch.randn_like(logits)
    g = torch.sigmoid(logits)
    # h' = g*h + (1-g)*o written as o + g*(h - o): one fewer elementwise op, same value.
    return o + g * (h - o), g


def gated_update(z: torch.Tensor, h: torch.Tensor, o: torch.Tensor, tau: float = 1.0,
                 sigma_g: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_update_reference(z, h, o, tau, sigma_g)
