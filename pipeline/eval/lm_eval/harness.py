"""lm-evaluation-harness adapter: the model class ``grt`` (a checkpoint of any registered model type: dense, GRT,
Poisson, MoR, RRT, Ouro).

From the shell (the package registers ``grt`` with lm-eval when lm-eval loads, see ``lm_eval_plugin``)::

    lm_eval --model grt --model_args checkpoint=runs/quickstart-grt,n_steps=6,kv=averaged \\
        --tasks lambada_openai,piqa --include_path pipeline/eval/lm_eval/tasks

``kv`` is the KV-cache strategy (``full`` default, ``last``, ``first``, ``averaged``: see
:mod:`pipeline.model.kv_cache`): generation decodes with it, and so does log-likelihood scoring when it is not
``full`` (the context prefilled, the continuation fed one token at a time, as generation would see it; ``full`` is
the exact model, scored in one forward). ``n_steps`` is the depth to score at: recurrence steps (GRT, Poisson:
default the trained R), recursions (MoR, RRT: default and maximum N_r), loops (Ouro: default T), the exit layer for
the dense model (default: all layers). MoR is scored with its causal routing (a token takes recursion r when its
router's sigmoid reaches 0.5): the expert-choice top-k it trains with lets later tokens decide which earlier tokens
get deeper, which scoring must not. ``grt eval RUN eval.tasks=[...] eval.task_depths=[2,4,8]`` scores several depths
with one forward per batch through a shared :class:`DepthScorer`.
"""
from __future__ import annotations

import lm_eval.models  # noqa: F401  (fills lm-eval's model registry before ours is added to it)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows
from lm_eval.utils import make_disjoint_window
from tqdm import tqdm

from pipeline.eval.lm_eval.scoring import decode_loglikelihoods
from pipeline.eval.lm_eval.scoring import greedy_generate
from pipeline.eval.lm_eval.scoring import loglikelihoods
from pipeline.infer.text import TokenText
from pipeline.model import model_class
from pipeline.model.kv_cache import KV_STRATEGIES
from pipeline.tokenize.tokenizers import dataset_tokenizer
from pipeline.tokenize.tokenizers import trained_tokenizer


class DepthScorer:
    """Log-likelihoods of token requests at every depth in ``depths``, computed together (one forward per batch
    serves all depths) and kept, so an adapter for each depth reads from one computation."""

    def __init__(self, model, depths: list[int], batch_size: int, max_length: int, pad_id: int):
        self.model, self.depths = model, sorted(set(depths))
        self.batch_size, self.max_length, self.pad_id = batch_size, max_length, pad_id
        self._done: dict[tuple, dict[int, tuple[float, bool]]] = {}

    def loglikelihoods(self, requests: list[tuple[list[int], list[int]]], depth: int,
                       show_progress: bool = True) -> list[tuple[float, bool]]:
        if depth not in self.depths:
            raise ValueError(f"depth {depth} is not among this scorer's depths {self.depths}")
        keys = [(tuple(c), tuple(t)) for c, t in requests]
        todo = list(dict.fromkeys(k for k in keys if k not in self._done))
        if todo:
            with tqdm(total=len(todo), desc=f"scoring at depths {self.depths}", disable=not show_progress) as bar:
                res = loglikelihoods(self.model, todo, self.depths, self.batch_size, self.max_length, self.pad_id,
                                     progress=bar.update)
            for j, k in enumerate(todo):
                self._done[k] = {d: res[d][j] for d in self.depths}
        return [self._done[k][depth] for k in keys]


class DecodeScorer:
    """Log-likelihoods at one depth as decoding with the KV strategy ``kv`` sees them (:func:`decode_loglikelihoods`),
    with :class:`DepthScorer`'s interface."""

    def __init__(self, model, depth: int, kv: str, batch_size: int, max_length: int, pad_id: int):
        self.model, self.depth, self.kv = model, depth, kv
        self.batch_size, self.max_length, self.pad_id = batch_size, max_length, pad_id

    def loglikelihoods(self, requests: list[tuple[list[int], list[int]]], depth: int,
                       show_progress: bool = True) -> list[tuple[float, bool]]:
        if depth != self.depth:
            raise ValueError(f"depth {depth} is not this scorer's depth {self.depth}")
        with tqdm(total=len(requests), desc=f"scoring with kv={self.kv}", disable=not show_progress) as bar:
            return decode_loglikelihoods(self.model, requests, depth, self.batch_size, self.max_length, self.kv,
                                         self.pad_id, progress=bar.update)


