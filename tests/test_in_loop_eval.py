"""In-loop evaluation at every depth (train.eval_exits): the same numbers as `grt eval`, bpb by hand."""
import json
import math

import pytest

from pipeline.train.in_loop_eval import bits_per_byte
from pipeline.train.in_loop_eval import byte_lengths

pytestmark = pytest.mark.usefixtures("one_thread")


class _Bytes:
    n_vocab = 3

    def token_bytes(self, t):
        return [b"a", "é".encode(), b"xyz"][t]


def test_bpb_by_hand():
    table = byte_lengths(_Bytes(), 5)  # ids 3, 4: the padded vocabulary, no bytes
    assert table.tolist() == [1, 2, 3, 0, 0]
    # 4 tokens "a", "é", "xyz", "a" = 1 + 2 + 3 + 1 = 7 bytes, 2 nats each
    assert bits_per_byte(8.0, 7) == pytest.approx(8.0 / math.log(2) / 7)


def test_eval_budget_cuts_the_batches_to_fit(capsys):
    """20 batches in 4 s against 10 s of training at a 10% budget: 0.2 s a batch, 1 s allowed, 5 batches, said once."""
    from types import SimpleNamespace

    from pipeline.train.in_loop_eval import InLoopEval

    ile = InLoopEval.__new__(InLoopEval)
    ile.cfg = SimpleNamespace(train=SimpleNamespace(eval_budget=0.1))
    ile.backend = SimpleNamespace(world_size=1, is_main=True)
    ile.max_batches, ile.cut_said = 20, False
    ile._fit_budget(4.0, 10.0, 20)
    ile._fit_budget(4.0, 10.0, 20)
    assert ile.max_batches == 5
    assert capsys.readouterr().err.count("cut to 5 validation batches") == 1
    ile._fit_budget(0.5, 10.0, 5)  # within the budget: left as it is
    assert ile.max_batches == 5


def test_in_loop_exit_losses_equal_grt_eval(tiny):
    from pipeline.eval.stage import evaluate
    from pipeline.tokenize import tokenize
    from pipeline.tokenize.tokenizers import dataset_tokenizer
    from pipeline.train.data import TokenShards
    from pipeline.train.data import validation_batches
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
    # bpb: the reference exit's summed nats over the UTF-8 bytes of the scored targets, counted here by joining bytes
    tok = dataset_tokenizer(cfg)
    targets = [int(t) for b in validation_batches(TokenShards(cfg.data.dataset_dir, "val"), 32, 4, max_batches=2,
                                                  vocab_size=cfg.model.vocab_size) for t in b[1].reshape(-1)]
    n_bytes = len(b"".join(tok.token_bytes(t) for t in targets))
    ref = got[res["ref_exit"]]
    assert last["val_bpb"] == pytest.approx(ref * len(targets) / math.log(2) / n_bytes, rel=1e-9)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_rank_in_loop_eval_equals_one_rank(tmp_path):
    """2 ranks (DDP, gloo) score 3 batches as 2 + 1 and reduce once: the curve of one process over all 3."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port
    from conftest import launched_recipe
    from conftest import subprocess_env
    from pipeline.eval.stage import evaluate

    repo = Path(__file__).resolve().parents[1]
    recipe = launched_recipe(tmp_path, backend="ddp", eval_exits=True, eval_batches=3, max_steps=2, eval_interval=2,
                             collective_timeout_s=60)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "pipeline.cli", "train", str(recipe)], cwd=repo,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(line) for line in lines if "exit_loss" in line][-1]
    res = evaluate(run_dir, ["eval.val_tokens=192", "eval.batch_size=2", "eval.diagnostics=false"], quiet=True)
    assert last["exit_tokens"] == res["val_tokens"] == 3 * 2 * 32
    got = dict(zip(last["exit"], last["exit_loss"]))
    assert [got[e] for e in res["exit"]] == pytest.approx(res["loss"], abs=1e-6)
