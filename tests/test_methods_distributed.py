"""The paper's four recurrent competitors (poisson, mor, rrt, ouro) under every backend, launched as a user would:

- each trains 10 steps in one process, and on 2 ranks under ddp, fsdp and DeepSpeed ZeRO-3; every 2-rank run is
  SIGKILLed after step 7 (checkpoint at 5) and started again, resumes at step 5 (resume_check), and its per-step
  losses — steps 1-5 from the killed run, 6-10 from the resumed one — equal the one-process run's (rel 1e-5: only
  the reduction order differs, fp32);
- Poisson's depth sampler and truncated backprop survive a SIGKILL exactly (one process: bit-equal losses);
- `grt eval` reads the last checkpoint of every backend (full, DCP sharded, DeepSpeed) and gives the same validation
  loss as the one-process run's.
"""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from conftest import model_recipes
from conftest import step_losses
from conftest import subprocess_env
from resume_check import assert_resumed
from test_distributed import REPO
from test_distributed import command
from test_distributed import run
from test_distributed import where

pytestmark = pytest.mark.slow

STEPS, CKPT_EVERY, KILL_AFTER = 10, 5, 7
METHODS = {
    # backprop_steps 2 < the sampled depths: most steps run some recurrence steps without gradient
    "poisson": {"type": "poisson", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3,
                "backprop_steps": 2},
    "mor": {"type": "mor", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3},
    "rrt": {"type": "rrt", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3, "lora_rank": 4,
            "lora_alpha": 8.0},
    "ouro": {"type": "ouro", "n_layer": 2, "n_recurrence": 3},
}
SHARDED = ["ddp", "fsdp", "zero3"]


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """One recipe per method over one tokenized corpus."""
    tmp = tmp_path_factory.mktemp("methods")
    return tmp, model_recipes(tmp, METHODS, dict(micro_batch_size=2, grad_accum_steps=4, max_steps=STEPS,
                                                 checkpoint_interval=CKPT_EVERY, eval_interval=5), {"mor": 3})


def killed_then_resumed(backend: str, recipe, name: str) -> str:
    """The resumed run's console output."""
    p = subprocess.run(command(backend, recipe, name), cwd=REPO, capture_output=True, text=True, timeout=600,
                       env=subprocess_env(GRT_FAULT_KILL_AT_STEP=str(KILL_AFTER)))
    assert p.returncode != 0, p.stdout[-2000:] + p.stderr[-2000:]
    return run(backend, recipe, name).stdout  # starts again from the checkpoint at step 5


@pytest.fixture(scope="module")
def trained(recipes):
    """{(method, backend): (per-step losses, the resumed run's console output or None)}; the 2-rank runs are killed
    once and resumed."""
    tmp, paths = recipes
    out = {}
    for method, recipe in paths.items():
        run("single", recipe, f"{method}-single")
        out[(method, "single")] = step_losses(tmp / "runs" / f"{method}-single"), None
        for backend in SHARDED:
            name = f"{method}-{backend}"
            stdout = killed_then_resumed(backend, recipe, name)
            out[(method, backend)] = step_losses(tmp / "runs" / name), stdout
    return out


@pytest.mark.parametrize("backend", SHARDED)
@pytest.mark.parametrize("method", list(METHODS))
def test_killed_and_resumed_two_rank_runs_equal_one_process(recipes, trained, method, backend):
    (single, _), (other, resumed_stdout) = trained[(method, "single")], trained[(method, backend)]
    assert_resumed(resumed_stdout, CKPT_EVERY, STEPS, recipes[0] / "runs" / f"{method}-{backend}", single, rel=1e-5,
                   on=where(backend))
    assert sorted(single) == sorted(other) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in single.values())
    for step in range(1, STEPS + 1):
        assert other[step] == pytest.approx(single[step], rel=1e-5, abs=1e-6), (method, backend, step)


def test_poisson_depths_and_truncated_backprop_resume_exactly_after_sigkill(recipes, trained):
    tmp, paths = recipes
    stdout = killed_then_resumed("single", paths["poisson"], "poisson-killed")
    assert_resumed(stdout, CKPT_EVERY, STEPS, tmp / "runs" / "poisson-killed", trained[("poisson", "single")][0],
                   on=where("single"))  # bit-equal losses
    depths = {}
    for line in (tmp / "runs" / "poisson-single" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "depth" in row:
            depths[row["step"]] = row["depth"]
    assert len(set(depths.values())) > 1, f"the sampled depth never changed over {STEPS} steps: {depths}"
    assert max(depths.values()) > METHODS["poisson"]["backprop_steps"], "no step ran without gradient"


@pytest.mark.parametrize("method", list(METHODS))
def test_eval_reads_the_checkpoint_of_every_backend(recipes, trained, method):
    from pipeline.eval.stage import evaluate

    tmp, _ = recipes
    results = {b: evaluate(tmp / "runs" / f"{method}-{b}", ["tracking.enabled=false"], quiet=True)
               for b in ["single", *SHARDED]}
    ref = results["single"]
    assert ref["step"] == STEPS and math.isfinite(ref["val_loss"])
    assert len(ref["exit"]) == len(ref["loss"]) >= 3
    for b, res in results.items():
        assert res["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4), (method, b)
    if method == "mor":
        assert [round(f, 6) for f in ref["method"]["mor"]["topk"]["fraction"]] == \
            [1.0, round(int(2 / 3 * 32) / 32, 6), round(int(1 / 3 * 32) / 32, 6)]
    if method == "ouro":
        assert sum(ref["method"]["ouro"]["exit_probability"]) == pytest.approx(1.0, abs=1e-6)