@register_model("grt")
class GRTLM(TemplateLM):
    """A trained checkpoint of this pipeline as an lm-eval model (``loglikelihood``, ``loglikelihood_rolling``,
    ``generate_until``)."""

    def __init__(self, checkpoint: str | None = None, n_steps: int | None = None, batch_size: int | str = 32,
                 max_batch_size: int | None = None, device: str | None = None, max_gen_toks: int = 256,
                 kv: str = "full", scorer: DepthScorer | None = None, model=None, cfg=None, tokenizer=None,
                 **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"unknown model_args for --model grt: {sorted(unknown)}; the arguments are checkpoint, "
                             f"n_steps, kv, batch_size, device, max_gen_toks")
        if kv not in KV_STRATEGIES:
            raise ValueError(f"kv={kv!r}: the KV-cache strategies are {', '.join(KV_STRATEGIES)} "
                             f"(--model_args checkpoint=...,kv=averaged)")
        if scorer is not None and kv != "full":
            raise ValueError(f"kv={kv} scores by decoding at one depth; a shared DepthScorer scores the exact model "
                             f"(kv=full): pass one or the other")
        if model is None:
            if checkpoint is None:
                raise ValueError("--model grt needs --model_args checkpoint=PATH (a run folder or a state.pt)")
            from pipeline.train.trained import load_trained

            model, cfg, _, ckpt = load_trained(checkpoint, device=_device_arg(device))
            tokenizer = trained_tokenizer(cfg, ckpt)
        self.model, self.cfg = model, cfg
        self.depth = int(n_steps) if n_steps is not None else model_class(cfg.model.type).full_depth(cfg.model)
        deepest = cfg.model.max_depth()
        if self.depth < 0 or (deepest is not None and self.depth > deepest):
            raise ValueError(f"n_steps={self.depth}: model.type={cfg.model.type} exits at 0.."
                             f"{deepest if deepest is not None else 'any depth'}; score at a depth in that range")
        if model.routing is not None:
            model.routing = "threshold"  # MoR: causal routing for scoring and generation (see the module docstring)
        self.batch_size = 32 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = cfg.model.block_size
        self.max_gen_toks = int(max_gen_toks)
        self.tokenizer = tokenizer or dataset_tokenizer(cfg)  # the one the model was trained with
        self.kv = kv
        if kv == "full":
            self.scorer = scorer or DepthScorer(model, [self.depth], self.batch_size, self.max_length,
                                                self.eot_token_id)
        else:
            self.scorer = DecodeScorer(model, self.depth, kv, self.batch_size, self.max_length, self.eot_token_id)

    # ---------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @property
    def tokenizer_name(self) -> str:
        tok = self.tokenizer
        return tok.kind if tok.kind == "gpt2" else f"{tok.kind}-{tok.vocab_hash[:12]}"  # lm-eval's cache key

    # --------------------------------------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.scorer.loglikelihoods([(ctx, cont) for _, ctx, cont in requests], self.depth,
                                             show_progress=not disable_tqdm)
        for (key, _, _), res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in disjoint windows of ``max_length`` tokens (each scored with up to
        ``max_length`` tokens of context), as lm-eval's HF model does."""
        out = []
        for (text,) in tqdm([r.args for r in requests], desc="rolling loglikelihood", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            total = sum(ll for ll, _ in self.scorer.loglikelihoods(windows, self.depth, show_progress=False))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding with a KV cache of strategy ``kv``; stops at any ``until`` string (cut from the answer) or
        the EOT token. Requests with the same generation arguments are decoded in batches of prompts of any lengths
        (left-padded), longest first so that a batch holds similar lengths."""
        prepared = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError(f"--model grt decodes greedily; got sampling arguments {gen_kwargs}")
            ctx = self.tok_encode(context)[-(self.max_length - 1):] or [self.prefix_token_id]
            prepared.append((i, ctx, tuple(until), max_new))
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list] = {}
        for item in prepared:
            groups.setdefault((item[2], item[3]), []).append(item)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for (until, max_new), items in groups.items():
            items.sort(key=lambda item: (-len(item[1]), item[0]))
            for b in range(0, len(items), self.batch_size):
                batch = items[b:b + self.batch_size]

                # each row's text decoded incrementally, ended at EOT or the first completed stop string (cut)
                texts = [TokenText(self.tokenizer, until, self.eot_token_id) for _ in batch]
                greedy_generate(self.model, [c for _, c, _, _ in batch], max_new, self.depth, self.max_length,
                                lambda row, toks: texts[row].feed(toks[-1]), kv=self.kv)
                for (i, _, _, _), row_text in zip(batch, texts):
                    row_text.finish()
                    results[i] = text = row_text.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results

    def get_model_info(self) -> dict:
        return {"grt_depth": self.depth, "grt_kv": self.kv, "grt_model": self.cfg.model.type,
                "grt_run": self.cfg.name}


def _device_arg(device: str | None) -> str:
    return "auto" if device in (None, "", "auto") else device
