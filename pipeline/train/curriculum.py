"""Curricula: what a step trains on, scheduled over the optimizer steps.

Both keys take the same form, a list of stages ``[[UNTIL_STEP, VALUE], ...]``: optimizer steps 1..UNTIL_STEP (as
logged) not covered by an earlier stage use VALUE; the steps after the last stage use the recipe's own value.

    train.batch_ramp: [[100, 4], [300, 8]]   # steps 1-100: 4 micro-batches, 101-300: 8, then train.grad_accum_steps
    model.depth_schedule: [[500, 2], [1000, 3]]  # steps 1-500 draw depths up to 2, 501-1000 up to 3, then R

- ``train.batch_ramp``: the micro-batches of a step over all ranks (``grad_accum_steps``), so tokens per step =
  micro_batch_size x VALUE x block_size. Every value must be a multiple of the world size (checked by the preflight
  and at start-up). The learning rate stays indexed by the step. tokens/s, MFU and tokens_seen count the step's
  real tokens; tokens_seen is kept in the checkpoint.
- ``model.depth_schedule``: the recurrence depth's bound for the types with a sampled depth (:data:`SAMPLED_DEPTH`):
  grt draws r ~ U{1..VALUE} (``depth_sampling=fixed``: r = VALUE), poisson's depth distribution takes VALUE as its
  mean (Huginn's curriculum grows that mean). Values lie in 1..model.n_recurrence, so the deepest forward, and the
  memory the preflight sizes, stays that of R. The draw is still from (seed, step) alone: the same on every rank.

Both are functions of the step and the recipe, so a resume continues the curriculum exactly where it stopped.
Torch-free (the recipe's validation reads it).
"""
from __future__ import annotations

# model.type -> (what model.depth_schedule sets, what bounds the training memory) for the types whose train_depth
# draws a depth; the others (gpt, mor, rrt, recurtrace, ouro, recurrent_transformer) train every step at full depth
SAMPLED_DEPTH = {"grt": ("the upper bound of r ~ U{1..value}", "memory sized for the largest, {largest}"),
                 "poisson": ("the mean of the depth draw", "memory sized for model.backprop_steps grad steps, "
                                                           "whatever the depth")}


def stage_value(stages: list | None, final: int, step: int) -> int:
    """The value of optimizer step ``step`` (1-based, as logged): the first stage [until, value] with step <= until,
    else ``final``."""
    for until, value in stages or ():
        if step <= until:
            return value
    return final


def stage_problems(key: str, stages, low: int, high: int | None = None) -> list[str]:
    """The shape of a stage list: pairs of integers, steps rising from 1, values in low..high."""
    if stages is None:
        return []
    form = f"{key} must be a list of [until_step, value] pairs, e.g. [[100, 4], [300, 8]]"
    if not isinstance(stages, list) or not stages:
        return [f"{form}, got {stages!r}"]
    if not all(isinstance(s, (list, tuple)) and len(s) == 2 and all(type(v) is int for v in s) for s in stages):
        return [f"{form} (integers), got {stages!r}"]
    p = []
    steps = [s[0] for s in stages]
    if steps[0] < 1 or any(b <= a for a, b in zip(steps, steps[1:])):
        p.append(f"{key}: the until_steps {steps} must rise strictly from >= 1")
    bad = [v for _, v in stages if v < low or (high is not None and v > high)]
    if bad:
        p.append(f"{key}: values {bad} must be " + (f"in {low}..{high}" if high is not None else f">= {low}"))
    return p


# ------------------------------------------------------------------------------------------------ batch
def accum_at(tc, step: int) -> int:
    """grad_accum_steps (micro-batches over all ranks) of optimizer step ``step`` (1-based)."""
    return stage_value(tc.batch_ramp, tc.grad_accum_steps, step)


def accum_values(tc) -> list[int]:
    """Every grad_accum_steps the run takes, the recipe's last."""
    return [v for _, v in tc.batch_ramp or ()] + [tc.grad_accum_steps]


def batch_ramp_problems(tc) -> list[str]:
    """train.batch_ramp's shape, and the backends it works on."""
    p = stage_problems("train.batch_ramp", tc.batch_ramp, 1)
    if tc.batch_ramp is not None and tc.backend == "deepspeed":
        p.append("train.batch_ramp with train.backend=deepspeed: the DeepSpeed engine fixes its "
                 "gradient_accumulation_steps when it is built and finds its step boundaries from a micro-step "
                 "counter over the whole run, so a changing accumulation would step at the wrong micro-batch; use "
                 "train.backend=ddp or fsdp (or remove train.batch_ramp)")
    return p


