"""HSDP in the preflight (``train.fsdp_shard``): per-rank parameters, gradients and AdamW state divide by the shard
group, not the world (checked against a hand formula over the model's own parameter count); a world size the
group does not divide, and a bad value, are one-line problems."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch.preflight import run_preflight
from pipeline.config import from_dict
from pipeline.config import load_recipe
from pipeline.model import build_model
from pipeline.train.mesh import build_mesh

REPO = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3


def _rows(text: str) -> dict[str, float]:
    out = {}
    for key in ("parameters", "gradients", "optimizer"):
        m = re.search(rf"^  {key}\b.*?([\d.]+) GiB$", text, re.M)
        out[key] = float(m.group(1))
    return out


@pytest.mark.parametrize("shard,group", [("world", 32), ("node", 8), (4, 4)])
def test_state_per_rank_divides_by_the_shard_group(shard, group):
    cfg = load_recipe(REPO / "recipes/paper/grt-large-isoparam.yaml",
                      ["tracking.enabled=false", "train.backend=fsdp", "train.grad_accum_steps=64"])
    cfg.train.fsdp_shard = shard
    model = build_model(cfg.model, device="meta")
    P = sum(p.numel() for p in model.parameters())  # unique (tied weights once)
    text = run_preflight(cfg, nodes=4, gpus_per_node=8, gpu_mem_gb=80, check_data=False,
                         check_tracking=False).render()
    want = {"parameters": 4 * P / group, "gradients": 4 * P / group, "optimizer": 8 * P / group}  # fp32 + m, v
    got = _rows(text)
    for key, b in want.items():
        assert got[key] == pytest.approx(b / GIB, abs=0.006), (key, text)
    assert ("HSDP (shard 8 x replicate 4)" in text) == (shard == "node")


def test_a_world_size_the_group_does_not_divide_is_one_problem():
    cfg = load_recipe(REPO / "recipes/paper/grt-large-isoparam.yaml",
                      ["tracking.enabled=false", "train.backend=fsdp", "train.grad_accum_steps=64",
                       "train.fsdp_shard=3"])
    rep = run_preflight(cfg, nodes=4, gpus_per_node=8, gpu_mem_gb=80, check_data=False, check_tracking=False)
    hits = [p for p in rep.problems if p.startswith("mesh:")]
    assert len(hits) == 1 and "multiple of 3, got 32" in hits[0] and "fsdp_shard=world" in hits[0], rep.problems
    with pytest.raises(ValueError, match="train.fsdp_shard=node .2 ranks per node. needs a world size that is a "
                                         "multiple of 2, got 3"):
        build_mesh("node", 3, 2, "cpu")  # at start-up, before any collective
    # one shard group spanning the world (one node, or N = world) is plain FSDP, as the preflight counts it: no
    # 2-D mesh (building one would need a process group, which this test does not have)
    assert build_mesh("node", 4, 4, "cpu") is None and build_mesh(8, 8, 4, "cpu") is None


@pytest.mark.parametrize("value,backend,message", [
    ("nodes", "fsdp", "must be world, node or a positive number"),
    (0, "fsdp", "must be world, node or a positive number"),
    ("node", "ddp", "shards FSDP2 only; set train.backend=fsdp"),
])
def test_bad_values_are_refused_by_the_schema(tmp_path, value, backend, message):
    from conftest import tiny_recipe

    recipe = tiny_recipe(tmp_path, tmp_path / "corpus")
    recipe["train"].update(backend=backend, fsdp_shard=value)
    with pytest.raises(Exception, match=message):
        from_dict(recipe)
