"""`grt info RECIPE` (what the recipe's model is and what a token of it costs) and `grt train RECIPE`."""
from __future__ import annotations

import json

from pipeline.config.arguments import add_recipe_arguments
from pipeline.config.arguments import recipe_of


def register_info(sub) -> None:
    """`grt info` (registered before `grt tokenize`, `grt train` after it: the order `grt --help` lists them in)."""
    s = add_recipe_arguments(sub.add_parser("info", help="parameters, shorthand, block executions and FLOPs of the "
                                                         "recipe's model"))
    s.set_defaults(fn=cmd_info)
    s.add_argument("--json", action="store_true", help="one JSON object")


def register(sub) -> None:
    s = add_recipe_arguments(sub.add_parser("train", help="train (resumes from the run folder's latest checkpoint)"))
    s.set_defaults(fn=cmd_train)


def cmd_info(args) -> int:
    from pipeline.model import model_info
    from pipeline.train import curriculum

    cfg = recipe_of(args)
    info = model_info(cfg.model)
    info.update(curriculum.info(cfg))  # train.batch_ramp / model.depth_schedule, only when set
    if cfg.data.document_masking:  # said only when on: the paper's recipes print what they always did
        info["document_masking"] = True
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{cfg.name}: {cfg.model.type} {info['shorthand']} (d={info['d_model']}, S={info['seq_len']})")
    print(f"  unique parameters            {info['params']:>15,}  ({info['params'] / 1e6:.2f}M)")
    print(f"  without position embeddings  {info['params_without_position']:>15,}  "
          f"({info['params_without_position'] / 1e6:.2f}M)")
    if "block" in info:  # a llama block or a padded vocabulary (absent from the paper's recipes)
        mlp = f", SwiGLU hidden {info['mlp_hidden']}" if "mlp_hidden" in info else ""
        print(f"  block                        {info['block']}: {info['n_head']} query / {info['n_kv_head']} "
              f"key-value heads{mlp}; vocabulary {info['vocab_size']:,} in {info['embedding_rows']:,} rows")
    print(f"  block executions / forward   {info['block_executions']:>15,}")
    print(f"  forward FLOPs/token, Eq. 1   {info['flops_per_token']:>15,}  ({info['flops_per_token'] / 1e9:.4f} G)")
    print(f"  ... with the LM head         {info['flops_per_token_with_head']:>15,}  "
          f"({info['flops_per_token_with_head'] / 1e9:.4f} G)")
    if info["executed_flops_per_token"] != info["flops_per_token"]:
        print(f"  forward FLOPs/token executed {info['executed_flops_per_token']:>15,}  "
              f"({info['executed_flops_per_token'] / 1e9:.4f} G)")
    if cfg.data.document_masking:
        print("  attention                    within each document (data.document_masking); the FLOPs count the "
              "full causal window, as unmasked")
    for note in info["flops_notes"]:
        print(f"  note: {note}")
    for line in curriculum.describe(cfg):
        print(f"  {line}")
    return 0


def cmd_train(args) -> int:
    from pipeline.train.trainer import train

    train(recipe_of(args))
    return 0
