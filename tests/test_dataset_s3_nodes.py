"""A dataset on object storage read from nodes that share no disk: a rank of `grt run` waiting for the dataset rank 0
uploads, `grt launch --check` against the store (the manifest and one listing, no shard downloaded), and a node
without the recipe's tokenizer file (the dataset's copy in the store stands in), against the real S3 server of
tests/s3_server.py (moto). The references: the manifest and the tokenizer file's bytes as boto3 and the local disk
hold them."""
from __future__ import annotations

import json
import threading

import yaml

from pipeline.cli import main
from pipeline.config import SourceConfig
from pipeline.config import from_dict
from pipeline.tokenize import tokenize
from pipeline.tokenize.stage import wait_for_dataset
from pipeline.tokenize.train_bpe import train_tokenizer
from pipeline.train.data_match import check_dataset_matches_model
from tests.conftest import tiny_recipe
from tests.test_dataset_s3 import cache  # noqa: F401  (the fixture: a node cache under tmp_path)

WAIT_S = 30.0  # far beyond the poll: a waiter still waiting then never sees the dataset


def _stored(s3_server, name: str = "manifest.json"):
    return s3_server.client().get_object(Bucket=s3_server.bucket, Key=f"{s3_server.prefix}/dataset/{name}")["Body"]


def _waiter(data_cfg) -> tuple[threading.Thread, dict]:
    """wait_for_dataset in a thread (a daemon: a waiter that never returns fails the test instead of hanging it)."""
    box: dict = {}

    def run():
        try:
            box["manifest"] = wait_for_dataset(data_cfg, poll_s=0.05)
        except BaseException as e:  # noqa: BLE001  (shown by the test)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _joined(t: threading.Thread, box: dict) -> dict:
    t.join(WAIT_S)
    assert not t.is_alive(), f"wait_for_dataset still waiting after {WAIT_S:g} s for a dataset the store holds"
    assert "error" not in box, box
    return box["manifest"]


def test_a_waiting_rank_finds_the_dataset_rank_0_uploads(tmp_path, corpus, s3_server, cache):  # noqa: F811
    cfg = from_dict(tiny_recipe(tmp_path, corpus, data={"dataset_dir": s3_server.url("dataset")}))
    t, box = _waiter(cfg.data)
    t.join(0.5)
    assert t.is_alive() and not box  # nothing in the store yet: waiting
    tokenize(cfg.data, quiet=True)  # rank 0
    assert _joined(t, box) == json.loads(_stored(s3_server).read())


def test_a_node_without_the_recipes_tokenizer_file(tmp_path, corpus, s3_server, cache, capsys):  # noqa: F811
    """Rank 0 tokenized with data.tokenizer=FILE; another node has no FILE: its waiting rank, the trainer's dataset
    check and `grt launch --check` all read the dataset's copy from the store (into the node cache, no shard)."""
    tok, _ = train_tokenizer([SourceConfig(kind="files", paths=[str(corpus / "part.jsonl")])], 300)
    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    tok_file.write_text(tok.to_str())
    url = s3_server.url("dataset")
    recipe = tiny_recipe(tmp_path, corpus, data={"dataset_dir": url, "tokenizer": str(tok_file)})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cfg = from_dict(recipe)
    tokenize(cfg.data, quiet=True)
    stored = json.loads(_stored(s3_server).read())
    original = tok_file.read_bytes()
    tok_file.rename(tmp_path / "elsewhere.json")  # this node has no file at the recipe's path

    assert _joined(*_waiter(cfg.data)) == stored
    check_dataset_matches_model(stored, cfg, "the dataset")  # raises on a mismatch or a missing tokenizer
    copies = list(cache.glob("*/tokenizer.json"))
    assert [c.read_bytes() for c in copies] == [original]
    assert main(["launch", str(tmp_path / "recipe.yaml"), "--gpu-mem", "8", "--check"]) == 0
    out = capsys.readouterr().out
    assert f"{url}: {stored['splits']['train']['tokens']:,} training tokens" in out and "no problems found" in out
    assert not list(cache.glob("*/*.bin")) and not list(cache.glob("*/*.idx"))  # checked without a download


def test_check_names_what_the_store_lacks(tmp_path, corpus, s3_server, cache, capsys):  # noqa: F811
    url = s3_server.url("dataset")
    recipe = tiny_recipe(tmp_path, corpus, data={"dataset_dir": url})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    tokenize(from_dict(recipe).data, quiet=True)
    m = json.loads(_stored(s3_server).read())
    val, train = m["splits"]["val"]["shards"][0], m["splits"]["train"]["shards"][0]
    client, key = s3_server.client(), f"{s3_server.prefix}/dataset/"
    client.delete_object(Bucket=s3_server.bucket, Key=key + val["file"])
    client.put_object(Bucket=s3_server.bucket, Key=key + train["index_file"],
                      Body=_stored(s3_server, train["index_file"]).read()[:-4])  # one document offset short
    args = ["launch", str(tmp_path / "recipe.yaml"), "--gpu-mem", "8", "--check"]
    assert main(args) == 2
    problems = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 2, problems
    assert f"{url}: train: {train['index_file']} holds {(train['documents'] - 1) * 4:,} bytes, not the " \
           f"{train['documents']:,} document offsets" in problems[0]
    assert f"{url}: val: {val['file']} is missing" in problems[1]
    assert main(args + ["data.dataset_dir=s3://grt-no-such-bucket/x"]) == 2  # one line naming the dataset and fix
    problems = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1 and "s3://grt-no-such-bucket/x" in problems[0], problems
    assert "does not exist" in problems[0] and "fix data.dataset_dir" in problems[0], problems
