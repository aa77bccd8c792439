"""`grt COMMAND ...`: dispatch to the command each stage registers (its ``command`` module's ``register``), and the
mapping from errors to exit statuses (pipeline/runtime/exit_status.py)."""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys

from pipeline.config import RecipeError
from pipeline.runtime.exit_status import FAILED
from pipeline.runtime.exit_status import USAGE
from pipeline.runtime.exit_status import TrainingStopped
from pipeline.runtime.exit_status import stopped_status


def build_parser() -> argparse.ArgumentParser:
    from launch.cli import add_launch_parser
    from pipeline.eval import command as eval_command
    from pipeline.export import command as export_command
    from pipeline.infer import command as infer_command
    from pipeline.run import command as run_command
    from pipeline.studies import command as studies_command
    from pipeline.tokenize import command as tokenize_command
    from pipeline.tracking.sync import add_track_parser
    from pipeline.train import branch_command
    from pipeline.train import command as train_command
    from pipeline.train.convert import add_checkpoint_parser

    p = argparse.ArgumentParser(prog="grt", description="Pretraining pipeline for recurrent-depth transformers.")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    sub = p.add_subparsers(dest="command", required=True)
    # in the order `grt --help` lists them
    train_command.register_info(sub)  # info
    tokenize_command.register(sub)  # tokenize, data, tokenizer
    train_command.register(sub)  # train
    branch_command.register(sub)  # branch
    run_command.register(sub)  # run
    eval_command.register(sub)  # eval
    studies_command.register(sub)  # compare, sweep, fit-phi, paper-table
    export_command.register(sub)  # export
    infer_command.register(sub)  # generate
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
    except TrainingStopped as e:  # saved and stopped on a signal: not finished (see pipeline/runtime/exit_status.py)
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
