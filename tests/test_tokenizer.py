"""The user's own tokenizer (data.tokenizer a tokenizer.json or a tiktoken BPE file; `grt tokenizer train`), against
independent references: the documents' own text and bytes, the `tokenizers` library reading the file directly, GPT-2's
BPE for the same ranks, hashlib for the identity, and transformers loading the exported folder."""
import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import tiny_recipe
from pipeline.cli import main as grt
from pipeline.config import SourceConfig
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.tokenize.tokenizers import load_tokenizer
from pipeline.tokenize.train_bpe import iter_texts
from pipeline.tokenize.train_bpe import train_tokenizer
from pipeline.tokenize.writer import verify_dataset
from pipeline.train.data_match import check_dataset_matches_model

R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # tiktoken_ext.openai_public
STDLIB = SourceConfig(kind="stdlib", max_bytes=1_500_000)  # the bundled corpus, its first 1.5 MB: seconds to train


def trained_file(tmp: Path, sources: list, vocab: int) -> Path:
    tok, _ = train_tokenizer(sources, vocab)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "tokenizer.json"
    path.write_text(tok.to_str(pretty=True), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stdlib_tok(tmp_path_factory) -> Path:
    return trained_file(tmp_path_factory.mktemp("tok"), [STDLIB], 1024)


def test_round_trips_every_document_byte_for_byte(stdlib_tok):
    tok = load_tokenizer(str(stdlib_tok))
    counts = {"documents": 0, "skipped": 0, "bytes": 0}
    n_tokens = 0
    for text in iter_texts([STDLIB], counts):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8", "surrogatepass")
        assert tok.eos_id not in ids and tok.bos_id not in ids  # special-token text in a document stays text
        n_tokens += len(ids)
    assert counts["documents"] > 50
    assert n_tokens < counts["bytes"] / 2.5  # a real BPE (merges learned), not bytes
    ident = tok.identity()
    assert ident["vocab_hash"] == hashlib.sha256(stdlib_tok.read_bytes()).hexdigest()
    assert (ident["n_vocab"], ident["eot_id"], ident["bos_id"]) == (1024, 0, 1)


def test_training_twice_gives_the_identical_file(tmp_path, stdlib_tok):
    """Again in another process (another hash seed), through the command line and a recipe's data.sources."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"sources": [{"kind": "stdlib", "max_bytes": STDLIB.max_bytes}]}}))
    subprocess.run([sys.executable, "-m", "pipeline.cli", "tokenizer", "train", str(recipe), "--vocab-size", "1024",
                    "--out", str(tmp_path / "again")], check=True, capture_output=True)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == stdlib_tok.read_bytes()


def test_cli_trains_from_a_recipe_and_files(tmp_path, corpus, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path, corpus)))
    assert grt(["tokenizer", "train", str(recipe), "--vocab-size", "300", "--out", str(tmp_path / "a")]) == 0
    paths = [str(corpus / "txt" / "*.txt"), str(corpus / "part.jsonl"), str(corpus / "part.jsonl.zst")]
    assert grt(["tokenizer", "train", *paths, "--vocab-size", "300", "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert "60 documents" in capsys.readouterr().out


def dataset(tmp: Path, corpus: Path, tokenizer: str, workers: int, name: str):
    cfg = from_dict(tiny_recipe(tmp, corpus, data={"tokenizer": tokenizer, "dataset_dir": str(tmp / name),
                                                   "workers": workers}))
    return cfg, tokenize(cfg.data, quiet=True)


@pytest.mark.multiprocess  # data.workers: 2 forks tokenizer processes
def test_tokenizing_is_byte_identical_for_1_and_2_workers(tmp_path, corpus, stdlib_tok):
    from tokenizers import Tokenizer

    _, m1 = dataset(tmp_path, corpus, str(stdlib_tok), 1, "w1")
    _, m2 = dataset(tmp_path, corpus, str(stdlib_tok), 2, "w2")
    files = sorted(p.name for p in (tmp_path / "w1").iterdir() if not p.name.startswith("."))
    assert files == sorted(p.name for p in (tmp_path / "w2").iterdir() if not p.name.startswith("."))
    for f in files:
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes(), f
    # the dataset carries the tokenizer, and the manifest names it by the file's hash
    assert (tmp_path / "w1" / "tokenizer.json").read_bytes() == stdlib_tok.read_bytes()
    assert m1["tokenizer"]["vocab_hash"] == hashlib.sha256(stdlib_tok.read_bytes()).hexdigest()
    assert m1["tokenizer"]["name"] == "hf" and m1["tokenizer"]["eot_id"] == 0
    assert verify_dataset(tmp_path / "w1") == []
    (tmp_path / "w2" / "tokenizer.json").write_text("{}")  # `grt data verify` checks the copy against the manifest
    assert [p for p in verify_dataset(tmp_path / "w2") if "tokenizer.json" in p]
    # the shards hold the documents as the tokenizers library encodes them, each followed by EOS
    ref = Tokenizer.from_file(str(stdlib_tok))
    ids = np.concatenate([np.fromfile(tmp_path / "w1" / s["file"], dtype=m1["dtype"])
                          for sp in ("train", "val") for s in m1["splits"][sp]["shards"]])
    docs = [ref.decode(d.tolist()) for d in np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]]
    assert len(docs) == m1["totals"]["documents"] and all(d.startswith("Document ") for d in docs)
    texts = {t for t in iter_texts([SourceConfig(kind="files", paths=[str(corpus / "txt" / "*.txt"),
                                                                       str(corpus / "part.jsonl"),
                                                                       str(corpus / "part.jsonl.zst")])],
                                   {"documents": 0, "skipped": 0, "bytes": 0})}
    assert {d[:-len("<|endoftext|>")] if d.endswith("<|endoftext|>") else d for d in docs} <= texts


def gpt2_ranks_file(tmp: Path) -> Path:
    """GPT-2's ranks as a .tiktoken file (tiktoken's own dump_tiktoken_bpe needs blobfile)."""
    from pipeline.tokenize.bpe import gpt2_encoding

    path = tmp / "gpt2ranks.tiktoken"
    ranks = sorted(gpt2_encoding()._mergeable_ranks.items(), key=lambda kv: kv[1])
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks))
    return path


def test_a_tiktoken_bpe_file_tokenizes_as_the_same_ranks_do_in_gpt2(tmp_path, corpus):
    from pipeline.tokenize.bpe import gpt2_encoding

    gpt2 = gpt2_encoding()
    path = gpt2_ranks_file(tmp_path)
    tok = load_tokenizer(str(path))
    text = "the gate decides how much of the state is kept, while the shared core proposes an update."
    assert tok.encode(text) == gpt2.encode_ordinary(text)  # words and punctuation: both split patterns agree
    assert tok.decode(tok.encode("héllo 日本 123 it's")) == "héllo 日本 123 it's"
    assert (tok.n_vocab, tok.eos_id, tok.bos_id) == (50257, 50256, None)
    assert tok.identity()["vocab_hash"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert tok.identity()["name"] == "tiktoken"
    # this file is byte for byte tiktoken's r50k_base (its sha256), so it brings r50k's split pattern, as GPT-2 splits
    assert hashlib.sha256(path.read_bytes()).hexdigest() == R50K_SHA256
    # a dataset made with it: every document as tiktoken itself encodes it with these ranks and r50k_base's split
    # pattern (its own definition in tiktoken_ext), then EOS
    import tiktoken
    import tiktoken_ext.openai_public as openai_public

    ref = tiktoken.Encoding("ref", pat_str=openai_public.r50k_pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                            special_tokens={})
    _, m = dataset(tmp_path, corpus, str(path), 1, "tt")
    assert m["tokenizer"]["name"] == "tiktoken" and m["totals"]["documents"] == 60
    ids = np.concatenate([np.fromfile(tmp_path / "tt" / sh["file"], dtype=m["dtype"])
                          for sp in ("train", "val") for sh in m["splits"][sp]["shards"]])
    docs = np.split(ids, np.flatnonzero(ids == 50256) + 1)[:-1]
    assert len(docs) == 60
    for d in docs:
        assert ref.encode_ordinary(gpt2.decode(d[:-1].tolist())) == d[:-1].tolist()
    assert sum(" 1" in gpt2.decode(d.tolist()) for d in docs) > 5  # the patterns differ here (cl100k splits " 1")


@pytest.mark.slow
def test_a_tiktoken_file_exports_as_a_tokenizer_json_with_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    from pipeline.export.tokenizer_files import write_user_tokenizer

    tok = load_tokenizer(str(gpt2_ranks_file(tmp_path)))
    write_user_tokenizer(tmp_path / "hf", tok, 64)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Hello world!  The gate decides \n\n how 123456 much, héllo 日本 it's IT'S"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == hf.pad_token_id == tok.eos_id == 50256


def test_a_mismatch_is_one_line_naming_both_tokenizers(tmp_path, corpus, stdlib_tok):
    cfg, manifest = dataset(tmp_path, corpus, str(stdlib_tok), 1, "ds")
    other = trained_file(tmp_path / "other", [SourceConfig(kind="stdlib", max_bytes=300_000)], 600)
    cfg.model.vocab_size = 1024
    check_dataset_matches_model(manifest, cfg)  # its own tokenizer: fits (vocab_size == n_vocab)
    for spec in ("gpt2", str(other)):
        cfg.data.tokenizer = spec
        with pytest.raises(ValueError) as e:
            check_dataset_matches_model(manifest, cfg)
        msg = str(e.value)
        assert "\n" not in msg and "vocab_hash" in msg and manifest["tokenizer"]["vocab_hash"] in msg, msg


E2E_HF = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # the folder's config.json names custom code
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
with torch.no_grad():
    logits = model(**ids).logits[0].tolist()
    out = model.generate(**ids, max_new_tokens=new, do_sample=False, eos_token_id=tok.eos_token_id)
print(json.dumps({"ids": ids["input_ids"][0].tolist(), "logits": logits,
                  "text": tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mtype", ["gpt", "grt"])
def test_train_eval_generate_export_reload_with_the_trained_tokenizer(tmp_path, corpus, mtype, capsys):
    """tokenize -> 2-step train (vocab padded to 128) -> eval -> generate -> export -> transformers: equal logits and
    the same text; the user's tokenizer file is moved away after training, so every later stage reads the copies."""
    import torch

    from pipeline.train.trained import load_trained

    sources = tiny_recipe(tmp_path, corpus)["data"]["sources"]
    user = trained_file(tmp_path / "user", [SourceConfig(**s) for s in sources], 300)
    n_vocab = load_tokenizer(str(user)).n_vocab
    model = {"type": mtype, "block": "gpt2", "vocab_size": n_vocab, "vocab_multiple": 128, "n_layer": 2}
    if mtype == "grt":
        model = {"type": "grt", "block": "gpt2", "vocab_size": n_vocab, "vocab_multiple": 128}
    recipe = tiny_recipe(tmp_path, corpus, data={"tokenizer": str(user)},
                         train={"max_steps": 2, "eval_interval": 2, "checkpoint_interval": 2},
                         eval={"diagnostics": False})
    recipe["model"] = {**{k: recipe["model"][k] for k in ("block_size", "d_model", "n_head")}, **model} \
        if mtype == "gpt" else {**recipe["model"], **model}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert grt(["tokenize", str(path)]) == 0
    assert grt(["train", str(path)]) == 0
    run = Path(recipe["out_dir"]) / "tiny"
    assert (run / "tokenizer.json").read_bytes() == user.read_bytes()
    user.rename(tmp_path / "moved.json")  # the user's file is gone: eval, generate and export read the copies
    assert grt(["eval", str(run)]) == 0
    prompt, new = "Document 3. the gate", 8
    capsys.readouterr()
    assert grt(["generate", str(run), prompt, "--max-new-tokens", str(new)]) == 0  # greedy, stops at EOS
    generated = capsys.readouterr().out.rstrip("\n")
    assert generated.startswith(prompt)
    out = tmp_path / "hf"
    assert grt(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    res = json.loads(subprocess.run([sys.executable, "-c", E2E_HF, str(out), prompt, str(new)], check=True,
                                    capture_output=True, text=True).stdout)
    ref = load_tokenizer(str(tmp_path / "moved.json"))  # the user's tokenizer itself
    assert res["ids"] == ref.encode(prompt)
    ours, _, _, _ = load_trained(run, device="cpu")
    with torch.no_grad():
        logits = ours(torch.tensor([res["ids"]]))[0][0]
    assert logits.shape[-1] == n_vocab  # the padded rows never show in a prediction
    assert torch.allclose(torch.tensor(res["logits"]), logits.float(), atol=1e-4, rtol=1e-4)
    assert prompt + res["text"] == generated
    from pipeline.eval.lm_eval.harness import GRTLM  # lm-eval's `grt` model reads the run folder's copy too

    lm = GRTLM(checkpoint=str(run), batch_size=2, device="cpu")
    assert lm.tok_encode(prompt) == res["ids"] and lm.eot_token_id == ref.eos_id == 0
    assert lm.tok_decode(res["ids"]) == prompt
