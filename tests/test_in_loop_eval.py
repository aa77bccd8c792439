"""In-loop evaluation at every depth (train.eval_exits): the same numbers as `grt eval`, bpb by hand."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.train.in_loop_eval import bits_per_byte
from pipeline.train.in_loop_eval import byte_lengths

pytestmark = pytest.mark.usefixtures("one_thread")


class _Bytes:
    n_vocab, eos_id = 4, 3

    def token_bytes(self, t):
        return [b"a", "é".encode(), b"xyz", b"<|endoftext|>"][t]


def test_bpb_by_hand():
    table = byte_lengths(_Bytes(), 6)  # id 3: the EOS, no text; ids 4, 5: the padded vocabulary, no bytes
    assert table.tolist() == [1, 2, 3, 0, 0, 0]
    # 4 tokens "a", "é", "xyz", "a" = 1 + 2 + 3 + 1 = 7 bytes, 2 nats each
    assert bits_per_byte(8.0, 7) == pytest.approx(8.0 / math.log(2) / 7)


def test_eval_history_keeps_the_steps_up_to_the_resume(tmp_path):
    """Rows of a discarded future (step 6 > resumed 4), step rows and a line cut by a kill are left out."""
    from pipeline.train.in_loop_eval import eval_history

    rows = [{"step": 2, "exit": [0, 1], "exit_loss": [5.0, 4.0]}, {"step": 3, "loss": 4.5},
            {"step": 4, "exit": [0, 1], "exit_loss": [4.0, 3.0]}, {"step": 6, "exit": [0, 1], "exit_loss": [3.0, 2.0]}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "exit_lo')
    assert eval_history(path, 4) == [(2, [0, 1], [5.0, 4.0]), (4, [0, 1], [4.0, 3.0])]
    assert eval_history(tmp_path / "none.jsonl", 4) == []


def test_eval_budget_cuts_the_batches_to_fit(capsys):
    """20 batches in 4 s against 10 s of training at a 10% budget: 0.2 s a batch, 1 s allowed, 5 batches, said once."""
    from types import SimpleNamespace

    from pipeline.train.in_loop_eval import InLoopEval

    ile = InLoopEval.__new__(InLoopEval)
    ile.cfg = SimpleNamespace(train=SimpleNamespace(eval_budget=0.1))
    ile.backend = SimpleNamespace(world_size=1, is_main=True, reduce_max=lambda v: v)
    ile.max_batches, ile.cut_said = 20, False
    ile._fit_budget(4.0, 10.0, 20)
    ile._fit_budget(4.0, 10.0, 20)
    assert ile.max_batches == 5
    assert capsys.readouterr().err.count("cut to 5 validation batches") == 1
    ile._fit_budget(0.5, 10.0, 5)  # within the budget: left as it is
    assert ile.max_batches == 5

    # 2 ranks, each its own clock (1.06 s and 0.99 s of eval): both decide on the slowest (a MAX reduction), so
    # they keep scoring the same batches (under FSDP / ZeRO-3 the same forwards); by hand: 1.06 / 20 = 0.053 s a
    # batch, 1 s allowed -> 18 batches on both
    clocks = [(1.06, 10.0), (0.99, 10.0)]
    ranks = []
    for rank in (0, 1):
        r = InLoopEval.__new__(InLoopEval)
        r.cfg = ile.cfg
        seen = iter([max(c[0] for c in clocks), max(c[1] for c in clocks)])  # what the all-reduce gives each rank
        r.backend = SimpleNamespace(world_size=2, is_main=rank == 0, reduce_max=lambda v, seen=seen: next(seen))
        r.max_batches, r.cut_said = 20, False
        r._fit_budget(*clocks[rank], 20)
        ranks.append(r.max_batches)
    assert ranks == [18, 18]


def test_in_loop_exit_losses_equal_grt_eval(tiny):
    from pipeline.eval.stage import evaluate
    from pipeline.tokenize import tokenize
    from pipeline.tokenize.tokenizers import dataset_tokenizer
    from pipeline.train.data import TokenShards
    from pipeline.train.data import validation_batches
    from pipeline.train.trainer import Trainer
    from pipeline.train.trainer import train

    cfg = tiny(train={"eval_exits": True}, eval={"diagnostics": False})
    tokenize(cfg.data, quiet=True)
    train(cfg)
    evals = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
             if "exit_loss" in line]
    assert [e["step"] for e in evals] == [2, 4]
    assert (cfg.run_dir / "eval_curve.png").stat().st_size > 0
    last = evals[-1]
    res = evaluate(cfg.run_dir, quiet=True)
    assert res["step"] == 4 and res["val_tokens"] == last["exit_tokens"]
    # grt eval reports r = 0 apart (loss_r0); tolerance: the same fp32 arithmetic on the same batches, 1e-6 (measured 0)
    got = dict(zip(last["exit"], last["exit_loss"]))
    assert [got[e] for e in res["exit"]] == pytest.approx(res["loss"], abs=1e-6)

    # resumed at step 4: eval_curve.png's history holds the evals before the resume (read back from metrics.jsonl)
    t = Trainer(cfg)
    assert [h[0] for h in t.in_loop_eval.history] == [2, 4]
    assert t.in_loop_eval.history[-1][2] == last["exit_loss"]
    # bpb by hand over 12 batches (several documents' EOS among the targets): the nats of the non-special targets,
    # from the step-4 model's logits at the trained depth by a plain cross-entropy, over the UTF-8 bytes of the
    # decoded text between the EOS separators
    tok = dataset_tokenizer(cfg)
    batches = list(validation_batches(TokenShards(cfg.data.dataset_dir, "val"), 32, 4, max_batches=12,
                                      vocab_size=cfg.model.vocab_size))
    model = t.raw_model.eval()
    nats, n_bytes, n_eos = 0.0, 0, 0
    with torch.no_grad():
        for b in batches:
            x, y = b.inputs, b.targets
            logits, _ = model(x, n_steps=cfg.model.n_recurrence)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), y.reshape(-1), reduction="none")
            keep = y.reshape(-1) != tok.eos_id
            nats += loss[keep].sum().item()
            n_eos += int((~keep).sum())
            for row in y.tolist():
                text, piece = [], []
                for i in row + [tok.eos_id]:
                    if i == tok.eos_id:
                        text.append(tok.decode(piece))
                        piece = []
                    else:
                        piece.append(i)
                n_bytes += sum(len(s.encode("utf-8")) for s in text)
    assert n_eos >= 2
    t.in_loop_eval.max_batches = 12
    out = t.in_loop_eval.run(t)
    # tolerance: an fp32 forward against the exit pass over 1536 tokens, measured rel 4e-10; 1e-7 allowed
    assert out["val_bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-7)
    t.in_loop_eval.max_batches = 2
    t.fit()  # resumed at max_steps: one more eval, then the run folder is released


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_rank_in_loop_eval_equals_one_rank(tmp_path):
    """2 ranks (DDP, FSDP and DeepSpeed ZeRO-3, gloo, launched side by side) score 3 batches as 2 + 1 and reduce
    once: the curve of one process over all 3. With sharded parameters rank 1 pads with an uncounted forward (the
    all-gathers pair up, or it hangs)."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port
    from conftest import launched_recipe
    from conftest import subprocess_env
    from pipeline.eval.stage import evaluate

    repo = Path(__file__).resolve().parents[1]
    procs = {}
    zero3 = {"backend": "deepspeed", "zero_stage": 3}
    for name, backend in (("ddp", {"backend": "ddp"}), ("fsdp", {"backend": "fsdp"}), ("zero3", zero3)):
        recipe = launched_recipe(tmp_path / name, **backend, eval_exits=True, eval_batches=3, max_steps=2,
                                 eval_interval=2, collective_timeout_s=60)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
             str(free_port()), "-m", "pipeline.cli", "train", str(recipe)], cwd=repo, env=subprocess_env(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for backend, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{backend}: {err[-3000:]}"
    # all three measured equal (0): the same fp32 weights and arithmetic; 1e-6 allowed for a summation order
    for backend in ("ddp", "fsdp", "zero3"):
        run_dir = tmp_path / backend / "runs" / "tiny"
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        last = [json.loads(line) for line in lines if "exit_loss" in line][-1]
        res = evaluate(run_dir, ["eval.val_tokens=192", "eval.batch_size=2", "eval.diagnostics=false"], quiet=True)
        assert last["exit_tokens"] == res["val_tokens"] == 3 * 2 * 32
        got = dict(zip(last["exit"], last["exit_loss"]))
        assert [got[e] for e in res["exit"]] == pytest.approx(res["loss"], abs=1e-6), backend
