"""train.eval_tasks: downstream scores at each eval against `grt eval` on the same checkpoint (the independent path),
training unchanged by them, and the recipe / data refusals."""
import json
from pathlib import Path

import pytest

from conftest import tiny_recipe
from pipeline.config import RecipeError
from pipeline.config import from_dict
from test_eval import make_task_data

TASKS, LIMIT = ["piqa", "lambada_openai"], 4


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.slow
def test_in_loop_tasks_equal_grt_eval_and_leave_training_unchanged(tmp_path, corpus):
    """Two tiny runs, one with train.eval_tasks: the same losses bit for bit (lm-eval reseeds the RNGs the GRT noise
    draws from); the in-loop scores at the last step equal `grt eval` on the last checkpoint with the same limit, and
    MLflow holds them at every eval step."""
    from mlflow.tracking import MlflowClient

    from pipeline.eval.stage import evaluate
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    data = make_task_data(tmp_path / "eval", n=6)
    plain = from_dict(tiny_recipe(tmp_path, corpus, name="plain"))
    tokenize(plain.data, quiet=True)
    Trainer(plain).fit()
    cfg = from_dict(tiny_recipe(tmp_path, corpus, name="tasks", train={"eval_tasks": TASKS, "eval_task_limit": LIMIT},
                                eval={"task_data_dir": str(data), "task_batch_size": 3},
                                tracking={"enabled": True}))
    Trainer(cfg).fit()
    assert losses(cfg.run_dir) == losses(plain.run_dir) and len(losses(plain.run_dir)) == 4

    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(evals) == [2, 4]
    res = evaluate(cfg.run_dir, [f"eval.tasks=[{','.join(TASKS)}]", f"eval.task_limit={LIMIT}"], quiet=True)
    (depth, table), = res["downstream"]["depths"].items()
    want = {f"task_{t}_{m}": v for t, row in table.items() for m, v in row.items()
            if m != "items" and not m.endswith("_stderr")}
    assert set(want) == {"task_piqa_acc", "task_piqa_acc_norm", "task_lambada_openai_acc",
                         "task_lambada_openai_perplexity"}
    assert {k: evals[4][k] for k in want} == want
    assert evals[2]["task_lambada_openai_perplexity"] != evals[4]["task_lambada_openai_perplexity"]  # trained on
    client = MlflowClient(cfg.tracking.uri)
    run_id = client.search_runs(client.get_experiment_by_name(cfg.tracking.experiment).experiment_id,
                                f"tags.run_dir = '{cfg.run_dir.resolve()}'")[0].info.run_id
    hist = client.get_metric_history(run_id, "task_piqa_acc")
    assert sorted((m.step, m.value) for m in hist) == [(s, evals[s]["task_piqa_acc"]) for s in (2, 4)]


def test_eval_tasks_refusals(tmp_path, corpus):
    """Unknown task (did you mean), a bad limit: refused with the recipe; a missing task file:
    refused when the trainer starts, before any step, naming the file."""
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    with pytest.raises(RecipeError) as e:
        from_dict(tiny_recipe(tmp_path, corpus, train={"eval_tasks": ["piqaa"], "eval_task_limit": 0}))
    msg = str(e.value)
    assert "train.eval_tasks: unknown task 'piqaa' — did you mean 'piqa'?" in msg
    assert "train.eval_task_limit must be an integer >= 1" in msg
    for train, said in (({"eval_tasks": "piqa"}, "train.eval_tasks must be a list of task names"),
                        ({"eval_task_limit": 5}, "train.eval_task_limit only applies to train.eval_tasks")):
        with pytest.raises(RecipeError, match=said):
            from_dict(tiny_recipe(tmp_path, corpus, train=train))
    data = make_task_data(tmp_path / "eval", n=2)
    (data / "piqa/original/valid-labels.lst").unlink()
    cfg = from_dict(tiny_recipe(tmp_path, corpus, train={"eval_tasks": ["piqa"]}, eval={"task_data_dir": str(data)}))
    tokenize(cfg.data, quiet=True)
    with pytest.raises(FileNotFoundError, match=r"lacks 1 file\(s\) of eval.tasks \(piqa: piqa/original/valid-labels"):
        Trainer(cfg)
    assert not (cfg.run_dir / "metrics.jsonl").exists()


def test_rng_kept_puts_back_every_rng_lm_eval_reseeds():
    """lm-eval seeds random, NumPy and torch (random_seed=0, 1234, 1234): after the block, each draws what it would
    have drawn without the block (the trainer reseeds torch per micro-step anyway; other code may not)."""
    import random

    import numpy as np
    import torch

    from pipeline.train.in_loop_tasks import rng_kept

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    want = draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    with rng_kept(torch.device("cpu")):
        random.seed(0), np.random.seed(1234), torch.manual_seed(1234)
        draws()
    assert draws() == want


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero3"])
def test_two_ranks_score_on_every_rank_and_equal_grt_eval(tmp_path, backend):
    """2 ranks of ddp, fsdp and ZeRO-3: both ranks score for themselves (lm-eval answers on LOCAL_RANK 0 only:
    without the in-loop override rank 1 would get None and fail), the same forwards on both (sharded parameters are
    gathered in them; the head's weight for the call), nobody waits, and rank 0's scores equal `grt eval` on the
    checkpoint."""
    import subprocess
    import sys

    import yaml

    from conftest import free_port
    from conftest import launched_recipe
    from conftest import subprocess_env
    from pipeline.eval.stage import evaluate

    data = make_task_data(tmp_path / "eval", n=6)
    extra = {"backend": "deepspeed", "zero_stage": 3} if backend == "zero3" else {"backend": backend}
    recipe = launched_recipe(tmp_path, **extra, eval_tasks=TASKS, eval_task_limit=LIMIT, max_steps=2,
                             eval_interval=2, collective_timeout_s=60)
    r = yaml.safe_load(recipe.read_text())
    r["eval"]["task_data_dir"] = str(data)
    recipe.write_text(yaml.safe_dump(r))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "pipeline.cli", "train", str(recipe)], env=subprocess_env(),
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("tasks step 2 |") == 1  # rank 0 prints
    run_dir = tmp_path / "runs" / "tiny"
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "task_piqa_acc" in line][-1]
    res = evaluate(run_dir, [f"eval.tasks=[{','.join(TASKS)}]", f"eval.task_limit={LIMIT}"], quiet=True)
    (_, table), = res["downstream"]["depths"].items()
    assert {f"task_{t}_{m}": last[f"task_{t}_{m}"] for t, row in table.items() for m in row
            if m != "items" and not m.endswith("_stderr")} == {
        f"task_{t}_{m}": v for t, row in table.items() for m, v in row.items()
        if m != "items" and not m.endswith("_stderr")}
