"""`grt generate RUN_OR_CKPT "prompt"`: load a checkpoint, continue one prompt (streamed if asked) or a file of
prompts (one batch, left-padded), print each prompt with its continuation on stdout and a summary line per prompt
on stderr (new tokens, what stopped it, tokens/s, and with early exit the mean recurrence steps per decoded token).
Every option conflict is reported at once (exit status 2), before the checkpoint is loaded where possible."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.runtime.exit_status import USAGE

if TYPE_CHECKING:
    from pipeline.infer.early_exit import EarlyExit

# torch and the models are imported by the functions that use them: `grt --help` and every other command register
# this module's parser without loading torch

ENDED_BY = {"eot": "the end-of-text token", "stop": "a stop string", "length": "--max-new-tokens"}


def register(sub) -> None:
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


def cmd_generate(args) -> int:
    try:
        return generate_command(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE


class UsageError(ValueError):
    """Options of `grt generate` that do not go together (exit status 2); the message names the fix."""


def unescape(s: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` in a --stop argument as newline, tab and backslash (shells pass them literally)."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def read_prompts(args) -> list[str]:
    """The prompt argument, or the lines of --batch-file (blank lines skipped)."""
    if (args.prompt is None) == (args.batch_file is None):
        raise UsageError("give one prompt as an argument or a file of prompts with --batch-file FILE (one per line), "
                         "not " + ("both" if args.prompt is not None else "neither"))
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.batch_file)
    if not path.is_file():
        raise UsageError(f"--batch-file {path}: no such file; write one prompt per line")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UsageError(f"--batch-file {path}: line {line} is not valid UTF-8 (byte 0x{data[e.start]:02x} at byte "
                         f"{col} of the line); save the file as UTF-8 text, one prompt per line") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--batch-file {path} holds no prompt (blank lines are skipped); write one prompt per line")
    return prompts


def option_problems(args, n_prompts: int) -> list[str]:
    """Conflicts among the options themselves, each with its fix."""
    from pipeline.infer.early_exit import CRITERIA
    from pipeline.infer.precision import PRECISIONS
    from pipeline.infer.sampling import sampling_problems

    p = sampling_problems(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        p.append(f"--max-new-tokens {args.max_new_tokens}: ask for at least 1 token")
    if args.n_steps is not None and args.n_steps < 1:
        p.append(f"--n-steps {args.n_steps}: run at least 1 recurrence step (dense model: exit layer >= 1)")
    if args.stream and args.batch_file is not None:
        p.append("--stream prints one prompt's tokens as they come; with --batch-file the rows finish together: "
                 "drop --stream, or pass a single prompt as the argument")
    if args.exit != "none":
        if n_prompts > 1:
            p.append(f"--exit {args.exit} decides per token, so it decodes one prompt at a time (batch size 1, for an "
                     f"honest measure); --batch-file has {n_prompts} prompts: run them one by one, or drop --exit")
        if args.exit_threshold is None:
            p.append(f"--exit {args.exit} needs --exit-threshold X (e.g. 0.01; 0 never exits early)")
    elif args.exit_threshold is not None:
        p.append(f"--exit-threshold applies to an exit criterion: add --exit {{{','.join(CRITERIA)}}} or drop it")
    if any(s == "" for s in args.stop or []):
        p.append("--stop '': an empty stop string would end every generation at once; drop it")
    if args.dtype not in PRECISIONS:
        p.append(f"--dtype {args.dtype}: choose one of {', '.join(PRECISIONS)} (auto: bf16 on a GPU that has "
                 f"it, fp32 elsewhere)")
    return p


def model_problems(args, cfg, n_vocab: int) -> list[str]:
    """What the checkpoint's model cannot do of what was asked."""
    from pipeline.infer.early_exit import EXIT_TYPES
    from pipeline.model import exits_are_layers

    m, p = cfg.model, []
    deepest = m.max_depth()
    if args.n_steps is not None and deepest is not None and args.n_steps > deepest:
        unit = "layers (the exit layer)" if exits_are_layers(m.type) else "recursions"
        p.append(f"--n-steps {args.n_steps}: model.type={m.type} has {deepest} {unit}; use --n-steps 1..{deepest}")
    if args.exit != "none" and m.type not in EXIT_TYPES:
        p.append(f"--exit {args.exit}: model.type={m.type} "
                 + ("is dense, it has no recurrence to exit from: drop --exit (--n-steps L exits at a fixed layer L)"
                    if exits_are_layers(m.type) else
                    f"does not support early exit (supported: {', '.join(EXIT_TYPES)})"))
    if m.vocab_size < n_vocab:
        p.append(f"model.vocab_size={m.vocab_size} is smaller than the {n_vocab} tokens of data.tokenizer="
                 f"{cfg.data.tokenizer} that grt generate reads and writes text with; this checkpoint was not "
                 f"trained on that tokenizer's tokens")
    return p