def world_size_problems(tc, world: int) -> list[str]:
    """Each accumulation of train.batch_ramp must split evenly over the ranks (grad_accum_steps is checked apart)."""
    bad = sorted({v for _, v in tc.batch_ramp or () if v % world})
    if not bad:
        return []
    near = [-(-v // world) * world for v in bad]
    return [f"train.batch_ramp: grad_accum_steps {bad} count micro-batches over all {world} ranks and are not "
            f"multiples of the world size {world}; use multiples of {world} (e.g. {near})"]


def tokens_through(cfg, step: int) -> int:
    """Tokens trained in optimizer steps 1..``step`` (the ramp's stages summed)."""
    tc = cfg.train
    per_micro = tc.micro_batch_size * cfg.model.block_size
    total, done = 0, 0
    for until, value in tc.batch_ramp or ():
        n = max(min(until, step) - done, 0)
        total, done = total + n * value, done + n
    return per_micro * (total + max(step - done, 0) * tc.grad_accum_steps)


# ------------------------------------------------------------------------------------------------ depth
def depth_schedule_problems(model_cfg) -> list[str]:
    """model.depth_schedule: only for the types with a sampled depth, values in 1..model.n_recurrence."""
    stages = getattr(model_cfg, "depth_schedule", None)
    if stages is None:
        return []
    if model_cfg.type not in SAMPLED_DEPTH:
        return [f"model.depth_schedule with model.type={model_cfg.type}: this type trains every step at its full "
                f"depth (no sampled depth to bound); it applies to {sorted(SAMPLED_DEPTH)}; remove it"]
    return stage_problems("model.depth_schedule", stages, 1, model_cfg.n_recurrence)


def depth_bound_at(model_cfg, step: int) -> int | None:
    """The scheduled depth bound of optimizer step ``step`` (1-based); None without model.depth_schedule."""
    stages = getattr(model_cfg, "depth_schedule", None)
    return None if stages is None else stage_value(stages, model_cfg.n_recurrence, step)


def depth_kwargs(model_cfg, step: int) -> dict:
    """What train_depth takes for ``step`` (1-based): ``{"depth": bound}``, or nothing without a schedule (the draw
    of every existing run, unchanged)."""
    bound = depth_bound_at(model_cfg, step)
    return {} if bound is None else {"depth": bound}


# ------------------------------------------------------------------------------------------------ said
def describe(cfg, world: int | None = None) -> list[str]:
    """Lines for `grt info` and the preflight, one per stage; nothing without a curriculum."""
    tc, m = cfg.train, cfg.model
    lines = []
    if tc.batch_ramp is not None:
        per_micro = tc.micro_batch_size * m.block_size
        lines.append("batch ramp (train.batch_ramp): grad_accum_steps over all ranks"
                     + ("" if world is None else " (per rank)") + ", tokens per step")
        for lo, hi, v in spans(tc.batch_ramp, tc.grad_accum_steps, tc.max_steps):
            rank = "" if world is None else f" ({v / world:g})"
            lines.append(f"  {steps_label(lo, hi):<22} {f'{v}{rank}':>12} {v * per_micro:>14,}")
        lines.append(f"  {tc.max_steps:,} steps = {tokens_through(cfg, tc.max_steps):,} tokens")
    stages = getattr(m, "depth_schedule", None)
    if stages is not None and m.type in SAMPLED_DEPTH:
        largest = max([v for _, v in stages] + [m.n_recurrence])
        what, memory = SAMPLED_DEPTH[m.type]
        lines.append(f"depth schedule (model.depth_schedule: {what}); {memory.format(largest=largest)}")
        lines += [f"  {steps_label(lo, hi):<22} {v:>12}" for lo, hi, v in spans(stages, m.n_recurrence,
                                                                                 tc.max_steps)]
    return lines


def steps_label(lo: int, hi: int) -> str:
    return f"step {lo:,}" if lo == hi else f"steps {lo:,}-{hi:,}"


def spans(stages: list, final: int, max_steps: int) -> list[tuple[int, int | str, int]]:
    """(first step, last step, value) of each stage up to max_steps, the recipe's own value last."""
    out, lo = [], 1
    for until, value in stages:
        if lo > max_steps:
            break
        out.append((lo, min(until, max_steps), value))
        lo = until + 1
    if lo <= max_steps:
        out.append((lo, max_steps, final))
    return out


def info(cfg) -> dict:
    """`grt info --json`'s curriculum keys (none without one)."""
    out = {}
    if cfg.train.batch_ramp is not None:
        out["batch_ramp"] = [list(s) for s in spans(cfg.train.batch_ramp, cfg.train.grad_accum_steps,
                                                     cfg.train.max_steps)]
        out["tokens_total"] = tokens_through(cfg, cfg.train.max_steps)
    stages = getattr(cfg.model, "depth_schedule", None)
    if stages is not None:
        out["depth_schedule"] = [list(s) for s in spans(stages, cfg.model.n_recurrence, cfg.train.max_steps)]
    return out


def step_metrics(cfg, step: int) -> dict:
    """The scheduled values of optimizer step ``step`` for its metrics line (none without a curriculum)."""
    out = {}
    if cfg.train.batch_ramp is not None:
        out["grad_accum_steps"] = accum_at(cfg.train, step)
    bound = depth_bound_at(cfg.model, step)
    if bound is not None:
        out["depth_bound"] = bound
    return out
