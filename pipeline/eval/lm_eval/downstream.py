"""Downstream tasks through lm-evaluation-harness: ``grt eval RUN eval.tasks=[piqa,...] eval.task_depths=[2,4]``.

Every depth is scored by lm-eval's own evaluator (prompts, metrics, aggregation, standard errors) with the ``grt``
adapter; the adapters of all depths share one :class:`DepthScorer`, so each batch runs the model once and reads the
log-likelihoods at every requested depth from that pass.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
# The files each local task reads from the task data folder (the loaders in tasks/local_data.py).
TASK_FILES = {
    "lambada_openai": ["lambada/original/lambada_test.jsonl"],
    "hellaswag": ["hellaswag/klosax_llamacpp_format/hellaswag_val_full.txt.bz2"],
    "arc_easy": ["arc_easy/mosaic_icl/arc_easy.jsonl"],
    "arc_challenge": ["arc_challenge/mosaic_icl/arc_challenge.jsonl"],
    "piqa": ["piqa/original/valid.jsonl", "piqa/original/valid-labels.lst"],
    "boolq": ["boolq/hf_olmo/validation.jsonl"],
    "winogrande": ["winogrande/hf_olmo/validation.jsonl"],
}


def check_task_inputs(tasks: list[str], data_dir: str | None) -> Path:
    """Before any scoring: lm-eval imports, the task data folder is found and holds every file of ``tasks``. Returns
    the folder; raises naming what is missing and how to provide it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise LookupError(f"eval.tasks={tasks} needs lm-eval, which does not import here ({e}); reinstall the "
                          f"package (make setup)") from None
    from pipeline.eval.lm_eval.tasks.local_data import resolve_data_dir

    root = resolve_data_dir(data_dir)  # FileNotFoundError naming eval.task_data_dir / GRT_EVAL_DATA when absent
    missing = [f"{t}: {rel}" for t in tasks for rel in TASK_FILES.get(t, []) if not (root / rel).is_file()]
    if missing:
        raise FileNotFoundError(f"the task data folder {root} lacks {len(missing)} file(s) of eval.tasks "
                                f"({'; '.join(missing)}); copy them there (layout of shared/data/eval) or drop "
                                f"those tasks")
    return root


def run_tasks(model, cfg, tasks: list[str], depths: list[int], batch_size: int, data_dir: str | None = None,
              limit: int | None = None, quiet: bool = False, bootstrap_iters: int = 1000) -> dict:
    """{"depths": {depth: {task: {metric: value, metric_stderr: ..., "items": n}}}, "seconds": ...}; bootstrap_iters=0:
    no stderrs (lm-eval bootstraps some in a forked process pool, which a training process must not start)"""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pipeline.eval.lm_eval.harness import GRTLM
    from pipeline.eval.lm_eval.harness import DepthScorer
    from pipeline.tokenize.tokenizers import dataset_tokenizer

    if quiet:
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # lm-eval warns once per task that takes a custom loader; here the loader and its arguments are ours
    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropCustomKwargsHint) for f in task_log.filters):
        task_log.addFilter(_DropCustomKwargsHint())
    t0 = time.time()
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          metadata={"data_dir": data_dir} if data_dir else None)
    # task names are checked against LOCAL_TASKS when the recipe is validated (EvalConfig)
    tokenizer = dataset_tokenizer(cfg)  # the one the model was trained with (evaluate checked its dataset)
    scorer = DepthScorer(model, depths, batch_size, cfg.model.block_size, tokenizer.eos_id)
    out: dict = {"tasks": list(tasks), "depths": {}, "limit": limit}
    for depth in depths:
        lm = GRTLM(model=model, cfg=cfg, n_steps=depth, batch_size=batch_size, scorer=scorer, tokenizer=tokenizer)
        res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                      log_samples=False, bootstrap_iters=bootstrap_iters, verbosity="WARNING")
        out["depths"][depth] = task_metrics(res)
    out["seconds"] = round(time.time() - t0, 1)
    return out


class _DropCustomKwargsHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def task_metrics(res: dict) -> dict:
    """lm-eval's results -> {task: {metric: value, metric_stderr: value, "items": evaluated items}}."""
    table = {}
    for task, metrics in res["results"].items():
        row = {}
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, _filter = key.split(",", 1)
            row[metric] = float(value)
        row["items"] = int(res["n-samples"][task]["effective"])
        table[task] = row
    return table
