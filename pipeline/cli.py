"""`grt tokenize|train|eval|run|sweep|info|compare|fit-phi|paper-table|export|generate` — thin: parse, build, call."""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys

from pipeline.config import RecipeError, TrackingConfig, load_recipe
from pipeline.exits import FAILED, USAGE, TrainingStopped, stopped_status

OVERRIDES_HELP = "recipe overrides key.sub=value (e.g. train.max_steps=100 model.n_recurrence=6)"


def _recipe(args):
    return load_recipe(args.recipe, args.overrides, data=getattr(args, "data", None))


def cmd_info(args) -> int:
    from pipeline.model import model_info

    cfg = _recipe(args)
    info = model_info(cfg.model)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{cfg.name}: {cfg.model.type} {info['shorthand']} (d={info['d_model']}, S={info['seq_len']})")
    print(f"  unique parameters            {info['params']:>15,}  ({info['params'] / 1e6:.2f}M)")
    print(f"  without position embeddings  {info['params_without_position']:>15,}  "
          f"({info['params_without_position'] / 1e6:.2f}M)")
    print(f"  block executions / forward   {info['block_executions']:>15,}")
    print(f"  forward FLOPs/token, Eq. 1   {info['flops_per_token']:>15,}  ({info['flops_per_token'] / 1e9:.4f} G)")
    print(f"  ... with the LM head         {info['flops_per_token_with_head']:>15,}  "
          f"({info['flops_per_token_with_head'] / 1e9:.4f} G)")
    if info["executed_flops_per_token"] != info["flops_per_token"]:
        print(f"  forward FLOPs/token executed {info['executed_flops_per_token']:>15,}  "
              f"({info['executed_flops_per_token'] / 1e9:.4f} G)")
    for note in info["flops_notes"]:
        print(f"  note: {note}")
    return 0


def cmd_tokenize(args) -> int:
    from pipeline.tokenize import tokenize

    tokenize(_recipe(args).data, force=args.force, strict=True if args.strict else None, workers=args.workers)
    return 0


def cmd_data_verify(args) -> int:
    from pipeline.tokenize.writer import read_manifest, verify_dataset

    problems = verify_dataset(args.dataset)
    m = read_manifest(args.dataset)
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


def cmd_train(args) -> int:
    from pipeline.train.trainer import train

    train(_recipe(args))
    return 0


def cmd_eval(args) -> int:
    from pipeline.eval.stage import evaluate

    evaluate(args.run, args.overrides)
    return 0


def cmd_run(args) -> int:
    """tokenize (reused when up to date) -> train (resumes) -> eval."""
    from pipeline.eval.stage import check_inputs, evaluate
    from pipeline.tokenize import tokenize
    from pipeline.tokenize.stage import wait_for_dataset
    from pipeline.train.trainer import train

    cfg = _recipe(args)
    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun: rank 0 tokenizes and evaluates
    if first:
        check_inputs(cfg, cfg.run_dir / "eval")  # what eval will need, before anything trains
        tokenize(cfg.data)
    else:  # rank 0 tokenizes (a failure there ends the job); the others wait for its dataset
        wait_for_dataset(cfg.data)
    train(cfg)  # a pre-empted or interrupted run stops here (TrainingStopped: exit 143 / 130), never evaluated
    if first:  # one evaluation (in one process) per run, not one per rank
        evaluate(cfg.run_dir)
    return 0


def cmd_sweep(args) -> int:
    """`grt run` on every recipe of a folder (pipeline/sweep.py), then a summary table."""
    from pipeline.sweep import sweep_command

    return sweep_command(args.folder, args.overrides, args.data, args.dry_run, rerun=args.rerun)


def cmd_paper_table(args) -> int:
    """The paper's numbers (pipeline/paper/results.yaml) beside the matching MLflow runs, with the deltas."""
    from pathlib import Path

    from pipeline.paper.table import TABLES, format_tables, load_results, paper_table

    which = list(TABLES) if args.table == "all" else [args.table]
    result = paper_table(load_results(), which, args.tracking_uri, args.experiment or [TrackingConfig.experiment],
                         Path(args.data).stem if args.data else None)
    print(format_tables(result, args.format))
    return 0


def parse_tags(given: list[str] | None) -> dict[str, str]:
    tags = {}
    for t in given or []:
        key, sep, value = t.partition("=")
        if not sep or not key:
            raise ValueError(f"--tag {t!r}: write it as key=value")
        tags[key] = value
    return tags


