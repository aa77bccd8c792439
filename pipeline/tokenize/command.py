"""`grt tokenize RECIPE` and `grt data verify|stats DATASET`: build a tokenized dataset, and inspect one."""
from __future__ import annotations

import json
import sys

from pipeline.config.arguments import add_recipe_arguments
from pipeline.config.arguments import recipe_of


def register(sub) -> None:
    s = add_recipe_arguments(sub.add_parser("tokenize", help="tokenize the recipe's data sources into shards + "
                                                             "manifest"))
    s.set_defaults(fn=cmd_tokenize)
    s.add_argument("--force", action="store_true", help="rebuild even when the dataset is up to date (with --tasks: "
                                                         "redo this task's slice; merge: over a finished dataset)")
    s.add_argument("--strict", action="store_true", help="fail on the first bad input record instead of counting it")
    s.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: data.workers or CPUs)")
    s.add_argument("--tasks", type=int, default=None, metavar="N",
                   help="tokenize on N nodes: this process does one slice (--task-id) into DATASET/.tasks/ID; "
                        "then `grt tokenize merge DATASET` (docs/data.md)")
    s.add_argument("--task-id", type=int, default=None, metavar="ID", help="which slice of --tasks (0..N-1)")
    data = sub.add_parser("data", help="inspect tokenized datasets").add_subparsers(dest="data_command",
                                                                                    required=True)
    s = data.add_parser("verify", help="recheck every shard's checksum, token ids and index against the manifest")
    s.add_argument("dataset", help="dataset folder (data.dataset_dir)")
    s.set_defaults(fn=cmd_data_verify)
    s = data.add_parser("stats", help="print the manifest's numbers")
    s.add_argument("dataset", help="dataset folder (data.dataset_dir)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_data_stats)
    from pipeline.tokenize.train_bpe import register as register_tokenizer

    register_tokenizer(sub)  # tokenizer train


def cmd_tokenize(args) -> int:
    from pipeline.tokenize import tokenize

    strict = True if args.strict else None
    if args.recipe == "merge":  # `grt tokenize merge DATASET_DIR`
        from pipeline.tokenize.merge import merge

        if len(args.overrides) != 1:
            raise ValueError("usage: grt tokenize merge DATASET_DIR (the data.dataset_dir the tasks wrote under)")
        merge(args.overrides[0], strict=strict, force=args.force)
        return 0
    if (args.tasks is None) != (args.task_id is None):
        raise ValueError("--tasks and --task-id go together: give both (e.g. --tasks 4 --task-id 0), or neither")
    if args.tasks is not None:
        from pipeline.tokenize.tasks import tokenize_task

        recipe = " ".join([args.recipe, *args.overrides, *(["--data", args.data] if args.data else [])])
        tokenize_task(recipe_of(args).data, args.tasks, args.task_id, recipe=recipe, strict=strict,
                      workers=args.workers, force=args.force)
        return 0
    tokenize(recipe_of(args).data, force=args.force, strict=strict, workers=args.workers)
    return 0


def cmd_data_verify(args) -> int:
    from pipeline.tokenize.dataset_cache import local_dataset
    from pipeline.tokenize.writer import read_manifest
    from pipeline.tokenize.writer import verify_dataset

    problems: list[str] = []  # an s3:// dataset's files are fetched into the node cache, each checked on the way
    folder = local_dataset(args.dataset, problems)
    problems += [p for p in verify_dataset(folder) if not (p.endswith(" is missing") and problems)]
    m = read_manifest(folder)
    n = sum(len(s["shards"]) for s in m["splits"].values())
    if problems:
        print(f"{args.dataset}: {len(problems)} problem(s) in {n} shards:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"{args.dataset}: OK — {n} shards and their document indexes match the manifest "
          f"({sum(s['tokens'] for s in m['splits'].values()):,} tokens, sha256 and token ids checked)")
    return 0


def cmd_data_stats(args) -> int:
    from pipeline.tokenize.writer import read_manifest

    m = read_manifest(args.dataset)
    if args.json:
        print(json.dumps({k: m[k] for k in ("tokenizer", "dtype", "shard_tokens", "splits", "sources", "totals")}))
        return 0
    tok = m["tokenizer"]
    print(f"{args.dataset}: {tok['name']} (vocab {tok['n_vocab']:,}, EOT {tok['eot_id']}, vocab sha256 "
          f"{tok['vocab_hash'][:12]}), {m['dtype']}, {m['shard_tokens']:,} tokens per shard")
    for split, s in m["splits"].items():
        print(f"  {split:5}  {s['tokens']:>15,} tokens  {s['documents']:>12,} documents  {len(s['shards']):>5} shards")
    t = m["totals"]
    print(f"  kept {t['documents']:,} documents ({t['bytes'] / 1e6:,.1f} MB of text), dropped {t['duplicates']:,} "
          f"duplicates")
    for i, src in enumerate(m["sources"]):
        what = src["name"] or ", ".join(src["paths"]) or src["kind"]
        skipped = ", ".join(f"{k} {v:,}" for k, v in src["skipped"].items() if v) or "none"
        print(f"  source {i} ({src['kind']}: {what}): {src['documents']:,} documents, {src['bytes'] / 1e6:,.1f} MB, "
              f"{src['tokens']:,} tokens, {src['duplicates']:,} duplicates; skipped: {skipped}")
    return 0
