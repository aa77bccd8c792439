"""The evaluation stage against independent references: log-probabilities taken by hand from full forwards, the
paper's Eq. 3 / Eq. 4 written out from the model's submodules, KL and top-1 from full logits, lm-eval's own
rolling windows, uncached greedy decoding."""
import bz2
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import SHARED_DATA
from conftest import tiny_recipe
from pipeline.config import from_dict
from pipeline.eval.analyses.dynamics import anchor_ablation
from pipeline.eval.analyses.dynamics import band_losses
from pipeline.eval.analyses.dynamics import decile_losses
from pipeline.eval.analyses.dynamics import trace_steps
from pipeline.eval.analyses.suite import traced_pass
from pipeline.eval.exit_losses import exit_curve
from pipeline.eval.lm_eval.harness import GRTLM
from pipeline.eval.lm_eval.harness import DepthScorer
from pipeline.eval.lm_eval.scoring import greedy_generate
from pipeline.model import build_model
from pipeline.tokenize.bpe import gpt2_encoding
from plot_check import assert_png_of
from plot_check import capture_figures
from test_model import block
from test_model import linear
from test_model import ln

ENC = gpt2_encoding()
PAIRS = [("The gate decides how much", " of the state"), ("A", " b c d e f"), ("", "Hello world"),
         ("the shared core proposes " * 12, " an update"),  # context longer than block_size: left-truncated
         ("one two", " three"), ("x" * 3, " y")]


SMALL_MODELS = {  # every registered type besides grt (tiny_recipe's default)
    "gpt": {"type": "gpt", "n_layer": 3},
    "poisson": {"type": "poisson", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3},
    "mor": {"type": "mor", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3},
    "rrt": {"type": "rrt", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3, "lora_rank": 4},
    "ouro": {"type": "ouro", "n_layer": 2, "n_recurrence": 3},
}
METHODS = ["poisson", "mor", "rrt", "ouro"]


def small(model_type: str, **model_keys):
    """A tiny model on the real GPT-2 vocabulary (so the adapter's tokenizer applies), weights moved off init."""
    torch.manual_seed(1)
    recipe = tiny_recipe(Path("/tmp"), Path("/tmp"), {"d_model": 16, "n_head": 2, **model_keys})
    if model_type != "grt":
        recipe["model"] = {"block_size": 32, "d_model": 16, "n_head": 2, **SMALL_MODELS[model_type], **model_keys}
    cfg = from_dict(recipe)
    model = build_model(cfg.model).eval()
    if model_type == "mor":
        model.routing = "threshold"  # what the adapter scores MoR with (causal); the hand-computed side uses it too
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        if model_type == "grt":
            model.recur.gate.fc2.bias.normal_(0.0, 1.0)
    return model, cfg


class Req:  # the part of lm-eval's Instance the adapter reads
    def __init__(self, *args):
        self.args = args


def direct_loglikelihood(model, ctx: str, cont: str, n_steps, block_size: int) -> tuple[float, bool]:
    """By hand: encode context + continuation as lm-eval does (trailing context spaces move to the continuation,
    an empty context becomes the EOT token), run one full forward on the last block_size + 1 tokens, read the
    continuation's log-probabilities."""
    if ctx:
        stripped = ctx.rstrip()
        ctx, cont = stripped, ctx[len(stripped):] + cont
        whole, c = ENC.encode_ordinary(ctx + cont), ENC.encode_ordinary(ctx)
        ctx_ids, cont_ids = c, whole[len(c):]
    else:
        ctx_ids, cont_ids = [ENC.eot_token], ENC.encode_ordinary(cont)
    seq = (ctx_ids + cont_ids)[-(block_size + 1):]
    logits, _ = model(torch.tensor([seq[:-1]]), n_steps=n_steps)
    logp = torch.log_softmax(logits[0].double(), -1)
    n = len(cont_ids)
    pos = range(len(seq) - 1 - n, len(seq) - 1)
    ll = sum(logp[p, t].item() for p, t in zip(pos, cont_ids))
    greedy = all(logp[p].argmax().item() == t for p, t in zip(pos, cont_ids))
    return ll, greedy


@pytest.mark.parametrize("model_type,n_steps", [("grt", None), ("grt", 2), ("grt", 5), ("gpt", None), ("gpt", 2)]
                         + [(m, n) for m in METHODS for n in (None, 2)])