def cmd_fit_phi(args) -> int:
    """Fit the recurrence-equivalence law over evaluated runs: phi with its bootstrap interval, JSON and a plot."""
    from pathlib import Path

    from pipeline.eval.compare import collect
    from pipeline.eval.phi import fit_phi, plot_fit, runs_from_results

    experiments = args.experiment or [TrackingConfig.experiment]
    tracking = TrackingConfig(uri=args.tracking_uri, experiment=experiments[0])
    runs = runs_from_results(collect(args.runs, tracking, experiments, parse_tags(args.tag)), args.with_embeddings)
    fit = fit_phi(runs, n_boot=args.boot, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [vars(x) for x in runs]
    (out / "phi.json").write_text(json.dumps({"params": fit.params, "ci95": fit.ci, "n_boot": fit.n_boot,
                                              "objective": fit.objective, "runs": rows,
                                              "with_embeddings": args.with_embeddings}, indent=1))
    plot_fit(fit, runs, out / "phi.png")
    lo, hi = fit.ci.get("phi", (float("nan"), float("nan")))
    print(f"phi = {fit.params['phi']:.3f} (95% bootstrap CI {lo:.3f} to {hi:.3f}, {fit.n_boot} refits) over "
          f"{len(runs)} runs, r in {sorted({x.r for x in runs})}")
    print("  " + ", ".join(f"{k} {v:.4g}" for k, v in fit.params.items() if k != "phi"))
    print(f"  saved {out / 'phi.json'}, {out / 'phi.png'}")
    return 0


def cmd_compare(args) -> int:
    from pipeline.eval.compare import compare
    from pipeline.tracking import is_http, resolve_uri

    tags = parse_tags(args.tag)
    experiments = args.experiment or [TrackingConfig.experiment]
    tracking = TrackingConfig(uri=args.tracking_uri, experiment=experiments[0])
    text, plot = compare(args.runs, tracking, args.out, args.format, experiments, tags)
    print(text)
    if args.format in ("table", "markdown"):
        print(f"\nearly-exit overlay (loss vs r and vs inference FLOPs): {plot}")
        uri, where = resolve_uri(tracking.uri), f"experiment(s) {', '.join(experiments)}"
        print(f"MLflow UI: open {uri} ({where})" if is_http(uri) else  # a server serves its own UI
              f"MLflow UI: `.venv/bin/mlflow ui --backend-store-uri {uri}` then open http://127.0.0.1:5000 ({where})")
    return 0


def cmd_export(args) -> int:
    from pipeline.export.hf import export_hf

    out, rec = export_hf(args.checkpoint, args.out, check=not args.no_verify)
    checked = ("" if "verified_max_abs_logit_diff" not in rec else
               f"; loaded back with transformers: max |logit difference| {rec['verified_max_abs_logit_diff']:.2e}")
    remote = ", trust_remote_code=True" if rec["model_type"] == "grt" else ""
    print(f"wrote {out} ({rec['hf_class']}, step {rec['step']} of {rec['source']}, {rec['source_format']} "
          f"checkpoint){checked}\nload it with AutoModelForCausalLM.from_pretrained({str(out)!r}{remote}) and "
          f"AutoTokenizer.from_pretrained({str(out)!r}{remote})")
    return 0


def cmd_generate(args) -> int:
    from pipeline.infer.command import UsageError, generate_command

    try:
        return generate_command(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE


def add_run_selection(s: argparse.ArgumentParser, tag_help: str) -> None:
    """The runs a command reads from MLflow: names/ids or folders, the tracking URI, experiments and tags."""
    s.add_argument("runs", nargs="*", help="MLflow run names/ids or run folders (default: all evaluated runs)")
    s.add_argument("--tracking-uri", default=TrackingConfig.uri)
    s.add_argument("--experiment", action="append", default=None,
                   help=f"MLflow experiment to search (repeatable; default {TrackingConfig.experiment})")
    s.add_argument("--tag", action="append", default=None, metavar="KEY=VALUE", help=tag_help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grt", description="Pretraining pipeline for recurrent-depth transformers.")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    sub = p.add_subparsers(dest="command", required=True)

    def with_recipe(name, fn, help_):
        s = sub.add_parser(name, help=help_)
        s.add_argument("recipe", help="YAML recipe (recipes/...)")
        s.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
        s.add_argument("--data", metavar="DATA_RECIPE", default=None,
                       help="a data recipe (recipes/data/*.yaml) whose data: section replaces the recipe's; the run "
                            "name gets its file stem appended; overrides still win")
        s.set_defaults(fn=fn)
        return s

    s = with_recipe("info", cmd_info, "parameters, shorthand, block executions and FLOPs of the recipe's model")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s = with_recipe("tokenize", cmd_tokenize, "tokenize the recipe's data sources into shards + manifest")
    s.add_argument("--force", action="store_true", help="rebuild even when the dataset is up to date")
    s.add_argument("--strict", action="store_true", help="fail on the first bad input record instead of counting it")
    s.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: data.workers or CPUs)")
    data = sub.add_parser("data", help="inspect tokenized datasets").add_subparsers(dest="data_command",
                                                                                    required=True)
    s = data.add_parser("verify", help="recheck every shard's checksum, token ids and index against the manifest")
    s.add_argument("dataset", help="dataset folder (data.dataset_dir)")
    s.set_defaults(fn=cmd_data_verify)
    s = data.add_parser("stats", help="print the manifest's numbers")
    s.add_argument("dataset", help="dataset folder (data.dataset_dir)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_data_stats)
    with_recipe("train", cmd_train, "train (resumes from the run folder's latest checkpoint)")
    with_recipe("run", cmd_run, "tokenize + train + eval")
    s = sub.add_parser("eval", help="early-exit curves, recurrence diagnostics and downstream tasks of a trained run")
    s.add_argument("run", help="run folder (runs/NAME), step folder or state.pt")
    s.add_argument("overrides", nargs="*", help="recipe overrides, e.g. eval.max_steps=12 eval.val_tokens=131072 "
                                                "eval.tasks=[piqa,arc_easy] eval.task_depths=[2,4,8]")
    s.set_defaults(fn=cmd_eval)
    s = sub.add_parser("compare", help="early-exit and downstream tables + early-exit overlays of evaluated runs")
    add_run_selection(s, "only runs with this MLflow tag (repeatable; set them with tracking.tags in the recipe; a "
                         "run folder is held to its recipe.yaml's)")
    s.add_argument("--format", default="table", choices=["table", "markdown", "csv", "json"])
    s.add_argument("--out", default="runs/compare", help="folder for the overlay plot and the table file")
    s.set_defaults(fn=cmd_compare)
    s = sub.add_parser("sweep", help="grt run on every recipe of a folder (files starting with _ skipped), in "
                                     "name order, each tagged sweep=FOLDER_NAME in MLflow; a failure does not stop "
                                     "the others; a summary table at the end")
    s.add_argument("folder", help="a folder of recipes, e.g. recipes/sweeps/toy-tau or recipes/paper/b6-gate-bias")
    s.add_argument("overrides", nargs="*", help="overrides for every recipe of the folder, e.g. train.max_steps=100")
    s.add_argument("--data", metavar="DATA_RECIPE", default=None,
                   help="a data recipe whose data: section replaces every recipe's (as grt run --data)")
    s.add_argument("--dry-run", action="store_true", help="list the recipes, their models and tags; run nothing")
    s.add_argument("--rerun", action="store_true",
                   help="also run the recipes whose run is already trained to max_steps and evaluated (skipped "
                        "otherwise, so the same command continues an interrupted sweep)")
    s.set_defaults(fn=cmd_sweep)
    s = sub.add_parser("fit-phi", help="the recurrence-equivalence exponent phi of L = E + A (N_once + r^phi "
                                       "N_rec)^-alpha + B D^-beta over evaluated runs (docs/related.md)")
    add_run_selection(s, "only runs with this MLflow tag (repeatable; e.g. sweep=phi, set by grt sweep)")
    s.add_argument("--boot", type=int, default=200, help="bootstrap refits for the confidence intervals")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--with-embeddings", action="store_true",
                   help="count the embeddings in N_once (default: non-embedding parameters)")
    s.add_argument("--out", default="runs/phi", help="folder for phi.json and phi.png")
    s.set_defaults(fn=cmd_fit_phi)
    s = sub.add_parser("paper-table", help="the paper's Table 1 / Table 2 / Figure 5 (and Appendix B sweep) numbers "
                                           "beside the matching MLflow runs, with the deltas")
    s.add_argument("--tracking-uri", default=TrackingConfig.uri)
    s.add_argument("--experiment", action="append", default=None,
                   help=f"MLflow experiment to search (repeatable; default {TrackingConfig.experiment})")
    s.add_argument("--table", default="all", choices=["table1", "table2", "figure5", "sweeps", "all"])
    s.add_argument("--data", metavar="DATA_RECIPE", default=None,
                   help="match the runs trained with grt run --data DATA_RECIPE (named RECIPE-STEM)")
    s.add_argument("--format", default="table", choices=["table", "markdown", "json"])
    s.set_defaults(fn=cmd_paper_table)
    s = sub.add_parser("export", help="a checkpoint of any format as a Hugging Face transformers folder")
    s.add_argument("checkpoint", help="run folder (latest checkpoint), step folder, state.pt or model.safetensors")
    s.add_argument("--format", default="hf", choices=["hf"],
                   help="hf: a folder for transformers' AutoModelForCausalLM and AutoTokenizer")
    s.add_argument("--out", required=True, help="output folder (replaced only if an earlier `grt export` wrote it)")
    s.add_argument("--no-verify", action="store_true",
                   help="skip loading the folder back with transformers and comparing its logits with ours")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("generate", help="continue a prompt (or a file of prompts) with a trained checkpoint: greedy or "
                                        "sampled, streamed, with stop strings and early exit at decode")
    s.add_argument("checkpoint", help="run folder (latest checkpoint), step folder or state.pt")
    s.add_argument("prompt", nargs="?", default=None, help="the prompt text (or --batch-file)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    s.add_argument("--top-p", type=float, default=None, help="then among the most likely tokens holding mass p")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0): the same seed, device and "
                                                       "options give the same text")
    s.add_argument("--n-steps", type=int, default=None, metavar="R",
                   help="recurrence steps per token (default: the trained depth; dense model: the exit layer); "
                        "with --exit, the most steps a token may run")
    s.add_argument("--kv", default="full", choices=["full", "last", "first", "averaged"],
                   help="KV-cache strategy across recurrence steps (docs/inference.md)")
    s.add_argument("--exit", default="none", choices=["none", "kl", "latent", "entropy"],
                   help="early exit at decode: stop a token's steps when this criterion between successive steps "
                        "is below --exit-threshold (one prompt at a time)")
    s.add_argument("--exit-threshold", type=float, default=None, metavar="X")
    s.add_argument("--batch-file", default=None, metavar="FILE", help="prompts, one per line, generated as one "
                                                                      "left-padded batch (blank lines skipped)")
    s.add_argument("--stream", action="store_true", help="print the tokens as they come (one prompt)")
    s.add_argument("--stop", nargs="+", action="extend", default=None, metavar="STR",
                   help="end a continuation at any of these strings (cut from the output; \\n = newline, "
                        "\\t = tab, \\\\ = backslash)")
    s.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    s.add_argument("--dtype", default="auto", help="the forwards' precision: auto (bf16 autocast and TF32 on a GPU "
                                                   "with bf16, fp32 on the CPU), bfloat16 or float32")
    s.set_defaults(fn=cmd_generate)
    # subcommands that live with their stage
    from launch.cli import add_launch_parser
    from pipeline.tracking_sync import add_track_parser
    from pipeline.train.convert import add_checkpoint_parser

    add_launch_parser(sub)
    add_checkpoint_parser(sub)
    add_track_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops the overrides at the first option: `grt train R --data D k=v` leaves k=v over; take it back
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE
    except TrainingStopped as e:  # saved and stopped on a signal: not finished (see pipeline/exits.py)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a further Ctrl-C while exiting changes nothing now
        if e.report:
            print(str(e), file=sys.stderr, flush=True)
        return e.exit_status
    except KeyboardInterrupt:  # Ctrl-C outside training, or a second one during it
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return stopped_status(signal.SIGINT)
    except RuntimeError as e:  # torch.OutOfMemoryError (torch imported lazily: only if the command imported it)
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(e, torch.OutOfMemoryError) or os.environ.get("GRT_DEBUG"):
            raise
        from pipeline.train.peers import failure_line

        print(f"error: {failure_line(e)}", file=sys.stderr, flush=True)
        return FAILED
    except (OSError, LookupError, ValueError, FloatingPointError) as e:
        if os.environ.get("GRT_DEBUG"):
            raise
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # a disk that filled outside a training run's saves
            e = (f"disk full: no space left to write {e.filename or 'an output file'}; free space on its disk (or "
                 f"point the command's output elsewhere) and run the same command again")
        print(f"error: {e}  (GRT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
