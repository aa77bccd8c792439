"""Fused kernels for the GRT step and the LM head, and the plain PyTorch references they must match."""
from ops.gate import gated_update
from ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["gated_update", "linear_cross_entropy"]
