"""The phi fit (pipeline/studies/phi.py) on synthetic losses drawn from the law with known parameters: it recovers phi
inside its bootstrap interval, and the limits phi = 0 and phi = 1."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.studies.phi import Run
from pipeline.studies.phi import fit_phi
from pipeline.studies.phi import initial_grid
from pipeline.studies.phi import predict

TRUE = {"E": 1.8, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}


def synthetic(phi: float, noise: float, seed: int = 0) -> list[Run]:
    """An iso-depth grid like recipes/sweeps/phi/: r in {1, 2, 4, 8} x 3 widths x 3 token budgets, losses from the
    law with multiplicative log-normal noise of ``noise``."""
    rng = np.random.default_rng(seed)
    runs = []
    for r in (1, 2, 4, 8):
        for n_rec in (2e6, 8e6, 3.2e7):
            for tokens in (2e8, 8e8, 3.2e9):
                n_once = 0.25 * n_rec
                loss = predict({**TRUE, "phi": phi}, n_once, n_rec, r, tokens)
                runs.append(Run(float(loss * np.exp(noise * rng.standard_normal())), n_once, n_rec, r, tokens))
    return runs


@pytest.mark.parametrize("phi", [0.0, 0.46, 1.0])
def test_noiseless_losses_give_back_the_parameters(phi):
    """Every sixth start of the default grid (16 of 96, for the suite's time) already recovers the law; the noisy test
    below runs the default grid."""
    fit = fit_phi(synthetic(phi, 0.0), n_boot=0, starts=initial_grid()[::6])
    assert fit.params["phi"] == pytest.approx(phi, abs=2e-3)
    assert fit.params["alpha"] == pytest.approx(TRUE["alpha"], rel=1e-2)
    assert fit.params["E"] == pytest.approx(TRUE["E"], rel=1e-2)


def test_noisy_losses_recover_phi_inside_its_bootstrap_interval():
    fit = fit_phi(synthetic(0.46, 0.003, seed=1), n_boot=60, seed=2)
    lo, hi = fit.ci["phi"]
    assert lo <= 0.46 <= hi and hi - lo < 0.3, (fit.params["phi"], lo, hi)
    assert lo <= fit.params["phi"] <= hi


def test_a_sweep_without_several_depths_is_refused():
    runs = [x for x in synthetic(0.5, 0.0) if x.r == 2]
    with pytest.raises(ValueError, match="sweep r"):
        fit_phi(runs)


def test_parameter_split_counts_the_looped_step_as_n_rec():
    """GRT 1+2x4+1 at d 64 by hand: a block 12d^2 + 13d; the step = 2 blocks + W_proj (2d^2 + d) + the gate (two
    LayerNorms 4d, f_g's 2d->d and d->d with biases); once = prelude + coda blocks + the final LN (2d); embeddings
    out by default (token 50,257 x d, positions 128 x d), in with with_embeddings. A dense model: all once."""
    from pipeline.model.configs import GPTConfig
    from pipeline.model.configs import GRTConfig
    from pipeline.studies.phi import parameter_split

    d = 64
    block = 12 * d * d + 13 * d
    step = 2 * block + (2 * d * d + d) + 4 * d + (2 * d * d + d) + (d * d + d)
    cfg = GRTConfig(vocab_size=50257, block_size=128, d_model=d, n_head=2, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=4)
    assert parameter_split(cfg) == (2 * block + 2 * d, step)
    assert parameter_split(cfg, with_embeddings=True) == (2 * block + 2 * d + (50257 + 128) * d, step)
    dense = GPTConfig(vocab_size=50257, block_size=128, d_model=d, n_head=2, n_layer=3)
    assert parameter_split(dense) == (3 * block + 2 * d, 0)


def test_runs_without_a_fixed_recurrence_count_are_refused(tmp_path):
    """phi's r is the count every training step ran: a GRT run trained with r ~ U{1..R}, and types whose loop is
    not one shared step (RRT's per-recursion LoRAs), are refused with the fix; the same run at a fixed depth reads
    back with r = R and the parameter split."""
    import yaml

    from pipeline.config import from_dict
    from pipeline.model.configs import RRTConfig
    from pipeline.studies.phi import parameter_split
    from pipeline.studies.phi import runs_from_results

    with pytest.raises(ValueError, match="model.type=rrt: phi is fitted over looped GRT runs and dense"):
        parameter_split(RRTConfig(vocab_size=64, block_size=16, d_model=16, n_head=2))
    model = {"type": "grt", "vocab_size": 64, "block_size": 16, "d_model": 16, "n_head": 2, "n_recurrence": 4}
    results = []
    for sampling in ("uniform", "fixed"):
        step = tmp_path / sampling / "checkpoints" / "step_00000010"
        step.mkdir(parents=True)
        cfg = from_dict({"name": sampling, "model": {**model, "depth_sampling": sampling}})
        (step / "recipe.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
        results.append({"name": sampling, "val_loss": 4.5, "checkpoint": str(step / "state.pt"),
                        "tokens_trained": 1e5})
    with pytest.raises(ValueError, match=r"depth_sampling=uniform \(r ~ U\{1..4\}\).*depth_sampling=fixed"):
        runs_from_results(results[:1])
    (run, branch) = runs_from_results(results[1:] + [{**results[1], "name": "b", "branch_parent": "fixed",
                                                       "branch_step": 6, "branch_decay_steps": 4}])
    assert (run.r, run.loss, run.tokens, run.branch_of) == (4, 4.5, 1e5, "")
    assert branch.branch_of == "fixed@6"  # a decay branch's point is labelled with its stable run and step
    assert (run.n_once, run.n_rec) == parameter_split(from_dict({"model": {**model, "depth_sampling": "fixed"}}).model)
