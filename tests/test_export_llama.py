"""`grt export --format hf` of models with the llama block (``model.block: llama``), against the pipeline model:
a dense model as the stock ``LlamaForCausalLM`` (no remote code), a dense model with QK-norm as the stock
``Qwen3ForCausalLM``, and a GRT through the remote-code template. Each has grouped-query attention and a vocabulary
padded to a multiple of 128 (the export holds the real rows only); two key/value heads for four query heads, so
that a wrong grouping (heads tiled instead of repeated) shows. The folders are loaded in a fresh, offline
process with transformers' Auto classes; the logits are compared with the pipeline model's, and greedy generate()
with ``grt generate``'s decoding loop (:func:`pipeline.infer.generate.generate`) and the uncached argmax."""
import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.infer.generate import generate
from pipeline.tokenize.bpe import gpt2_encoding
from test_export import IDS
from test_export import PADDED
from test_export import PROMPT
from test_export import pipeline_greedy
from test_export import save_run

LLAMA = {"block": "llama", "bias": False, "n_kv_head": 2, "rope_theta": 500.0, "mlp_multiple": 16,
         "vocab_multiple": 128}  # 50257 -> 50304 embedding rows
DENSE = {"type": "gpt", "vocab_size": 50257, "block_size": 64, "d_model": 32, "n_head": 4, "n_layer": 2, **LLAMA}
QWEN = {**DENSE, "qk_norm": True}
GRT = {"type": "grt", "vocab_size": 50257, "block_size": 64, "d_model": 32, "n_head": 4, "n_prelude": 1,
       "n_core": 2, "n_coda": 1, "n_recurrence": 2, **LLAMA, "qk_norm": True}
MODELS = {"llama": DENSE, "qwen3": QWEN, "grt": GRT}
NEW = 12
# fp32 against fp32 in another order of operations (rotary angles in fp64 here, fp32 in transformers): measured
# largest |logit difference| on IDS 4.0e-6 (llama, qwen3) and 4.3e-6 (grt) at logits up to ~6; 2e-5: a 5x margin
ATOL = 2e-5

LOADER = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen3ForCausalLM
spec = json.loads(sys.argv[1])
res = {}
LOOSE = ("missing_keys", "unexpected_keys", "mismatched_keys")
for name, folder in spec["dirs"].items():
    r = res[name] = {}
    remote = name == "grt"
    m, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, output_loading_info=True)
    r["class"], r["stock"] = type(m).__name__, type(m) in (LlamaForCausalLM, Qwen3ForCausalLM)
    r["loading"] = {k: list(v) for k, v in info.items() if k in LOOSE}
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        r["logits"] = m(torch.tensor(spec["ids"])).logits
    prompt = tok(spec["prompt"], return_tensors="pt")
    r["prompt"] = prompt["input_ids"][0].tolist()
    m.generation_config.eos_token_id = None  # always spec["new"] tokens, as the references decode
    out = m.generate(**prompt, do_sample=False, max_new_tokens=spec["new"])[0]
    r["greedy"], r["text"] = out.tolist(), tok.decode(out[len(r["prompt"]):])
    if remote:
        r["strategies"] = {s: m.generate(**prompt, do_sample=False, max_new_tokens=spec["new"], kv_strategy=s)[0]
                           .tolist() for s in ("last", "first", "averaged")}
        batch = tok(spec["padded"], return_tensors="pt", padding=True)
        r["padded"] = m.generate(**batch, do_sample=False, max_new_tokens=6)[:, -6:].tolist()
