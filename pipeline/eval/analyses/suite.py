"""`grt eval`'s Appendix E analyses (``eval.analyses``): which ones apply to a model, ONE traced pass over the
validation batches that feeds every per-step accumulator (not R separate forwards), their plots and MLflow metrics.

The computations live in ``dynamics`` (gate/update statistics, bands, deciles, anchor ablation, gate maps),
``representation`` (E.3-E.6, E.10) and ``mechanism`` (E.7-E.9, Figure 4); this module only wires them.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pipeline.config import ANALYSES
from pipeline.eval.analyses.dynamics import StepStatistics
from pipeline.eval.analyses.dynamics import anchor_ablation
from pipeline.eval.analyses.dynamics import band_losses
from pipeline.eval.analyses.dynamics import decile_losses
from pipeline.eval.analyses.dynamics import gate_heatmaps
from pipeline.eval.analyses.dynamics import trace_steps
from pipeline.eval.analyses.mechanism import AttentionStatistics
from pipeline.eval.analyses.mechanism import GateAttribution
from pipeline.eval.analyses.mechanism import gate_weight_spectra
from pipeline.eval.analyses.mechanism import next_token_traces
from pipeline.eval.analyses.mechanism import projection_analysis
from pipeline.eval.analyses.representation import SuccessiveStates
from pipeline.eval.analyses.representation import TokenGateMean
from pipeline.eval.analyses.representation import TokenSample
from pipeline.eval.analyses.representation import cka_matrix
from pipeline.eval.analyses.representation import cross_cka
from pipeline.eval.analyses.representation import dense_layer_states
from pipeline.eval.analyses.representation import effective_rank_by_step
from pipeline.eval.analyses.representation import gate_difficulty_by_step
from pipeline.eval.analyses.representation import relative_improvement
from pipeline.model.layers import token_layout
from pipeline.train.data import batch_parts


def resolve(names: list[str], model_type: str, has_gate: bool) -> tuple[list[str], dict[str, str]]:
    """(the analyses to run, in ANALYSES order; {name: why not} for those asked for by name, or by ``all``, that this
    model lacks — the ones ``default`` implies are left out quietly)."""
    asked, named = set(), set()
    for n in names:
        asked |= ({a for a, spec in ANALYSES.items() if spec.default} if n == "default"
                  else set(ANALYSES) if n == "all" else {n})
        named |= set(ANALYSES) if n == "all" else {n} if n != "default" else set()
    chosen, skipped = [], {}
    for name in ANALYSES:
        if name not in asked:
            continue
        needs = ANALYSES[name].needs
        if needs != "exits" and model_type != "grt":
            why = f"reads GRT's gated recurrence step; model type {model_type!r} has none"
        elif needs == "gate" and not has_gate:
            why = "needs the gate; this GRT has model.gate=none"
        else:
            chosen.append(name)
            continue
        if name in named:
            skipped[name] = why
    return chosen, skipped


@torch.no_grad()
def traced_pass(model, batches, n_steps: int, device, chosen: list[str], noise: bool, analysis_tokens: int,
                baseline=None, trained: int | None = None) -> dict:
    """One pass of :func:`~.dynamics.trace_steps` per batch feeding every chosen per-step analysis;
    ``baseline`` (a dense model) gets the same tokens for cross-model CKA. Per-step curves run to ``n_steps``; the
    summaries over steps (attention head classes, the late update's rank, the gate averaged over steps) stop at
    ``trained`` (R), as the paper's figures describe its R-step model."""
    want = set(chosen)
    stats = StepStatistics(n_steps) if "steps" in want else None
    similar = SuccessiveStates() if "similarity" in want else None
    sample = TokenSample(analysis_tokens) if want & {"cka", "effective_rank"} else None
    base = TokenSample(analysis_tokens) if "cka" in want and baseline is not None else None
    gates = TokenGateMean() if "gate_difficulty" in want else None
    attribution = GateAttribution(model.recurrent_core().gate) if "gate_attribution" in want else None
    attention = AttentionStatistics(model, n_steps, classify_through=trained) if "attention" in want else None
    with attention or contextlib.nullcontext():
        for batch in batches:
            x, _, docs = batch_parts(batch, device)
            layout = token_layout(model.cfg, x, **docs)  # one per batch, as in the model's own forward
            h_pre = model.encode(x, layout=layout)
            if base is not None and not base.full():
                for layer, states in enumerate(dense_layer_states(baseline, x, **docs)):
                    base.add(layer, states)
            for r, h, o, g, h_new in trace_steps(model, x, n_steps, noise=noise, h_pre=h_pre, layout=layout):
                if stats is not None:
                    stats.update(r, h, o, g, h_new)
                if similar is not None:
                    similar.update(r, h, h_new, o)
                if sample is not None:
                    if r == 1:
                        sample.add(0, h)
                    sample.add(r, h_new)
                if gates is not None and g is not None:
                    gates.update(r, g)
                if attribution is not None:
                    attribution.update(r, h, h_pre)
    out = {}
    if stats is not None:
        out["steps"] = stats.result()
    if similar is not None:
        out["similarity"] = similar.result()
    if "effective_rank" in want:
        out["effective_rank"] = effective_rank_by_step(sample, late_step=trained)
    if "cka" in want:
        states = [sample.matrix(r) for r in sample.steps()]
        out["cka"] = {"within": cka_matrix(states, sample.steps()),
                      "cross": cross_cka(states, [base.matrix(l) for l in base.steps()], sample.steps())
                      if base is not None else None}
    if gates is not None:
        out["_gates"] = gates  # turned into gate_difficulty by run_analyses, with the exit curve's r = 0 losses
    if attribution is not None:
        out["gate_attribution"] = {**attribution.result(), "spectra": gate_weight_spectra(model.recurrent_core().gate)}
    if attention is not None:
        out["attention"] = attention.result()
    return out


def run_analyses(model, cfg, curve: dict, batches, n_max: int, ref: int, device, baseline=None,
                 baseline_note: str | None = None) -> dict:
    """Every analysis of ``eval.analyses`` that applies to the model, as {name: result}; ``skipped`` says why any
    asked-for analysis did not run. ``curve``: :func:`~pipeline.eval.exit_losses.exit_curve` with ``keep_tokens``."""
    ev = cfg.eval
    has_gate = getattr(model.recurrent_core(), "gate", None) is not None  # GRT's (its ablations may drop it)
    chosen, skipped = resolve(list(ev.analyses), cfg.model.type, has_gate)
    exits = curve["exit"]
    trained = type(model).recurrence_depth(cfg.model) or ref
    out: dict = {}
    if "bands" in chosen or "relative_improvement" in chosen:
        out["bands"] = band_losses(curve["token_losses"], curve["token_ids"], exits)
    if "deciles" in chosen:
        out["deciles"] = decile_losses(curve["token_losses"], exits, by_exit=exits[0],
                                       to_exit=trained if trained in exits else None)
    if "relative_improvement" in chosen:
        out["relative_improvement"] = relative_improvement(exits, curve["loss"], out["bands"])
        if "bands" not in chosen:
            del out["bands"]
    per_step = [a for a in chosen if ANALYSES[a].needs != "exits" and a not in ("anchor_ablation", "gate_heatmaps",
                                                                                 "projection")]
    if per_step:
        if baseline is None and "cka" in chosen and baseline_note:
            skipped["cka (cross-model)"] = baseline_note
        torch.manual_seed(cfg.seed)  # eval.noise: the same draws whatever ran before (e.g. building the baseline)
        out.update(traced_pass(model, batches(), n_max, device, per_step, ev.noise, ev.analysis_tokens, baseline,
                               trained))
    gates = out.pop("_gates", None)
    if gates is not None:
        out["gate_difficulty"] = gate_difficulty_by_step(gates, curve["token_losses"][:, exits.index(0)], trained)
    if "projection" in chosen:
        out["projection"] = projection_analysis(model.recurrent_core())
    if "anchor_ablation" in chosen:
        out["anchor_ablation"] = anchor_ablation(model, batches(), ref, device)
    prompted = [a for a in ("gate_heatmaps", "trace") if a in chosen]
    if prompted:
        from pipeline.tokenize.tokenizers import dataset_tokenizer

        enc = dataset_tokenizer(cfg)  # the tokenizer the model was trained with (the dataset check passed)
        if cfg.model.vocab_size < enc.n_vocab:  # the prompts' ids would index past the embedding
            skipped.update({a: f"its prompts are {enc.kind} tokens ({enc.n_vocab:,} ids) and this model has "
                               f"model.vocab_size={cfg.model.vocab_size:,}" for a in prompted})
            prompted = []
    if prompted:
        decode = lambda t: enc.decode([t])  # noqa: E731
        if "gate_heatmaps" in prompted and ev.heatmap_prompts:
            out["gate_heatmaps"] = gate_heatmaps(model, list(ev.heatmap_prompts), ref, device, enc.encode, decode)
        if "trace" in prompted and ev.trace_prompts:
            out["trace"] = next_token_traces(model, list(ev.trace_prompts), ref, enc.encode, decode)
    if skipped:
        out["skipped"] = skipped
    return out


def analysis_plots(result: dict, out_dir: Path) -> list[Path]:
    """The PNGs of whatever analyses ``result['diagnostics']`` holds."""
    from pipeline.eval.analyses.mechanism_plots import plot_attention
    from pipeline.eval.analyses.mechanism_plots import plot_gate_attribution
    from pipeline.eval.analyses.mechanism_plots import plot_projection
    from pipeline.eval.analyses.mechanism_plots import plot_traces
    from pipeline.eval.analyses.representation_plots import plot_cka
    from pipeline.eval.analyses.representation_plots import plot_representation

    diag = result.get("diagnostics", {})
    plots = []
    sheet = {k: diag[k] for k in ("similarity", "effective_rank", "relative_improvement", "gate_difficulty")
             if diag.get(k)}
    if sheet:
        plots.append(plot_representation({**sheet, "name": result["name"], "val_tokens": result["val_tokens"]},
                                         out_dir / "representation.png"))
    if diag.get("cka"):
        plots.append(plot_cka(diag["cka"]["within"], diag["cka"]["cross"], out_dir / "cka.png"))
    if diag.get("gate_attribution"):
        plots.append(plot_gate_attribution(diag["gate_attribution"], out_dir / "gate_attribution.png"))
    if diag.get("projection"):
        plots.append(plot_projection(diag["projection"], out_dir / "projection.png"))
    if diag.get("attention"):
        plots.append(plot_attention(diag["attention"], out_dir / "attention.png"))
    if diag.get("trace"):
        plots.append(plot_traces(diag["trace"], out_dir / "next_token_traces.png"))
    return plots


def analysis_metrics(diag: dict) -> list[tuple[dict, int]]:
    """(metrics, step) pairs for MLflow: per-step curves with step = r, single figures at step 0."""
    rows: dict[int, dict] = {}

    def put(prefix: str, steps, **series):
        for i, r in enumerate(steps):
            for key, values in series.items():
                if values is not None and values[i] is not None:
                    rows.setdefault(int(r), {})[f"eval.{prefix}{key}"] = float(values[i])

    if diag.get("similarity"):
        s = diag["similarity"]
        put("", s["step"], cos_successive=s["cosine"], cos_proposal=s.get("proposal_cosine"),
            delta_ratio=s.get("delta_ratio"))
    if diag.get("effective_rank"):
        e = diag["effective_rank"]
        put("", e["step"], effective_rank=e["effective_rank"], effective_rank_fraction=e["effective_rank_fraction"])
    if diag.get("relative_improvement"):
        ri = diag["relative_improvement"]
        put("", ri["step"], delta_rel=ri["relative_improvement"])
    if diag.get("gate_difficulty"):
        gd = diag["gate_difficulty"]
        put("", gd["step"], gate_difficulty_r=gd["pearson_r"])
        rows.setdefault(0, {})["eval.gate_difficulty_r2"] = gd["all_steps"]["r2"]
    if diag.get("gate_attribution"):
        ga = diag["gate_attribution"]
        put("gate_", ga["step"], state_var_frac=ga["state_var_frac"], x_dominance=ga["x_dominance"],
            sign_agreement=ga["sign_agreement"])
    if diag.get("attention"):
        at = diag["attention"]
        put("attention_", at["step"], entropy=at["mean_entropy"], diag_mass=at["mean_diag_mass"],
            prev_mass=at["mean_prev_mass"])
    if diag.get("deciles") and diag["deciles"].get("improvement_r2") is not None:
        rows.setdefault(0, {})["eval.decile_improvement_r2"] = diag["deciles"]["improvement_r2"]
    proj = (diag.get("projection") or {}).get("proj")
    if proj:
        rows.setdefault(0, {})["eval.proj_row_cosine"] = proj["row_cosine"]["mean"]
    return [(m, r) for r, m in sorted(rows.items())]


def print_analyses(diag: dict) -> None:
    """One or two lines per Appendix E analysis; every figure is in exits.json and the plots."""
    fmt = lambda xs: " ".join("-" if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
    d = diag.get("deciles")
    if d:
        print(f"  difficulty deciles (loss at exit {d['by_exit']}): improvement to exit {d['to_exit']} "
              f"{fmt(d['improvement'])}" + (f"; R² vs initial loss {d['improvement_r2']:.3f}"
                                            if d.get("improvement_r2") is not None else ""))
    if diag.get("relative_improvement"):
        ri = diag["relative_improvement"]
        print(f"  Δ_rel per exit {ri['step'][0]}..{ri['step'][-1]}: {fmt(ri['relative_improvement'])}")
    if diag.get("similarity"):
        s = diag["similarity"]
        print(f"  cos(h_r, h_r-1): {fmt(s['cosine'])}; |Δh_r|/|Δh_r-1|: {fmt(s['delta_ratio'])}")
    if diag.get("effective_rank"):
        e = diag["effective_rank"]
        print(f"  effective rank / max ({e['tokens']:,} tokens), steps {e['step'][0]}..{e['step'][-1]}: "
              f"{fmt(e['effective_rank_fraction'])}")
    if diag.get("cka"):
        w = diag["cka"]["within"]["cka"]
        print(f"  CKA step r vs r-1: {fmt([w[i][i - 1] for i in range(1, len(w))])}" +
              ("" if not diag["cka"]["cross"] else
               f"; best dense layer per step: {diag['cka']['cross']['best_layer']}"))
    if diag.get("gate_difficulty"):
        g = diag["gate_difficulty"]
        print(f"  gate vs r=0 loss: Pearson r per step {fmt(g['pearson_r'])}; gate over steps "
              f"1..{g['all_steps_through']}: R² {fmt([g['all_steps']['r2']])}")
    if diag.get("gate_attribution"):
        a = diag["gate_attribution"]
        print(f"  gate logit variance from the state half per step: {fmt(a['state_var_frac'])}; leading singular "
              f"values W1_x / W1_a = {fmt([a['spectra']['leading_ratio_x_over_a']])}")
    proj = (diag.get("projection") or {}).get("proj")
    if proj:
        print(f"  W_proj: effective rank W_x {proj['W_x']['effective_rank']:.1f}, W_h "
              f"{proj['W_h']['effective_rank']:.1f}; mean row cosine {proj['row_cosine']['mean']:.3f}")
    if diag.get("attention"):
        at = diag["attention"]
        print(f"  attention entropy per step (nats): {fmt(at['mean_entropy'])}; head classes {at['class_counts']}")
    for t in diag.get("trace", []):
        print(f"  trace {t['prompt']!r}: most likely next token per exit {[a['token'] for a in t['argmax']]}")
    by_reason: dict[str, list[str]] = {}
    for name, why in diag.get("skipped", {}).items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        print(f"  (not run: {', '.join(names)}: {why})")
