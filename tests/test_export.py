"""`grt export --format hf` against independent references. Tiny GRT and GPT models with random (non-init) weights
are saved the way training saves them (the backend's own writer: full and sharded formats), exported, then loaded
in a fresh, offline Python process with transformers' Auto classes. Their logits are compared with the pipeline
model's; greedy generate() with the pipeline's uncached greedy continuation; each KV strategy's cached generate()
with a float64 reference of that strategy written here, recomputed from scratch for every token; the tokenizer with
the pipeline's tiktoken BPE."""
import ast
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.model import build_model
from pipeline.tokenize.bpe import gpt2_encoding
from test_model import linear
from test_model import ln

GRT = {"type": "grt", "vocab_size": 50257, "block_size": 64, "d_model": 32, "n_head": 2, "n_prelude": 1,
       "n_core": 2, "n_coda": 1, "n_recurrence": 2}  # R = 2
GPT = {"type": "gpt", "vocab_size": 50257, "block_size": 64, "d_model": 32, "n_head": 2, "n_layer": 2}
STRATEGIES = ["full", "last", "first", "averaged"]
PROMPT = "the gate decides how much"
PADDED = ["the gate decides how much of the state is kept", "A shared core", "depth"]
NEW = 16  # greedy tokens per strategy
TEXT = "Hello world!  The gate<|endoftext|> decides \n\n how 123 much, héllo 日本"
IDS = [[15496, 995, 0, 383, 8946, 13267, 703, 881, 11, 220, 628, 42], [7, 1, 50256, 3, 99, 4, 5, 6, 1000, 8, 9, 10]]


def save_run(tmp: Path, model_section: dict, fmt: str, seed: int):
    """A one-checkpoint run written by the training backend itself (state.pt + shards or weights, index, recipe)."""
    from pipeline.train.backend import SingleProcess
    from pipeline.train.checkpoint import prepare_staging
    from pipeline.train.checkpoint import publish
    from pipeline.train.checkpoint import staging_dir

    recipe = tiny_recipe(tmp, tmp, train={"checkpoint_format": fmt})
    recipe["model"] = dict(model_section)
    cfg = from_dict(recipe)
    torch.manual_seed(seed)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # move off the GPT-2 init: every parameter matters, the gate is neither open nor shut
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        if getattr(getattr(model, "recur", None), "gate", None) is not None:
            model.recur.gate.fc2.bias.normal_(0.0, 1.0)
    root = cfg.run_dir / "checkpoints"
    prepare_staging(root, 5)
    with warnings.catch_warnings():  # DCP's note that it saves in one process: it does, as a 1-rank run would
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        SingleProcess(cfg.train).save_model_optimizer(model, torch.optim.AdamW(model.parameters()),
                                                      staging_dir(root, 5), {"step": 5, "recipe": cfg.to_dict()})
    publish(root, 5, cfg.to_yaml(), keep=1)
    return model, cfg


LOADER = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel
grt_dir, gpt_dir, out = sys.argv[1:4]
spec = json.loads(sys.argv[4])
res = {}
g, info = AutoModelForCausalLM.from_pretrained(grt_dir, trust_remote_code=True, output_loading_info=True)
res["grt_class"], res["grt_dtype"] = type(g).__name__, str(g.dtype)
LOOSE = ("missing_keys", "unexpected_keys", "mismatched_keys")
res["grt_loading"] = {k: list(v) for k, v in info.items() if k in LOOSE}
tok = AutoTokenizer.from_pretrained(grt_dir, trust_remote_code=True)
res["tok_ids"] = tok(spec["text"])["input_ids"]
res["tok_roundtrip"] = tok.decode(res["tok_ids"]) == spec["text"]
ids = torch.tensor(spec["ids"])
with torch.no_grad():
    res["grt_default"] = g(ids).logits
    res["grt_logits"] = {r: g(ids, n_steps=r).logits for r in range(1, 2 * g.config.n_recurrence + 1)}
    res["grt_loss"] = g(ids, labels=ids).loss
    outs = {s: g(ids, use_cache=True, kv_strategy=s) for s in spec["strategies"]}
    # the output's cache field is named cache from transformers 5.24, past_key_values before it
    res["cache_bytes"] = {s: (getattr(o, "cache", None) or o.past_key_values).nbytes() for s, o in outs.items()}
