"""Fused kernels for the GRT step and the LM head, and the plain PyTorch references they must match."""
from ops.gate import gate_update
from ops.gate import gated_update
from ops.gate import new_seed
from ops.gate import set_backend
from ops.gate import state_noise
from ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["gate_update", "gated_update", "linear_cross_entropy", "new_seed", "set_backend", "state_noise"]