torch.save(res, sys.argv[2])
'''


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The three models saved as training saves them, exported with export_hf (which verifies its own logits), and
    what a fresh offline process loading them with transformers computed."""
    from pipeline.export.hf import export_hf

    tmp = tmp_path_factory.mktemp("export-llama")
    models, records, runs = {}, {}, {}
    for seed, (name, section) in enumerate(MODELS.items()):
        models[name], cfg = save_run(tmp / name, section, "full", seed=seed)
        runs[name] = cfg.run_dir
        records[name] = export_hf(cfg.run_dir, tmp / f"{name}-hf")[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf-home"),
               OMP_NUM_THREADS="1")
    spec = {"dirs": {n: str(tmp / f"{n}-hf") for n in MODELS}, "ids": IDS, "prompt": PROMPT, "new": NEW,
            "padded": PADDED}
    out = subprocess.run([sys.executable, "-c", LOADER, json.dumps(spec), str(tmp / "res.pt")], env=env, cwd=tmp,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return {"models": models, "records": records, "runs": runs, "dir": tmp,
            "res": torch.load(tmp / "res.pt", weights_only=False)}


@pytest.mark.parametrize("name,cls", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_dense_llama_exports_as_a_stock_class_with_equal_logits(exported, name, cls):
    res, model = exported["res"][name], exported["models"][name]
    assert res["class"] == cls and res["stock"]
    assert res["loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    folder = exported["dir"] / f"{name}-hf"
    assert not list(folder.glob("*.py"))  # no remote code
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == [cls]
    c = model.cfg
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["rms_norm_eps"],
            config["tie_word_embeddings"], config["intermediate_size"]) == (2, 4, 1e-6, True, 96)
    assert config["rope_parameters"]["rope_theta"] == 500.0
    # the padded vocabulary: the export holds the 50257 real rows, so no padding row has a logit to be predicted
    assert model.embed.wte.weight.shape[0] == 50304 and config["vocab_size"] == c.vocab_size == 50257
    assert res["logits"].shape[-1] == 50257
    with torch.no_grad():
        torch.testing.assert_close(res["logits"], model(torch.tensor(IDS))[0], atol=ATOL, rtol=0)
    assert exported["records"][name]["hf_class"] == cls
    assert exported["records"][name]["verified_max_abs_logit_diff"] < ATOL


@pytest.mark.parametrize("name", list(MODELS))
def test_exported_greedy_generate_equals_grt_generate(exported, name, capsys):
    """transformers' generate() of the export == ``grt generate``'s loop (KV cache, kv=full) == the uncached
    argmax, token for token, and the same text; and the `grt generate` command on the run prints that text."""
    from pipeline.cli import main

    res, model = exported["res"][name], exported["models"][name]
    enc = gpt2_encoding()
    assert res["prompt"] == enc.encode_ordinary(PROMPT)
    ours = generate(model, [res["prompt"]], NEW, model.cfg.block_size).tokens[0]
    assert res["greedy"] == res["prompt"] + ours == pipeline_greedy(model, res["prompt"], NEW)
    assert res["text"] == enc.decode(ours)
    capsys.readouterr()
    assert main(["generate", str(exported["runs"][name]), PROMPT, "--max-new-tokens", str(NEW), "--device",
                 "cpu"]) == 0
    eot = enc.eot_token  # the command stops at the end-of-text token and does not print it
    assert capsys.readouterr().out == PROMPT + enc.decode(ours[:ours.index(eot)] if eot in ours else ours) + "\n"


def test_grt_with_llama_blocks_through_remote_code(exported):
    res, model = exported["res"]["grt"], exported["models"]["grt"]
    assert res["class"] == "GRTForCausalLM" and not res["stock"]
    assert res["loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert res["logits"].shape[-1] == 50257  # the padded rows are not exported
    with torch.no_grad():
        torch.testing.assert_close(res["logits"], model(torch.tensor(IDS))[0], atol=ATOL, rtol=0)
    # the compact KV strategies: the template's cache against the pipeline's (two implementations of one rule)
    for kv, tokens in res["strategies"].items():
        assert tokens == res["prompt"] + generate(model, [res["prompt"]], NEW, model.cfg.block_size, kv=kv).tokens[0]
    # left padding: rotary positions from the attention mask, each row from 0 at its first real token
    enc = gpt2_encoding()
    alone = [generate(model, [enc.encode_ordinary(p)], 6, model.cfg.block_size).tokens[0] for p in PADDED]
    assert res["padded"] == alone


@torch.no_grad()
def test_grt_template_with_llama_blocks_at_every_depth(exported):
    """In this process, the template's class at depths 0..2R (deeper than trained included)."""
    from pipeline.export.hf_template.modeling_grt import GRTForCausalLM

    model = exported["models"]["grt"]
    hf = GRTForCausalLM.from_pretrained(str(exported["dir"] / "grt-hf")).eval()
    ids = torch.tensor(IDS)
    for r in range(0, 2 * model.cfg.n_recurrence + 1):
        torch.testing.assert_close(hf(ids, n_steps=r).logits, model(ids, n_steps=r)[0], atol=ATOL, rtol=0,
                                   msg=lambda m: f"r={r}: {m}")
    long = torch.randint(0, 50257, (1, 80), generator=torch.Generator().manual_seed(0))  # past block_size: RoPE
    torch.testing.assert_close(hf(long).logits, model(long)[0], atol=ATOL, rtol=0)
    # the cache holds the n_kv_head = 2 key/value heads (not the 4 query heads): layers x K,V x tokens x 2 x hd x fp32
    c = model.cfg
    for kv, layers in (("full", c.n_prelude + c.n_core * c.n_recurrence + c.n_coda),
                       ("averaged", c.n_prelude + c.n_core + c.n_coda)):
        out = hf(ids, use_cache=True, kv_strategy=kv)
        cache = getattr(out, "cache", None) or out.past_key_values
        assert cache.nbytes() == layers * 2 * ids.numel() * 2 * (c.d_model // c.n_head) * 4
