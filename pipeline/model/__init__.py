"""Models: nn.Modules only (no distributed code, no I/O). Look them up by ``model.type`` in :mod:`registry`."""
from pipeline.model.registry import build_model
from pipeline.model.registry import count_params
from pipeline.model.registry import exits_are_layers
from pipeline.model.registry import model_class
from pipeline.model.registry import model_info

__all__ = ["build_model", "count_params", "exits_are_layers", "model_class", "model_info"]
