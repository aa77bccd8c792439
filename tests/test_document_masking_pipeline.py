"""Document masking from the shards to the model (``data.document_masking``): the loader's per-token document index
from the shards' .idx files against EOS and a hand count, the EOS fallback for a dataset without .idx files, a masked
training run whose validation loss equals separate forwards over each document of the saved model, the backends
against one process, and exact resume. (The models' own masking contract: tests/test_document_masking.py.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import free_port
from conftest import launched_recipe
from conftest import step_losses
from conftest import subprocess_env
from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards
from pipeline.train.data import validation_batches
from resume_check import assert_resumed

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the model reads a window of packed documents and each token attends only to earlier tokens of its own "
         "document while positions restart at every boundary of the text")
SEQ = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Short documents (3 to 40 words: about 30 tokens, so most 32-token windows hold a boundary), tokenized."""
    tmp = tmp_path_factory.mktemp("docmask")
    words = WORDS.split()
    lines = [json.dumps({"text": " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + (i * 11) % 38))})
             for i in range(400)]
    (tmp / "docs.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tiny_recipe(tmp, tmp, data={"document_masking": True,
                                         "sources": [{"kind": "files", "paths": [str(tmp / "docs.jsonl")]}]})
    tokenize(from_dict(recipe).data, quiet=True)
    return tmp, recipe


def test_the_recipe_key_defaults_off_and_is_checked():
    from pipeline.config import RecipeError

    assert from_dict({}).data.document_masking is False
    assert from_dict({"data": {"document_masking": True}}).data.document_masking is True
    for data, words in (({"document_mask": True}, "did you mean 'data.document_masking'"),
                        ({"document_masking": "yes"}, "data.document_masking must be true or false")):
        with pytest.raises(RecipeError, match=words):
            from_dict({"data": data})


def test_grt_info_says_when_masking_is_on_and_counts_the_same_flops(tmp_path, capsys):
    from pipeline.cli import main as grt

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "model": {"type": "gpt", "block_size": SEQ, "d_model": 32,
                                                           "n_head": 2, "n_layer": 2}}))
    out = {}
    for on in (False, True):
        assert grt(["info", str(path), f"data.document_masking={str(on).lower()}"]) == 0
        out[on] = capsys.readouterr().out
    assert "within each document" in out[True] and "document" not in out[False]
    flops = [line for line in out[True].splitlines() if " G)" in line]  # the FLOPs/token figures
    assert len(flops) >= 2 and flops == [line for line in out[False].splitlines() if " G)" in line]


def eos_count(tokens, eot: int) -> list[int]:
    """By hand: token t's document is the number of end-of-text tokens before it in the window."""
    out, n = [], 0
    for tok in tokens:
        out.append(n)
        n += int(tok == eot)
    return out


def idx_count(starts, first: int, length: int) -> list[int]:
    """By hand: token first+t's document is the number of .idx starts in (first, first+t]."""
    return [sum(1 for s in starts if first < s <= first + t) for t in range(length)]


def test_loader_docs_from_idx_equal_docs_from_eos_and_a_hand_count(dataset):
    tmp, recipe = dataset
    shards = TokenShards(recipe["data"]["dataset_dir"], "train")
    eot = shards.manifest["tokenizer"]["eot_id"]
    assert all(shards.document_starts(i) is not None for i in range(len(shards.shards)))  # the writer made .idx
    crossing = 0
    for shard, start in shards.window_index(SEQ)[:60]:
        window = shards.window(int(shard), int(start), SEQ)
        docs = shards.window_docs(int(shard), int(start), SEQ, window).tolist()
        assert docs == eos_count(window[:SEQ], eot) == idx_count(shards.document_starts(int(shard)), int(start), SEQ)
        crossing += docs[-1] > 0
    assert crossing >= 30  # windows that hold a document boundary (the check is not vacuous)
    # the loader's batches carry exactly those docs, for the inputs of their windows; the rest is unchanged
    plain = SequenceLoader(shards, SEQ, 4, seed=3)
    masked = SequenceLoader(shards, SEQ, 4, seed=3, document_masking=True)
    for _ in range(5):
        (x, y, none), (mx, my, docs) = plain.next_batch(), masked.next_batch()
        assert none is None and torch.equal(x, mx) and torch.equal(y, my)
        assert docs.shape == x.shape and docs.dtype == torch.int64
        assert docs.tolist() == [eos_count(row.tolist(), eot) for row in x]
    assert masked.state_dict() == plain.state_dict()  # docs are a function of the window: no loader state
    val = TokenShards(recipe["data"]["dataset_dir"], "val")
    for x, _, docs in validation_batches(val, SEQ, 4, max_batches=3, document_masking=True):
        assert docs.tolist() == [eos_count(row.tolist(), eot) for row in x]