prompt = tok(spec["prompt"], return_tensors="pt")
res["prompt"] = prompt["input_ids"][0].tolist()
greedy = dict(do_sample=False, max_new_tokens=spec["new"])
g.generation_config.eos_token_id = None  # always spec["new"] tokens, EOT included, as the references decode
res["grt_greedy"] = g.generate(**prompt, **greedy)[0].tolist()
g64 = AutoModelForCausalLM.from_pretrained(grt_dir, trust_remote_code=True, dtype=torch.float64)
g64.generation_config.eos_token_id = None
R = g.config.n_recurrence
res["strategy_greedy"] = {f"{s}@{n}": g64.generate(**prompt, **greedy, kv_strategy=s, n_steps=n)[0].tolist()
                          for s, n in [(s, R) for s in spec["strategies"]] + [("averaged", 2 * R), ("last", 1)]}
batch = tok(spec["padded"], return_tensors="pt", padding=True)
short = dict(do_sample=False, max_new_tokens=6)
for s in ("full", "averaged"):
    res[f"padded_{s}"] = g64.generate(**batch, **short, kv_strategy=s)[:, -6:].tolist()
    res[f"alone_{s}"] = [g64.generate(**tok(p, return_tensors="pt"), **short, kv_strategy=s)[0, -6:].tolist()
                         for p in spec["padded"]]
d, info = AutoModelForCausalLM.from_pretrained(gpt_dir, output_loading_info=True)
res["gpt_class"], res["gpt_is_stock"] = type(d).__name__, type(d) is GPT2LMHeadModel
res["gpt_loading"] = {k: list(v) for k, v in info.items() if k in LOOSE}
res["gpt_tok_ids"] = AutoTokenizer.from_pretrained(gpt_dir)(spec["text"])["input_ids"]
with torch.no_grad():
    res["gpt_logits"] = d(ids).logits
