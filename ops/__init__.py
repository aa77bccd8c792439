"""Fused kernels for the GRT step and the LM head, and the plain PyTorch references they must match."""
from ops.gate import gate_update, gated_update, new_seed, set_backend, state_noise
from ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["gate_update", "gated_update", "linear_cross_entropy", "new_seed", "set_backend", "state_noise"]
