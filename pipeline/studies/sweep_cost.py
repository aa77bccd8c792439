"""The planned cost of a sweep, before it runs: training steps, tokens and model FLOPs of every run and decay branch
(``train.branch_budgets``), and its evaluation work. `grt sweep --dry-run` prints the totals; bench/phi_sweep_cost.py
compares the independent and the branched phi sweeps.

Per run: steps = max_steps (a branch trains only its decay steps, from its branch point to its budget); tokens =
steps x micro_batch_size x grad_accum_steps x block_size; training FLOPs = tokens x the model's
``training_flops_per_token`` (3x the paper's Eq. 1 forward with the head, the trainer's MFU count) at the trained
depth, averaged over r ~ U{1..R} where ``model.depth_sampling`` is uniform. Evaluation: the trainer validates at every
``eval_interval``-th step and at the last (eval_batches x micro_batch_size x block_size tokens, a forward each at the
full depth), and `grt eval` evaluates each run once (``eval.val_tokens`` per evaluated depth). Checkpoints: every
``checkpoint_interval``-th step, the last and ``keep_steps`` (the branch points).
"""
from __future__ import annotations


def train_flops_per_token(model_cfg) -> float:
    """Training FLOPs per token at the trained depth (the mean over U{1..R} for uniform depth sampling)."""
    from pipeline.model.registry import model_class

    cls = model_class(model_cfg.type)
    full = cls.full_depth(model_cfg)
    uniform = getattr(model_cfg, "depth_sampling", "fixed") == "uniform" and cls.recurrence_depth(model_cfg)
    depths = range(1, full + 1) if uniform else [full]
    return sum(cls.training_flops_per_token(model_cfg, d) for d in depths) / len(depths)


def validations(start: int, end: int, every: int) -> int:
    """The trainer's in-loop validations over steps start+1..end: each multiple of ``every`` and the last step."""
    return end // every - start // every + (end % every != 0)


def checkpoints(tc, start: int, end: int) -> int:
    """Checkpoints saved over steps start+1..end: each checkpoint_interval-th step, the last and the kept steps."""
    every = tc.checkpoint_interval
    return len({s for s in range(start + 1, end + 1) if s % every == 0 or s == end or s in tc.keep_steps})


def run_cost(cfg, name: str, start: int, end: int, kind: str) -> dict:
    """One run's (or branch's: ``start`` its branch point) planned cost from step ``start`` to ``end``."""
    from pipeline.model.registry import model_class
    from pipeline.train.curriculum import tokens_through

    tc, m = cfg.train, cfg.model
    steps, tokens = end - start, tokens_through(cfg, end) - tokens_through(cfg, start)  # a batch ramp's stages too
    n_val = validations(start, end, tc.eval_interval)
    val_tokens = n_val * tc.eval_batches * tc.micro_batch_size * m.block_size
    fwd = model_class(m.type).flops_per_token(m, None, with_head=True)
    return {"name": name, "kind": kind, "steps": steps, "tokens": tokens,
            "train_flops": tokens * train_flops_per_token(m), "validations": n_val,
            "validation_tokens": val_tokens, "validation_flops": val_tokens * fwd, "evaluations": 1,
            "eval_val_tokens": cfg.eval.val_tokens, "checkpoints": checkpoints(tc, start, end)}


def plan_configs(cfgs: list, folder: str = "") -> dict:
    """Every run and branch of a sweep's loaded recipes (:func:`pipeline.studies.sweep.plan_sweep`) with its planned
    cost, and the totals."""
    from pipeline.studies.sweep_branches import branch_name
    from pipeline.studies.sweep_branches import points_of

    runs = []
    for cfg in cfgs:
        runs.append(run_cost(cfg, cfg.name, 0, cfg.train.max_steps, "run"))
        runs += [run_cost(cfg, branch_name(cfg, p), p.at, p.budget, "branch") for p in points_of(cfg)]
    keys = ("steps", "tokens", "train_flops", "validations", "validation_tokens", "validation_flops", "evaluations",
            "checkpoints")
    total = {k: sum(r[k] for r in runs) for k in keys}
    total.update(runs=sum(r["kind"] == "run" for r in runs), branches=sum(r["kind"] == "branch" for r in runs))
    return {"folder": folder, "total": total, "runs": runs}


def plan_line(plan: dict) -> str:
    """The dry run's one line of totals."""
    t = plan["total"]
    return (f"planned: {t['runs']} run(s) + {t['branches']} branch(es), {t['steps']:,} training steps, "
            f"{t['tokens'] / 1e6:.4g}M tokens, {t['train_flops']:.4g} training FLOPs; {t['evaluations']} "
            f"evaluations (grt eval), {t['validations']} in-loop validations")