def test_the_idx_is_read_where_it_exists_and_eos_where_it_does_not(dataset, tmp_path):
    _, recipe = dataset
    copy = tmp_path / "dataset"
    shutil.copytree(recipe["data"]["dataset_dir"], copy)
    shards = TokenShards(copy, "train")
    eot = shards.manifest["tokenizer"]["eot_id"]
    first = shards.shards[0]
    starts = np.fromfile(copy / first["index_file"], dtype="<u4")
    # forget one document start in the .idx: the loader now merges those two documents (it reads the index) ...
    dropped = int(starts[3])
    np.delete(starts, 3).astype("<u4").tofile(copy / first["index_file"])
    window = shards.window(0, dropped - 5, SEQ)
    docs = TokenShards(copy, "train").window_docs(0, dropped - 5, SEQ, window).tolist()
    assert docs == idx_count(np.delete(starts, 3), dropped - 5, SEQ) != eos_count(window[:SEQ], eot)
    # ... and without .idx files it counts end-of-text tokens
    for f in copy.glob("*.idx"):
        f.unlink()
    bare = TokenShards(copy, "train")
    assert bare.document_starts(0) is None
    assert bare.window_docs(0, dropped - 5, SEQ, window).tolist() == eos_count(window[:SEQ], eot)
    x, _, docs = SequenceLoader(bare, SEQ, 4, seed=1, document_masking=True).next_batch()
    assert docs.tolist() == [eos_count(row.tolist(), eot) for row in x]


def separate_document_loss(model, x: torch.Tensor, y: torch.Tensor, eot: int, n_steps) -> tuple[float, int]:
    """Summed next-token loss (fp64) of windows ``x`` -> ``y``, each document of each window run on its own (no
    mask, positions from 0), and the token count."""
    total, count = 0.0, 0
    at = {} if n_steps is None else {"n_steps": n_steps}
    for row, tgt in zip(x, y):
        docs = torch.tensor(eos_count(row.tolist(), eot))
        for d in docs.unique():
            sel = docs == d
            logits, _ = model(row[sel][None], **at)
            total += F.cross_entropy(logits[0].double(), tgt[sel], reduction="sum").item()
            count += int(sel.sum())
    return total, count


@pytest.mark.slow  # training, then `grt eval` with GRT's analyses: 15-35 s each
@pytest.mark.parametrize("mtype", ["gpt", "grt"])
def test_a_masked_run_trains_and_its_validation_loss_is_that_of_separate_documents(dataset, tmp_path, mtype):
    from pipeline.train.trained import load_trained
    from pipeline.train.trainer import Trainer

    _, base = dataset
    model = {"type": "gpt", "block_size": SEQ, "d_model": 32, "n_head": 2, "n_layer": 2} if mtype == "gpt" else \
        base["model"]
    recipe = {**base, "name": f"masked-{mtype}", "out_dir": str(tmp_path / "runs"), "model": model,
              "train": {**base["train"], "max_steps": 2, "eval_interval": 2, "checkpoint_interval": 2}}
    cfg = from_dict(recipe)
    trainer = Trainer(cfg)
    initial = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    trainer.fit()
    losses = step_losses(cfg.run_dir)
    assert list(losses) == [1, 2] and losses[2] < losses[1]
    if mtype == "gpt":  # no noise, no sampled depth: step 1's loss by hand from the initial weights and the batches
        ref = type(trainer.raw_model)(cfg.model)
        ref.load_state_dict(initial)
        ref.eval()
        loader = SequenceLoader(TokenShards(cfg.data.dataset_dir, "train"), SEQ, cfg.train.micro_batch_size, cfg.seed)
        with torch.no_grad():
            parts = [separate_document_loss(ref, *loader.next_batch()[:2], trainer.val_data.eot_id, None)
                     for _ in range(cfg.train.grad_accum_steps)]
        assert losses[1] == pytest.approx(sum(t / n for t, n in parts) / len(parts), rel=1e-5)
    logged = val_losses(cfg.run_dir)[2]
    trained, _, _, _ = load_trained(cfg.run_dir, device="cpu")
    val = TokenShards(cfg.data.dataset_dir, "val")
    eot = val.manifest["tokenizer"]["eot_id"]
    depth = type(trained).recurrence_depth(cfg.model)
    total, count, whole = 0.0, 0, 0.0
    with torch.no_grad():
        for x, y, _ in validation_batches(val, SEQ, cfg.train.micro_batch_size, max_batches=cfg.train.eval_batches):
            t, n = separate_document_loss(trained, x, y, eot, depth)
            total, count = total + t, count + n
            logits, _ = trained(x, **({} if depth is None else {"n_steps": depth}))
            whole += F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum").item()
    assert logged == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    # unmasked windows give another loss, far outside the agreement above: the check sees the masking
    assert abs(whole / count - logged) > 20 * abs(total / count - logged), (whole / count, total / count, logged)
    # `grt eval`'s exit curve (and, for GRT, its analyses) read the same windows (eval.val_tokens 256 = 8 windows)
    from pipeline.eval.stage import evaluate

    result = evaluate(cfg.run_dir, quiet=True)
    assert result["val_tokens"] == count
    assert result["val_loss"] == pytest.approx(total / count, rel=1e-5, abs=1e-6)