def test_adapter_loglikelihood_equals_direct_log_probs_at_any_batch_size(model_type, n_steps):
    model, cfg = small(model_type)
    want = [direct_loglikelihood(model, c, t, n_steps, cfg.model.block_size) for c, t in PAIRS]
    for bs in (1, 2, 64):
        lm = GRTLM(model=model, cfg=cfg, n_steps=n_steps, batch_size=bs)
        got = lm.loglikelihood([Req(c, t) for c, t in PAIRS], disable_tqdm=True)
        for (ll, greedy), (w_ll, w_greedy) in zip(got, want):
            assert ll == pytest.approx(w_ll, abs=1e-4)
            assert greedy == w_greedy
    assert all(ll < 0 for ll, _ in want)


def test_one_forward_serves_every_depth():
    model, cfg = small("grt")
    reqs = [(ENC.encode_ordinary(c) or [ENC.eot_token], ENC.encode_ordinary(t)) for c, t in PAIRS]
    shared = DepthScorer(model, [1, 3, 6], 4, cfg.model.block_size, ENC.eot_token)
    for depth in (1, 3, 6):
        alone = DepthScorer(model, [depth], 4, cfg.model.block_size, ENC.eot_token)
        together, apart = shared.loglikelihoods(reqs, depth, False), alone.loglikelihoods(reqs, depth, False)
        for (a, ga), (b, gb) in zip(together, apart):
            assert a == pytest.approx(b, abs=1e-5) and ga == gb


@pytest.mark.parametrize("model_type", ["grt", "gpt"])
def test_loglikelihood_rolling_against_lm_evals_windows(model_type):
    from lm_eval.utils import get_rolling_token_windows
    from lm_eval.utils import make_disjoint_window

    model, cfg = small(model_type)
    lm = GRTLM(model=model, cfg=cfg, batch_size=3)
    short, long = "a short text of a few words", " ".join(f"word{i}" for i in range(60))  # long > block_size
    got = lm.loglikelihood_rolling([Req(short), Req(long)], disable_tqdm=True)
    # short: every token scored from the EOT prefix on, in one full forward
    ids = ENC.encode_ordinary(short)
    logits, _ = model(torch.tensor([[ENC.eot_token] + ids[:-1]]))
    want_short = torch.log_softmax(logits[0].double(), -1).gather(1, torch.tensor(ids)[:, None]).sum().item()
    assert got[0] == pytest.approx(want_short, abs=1e-4)
    # long: lm-eval's own windows, each one full forward
    total = 0.0
    for ctx, pred in (make_disjoint_window(w) for w in get_rolling_token_windows(
            ENC.encode_ordinary(long), ENC.eot_token, cfg.model.block_size, 1)):
        seq = (ctx + pred)[-(cfg.model.block_size + 1):]
        lp = torch.log_softmax(model(torch.tensor([seq[:-1]]))[0][0].double(), -1)
        total += sum(lp[len(seq) - 1 - len(pred) + i, t].item() for i, t in enumerate(pred))
    assert got[1] == pytest.approx(total, abs=1e-3)
    assert len(ENC.encode_ordinary(long)) > cfg.model.block_size


@pytest.mark.parametrize("model_type,n_steps", [("grt", None), ("grt", 2), ("gpt", None)]
                         + [(m, n) for m in METHODS for n in (None, 2)])
def test_kv_cache_generation_equals_uncached_greedy(model_type, n_steps):
    model, cfg = small(model_type)
    prompts = [ENC.encode_ordinary("the gate decides")[:3], ENC.encode_ordinary("a shared core is")[:3]]
    got = greedy_generate(model, prompts, 12, n_steps, cfg.model.block_size)
    for p, g in zip(prompts, got):
        seq = list(p)
        for _ in range(12):
            seq.append(model(torch.tensor([seq]), n_steps=n_steps)[0][0, -1].argmax().item())
        assert g == seq[len(p):]


