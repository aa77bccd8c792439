"""`grt generate RUN_OR_CKPT "prompt"`: load a checkpoint, continue one prompt (streamed if asked) or a file of
prompts (one batch, left-padded), print each prompt with its continuation on stdout and a summary line per prompt
on stderr (new tokens, what stopped it, tokens/s, and with early exit the mean recurrence steps per decoded token).
Every option conflict is reported at once (exit status 2), before the checkpoint is loaded where possible."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from pipeline.infer.early_exit import CRITERIA, EXIT_TYPES, EarlyExit
from pipeline.infer.generate import generate
from pipeline.infer.precision import PRECISIONS, autocast_dtype
from pipeline.infer.sampling import Sampler, sampling_problems, seeded_generator
from pipeline.infer.text import TokenText
from pipeline.model import exits_are_layers

ENDED_BY = {"eot": "the end-of-text token", "stop": "a stop string", "length": "--max-new-tokens"}


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
    m, p = cfg.model, []
    deepest = m.max_depth()
    if args.n_steps is not None and deepest is not None and args.n_steps > deepest:
        unit = "layers (the exit layer)" if exits_are_layers(m.type) else "recursions"
        p.append(f"--n-steps {args.n_steps}: model.type={m.type} has {deepest} {unit}; use --n-steps 1..{deepest}")
    if args.exit != "none" and m.type not in EXIT_TYPES:
        p.append(f"--exit {args.exit}: model.type={m.type} "
                 + ("is dense, it has no recurrence to exit from: drop --exit (--n-steps L exits at a fixed layer L)"
                    if exits_are_layers(m.type) else f"does not support early exit (supported: {', '.join(EXIT_TYPES)})"))
    if m.vocab_size < n_vocab:
        p.append(f"model.vocab_size={m.vocab_size} is smaller than the GPT-2 BPE's {n_vocab} tokens that grt "
                 f"generate reads and writes text with; this checkpoint was not trained on GPT-2 tokens")
    return p


def generate_command(args, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    prompts = read_prompts(args)
    problems = option_problems(args, len(prompts))
    if problems:
        raise UsageError("; ".join(problems))
    if args.device.startswith("cuda") and not torch.cuda.is_available():  # in generate's words, not a recipe's
        raise UsageError(f"--device {args.device}: CUDA is not available here (torch sees no CUDA device); pass "
                         f"--device cpu, or omit --device (auto picks CUDA when present)")
    from pipeline.eval.stage import load_trained
    from pipeline.model import model_class
    from pipeline.tokenize.bpe import gpt2_encoding

    model, cfg, _, ckpt = load_trained(args.checkpoint, device=args.device)
    problems = model_problems(args, cfg, gpt2_encoding().n_vocab)
    if problems:
        raise UsageError("; ".join(problems))
    enc, block_size = gpt2_encoding(), cfg.model.block_size
    device = next(model.parameters()).device
    ids = [enc.encode_ordinary(p) or [enc.eot_token] for p in prompts]  # an empty prompt starts from EOT
    for i, t in enumerate(ids):
        if len(t) > block_size - 1:
            print(f"note: prompt {i + 1} has {len(t)} tokens; the model reads its last {block_size - 1} "
                  f"(model.block_size={block_size})", file=err)
    early = (EarlyExit(model, args.exit, args.exit_threshold, args.n_steps) if args.exit != "none" else None)
    sampler = Sampler(args.temperature, args.top_k, args.top_p,
                      seeded_generator(args.seed, device) if args.temperature > 0 else None)
    stops = [unescape(s) for s in args.stop or []]
    texts = [TokenText(enc, stops, enc.eot_token) for _ in prompts]

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
