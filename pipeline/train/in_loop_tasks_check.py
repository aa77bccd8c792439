"""The recipe check of ``train.eval_tasks`` (pipeline/train/in_loop_tasks.py runs them); no imports of the pipeline,
so the recipe schema can call it without a cycle."""
from __future__ import annotations

import difflib

DEFAULT_LIMIT = 100  # items per task when train.eval_task_limit is null (docs/eval.md says why)


def eval_task_problems(tc, local_tasks: tuple[str, ...]) -> list[str]:
    """train.eval_tasks / eval_task_limit checked with the recipe (the data files: when the trainer starts)."""
    p = []
    if tc.eval_tasks is not None and not isinstance(tc.eval_tasks, list):
        return [f"train.eval_tasks must be a list of task names (e.g. [piqa, arc_easy]) or null, got "
                f"{tc.eval_tasks!r}"]
    if tc.eval_task_limit is not None and not tc.eval_tasks:
        p.append("train.eval_task_limit only applies to train.eval_tasks (none listed); remove it or list tasks")
    for t in tc.eval_tasks or []:
        if t not in local_tasks:
            near = difflib.get_close_matches(str(t), local_tasks, n=1)
            p.append(f"train.eval_tasks: unknown task {t!r}" + (f" — did you mean {near[0]!r}?" if near else
                                                                f"; the local tasks are {list(local_tasks)}"))
    if tc.eval_task_limit is not None and (not isinstance(tc.eval_task_limit, int) or tc.eval_task_limit < 1):
        p.append(f"train.eval_task_limit must be an integer >= 1 (items per task at each eval), got "
                 f"{tc.eval_task_limit!r}")
    return p