def test_generate_until_honours_stop_sequences():
    model, cfg = small("grt")
    lm = GRTLM(model=model, cfg=cfg, batch_size=2, max_gen_toks=10)
    free = lm.generate_until([Req("the gate", {"until": ["\u2603"]})], disable_tqdm=True)[0]
    assert len(ENC.encode_ordinary(free)) >= 5
    stop = free[len(free) // 2:len(free) // 2 + 2]
    cut = lm.generate_until([Req("the gate", {"until": [stop]}), Req("the gate", {"until": ["\u2603"],
                                                                                  "max_gen_toks": 3})],
                            disable_tqdm=True)
    assert cut[0] == free.split(stop)[0] and stop not in cut[0]
    assert cut[1] == ENC.decode(ENC.encode_ordinary(free)[:3])


# ------------------------------------------------------------------------------------- early exits and dynamics
def test_exit_curve_loss_kl_top1_from_full_logits():
    model, cfg = small("grt")
    torch.manual_seed(3)
    x, y = torch.randint(0, 50257, (3, 32)), torch.randint(0, 50257, (3, 32))
    res = exit_curve(model, [(x, y)], list(range(0, 7)), 3, torch.device("cpu"), keep_tokens=True)
    ref = torch.log_softmax(model(x, n_steps=3)[0].double(), -1)
    for j, r in enumerate(res["exit"]):
        lp = torch.log_softmax(model(x, n_steps=r)[0].double(), -1)
        assert res["loss"][j] == pytest.approx(F.nll_loss(lp.flatten(0, 1), y.flatten()).item(), abs=1e-4)
        kl = (lp.exp() * (lp - ref)).sum(-1).mean().item()
        assert res["kl"][j] == pytest.approx(kl, abs=1e-5)
        assert res["top1"][j] == pytest.approx((lp.argmax(-1) == ref.argmax(-1)).double().mean().item())
    assert res["kl"][3] == 0 and res["top1"][3] == 1
    assert res["token_losses"].shape == (96, 7)


def test_dense_exit_curve_per_layer():
    model, cfg = small("gpt")
    x, y = torch.randint(0, 50257, (2, 32)), torch.randint(0, 50257, (2, 32))
    res = exit_curve(model, [(x, y)], [1, 2, 3], 3, torch.device("cpu"))
    want = [F.cross_entropy(model(x, n_steps=k)[0].flatten(0, 1), y.flatten()).item() for k in (1, 2, 3)]
    assert res["loss"] == pytest.approx(want, abs=1e-4)
    assert res["top1"][-1] == 1.0 and res["kl"][-1] == 0.0


def test_step_statistics_follow_eq3_and_eq4_by_hand():
    model, cfg = small("grt")
    x = torch.randint(0, 50257, (2, 32))
    stats = traced_pass(model, [(x, None)], 4, torch.device("cpu"), ["steps"], noise=False, analysis_tokens=0)["steps"]
    rs, tau = model.recur, model.cfg.tau
    with torch.no_grad():
        h = h_pre = model.encode(x)  # init_state = prelude
        for r in range(1, 5):
            o = linear(torch.cat([h, h_pre], -1), rs.proj)
            for b in rs.blocks:
                o = block(b, o)
            u = torch.cat([ln(h, rs.gate.ln_h.weight, rs.gate.ln_h.bias),
                           ln(h_pre, rs.gate.ln_pre.weight, rs.gate.ln_pre.bias)], -1)
            a = linear(u, rs.gate.fc1)
            g = torch.sigmoid(linear(a * torch.sigmoid(a), rs.gate.fc2) / tau)
            new = g * h + (1 - g) * o
            i = r - 1
            assert stats["rho"][i] == pytest.approx(((1 - g) * (o - h)).norm().item() / (o - h).norm().item(),
                                                    rel=1e-4)
            assert stats["delta_fp"][i] == pytest.approx((new - h).norm().item() / h.norm().item(), rel=1e-4)
            assert stats["proposal_norm"][i] == pytest.approx(o.norm(dim=-1).mean().item(), rel=1e-4)
            assert stats["update_norm"][i] == pytest.approx((new - h).norm(dim=-1).mean().item(), rel=1e-4)
            assert stats["update_over_proposal"][i] == pytest.approx(  # the paper's printed rho: |Δh| / |o|
                (new - h).norm(dim=-1).mean().item() / o.norm(dim=-1).mean().item(), rel=1e-4)
            assert stats["update_over_proposal"][i] != pytest.approx(stats["rho"][i], rel=1e-3)  # two quantities
            assert stats["gate_mean"][i] == pytest.approx(g.mean().item(), rel=1e-5)
            assert stats["gate_std"][i] == pytest.approx(g.std(unbiased=False).item(), rel=1e-3)
            assert stats["gate_frac_above_095"][i] == pytest.approx((g > 0.95).double().mean().item())
            h = new


def ablated_loss_by_hand(model, x, y, n_steps: int, anchor: str, gate: float | None = None) -> float:
    """Table 11 / E.1 written out: embeddings and prelude give h_pre = h^(0); each step reads its anchor A in the
    projection and the gate, o = core(W_proj [h, A]), g = sigmoid(f_g([LN h, LN A]) / tau) (or forced to ``gate``),
    h = g h + (1 - g) o; coda, final LN, tied head, mean cross-entropy. A is h_pre (as trained), zeros, the input
    embedding (token + position, before the prelude) or h^(r-1) (drifting); only the anchor changes, h^(0) stays
    h_pre."""
    rs, tau = model.recur, model.cfg.tau
    emb = model.embed.wte.weight[x] + model.embed.wpe.weight[torch.arange(x.shape[1])]
    h_pre = emb
    for b in model.prelude:
        h_pre = block(b, h_pre)
    h = h_pre
    for _ in range(n_steps):
        anc = {"prelude": h_pre, "zeros": torch.zeros_like(h_pre), "embedding": emb, "previous": h}[anchor]
        o = linear(torch.cat([h, anc], -1), rs.proj)
        for b in rs.blocks:
            o = block(b, o)
        u = linear(torch.cat([ln(h, rs.gate.ln_h.weight, rs.gate.ln_h.bias),
                              ln(anc, rs.gate.ln_pre.weight, rs.gate.ln_pre.bias)], -1), rs.gate.fc1)
        g = torch.sigmoid(linear(u * torch.sigmoid(u), rs.gate.fc2) / tau) if gate is None else gate
        h = g * h + (1 - g) * o
    for b in model.coda:
        h = block(b, h)
    logits = ln(h, model.ln_f.weight, model.ln_f.bias) @ model.embed.wte.weight.T
    return F.cross_entropy(logits.double().flatten(0, 1), y.flatten()).item()


def test_anchor_ablations_and_forced_gates():
    """Every variant of anchor_ablation against the recurrence written out by hand (ablated_loss_by_hand): the four
    anchors of Table 11 and the gate forced to 0 (always write) and 1 (never update: the r = 0 loss). abs 2e-6 on a
    loss of ~11 nats: float32 forwards in another op order (the model fuses the gate, splits W_proj into its halves)
    agree to ~1.5e-7, and float32's resolution at 11 is 1e-6; the variants differ from each other by > 1e-3."""
    model, cfg = small("grt")
    x, y = torch.randint(0, 50257, (2, 32)), torch.randint(0, 50257, (2, 32))
    ab = anchor_ablation(model, [(x, y)], 3, torch.device("cpu"))["loss"]
    assert set(ab) == {"prelude", "zeros", "embedding", "previous", "gate0", "gate1"}
    with torch.no_grad():
        want = {a: ablated_loss_by_hand(model, x, y, 3, a) for a in ("prelude", "zeros", "embedding", "previous")}
        want.update(gate0=ablated_loss_by_hand(model, x, y, 3, "prelude", gate=0.0),
                    gate1=ablated_loss_by_hand(model, x, y, 3, "prelude", gate=1.0))
    for key, loss in want.items():
        assert ab[key] == pytest.approx(loss, abs=2e-6), key
    with torch.no_grad():  # the model's own forward agrees: as trained, and never updating = r = 0
        assert ab["prelude"] == pytest.approx(model(x, y, n_steps=3)[1].item(), abs=1e-4)
        assert ab["gate1"] == pytest.approx(model(x, y, n_steps=0)[1].item(), abs=1e-4)
    assert min(abs(a - b) for a, b in itertools.combinations(want.values(), 2)) > 1e-3  # each changes the model
    assert [r for r, *_ in trace_steps(model, x, 2, "embedding")] == [1, 2]


def test_bands_and_deciles_by_hand():
    losses = torch.tensor([[4.0, 3.0], [6.0, 2.0], [1.0, 1.0], [8.0, 4.0]] * 5)
    ids = torch.tensor([10, 300, 5000, 40000] * 5)
    b = band_losses(losses, ids, [0, 1])["bands"]
    assert b["bytes"]["loss"] == [4.0, 3.0] and b["common"]["loss"] == [6.0, 2.0]
    assert b["medium"]["loss"] == [1.0, 1.0] and b["rare"]["loss"] == [8.0, 4.0] and b["rare"]["tokens"] == 5
    d = decile_losses(losses, [0, 1], by_exit=0)
    assert d["tokens"] == [2] * 10
    assert d["loss"][0] == [1.0, 1.0] and d["loss"][-1] == [8.0, 4.0] and d["improvement"][-1] == 4.0


def test_decile_improvement_is_measured_to_the_trained_depth():
    """Appendix E.5: "improvement over six recurrence steps" — to R, not to the last exit (2R)."""
    # exits 0..4 with R = 2: token k has loss (k+1) at r=0, halves by r=2, then drops by 1 more by r=4
    base = torch.arange(1.0, 21.0)
    losses = torch.stack([base, 0.75 * base, 0.5 * base, 0.5 * base - 0.5, 0.5 * base - 1.0], dim=1)
    d = decile_losses(losses, [0, 1, 2, 3, 4], by_exit=0, to_exit=2)
    assert d["to_exit"] == 2 and d["last_exit"] == 4
    means = [(2 * k + 1 + 2 * k + 2) / 2 for k in range(10)]  # decile k holds tokens 2k+1 and 2k+2
    assert d["improvement"] == pytest.approx([0.5 * m for m in means])
    assert d["improvement_to_last"] == pytest.approx([0.5 * m + 1.0 for m in means])
    assert d["improvement_r2"] == pytest.approx(1.0)  # exactly linear in the initial loss
    default = decile_losses(losses, [0, 1, 2, 3, 4], by_exit=0)
    assert default["to_exit"] == 4 and default["improvement"] == default["improvement_to_last"]  # the last exit


# ------------------------------------------------------------------------------------------ downstream tasks
def make_task_data(root: Path, n: int = 6) -> Path:
    """Files in the layout of shared/data/eval, n items per task."""
    def jl(rel, rows):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    jl("lambada/original/lambada_test.jsonl", [{"text": f"the gate keeps the state number {i}"} for i in range(n)])
    hs = []
    for i in range(n):
        hs += [f"Label {i}: A man sits on a roof. he", str(i % 4), "jumps.", "sings a song.", "eats.", "sleeps."]
    (root / "hellaswag/klosax_llamacpp_format").mkdir(parents=True)
    (root / "hellaswag/klosax_llamacpp_format/hellaswag_val_full.txt.bz2").write_bytes(
        bz2.compress(("\n".join(hs) + "\n").encode()))
    for name in ("arc_easy", "arc_challenge"):
        jl(f"{name}/mosaic_icl/{name}.jsonl", [{"query": f"Question: what is {i}?", "choices": ["a", "b", "c", "d"],
                                                "gold": i % 4} for i in range(n)])
    jl("piqa/original/valid.jsonl", [{"goal": f"goal {i}", "sol1": "do this", "sol2": "do that"} for i in range(n)])
    (root / "piqa/original/valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(n)))
    jl("boolq/hf_olmo/validation.jsonl", [{"question": "is it", "passage": f"passage {i}", "answer": i % 2 == 0}
                                          for i in range(n)])
    jl("winogrande/hf_olmo/validation.jsonl", [{"sentence": f"Tom beat Bob so _ won {i}.", "option1": "Tom",
                                                "option2": "Bob", "answer": "1"} for i in range(n)])
    return root


def test_local_task_prompts_match_lm_evals_templates(tmp_path):
    from lm_eval.tasks import TaskManager

    from pipeline.eval.lm_eval.downstream import TASKS_DIR

    root = make_task_data(tmp_path / "eval")
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(root)})
    tasks = tm.load(["arc_easy", "piqa", "boolq", "winogrande", "hellaswag", "lambada_openai"])["tasks"]
    doc = lambda t: next(iter(tasks[t].eval_docs))  # noqa: E731
    assert tasks["arc_easy"].doc_to_text(doc("arc_easy")) == "Question: what is 0?\nAnswer:"
    assert tasks["piqa"].doc_to_text(doc("piqa")) == "Question: goal 0\nAnswer:"
    assert tasks["piqa"].doc_to_choice(doc("piqa")) == ["do this", "do that"]
    assert tasks["boolq"].doc_to_text(doc("boolq")) == "passage 0\nQuestion: is it?\nAnswer:"
    assert tasks["boolq"].doc_to_target(doc("boolq")) == 1
    assert tasks["winogrande"].doc_to_choice(doc("winogrande")) == ["Tom beat Bob so Tom", "Tom beat Bob so Bob"]
    assert tasks["hellaswag"].doc_to_text(doc("hellaswag")) == "Label 0: A man sits on a roof. He"
    assert tasks["lambada_openai"].doc_to_target(doc("lambada_openai")) == " 0"
    assert all(len(t.eval_docs) == 6 for t in tasks.values())


