"""Models by ``model.type``. A new architecture is one new file plus one line here and its config in configs.py."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.configs import ModelConfig

if TYPE_CHECKING:
    from pipeline.model.interface import LanguageModel

# type -> "module:Class"; each type's config class is pipeline.model.configs.MODEL_CONFIGS. Classes are imported
# lazily so that reading a recipe needs no torch.
_MODELS: dict[str, str] = {
    "gpt": "pipeline.model.gpt:GPT",
    "grt": "pipeline.model.grt:GRT",
    # the paper's recurrent competitors (Table 1, Table 8)
    "poisson": "pipeline.model.poisson:PoissonDepth",
    "mor": "pipeline.model.mor:MoR",
    "rrt": "pipeline.model.rrt:RRT",
    "ouro": "pipeline.model.ouro:Ouro",
    # the companion abstracts' systems
    "recurrent_transformer": "pipeline.model.recurrent_transformer:RecurrentTransformer",
    "recurtrace": "pipeline.model.recurtrace:RecurTrace",
}
if set(_MODELS) != set(MODEL_CONFIGS):  # a type with a config but no model (or the reverse) fails at import
    raise ImportError(f"pipeline.model.registry and pipeline.model.configs.MODEL_CONFIGS name different model types: "
                      f"{sorted(set(_MODELS) ^ set(MODEL_CONFIGS))}")
# trained with noise (GRT's state and gate noise, Poisson's random start), evaluated without
NOISY_TYPES = ("grt", "poisson")


def model_class(model_type: str) -> type[LanguageModel]:
    """The model class of ``model_type``: a :class:`~pipeline.model.interface.LanguageModel`."""
    import importlib

    if model_type not in _MODELS:
        raise KeyError(f"model.type={model_type!r} is not registered; known: {sorted(_MODELS)}")
    module, cls = _MODELS[model_type].split(":")
    return getattr(importlib.import_module(module), cls)


def exits_are_layers(model_type: str) -> bool:
    """Whether the model's depth is an exit layer of a stack run once (dense-style: gpt, recurrent_transformer)
    rather than a recurrence/recursion/loop count."""
    return model_class(model_type).exits_are_layers


def build_model(cfg: ModelConfig, device=None, seed: int | None = None):
    """The model for ``cfg`` with its GPT-2 initial weights, each parameter drawn from its own generator seeded by
    (``seed``, its name); ``seed`` defaults to ``torch.initial_seed()``, so ``torch.manual_seed(s); build_model(cfg)``
    gives the weights of seed s. ``device='meta'`` allocates and initialises nothing (for counting, or to be sharded
    and then materialised: :mod:`pipeline.train.materialize`)."""
    import torch

    with torch.device(device or "cpu"):
        model = model_class(cfg.type)(cfg)
    if torch.device(device or "cpu").type != "meta":
        model.init_weights(torch.initial_seed() if seed is None else seed)
    return model


def count_params(model) -> dict[str, int]:
    """Unique parameters (a tied tensor counts once), total and without position embeddings."""
    seen, total, pos = set(), 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if name.endswith("wpe.weight"):
            pos += p.numel()
    return {"params": total, "params_without_position": total - pos}


def model_info(cfg: ModelConfig) -> dict:
    """What `grt info` prints: parameters counted on the instantiated (meta) model, FLOPs from the paper's Eq. 1."""
    cls = model_class(cfg.type)
    info = {"type": cfg.type, "shorthand": cls.shorthand(cfg)}
    info.update(count_params(build_model(cfg, device="meta")))
    info["block_executions"] = cls.block_executions(cfg)
    info["flops_per_token"] = cls.flops_per_token(cfg)
    info["flops_per_token_with_head"] = cls.flops_per_token(cfg, with_head=True)
    info["executed_flops_per_token"] = cls.flops_per_token(cfg, executed=True)  # after the exact step savings
    info["seq_len"] = cfg.block_size
    # how the method's real cost differs from the Eq. 1 figure above (capacities, extra heads, sampled depth, ...)
    info["flops_notes"] = cls.flops_notes(cfg)
    info["d_model"] = cfg.d_model
    if cfg.block != "gpt2" or cfg.embedding_rows() != cfg.vocab_size:  # the paper's recipes print what they did

        info.update(block=cfg.block, n_head=cfg.n_head, n_kv_head=cfg.kv_heads(), vocab_size=cfg.vocab_size,
                    embedding_rows=cfg.embedding_rows())
        if cfg.block == "llama":
            info["mlp_hidden"] = cfg.mlp_hidden()
    return info