def generate_command(args, out=None, err=None) -> int:
    import torch

    from pipeline.infer.early_exit import EarlyExit
    from pipeline.infer.generate import generate
    from pipeline.infer.precision import autocast_dtype
    from pipeline.infer.sampling import Sampler
    from pipeline.infer.sampling import seeded_generator
    from pipeline.infer.text import TokenText

    out, err = out or sys.stdout, err or sys.stderr
    prompts = read_prompts(args)
    problems = option_problems(args, len(prompts))
    if problems:
        raise UsageError("; ".join(problems))
    if args.device.startswith("cuda") and not torch.cuda.is_available():  # in generate's words, not a recipe's
        raise UsageError(f"--device {args.device}: CUDA is not available here (torch sees no CUDA device); pass "
                         f"--device cpu, or omit --device (auto picks CUDA when present)")
    from pipeline.model import model_class
    from pipeline.tokenize.tokenizers import trained_tokenizer
    from pipeline.train.trained import load_trained

    model, cfg, _, ckpt = load_trained(args.checkpoint, device=args.device)
    enc = trained_tokenizer(cfg, ckpt)  # the run folder's copy: the user's file may have moved since
    problems = model_problems(args, cfg, enc.n_vocab)
    if problems:
        raise UsageError("; ".join(problems))
    block_size = cfg.model.block_size
    device = next(model.parameters()).device
    # an empty prompt starts from EOS, as every document after the first follows one in training
    ids = [enc.encode(p) or [enc.eos_id] for p in prompts]
    for i, t in enumerate(ids):
        if len(t) > block_size - 1:
            print(f"note: prompt {i + 1} has {len(t)} tokens; the model reads its last {block_size - 1} "
                  f"(model.block_size={block_size})", file=err)
    early = (EarlyExit(model, args.exit, args.exit_threshold, args.n_steps) if args.exit != "none" else None)
    sampler = Sampler(args.temperature, args.top_k, args.top_p,
                      seeded_generator(args.seed, device) if args.temperature > 0 else None)
    stops = [unescape(s) for s in args.stop or []]
    texts = [TokenText(enc, stops, enc.eos_id) for _ in prompts]

    def stop(row: int, tokens: list[int]) -> bool:
        ended = texts[row].feed(tokens[-1])
        if args.stream:
            out.write(texts[row].take())
            out.flush()
        return ended

    if args.stream:
        out.write(prompts[0])
        out.flush()
    gen = generate(model, ids, args.max_new_tokens, block_size, n_steps=args.n_steps, kv=args.kv, sampler=sampler,
                   stop=stop, early_exit=early, dtype=args.dtype)
    arithmetic = {torch.bfloat16: "bf16", torch.float32: "fp32"}[autocast_dtype(args.dtype, device)]
    depth = early.n_max if early else (args.n_steps or model_class(cfg.model.type).full_depth(cfg.model))
    halting = cfg.model.type == "recurtrace" and args.n_steps is None  # its halting head sets each token's loops
    speed = (f"{gen.n_tokens} new tokens in {gen.seconds:.2f} s, {gen.n_tokens / max(gen.seconds, 1e-9):.1f} "
             f"tokens/s (prefill included; {device.type} {arithmetic}, kv={args.kv})")
    for row, (prompt, text) in enumerate(zip(prompts, texts)):
        rest = text.finish()
        out.write(rest if args.stream else prompt + rest)
        out.write("\n")
        out.flush()
        what = f"{len(gen.tokens[row])} new tokens, ended by {ENDED_BY[text.ended]}"
        if len(prompts) > 1:
            print(f"-- prompt {row + 1}/{len(prompts)}: {what}", file=err)
        else:
            print(f"-- {what}; {speed}; {_depth_note(cfg, depth, early, gen, halting)}", file=err)
    if len(prompts) > 1:
        print(f"-- batch of {len(prompts)}: {speed}; {_depth_note(cfg, depth, None, gen, halting)}", file=err)
    err.flush()
    return 0


def _depth_note(cfg, depth: int, early: EarlyExit | None, gen, halting: bool = False) -> str:
    from pipeline.model import exits_are_layers

    if halting:
        return (f"halting: each {'token' if cfg.model.halt_mode == 'token' else 'row'} stops once P(continue) < "
                f"{cfg.model.halt_threshold:g}, at most {depth} loops (--n-steps N: exactly N)")
    if exits_are_layers(cfg.model.type):
        return f"exit layer {depth} of {cfg.model.n_layer}"
    if early is None:
        return f"{depth} recurrence steps per token"
    if not gen.steps:
        return (f"early exit ({early.criterion} < {early.threshold:g}): no token decoded (the first new token comes "
                f"from the prefill at {early.n_max} steps)")
    return (f"mean recurrence steps used {gen.mean_steps:.2f} of {early.n_max} over {len(gen.steps)} decoded tokens "
            f"(exit when {early.criterion} < {early.threshold:g}; the prompt and the first new token at "
            f"{early.n_max})")