def test_task_input_check_lists_exactly_the_files_each_loader_reads(tmp_path):
    """grt eval checks TASK_FILES before computing anything: each task's loader must work with those files alone,
    and the check must name each one that is missing."""
    import shutil

    from pipeline.eval.lm_eval.downstream import TASK_FILES
    from pipeline.eval.lm_eval.downstream import check_task_inputs
    from pipeline.eval.lm_eval.tasks import local_data as ld

    full = make_task_data(tmp_path / "full")
    assert sorted(str(p.relative_to(full)) for p in full.rglob("*") if p.is_file()) == \
        sorted(f for files in TASK_FILES.values() for f in files)
    for task, files in TASK_FILES.items():
        only = tmp_path / task
        for rel in files:
            (only / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(full / rel, only / rel)
        assert check_task_inputs([task], str(only)) == only
        loader = getattr(ld, "lambada" if task == "lambada_openai" else task)
        assert len(next(iter(loader(data_dir=str(only)).values()))) == 6, task
        (only / files[-1]).unlink()
        with pytest.raises(FileNotFoundError, match=f"lacks 1 file\\(s\\) of eval.tasks \\({task}: {files[-1]}\\)"):
            check_task_inputs([task], str(only))


@pytest.mark.skipif(not (SHARED_DATA / "eval").is_dir(), reason="needs ../shared/data/eval")
def test_local_task_files_give_the_published_item_counts():
    from pipeline.eval.lm_eval.tasks import local_data as ld

    root = str(SHARED_DATA / "eval")
    counts = {"lambada": ("test", 5153), "hellaswag": ("validation", 10042), "arc_easy": ("test", 2376),
              "arc_challenge": ("test", 1172), "piqa": ("validation", 1838), "boolq": ("validation", 3270),
              "winogrande": ("validation", 1267)}
    for name, (split, n) in counts.items():
        assert len(getattr(ld, name)(data_dir=root)[split]) == n, name


# The metrics lm-eval defines for each of the seven tasks (its own task configs, mirrored in
# pipeline/eval/lm_eval/tasks/*.yaml metric_list), written out here so that a metric missing on either side fails the
# test instead of being skipped; every one comes with its standard error.
TASK_METRICS = {"lambada_openai": ("perplexity", "acc"), "hellaswag": ("acc", "acc_norm"),
                "arc_easy": ("acc", "acc_norm"), "arc_challenge": ("acc", "acc_norm"), "piqa": ("acc", "acc_norm"),
                "boolq": ("acc",), "winogrande": ("acc",)}
# Bootstrap standard errors: grt eval draws 1,000 resamples, the lm_eval command its default 100,000 (no flag sets
# it), from the same seeds; two estimates of one quantity, so compared loosely (the 1,000-resample estimate's own
# relative error is ~1/sqrt(2 * 1000) = 2 % for a normal statistic; 10 % allows a heavier-tailed perplexity).
BOOTSTRAPPED = {"perplexity_stderr"}


def test_grt_eval_and_lm_eval_shell_give_the_same_numbers(tmp_path, corpus):
    """Train a tiny run, score all seven tasks at two depths with `grt eval eval.tasks=...` and with the `lm_eval`
    command (one process per depth, `--model grt --model_args checkpoint=...,n_steps=...`, the data folder through
    --metadata as docs/eval.md shows): each task reports exactly lm-eval's metric set on both sides and every value is
    bit for bit the same (but the bootstrapped perplexity stderr, see BOOTSTRAPPED); --limit / eval.task_limit cut
    both to 8 of the files' 10 items. MLflow has the per-depth metrics and the JSON artifact."""
    from pipeline.eval.stage import evaluate
    from pipeline.tokenize import tokenize
    from pipeline.train.trainer import Trainer

    data = make_task_data(tmp_path / "eval", n=10)
    cfg = from_dict(tiny_recipe(tmp_path, corpus, tracking={"enabled": True, "tags": {"study": "harness"}}))
    tokenize(cfg.data, quiet=True)
    Trainer(cfg).fit()
    tasks, depths, limit = list(TASK_METRICS), (1, 3), 8
    res = evaluate(cfg.run_dir, [f"eval.tasks=[{','.join(tasks)}]", f"eval.task_depths=[{','.join(map(str, depths))}]",
                                 f"eval.task_data_dir={data}", "eval.task_batch_size=3", f"eval.task_limit={limit}"],
                   quiet=True)
    ours = res["downstream"]["depths"]
    assert set(ours) == set(depths)
    lm_eval = Path(sys.executable).parent / "lm_eval"
    for depth in depths:
        out_dir = tmp_path / f"lm_eval_{depth}"
        out = subprocess.run([str(lm_eval), "--model", "grt", "--model_args",
                              f"checkpoint={cfg.run_dir},n_steps={depth}", "--tasks", ",".join(tasks),
                              "--include_path", "pipeline/eval/lm_eval/tasks", "--batch_size", "5",
                              "--limit", str(limit),
                              "--metadata", json.dumps({"data_dir": str(data)}), "--output_path", str(out_dir)],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(next(out_dir.rglob("results_*.json")).read_text())
        for task, metrics in TASK_METRICS.items():
            want = set(metrics) | {f"{m}_stderr" for m in metrics}
            theirs = {k.removesuffix(",none"): v for k, v in report["results"][task].items() if "," in k}
            mine = {k: v for k, v in ours[depth][task].items() if k != "items"}
            assert set(theirs) == want and set(mine) == want, (depth, task, sorted(theirs), sorted(mine))
            assert ours[depth][task]["items"] == report["n-samples"][task]["effective"] == limit, (depth, task)
            for name in sorted(want - BOOTSTRAPPED):
                assert mine[name] == theirs[name], (depth, task, name, mine[name], theirs[name])
            for name in want & BOOTSTRAPPED:
                assert mine[name] == pytest.approx(theirs[name], rel=0.1), (depth, task, name)
    assert ours[1] != ours[3]  # the depth reaches the scores (not one depth's numbers twice)
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.tracking.uri)
    hist = client.get_metric_history(res["mlflow_run_id"], "downstream.piqa.acc")
    assert sorted(m.step for m in hist) == [1, 3]
    arts = {a.path for a in client.list_artifacts(res["mlflow_run_id"], "eval")}
    assert {"eval/downstream.json", "eval/diagnostics.png", "eval/gate_heatmap.png", "eval/exits.json"} <= arts
    from pipeline.eval.results import collect  # selection by MLflow tag (set from tracking.tags)
    assert [r["name"] for r in collect([], cfg.tracking, tags={"study": "harness"})] == ["tiny"]
    assert collect([], cfg.tracking, tags={"study": "other"}) == []


def test_compare_formats_and_downstream_table(tmp_path, monkeypatch):
    from pipeline.cli import main

    figs = capture_figures(monkeypatch)

    def run(name, val, depths):
        d = tmp_path / name / "eval"
        d.mkdir(parents=True)
        res = {"name": name, "type": "grt", "shorthand": "1+1x4+1", "params": 7.1e6, "step": 200,
               "tokens_trained": 204800, "val_loss": val, "exit": [1, 2], "loss": [val + 0.1, val],
               "kl": [0.1, 0.0], "top1": [0.9, 1.0], "exit_flops": [1e6, 2e6], "trained_depth": 2,
               "downstream": {"depths": {str(k): {"piqa": {"acc": a, "acc_norm": a + 0.01, "acc_stderr": 0.01,
                                                           "items": 1838}} for k, a in depths.items()}}}
        (d / "exits.json").write_text(json.dumps(res))
        return str(tmp_path / name)
    a, b = run("runA", 4.5, {2: 0.55}), run("runB", 4.4, {2: 0.6, 4: 0.61})
    import contextlib
    import io
    for fmt in ("csv", "markdown", "json"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["compare", a, b, "--format", fmt, "--out", str(tmp_path / "cmp")]) == 0
        text = buf.getvalue()
        if fmt == "json":
            rows = json.loads(text)
            assert [r["name"] for r in rows] == ["runA", "runB"] and rows[1]["val_loss"] == 4.4
        elif fmt == "csv":
            exits, down = text.strip().split("\n\n")
            assert exits.splitlines()[0].startswith("run,model,shorthand") and "4.5000" in exits
            assert down.splitlines()[0] == "task,metric,items,runA @2,runB @2,runB @4"
            assert down.splitlines()[1].startswith("piqa,acc_norm,\"1,838\",0.5600")
        else:
            assert "| piqa | acc_norm | 1,838 | 0.5600 ± " not in text  # stderr is of acc, not acc_norm
            assert "| piqa | acc_norm | 1,838 | 0.5600 | 0.6100 | 0.6200 |" in text
    # the overlay drew each run's loss per exit (left) and per inference GFLOPs (right), not only axes and a legend
    overlay = figs[-1]
    assert_png_of(overlay, tmp_path / "cmp" / "early_exit_overlay.png", dpi=110)
    by_exit, by_flops = overlay.axes
    for ax, xs in ((by_exit, [1, 2]), (by_flops, [1e-3, 2e-3])):
        curves = {line.get_label(): [*line.get_xdata(), *line.get_ydata()] for line in ax.lines
                  if not line.get_label().startswith("_")}  # the runs' curves, not the dotted trained-R marks
        assert curves == {"runA (1+1x4+1)": pytest.approx([*xs, 4.6, 4.5]),
                          "runB (1+1x4+1)": pytest.approx([*xs, 4.5, 4.4])}, curves


def test_adapter_refuses_a_depth_past_the_last_recursion():
    model, cfg = small("mor")
    with pytest.raises(ValueError, match=r"n_steps=4: model.type=mor exits at 0..3; score at a depth in that range"):
        GRTLM(model=model, cfg=cfg, n_steps=4)


@pytest.mark.parametrize("vocab_multiple", [1, 128])
def test_ouro_exit_distribution_and_q_exit_rule_by_hand(vocab_multiple):
    """Mean p_t and, per q, the loss of exiting each token at the first loop whose cumulative p reaches q. With a
    padded vocabulary the padding rows (made large here) take no share of the softmax: the reference's logits are
    the model's, which stop at the real vocabulary."""
    from pipeline.eval.analyses.methods import Q_LEVELS
    from pipeline.eval.analyses.methods import ouro_report

    model, cfg = small("ouro", vocab_multiple=vocab_multiple)
    with torch.no_grad():
        model.exit_gate.bias.fill_(0.3)  # a gate that spreads the exits over the loops
        model.lm_head.weight[50257:].fill_(5.0)  # padding rows that would dominate a softmax over them
    torch.manual_seed(3)
    batches = [(torch.randint(0, 50257, (2, 32)), torch.randint(0, 50257, (2, 32))) for _ in range(2)]
    got = ouro_report(model, cfg.model, lambda: iter(batches), torch.device("cpu"))
    T = cfg.model.n_recurrence
    p = torch.cat([model.exit_distribution(x, T).reshape(-1, T) for x, _ in batches]).double()
    ce = torch.stack([torch.cat([F.cross_entropy(model(x, n_steps=t)[0].reshape(-1, 50257).double(), y.reshape(-1),
                                                 reduction="none") for x, y in batches]) for t in range(1, T + 1)], 1)
    assert got["exit_probability"] == pytest.approx(p.mean(0).tolist(), abs=1e-9)
    for row, q in zip(got["q_exit"], Q_LEVELS):
        loss, loops = [], []
        for i in range(p.shape[0]):
            cum, t = 0.0, T
            for j in range(T):
                cum += p[i, j].item()
                if cum >= q:
                    t = j + 1
                    break
            loss.append(ce[i, t - 1].item())
            loops.append(t)
        assert row["loss"] == pytest.approx(sum(loss) / len(loss), rel=1e-5)
        assert row["mean_loops"] == pytest.approx(sum(loops) / len(loops))
    assert 1 < got["q_exit"][0]["mean_loops"] < T  # the test exercises early exits, not only the last loop


def test_mor_report_fractions_and_causal_loss():
    from pipeline.eval.analyses.methods import mor_report
    from pipeline.model.mor import capacity_tokens

    model, cfg = small("mor")
    torch.manual_seed(4)
    batches = [(torch.randint(0, 50257, (2, 32)), torch.randint(0, 50257, (2, 32)))]
    model.routing = "topk"
    got = mor_report(model, lambda: iter(batches), torch.device("cpu"))
    assert model.routing == "topk"  # the report restored the mode it found
    N = cfg.model.n_recurrence
    assert got["topk"]["fraction"] == pytest.approx([capacity_tokens(N, r, 32) / 32 for r in range(N)])
    frac = got["threshold"]["fraction"]
    assert frac[0] == 1.0 and all(a >= b for a, b in zip(frac, frac[1:]))
    model.routing = "threshold"
    x, y = batches[0]
    assert got["threshold"]["loss"] == pytest.approx(model(x, y)[1].item(), rel=1e-6)


def test_compare_shows_training_throughput_and_its_ratio_to_dense(tmp_path):
    from pipeline.studies.compare import format_results

    def res(name, kind, rate):
        return {"name": name, "type": kind, "shorthand": "x", "params": 1e6, "step": 10, "tokens_trained": 1e4,
                "val_loss": 5.0, "exit": [1], "loss": [5.0], "train_tokens_per_s": rate}
    text = format_results([res("dense", "gpt", 1000.0), res("mor", "mor", 800.0), res("old", "grt", None)],
                          "markdown")
    assert "| train tok/s | vs dense |" in text
    assert "| 1,000 | 1.00x |" in text and "| 800 | 0.80x |" in text and "| - | - |" in text


def test_training_throughput_is_the_median_after_the_first_two_steps(tmp_path):
    from pipeline.eval.stage import training_throughput

    rows = [{"step": 1, "tokens_per_s": 10.0}, {"step": 2, "tokens_per_s": 20.0}, {"step": 3, "tokens_per_s": 300.0},
            {"step": 4, "tokens_per_s": 100.0}, {"step": 4, "val_loss": 5.0}, {"step": 5, "tokens_per_s": 200.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 6, \"tok")
    assert training_throughput(tmp_path) == 200.0
    assert training_throughput(tmp_path / "elsewhere") is None
