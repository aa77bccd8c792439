"""`grt eval RUN [overrides]`: early-exit curves, recurrence diagnostics and downstream tasks of a trained run."""
from __future__ import annotations


def register(sub) -> None:
    s = sub.add_parser("eval", help="early-exit curves, recurrence diagnostics and downstream tasks of a trained run")
    s.add_argument("run", help="run folder (runs/NAME), step folder or state.pt")
    s.add_argument("overrides", nargs="*", help="recipe overrides, e.g. eval.max_steps=12 eval.val_tokens=131072 "
                                                "eval.tasks=[piqa,arc_easy] eval.task_depths=[2,4,8]")
    s.set_defaults(fn=cmd_eval)


def cmd_eval(args) -> int:
    from pipeline.eval.stage import evaluate

    evaluate(args.run, args.overrides)
    return 0
