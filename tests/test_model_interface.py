"""Every registered model type offers the written interface (pipeline/model/interface.py), and a class that misses a
member is refused."""
import inspect

import pytest
import torch

from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.interface import LanguageModel
from pipeline.model.registry import _MODELS
from pipeline.model.registry import build_model
from pipeline.model.registry import model_class

ABSTRACT = {"forward", "exit_states", "init_weights", "train_depth", "full_depth", "shorthand", "block_executions",
            "flops_per_token"}


def test_the_interface_lists_these_members():
    assert LanguageModel.__abstractmethods__ == ABSTRACT


@pytest.mark.parametrize("model_type", sorted(_MODELS))
def test_every_registered_type_implements_the_interface(model_type):
    cls = model_class(model_type)
    assert issubclass(cls, LanguageModel) and not inspect.isabstract(cls), cls.__abstractmethods__
    cfg = MODEL_CONFIGS[model_type]()
    model = build_model(cfg, device="meta")
    assert isinstance(model, LanguageModel)
    assert cls.full_depth(cfg) >= 1 and isinstance(cls.shorthand(cfg), str)
    assert cls.recurrence_depth(cfg) == getattr(cfg, "n_recurrence", None)  # None exactly for a stack run once
    assert (model.recurrent_core() is None) == cls.exits_are_layers
    assert cls.training_flops_per_token(cfg, cls.full_depth(cfg)) >= cls.flops_per_token(cfg, with_head=True)
    assert isinstance(cls.flops_notes(cfg), list)


def test_a_class_missing_a_member_cannot_be_instantiated():
    gpt = model_class("gpt")
    Incomplete = type("Incomplete", (LanguageModel,), {k: v for k, v in vars(gpt).items() if k != "flops_per_token"})
    assert inspect.isabstract(Incomplete) and Incomplete.__abstractmethods__ == {"flops_per_token"}
    with pytest.raises(TypeError, match="flops_per_token"):
        Incomplete(MODEL_CONFIGS["gpt"]())


def test_defaults_the_base_gives():
    gpt, cfg = model_class("gpt"), MODEL_CONFIGS["gpt"]()
    assert gpt.flops_notes(cfg) == [] and gpt.recurrence_depth(cfg) is None
    assert gpt.training_flops_per_token(cfg) == 3 * gpt.flops_per_token(cfg, with_head=True)
    assert torch.nn.Module in LanguageModel.__mro__
