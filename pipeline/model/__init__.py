"""Models: nn.Modules only (no distributed code, no I/O). Look them up by ``model.type`` in :mod:`registry`."""
from pipeline.model.registry import build_model, count_params, exits_are_layers, model_class, model_info

__all__ = ["build_model", "count_params", "exits_are_layers", "model_class", "model_info"]