d.generation_config.eos_token_id = None
res["gpt_greedy"] = d.generate(**prompt, **greedy)[0].tolist()
torch.save(res, out)
'''


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Both models exported (GRT from a full checkpoint with export_hf, GPT from a sharded one with the CLI), and
    what a fresh offline process loading them with transformers computed."""
    from pipeline.cli import main
    from pipeline.export.hf import export_hf

    tmp = tmp_path_factory.mktemp("export")
    grt, grt_cfg = save_run(tmp / "grt", GRT, "full", seed=3)
    gpt, gpt_cfg = save_run(tmp / "gpt", GPT, "sharded", seed=4)
    export_hf(grt_cfg.run_dir, tmp / "grt-hf")
    assert main(["export", str(gpt_cfg.run_dir), "--format", "hf", "--out", str(tmp / "gpt-hf")]) == 0
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf-home"),
               OMP_NUM_THREADS="1")
    spec = {"text": TEXT, "ids": IDS, "prompt": PROMPT, "padded": PADDED, "new": NEW, "strategies": STRATEGIES}
    out = subprocess.run([sys.executable, "-c", LOADER, str(tmp / "grt-hf"), str(tmp / "gpt-hf"), str(tmp / "res.pt"),
                          json.dumps(spec)], env=env, cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return {"grt": grt, "gpt": gpt, "grt_cfg": grt_cfg.model, "gpt_cfg": gpt_cfg.model, "dir": tmp,
            "res": torch.load(tmp / "res.pt", weights_only=False)}


# ---- the float64 reference of the KV strategies (issue #13 item 1), recomputed from scratch for every token
def ref_block(blk, x, past):
    """One pre-LN block on x [T, d] whose tokens follow the cached ones; past: (K, V) [H, S, hd] or None. Returns
    (output, (k, v) of x's tokens)."""
    T, C = x.shape
    H = blk.attn.n_head
    q, k, v = linear(ln(x, blk.ln_1.weight, blk.ln_1.bias), blk.attn.c_attn).split(C, dim=1)
    q, k, v = (t.reshape(T, H, C // H).transpose(0, 1) for t in (q, k, v))
    K, V = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
    S = K.shape[1]
    scores = q @ K.transpose(-1, -2) / math.sqrt(C // H)
    future = torch.arange(S)[None, :] > torch.arange(S - T, S)[:, None]
    y = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ V
    x = x + linear(y.transpose(0, 1).reshape(T, C), blk.attn.c_proj)
    hid = linear(ln(x, blk.ln_2.weight, blk.ln_2.bias), blk.mlp.c_fc)
    return x + linear(0.5 * hid * (1 + torch.erf(hid / math.sqrt(2))), blk.mlp.c_proj), (k, v)


def cat_kv(a, b):
    return b if a is None else (torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1))


def ref_next_logits(m, seq: list[int], n_prompt: int, n: int, strategy: str) -> torch.Tensor:
    """Logits after seq's last token when seq[:n_prompt] was the prompt (one pass, full per-step attention, then its
    core K/V compacted) and every later token was decoded alone: at step r its core blocks see the past's K/V of step
    r (full) or the compacted past (last: step n's, first: step 1's, averaged: the mean over steps) plus its own step-r
    K/V, then it appends its own compacted K/V. Eq. 2 with the gate of §3.3, noise off."""
    gate = m.recur.gate
    pre, coda, core = {}, {}, {}

    def run(tokens, start, prefill):
        idx = torch.tensor(tokens)
        x = m.embed.wte.weight[idx] + m.embed.wpe.weight[start:start + len(tokens)]
        for i, blk in enumerate(m.prelude):
            x, kv = ref_block(blk, x, pre.get(i))
            pre[i] = cat_kv(pre.get(i), kv)
        h_pre = h = x
        steps = {j: [] for j in range(len(m.recur.blocks))}
        for r in range(n):
            o = linear(torch.cat([h, h_pre], -1), m.recur.proj)
            for j, blk in enumerate(m.recur.blocks):
                if strategy == "full":
                    o, kv = ref_block(blk, o, core.get((r, j)))
                    core[(r, j)] = cat_kv(core.get((r, j)), kv)
                else:
                    o, kv = ref_block(blk, o, None if prefill else core.get(j))
                    steps[j].append(kv)
            a = [ln(h, gate.ln_h.weight, gate.ln_h.bias), ln(h_pre, gate.ln_pre.weight, gate.ln_pre.bias)]
            z = linear(F.silu(linear(torch.cat(a, -1), gate.fc1)), gate.fc2)
            g = torch.sigmoid(z / m.cfg.tau)
            h = g * h + (1 - g) * o
        for j, kvs in steps.items():
            if strategy != "full":
                ks, vs = torch.stack([kv[0] for kv in kvs]), torch.stack([kv[1] for kv in kvs])
                pick = {"last": (ks[-1], vs[-1]), "first": (ks[0], vs[0]), "averaged": (ks.mean(0), vs.mean(0))}
                core[j] = cat_kv(core.get(j), pick[strategy])
        for i, blk in enumerate(m.coda):
            h, kv = ref_block(blk, h, coda.get(i))
            coda[i] = cat_kv(coda.get(i), kv)
        return ln(h, m.ln_f.weight, m.ln_f.bias)[-1] @ m.embed.wte.weight.T

    logits = run(seq[:n_prompt], 0, True)
    for s in range(n_prompt, len(seq)):
        logits = run(seq[s:s + 1], s, False)
    return logits


@contextlib.contextmanager
def one_thread():
    """Thousands of tiny ops: one thread is ~10x faster than several competing for 2 busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def ref_greedy(m, prompt: list[int], new: int, n: int, strategy: str) -> list[int]:
    seq = list(prompt)
    with one_thread():
        for _ in range(new):
            seq.append(int(ref_next_logits(m, seq, len(prompt), n, strategy).argmax()))
    return seq


def pipeline_greedy(model, prompt: list[int], new: int) -> list[int]:
    """The pipeline model's uncached greedy continuation (a full forward for every token)."""
    seq = list(prompt)
    with one_thread():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    return seq


# ---- tests
def test_grt_loads_offline_with_auto_classes_and_every_parameter(exported):
    res = exported["res"]
    assert res["grt_class"] == "GRTForCausalLM" and res["grt_dtype"] == "torch.float32"
    assert res["grt_loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}


def test_grt_logits_equal_the_pipeline_model_at_every_depth(exported):
    model, res = exported["grt"], exported["res"]
    ids = torch.tensor(IDS)
    R = exported["grt_cfg"].n_recurrence
    assert sorted(res["grt_logits"]) == list(range(1, 2 * R + 1))
    with torch.no_grad():
        for r, theirs in res["grt_logits"].items():
            torch.testing.assert_close(theirs, model(ids, n_steps=r)[0], atol=1e-5, rtol=0, msg=f"r={r}")
        torch.testing.assert_close(res["grt_default"], model(ids)[0], atol=1e-5, rtol=0)  # default depth R
        ours = model(ids)[0]
    # labels: mean next-token cross-entropy, written out by hand
    logp = torch.log_softmax(ours.double(), -1)[:, :-1]
    ce = -logp.gather(-1, ids[:, 1:, None]).mean()
    assert res["grt_loss"].item() == pytest.approx(ce.item(), abs=1e-5)


def test_grt_greedy_generate_equals_the_pipeline_uncached_continuation(exported):
    res = exported["res"]
    assert res["prompt"] == gpt2_encoding().encode_ordinary(PROMPT)
    assert res["grt_greedy"] == pipeline_greedy(exported["grt"], res["prompt"], NEW)


@pytest.mark.parametrize("strategy,n", [(s, 2) for s in STRATEGIES] + [("averaged", 4), ("last", 1)])
def test_kv_strategy_cached_generate_equals_its_uncached_reference(exported, strategy, n):
    """transformers' generate() with the exported cache == the strategy recomputed from scratch in float64."""
    m = copy.deepcopy(exported["grt"]).double()
    prompt = exported["res"]["prompt"]
    want = ref_greedy(m, prompt, NEW, n, strategy)
    assert exported["res"]["strategy_greedy"][f"{strategy}@{n}"] == want
    if strategy == "full":  # the full cache is exactly the plain model (which also checks the reference itself)
        assert want == pipeline_greedy(m, prompt, NEW)


@pytest.mark.parametrize("variant", [{"gate": "none", "bias": False}, {"reinject": False, "init_state": "zeros"},
                                     {"tau": 0.5, "n_prelude": 0, "n_coda": 2}])
def test_ablation_variants_export_with_equal_logits(tmp_path, variant):
    """Every switch of the model section that the exported code reads (in this process, the template's class)."""
    from pipeline.export.hf import export_hf
    from pipeline.export.hf_template.modeling_grt import GRTForCausalLM

    model, cfg = save_run(tmp_path, {**GRT, "vocab_size": 96, **variant}, "full", seed=5)
    export_hf(cfg.run_dir, tmp_path / "hf", check=False)  # the comparison below is the check
    hf = GRTForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.tensor(IDS) % 96
    with torch.no_grad():
        for r in range(0, 2 * cfg.model.n_recurrence + 1):
            torch.testing.assert_close(hf(ids, n_steps=r).logits, model(ids, n_steps=r)[0], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="n_steps=-1"):
            hf(ids, n_steps=-1)
        out = hf(ids[:, :4], use_cache=True)
        with pytest.raises(ValueError, match="the cache was filled with n_steps=2, kv_strategy=full"):
            hf(ids[:, 4:5], past_key_values=getattr(out, "cache", None) or out.past_key_values, n_steps=3)
        with pytest.raises(ValueError, match="past block_size=64"):
            hf(torch.zeros(1, 65, dtype=torch.long))


def test_compact_strategies_differ_from_full_on_this_model(exported):
    """The strategies are not all the same computation (else the test above could not tell them apart)."""
    greedy = exported["res"]["strategy_greedy"]
    assert len({tuple(greedy[f"{s}@2"]) for s in STRATEGIES}) >= 3


def test_left_padded_batch_gives_each_prompt_what_it_gives_alone(exported):
    res = exported["res"]
    assert len({len(gpt2_encoding().encode_ordinary(p)) for p in PADDED}) == 3  # really padded
    for s in ("full", "averaged"):
        assert res[f"padded_{s}"] == res[f"alone_{s}"], s


def test_cache_bytes_follow_the_layer_count(exported):
    """full: n_prelude + n_core * n + n_coda layer caches; last | first | averaged: n_prelude + n_core + n_coda."""
    c = exported["grt_cfg"]
    per_layer = 2 * len(IDS) * len(IDS[0]) * c.d_model * 4  # K and V, float32
    full = (c.n_prelude + c.n_core * c.n_recurrence + c.n_coda) * per_layer
    compact = (c.n_prelude + c.n_core + c.n_coda) * per_layer
    assert exported["res"]["cache_bytes"] == {"full": full, "last": compact, "first": compact, "averaged": compact}


def test_gpt_exports_as_stock_gpt2_with_equal_logits_and_generation(exported):
    res, model = exported["res"], exported["gpt"]
    assert res["gpt_class"] == "GPT2LMHeadModel" and res["gpt_is_stock"]
    assert res["gpt_loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    with torch.no_grad():
        torch.testing.assert_close(res["gpt_logits"], model(torch.tensor(IDS))[0], atol=1e-5, rtol=0)
    assert res["gpt_greedy"] == pipeline_greedy(model, res["prompt"], NEW)
    config = json.loads((exported["dir"] / "gpt-hf" / "config.json").read_text())
    assert config["activation_function"] == "gelu"  # exact erf GELU as layers.MLP; gelu_new would be tanh's


def test_gpt_without_biases_exports_with_zero_biases(tmp_path):
    from transformers import GPT2LMHeadModel

    from pipeline.export.hf import export_hf

    model, cfg = save_run(tmp_path, {**GPT, "vocab_size": 96, "bias": False}, "full", seed=6)
    export_hf(cfg.run_dir, tmp_path / "hf", check=False)
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert not hf.transformer.h[0].attn.c_attn.bias.any() and not hf.transformer.ln_f.bias.any()
    ids = torch.tensor(IDS) % 96
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("section", [GRT, GPT], ids=["grt", "gpt"])
def test_a_corrupted_weights_file_is_refused_and_leaves_no_folder_behind(tmp_path, monkeypatch, capsys, section):
    """One tensor of the written model.safetensors is perturbed on disk after it is written; the real load-back
    check of `grt export` must refuse it in one line, exit non-zero, and publish nothing."""
    import safetensors.torch as st

    real_save = st.save_file
    corrupted = []

    def save_then_corrupt(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        on_disk = st.load_file(filename)
        name = next(k for k in sorted(on_disk) if k.endswith("mlp.c_fc.weight"))
        on_disk[name] = on_disk[name] + 0.05  # a damaged tensor, as a flipped block of bytes would give
        real_save(on_disk, filename, metadata=metadata)
        corrupted.append(name)

    # GPT-2's vocabulary: with a smaller one, transformers warns on stderr that EOT 50256 is out of range
    _, cfg = save_run(tmp_path / "run", section, "full", seed=7)
    monkeypatch.setattr(st, "save_file", save_then_corrupt)
    from pipeline.cli import main

    capsys.readouterr()
    code = main(["export", str(cfg.run_dir), "--format", "hf", "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert corrupted and code != 0
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "logits" in err and "away" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # neither hf/ nor its staging .hf.tmp/


def test_tokenizer_equals_the_pipeline_bpe(exported):
    res = exported["res"]
    want = gpt2_encoding().encode(TEXT, allowed_special="all")
    assert res["tok_ids"] == want and res["gpt_tok_ids"] == want and res["tok_roundtrip"]


def test_folder_has_the_config_fields_auto_map_and_self_contained_code(exported):
    folder = exported["dir"] / "grt-hf"
    config = json.loads((folder / "config.json").read_text())
    for key, value in vars(exported["grt_cfg"]).items():
        assert config[key] == value, key
    assert config["auto_map"] == {"AutoConfig": "configuration_grt.GRTHFConfig",
                                  "AutoModelForCausalLM": "modeling_grt.GRTForCausalLM"}
    assert config["n_steps"] is None and config["kv_strategy"] == "full"
    template = Path(__file__).resolve().parents[1] / "pipeline" / "export" / "hf_template"
    for name in ("configuration_grt.py", "modeling_grt.py"):
        code = (folder / name).read_text()
        assert code == (template / name).read_text()
        roots = set()
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots.add(node.module.split(".")[0])
        assert roots <= {"torch", "transformers"}, (name, roots)
    record = json.loads((folder / "grt_export.json").read_text())
    assert record["step"] == 5 and record["source_format"] == "full" and record["verified_max_abs_logit_diff"] < 1e-4
    assert json.loads((exported["dir"] / "gpt-hf" / "grt_export.json").read_text())["source_format"] == "sharded"
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
            "generation_config.json"} <= {p.name for p in folder.iterdir()}


def test_unsupported_type_and_foreign_out_folder_are_refused(tmp_path):
    from pipeline.export.hf import export_hf

    _, cfg = save_run(tmp_path / "p", {"type": "poisson", "vocab_size": 64, "block_size": 16, "d_model": 16,
                                       "n_head": 2, "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 2},
                      "full", seed=0)
    with pytest.raises(ValueError, match=r"supports model.type grt and gpt .*'poisson'"):
        export_hf(cfg.run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    _, hyper = save_run(tmp_path / "h", {"type": "grt", "vocab_size": 64, "block_size": 16, "d_model": 16,
                                         "n_head": 2, "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 2,
                                         "hyper_streams": 2}, "full", seed=0)
    with pytest.raises(ValueError, match=r"hyper-connections \(model.hyper_streams=2\).*--to safetensors"):
        export_hf(hyper.run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not an earlier `grt export`"):
        export_hf(cfg.run_dir, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