@pytest.mark.slow  # dynamo: ~30 s on a loaded 2-core CPU
@pytest.mark.parametrize("mtype, checkpointing", [("gpt", "blocks"), ("grt", "core_step")])
def test_activation_checkpointing_and_compile_pass_docs_without_recompiling(mtype, checkpointing):
    """train.activation_checkpointing and train.compile (dynamo; aot_eager: no C++ toolchain needed) as the trainer
    applies them: the masked loss and gradients of the plain model, and no new graph when the documents change."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    from pipeline.model import model_class
    from pipeline.model.layout import documents_from_eos
    from pipeline.train.parallelize import apply_activation_checkpointing
    from pipeline.train.parallelize import apply_compile

    m = {"type": "gpt", "block_size": SEQ, "d_model": 32, "n_head": 2, "n_layer": 2} if mtype == "gpt" else \
        {"type": "grt", "block_size": SEQ, "d_model": 32, "n_head": 2, "n_prelude": 1, "n_core": 1, "n_coda": 1}
    torch.manual_seed(0)
    plain = model_class(mtype)(from_dict({"model": m}).model)
    ckpt, compiled = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, checkpointing)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(compiled, backend="aot_eager")

    def loss_and_grads(model, x, y, docs):
        model.zero_grad()
        torch.manual_seed(1)  # GRT's training noise: the same draws for every variant
        _, loss = model(x, y, docs=docs)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    graphs = []
    for i in range(3):
        x, y = torch.randint(0, 20, (2, SEQ)), torch.randint(0, 20, (2, SEQ))
        x[:, 5 + 4 * i] = 3
        docs = documents_from_eos(x, 3)  # a new document layout every batch (3 plays end-of-text)
        assert docs[:, -1].min() > 0
        ref, ref_grads = loss_and_grads(plain, x, y, docs)
        for model in (ckpt, compiled):
            loss, grads = loss_and_grads(model, x, y, docs)
            assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
            for g, r in zip(grads, ref_grads):
                assert (g is None) == (r is None) and (g is None or torch.allclose(g, r, rtol=1e-5, atol=1e-6))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ launched runs: backends and resume
STEPS = 4
BACKENDS = {"single": [], "ddp": ["train.backend=ddp"], "fsdp": ["train.backend=fsdp"],
            "zero3": ["train.backend=deepspeed", "train.zero_stage=3"]}


def train(recipe: Path, name: str, backend: str, **env) -> subprocess.CompletedProcess:
    args = ["-m", "pipeline.cli", "train", str(recipe), f"name={name}", *BACKENDS[backend]]
    launcher = [] if backend == "single" else ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                                               "--master_port", str(free_port())]
    return subprocess.run([sys.executable, *launcher, *args], cwd=REPO, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_masked_backends_equal_one_process_and_resume_exactly(tmp_path):
    """ddp, fsdp and ZeRO-3 (gloo, 2 processes) with document masking give one process's training and validation
    losses (fp32 sums in another order: the tolerance of tests/test_distributed.py); a masked run stopped by SIGTERM
    after step 2 resumes exactly."""
    recipe = launched_recipe(tmp_path, max_steps=STEPS, checkpoint_interval=2, eval_interval=2, grad_accum_steps=4)
    data = yaml.safe_load(recipe.read_text())
    data["data"]["document_masking"] = True
    recipe.write_text(yaml.safe_dump(data))
    runs = tmp_path / "runs"
    for backend in BACKENDS:
        p = train(recipe, f"full-{backend}", backend)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    single = step_losses(runs / "full-single")
    single_val = val_losses(runs / "full-single")
    assert sorted(single) == list(range(1, STEPS + 1))
    for backend in ("ddp", "fsdp", "zero3"):
        got = step_losses(runs / f"full-{backend}")
        for s in range(1, STEPS + 1):
            assert got[s] == pytest.approx(single[s], rel=1e-5, abs=1e-5), (backend, s)
        vals = val_losses(runs / f"full-{backend}")
        assert vals.keys() == single_val.keys() and len(vals) == 2
        for s, v in vals.items():
            assert v == pytest.approx(single_val[s], rel=1e-5, abs=1e-5), (backend, s)
    stopped = train(recipe, "resumed", "single", GRT_FAULT_SIGNAL_AT_STEP="2:SIGTERM")
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    again = train(recipe, "resumed", "single")
    assert again.returncode == 0, again.stderr[-2000:]
    assert_resumed(again.stdout, 2, STEPS, runs / "resumed", single, on="single x1")


def val_losses(run_dir: Path) -> dict[int, float]:
    rows = [yaml.safe_load(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
