"""`grt generate` and the decoding loop behind it, against references written here: the uncached model's argmax
token by token; a sampler written out in plain Python (softmax(z / T), top-k, top-p, the inverse CDF over the
vocabulary) fed the same generator draws, so sampled runs are replicated exactly, not only in distribution;
early-exit criteria computed by hand in float64 from uncached step states; stop strings and EOT from the BPE's own
decode. Tiny models on the real GPT-2 vocabulary (the pattern of test_eval's ``small``), weights moved off init."""
import math
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_recipe
from pipeline.cli import main
from pipeline.config import from_dict
from pipeline.infer.early_exit import CRITERIA
from pipeline.infer.early_exit import EarlyExit
from pipeline.infer.generate import generate
from pipeline.infer.sampling import Sampler
from pipeline.infer.sampling import seeded_generator
from pipeline.infer.text import TokenText
from pipeline.model import build_model
from pipeline.model.kv_cache import KVCache
from pipeline.tokenize.bpe import gpt2_encoding

ENC = gpt2_encoding()
EOT = ENC.eot_token
TEXT = ("The gate decides how much of the state is kept while the shared core proposes an update, and the prelude "
        "anchors every step so that depth can grow without new weights. A recurrent transformer trades parameters "
        "for compute: the same blocks run again and again on a state that converges.")
IDS = ENC.encode_ordinary(TEXT)
SMALL = {  # d_model 16, 2 heads, block_size 64 (room for a 40-token prompt and its continuation)
    "grt": {"type": "grt", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3},
    "gpt": {"type": "gpt", "n_layer": 3},
    "poisson": {"type": "poisson", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3},
    "mor": {"type": "mor", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3},
    "rrt": {"type": "rrt", "n_prelude": 1, "n_core": 1, "n_coda": 1, "n_recurrence": 3, "lora_rank": 4},
    "ouro": {"type": "ouro", "n_layer": 2, "n_recurrence": 3},
}
_CACHE: dict = {}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread


def recipe_of(model_type: str, tmp: Path = Path("/tmp"), name: str = "tiny") -> dict:
    recipe = tiny_recipe(tmp, tmp)
    recipe["name"] = name
    recipe["model"] = {"block_size": 64, "d_model": 16, "n_head": 2, **SMALL[model_type]}
    return recipe


def perturbed(model, seed: int = 1):
    """Weights moved off the GPT-2 init: every step's state differs, GRT's gate is neither open nor shut."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        if getattr(getattr(model, "recur", None), "gate", None) is not None:
            model.recur.gate.fc2.bias.normal_(0.0, 1.0)
    if hasattr(model, "routing"):
        model.routing = "threshold"  # MoR: the causal routing it decodes with
    return model.eval()


def small(model_type: str = "grt", double: bool = False):
    key = (model_type, double)
    if key not in _CACHE:
        cfg = from_dict(recipe_of(model_type))
        torch.manual_seed(0)
        model = perturbed(build_model(cfg.model))
        _CACHE[key] = (model.double() if double else model), cfg
    return _CACHE[key]


@torch.no_grad()
def uncached_greedy(model, prompt, n, n_steps=None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]), n_steps=n_steps)[0][0, -1].argmax()))
    return seq[len(prompt):]


# ------------------------------------------------------------------------------------------------ greedy decoding
@pytest.mark.parametrize("model_type,n_steps,kv", [("grt", None, "full"), ("grt", 5, "full"), ("gpt", None, "full"),
                                                   ("gpt", 2, "last"), ("poisson", None, "full"),
                                                   ("ouro", 2, "full")])
def test_greedy_generate_equals_the_uncached_argmax(model_type, n_steps, kv):
    model, cfg = small(model_type)
    prompt = IDS[:7]
    got = generate(model, [prompt], 12, cfg.model.block_size, n_steps=n_steps, kv=kv)
    assert got.tokens == [uncached_greedy(model, prompt, 12, n_steps)]
    assert got.n_tokens == 12 and got.steps == [] and got.seconds > 0


@pytest.mark.parametrize("model_type,kv", [("grt", "full"), ("grt", "averaged"), ("gpt", "full")])
def test_left_padded_batch_gives_row_by_row_what_each_prompt_gives_alone(model_type, kv):
    model, cfg = small(model_type)
    prompts = [IDS[:3], IDS[5:22], IDS[:40]]
    assert [len(p) for p in prompts] == [3, 17, 40]
    batch = generate(model, prompts, 8, cfg.model.block_size, kv=kv).tokens
    for p, row in zip(prompts, batch):
        assert row == generate(model, [p], 8, cfg.model.block_size, kv=kv).tokens[0]
        if kv == "full":
            assert row == uncached_greedy(model, p, 8)


# ------------------------------------------------------------------------------------------------------ sampling
def hand_sample(logits: torch.Tensor, T: float, top_k, top_p, u: float) -> int:
    """softmax(z / T) over the top-k tokens (ties at the k-th value kept), then the smallest most-likely prefix whose
    mass reaches top_p, renormalised; the first id (vocabulary order) whose running mass exceeds u x the total."""
    z = [x / T for x in logits.tolist()]
    keep = range(len(z))
    if top_k is not None:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [i for i in keep if z[i] >= kth]
    top = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - top) for i in keep}
    total = sum(w.values())
    q = {i: w[i] / total for i in keep}
    if top_p is not None:
        mass, kept = 0.0, {}
        for i in sorted(q, key=lambda i: -q[i]):
            if mass >= top_p:
                break
            kept[i] = q[i]
            mass += q[i]
        q = kept
    total, acc = sum(q.values()), 0.0
    for i in sorted(q):
        acc += q[i] / total
        if acc > u:
            return i
    return max(q)


@torch.no_grad()
def hand_sampled_run(model, prompts, n, T, top_k, top_p, seed) -> list[list[int]]:
    """Uncached logits of every row, one float64 uniform per row per step from a generator seeded the same."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        u = torch.rand(len(prompts), 1, generator=gen, dtype=torch.float64)[:, 0].tolist()
        for row, s in enumerate(seqs):
            s.append(hand_sample(model(torch.tensor([s]))[0][0, -1].double(), T, top_k, top_p, u[row]))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("T,top_k,top_p,n_prompts", [(1.0, None, None, 1), (0.7, 50, None, 1),
                                                     (1.3, None, 0.9, 2), (0.8, 200, 0.6, 2)])
def test_seeded_sampling_equals_a_hand_written_sampler_draw_for_draw(T, top_k, top_p, n_prompts):
    model, cfg = small("grt", double=True)  # float64: cached and uncached logits agree to ~1e-13
    prompts = [IDS[:5], IDS[9:20]][:n_prompts]

    def run(seed):
        sampler = Sampler(T, top_k, top_p, seeded_generator(seed, "cpu"))
        return generate(model, prompts, 10, cfg.model.block_size, sampler=sampler).tokens

    got = run(11)
    assert got == hand_sampled_run(model, prompts, 10, T, top_k, top_p, seed=11)
    assert run(11) == got  # the same seed, the same text
    assert run(12) != got
    assert got != [uncached_greedy(model, p, 10) for p in prompts]  # it did sample


def test_top_k_1_is_greedy_at_any_temperature():
    model, cfg = small("grt")
    prompts = [IDS[:4], IDS[10:25]]
    greedy = generate(model, prompts, 10, cfg.model.block_size).tokens
    for T in (0.5, 3.0):
        sampler = Sampler(T, top_k=1, generator=seeded_generator(0, "cpu"))
        assert generate(model, prompts, 10, cfg.model.block_size, sampler=sampler).tokens == greedy


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampler(0.0, top_k=5)
    with pytest.raises(ValueError, match="needs a generator"):
        Sampler(1.0)
    with pytest.raises(ValueError, match=r"outside \(0, 1\]"):
        Sampler(1.0, top_p=1.5, generator=seeded_generator(0, "cpu"))
    with pytest.raises(ValueError, match="at least 1 token"):
        Sampler(1.0, top_k=0, generator=seeded_generator(0, "cpu"))


# ---------------------------------------------------------------------------------- text: streaming, stop, EOT
def fed(text: TokenText, tokens) -> list[str]:
    chunks = []
    for t in tokens:
        ended = text.feed(t)
        chunks.append(text.take())
        if ended:
            break
    chunks.append(text.finish())
    return chunks


def test_streamed_text_never_splits_a_multibyte_character():
    s = "héllo 日本語 🙂 and ✓"
    tokens = ENC.encode_ordinary(s)
    split = [t for t in tokens if not _valid_utf8(ENC.decode_single_token_bytes(t))]
    assert split, "the test needs a character spread over several tokens"
    chunks = fed(TokenText(ENC), tokens)
    assert "".join(chunks) == s == ENC.decode(tokens)
    assert all("\ufffd" not in c for c in chunks)
    cut = tokens[:-1] + ENC.encode_ordinary("日")[:1]  # ends inside a character: U+FFFD, as tiktoken decodes it
    assert "".join(fed(TokenText(ENC), cut)) == ENC.decode(cut)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stop_strings_cut_and_are_held_back_while_they_may_start():
    tokens = ENC.encode_ordinary("Hello world.\n\nNext line here")
    text = TokenText(ENC, stop=["\n\n", "zzz"])
    chunks = fed(text, tokens)
    assert text.ended == "stop" and text.text == "Hello world."
    assert "".join(chunks) == "Hello world." and all("\n" not in c for c in chunks)
    assert text.tokens == tokens[:len(text.tokens)] and len(text.tokens) < len(tokens)
    # a tail that could begin a stop string waits; released when the next characters rule it out
    text = TokenText(ENC, stop=["abc"])
    shown = ""
    for t in ENC.encode_ordinary("x ab"):
        text.feed(t)
        shown += text.take()
    assert shown == "x " and text.ended is None
    for t in ENC.encode_ordinary("d"):
        text.feed(t)
        shown += text.take()
    assert shown + text.finish() == "x abd" and text.ended == "length"


def test_eot_ends_the_text_and_is_not_printed():
    tokens = ENC.encode_ordinary("one two") + [EOT] + ENC.encode_ordinary(" three")
    text = TokenText(ENC, eot_id=EOT)
    assert "".join(fed(text, tokens)) == "one two" and text.ended == "eot"
    assert text.tokens[-1] == EOT
    with pytest.raises(RuntimeError, match="ended"):
        text.feed(5)


def test_a_stopped_row_ends_while_the_others_run_on():
    model, cfg = small("grt")
    prompts = [IDS[:4], IDS[10:25]]
    free = generate(model, prompts, 10, cfg.model.block_size).tokens
    end_at = free[0][3]
    first = free[0].index(end_at)
    got = generate(model, prompts, 10, cfg.model.block_size, stop=lambda row, t: row == 0 and t[-1] == end_at)
    assert got.tokens == [free[0][:first + 1], free[1]]
    both = generate(model, prompts, 10, cfg.model.block_size, stop=lambda row, t: len(t) == 2 + row)
    assert both.tokens == [free[0][:2], free[1][:3]]


# --------------------------------------------------------------------------------------------------- early exit
@torch.no_grad()
def step_states(model, seq: list[int], n: int) -> list[torch.Tensor]:
    """h^(0..n) of every position, uncached, from the model's parts (GRT and Poisson: prelude, then the steps)."""
    x = torch.tensor([seq])
    h_pre = model.encode(x)
    h = model.initial_state(h_pre, noise=False)
    out = [h]
    for _ in range(n):
        h = model.recur(h, h_pre, False)[0] if model.cfg.type == "grt" else model.recur(h, h_pre)
        out.append(h)
    return out


@torch.no_grad()
def mixed_log_probs(model, prompt: list[int], tok: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """For one token decoded after a prompt prefilled at n steps: its state h^(r) and log p_r for r = 0..n. Its
    step-r queries see the prompt's step-r keys (full per-step attention), so h^(r) is the uncached state at its
    position; its coda sees the prompt's coda keys, computed from the prompt's h^(n)."""
    states = step_states(model, prompt + [tok], n)
    P = len(prompt)
    logps = []
    for h in states:
        mixed = torch.cat([states[n][:, :P], h[:, P:]], dim=1)
        logps.append(torch.log_softmax(model.lm_head(model.readout(mixed))[0, -1].double(), -1))
    return [h[0, -1].double() for h in states], logps


def by_hand(criterion: str, h, logps, r: int) -> float:
    p, q = logps[r].exp(), logps[r - 1].exp()
    if criterion == "kl":
        return float((p * (logps[r] - logps[r - 1])).sum())
    if criterion == "entropy":
        return abs(float(-(p * logps[r]).sum() + (q * logps[r - 1]).sum()))
    return float((h[r] - h[r - 1]).norm() / h[r].norm())


@pytest.mark.parametrize("criterion", CRITERIA)
def test_each_criterion_by_hand_and_the_exit_it_picks(criterion):
    model, cfg = small("grt", double=True)
    n, prompt, tok = 4, IDS[:9], IDS[9]
    h, logps = mixed_log_probs(model, prompt, tok, n)
    want = [by_hand(criterion, h, logps, r) for r in range(1, n + 1)]
    assert min(want) > 0

    def decode(threshold):
        cache = KVCache(cfg.model.block_size, "full")
        model(torch.tensor([prompt]), n_steps=n, cache=cache)  # the prefill at n_max
        return EarlyExit(model, criterion, threshold, n).decode(torch.tensor([[tok]]), cache)

    logits, steps, values = decode(0.0)
    assert steps == n
    assert values == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(torch.log_softmax(logits[0].double(), -1), logps[n], rtol=1e-9, atol=1e-9)
    for threshold in sorted(want)[:-1] + [max(want) * 2]:
        threshold *= 1 + 1e-6
        exit_step = next(r for r in range(1, n + 1) if want[r - 1] < threshold)
        logits, steps, values = decode(threshold)
        assert steps == exit_step and len(values) == exit_step
        torch.testing.assert_close(torch.log_softmax(logits[0].double(), -1), logps[exit_step], rtol=1e-9,
                                   atol=1e-9)


@pytest.mark.parametrize("model_type,criterion,kv", [("grt", c, "full") for c in CRITERIA]
                         + [("grt", "kl", "averaged"), ("poisson", "latent", "full"), ("ouro", "kl", "last"),
                            ("ouro", "latent", "full"), ("mor", "entropy", "full"), ("rrt", "kl", "first")])
def test_threshold_zero_never_exits_early(model_type, criterion, kv):
    model, cfg = small(model_type)
    R = cfg.model.n_recurrence
    early = EarlyExit(model, criterion, 0.0)
    got = generate(model, [IDS[:6]], 8, cfg.model.block_size, kv=kv, early_exit=early)
    assert got.steps == [R] * 7 and got.mean_steps == R  # the first new token comes from the prefill
    assert got.tokens == generate(model, [IDS[:6]], 8, cfg.model.block_size, n_steps=R, kv=kv).tokens
    if kv == "full":
        assert got.tokens == [uncached_greedy(model, IDS[:6], 8, R)]


@torch.no_grad()
def mixed_depth_greedy(model, prompt: list[int], n_new: int, n_max: int) -> list[int]:
    """The prompt at n_max steps, every decoded token at 1 step, kv=full: a decoded token's only step (0) attends to
    every earlier token's real step-0 K/V, so its state is the uncached h^(1); its coda attends to the prompt's coda
    keys (from h^(n_max)) and the decoded tokens' (from h^(1))."""
    seq = list(prompt)
    seq.append(int(model(torch.tensor([seq]), n_steps=n_max)[0][0, -1].argmax()))
    P = len(prompt)
    for _ in range(n_new - 1):
        if model.cfg.type == "ouro":  # no coda: exactly the uncached model at one loop
            logits = model(torch.tensor([seq]), n_steps=1)[0][0, -1]
        else:
            states = step_states(model, seq, n_max)
            mixed = torch.cat([states[n_max][:, :P], states[1][:, P:]], dim=1)
            logits = model.lm_head(model.readout(mixed))[0, -1]
        seq.append(int(logits.argmax()))
    return seq[P:]


@pytest.mark.parametrize("model_type,criterion", [("grt", "kl"), ("grt", "latent"), ("poisson", "entropy"),
                                                  ("ouro", "kl")])
def test_a_huge_threshold_exits_after_step_one(model_type, criterion):
    model, cfg = small(model_type)
    early = EarlyExit(model, criterion, 1e9)
    got = generate(model, [IDS[:6]], 8, cfg.model.block_size, early_exit=early)
    assert got.steps == [1] * 7 and got.mean_steps == 1.0
    assert got.tokens == [mixed_depth_greedy(model, IDS[:6], 8, cfg.model.n_recurrence)]


def test_early_exit_refusals_name_the_fix():
    gpt, cfg = small("gpt")
    with pytest.raises(ValueError, match="dense"):
        EarlyExit(gpt, "kl", 0.1)
    model, cfg = small("grt")
    with pytest.raises(ValueError, match="batch size 1"):
        generate(model, [IDS[:3], IDS[:5]], 4, 64, early_exit=EarlyExit(model, "kl", 0.1))
    with pytest.raises(ValueError, match="unknown"):
        EarlyExit(model, "cosine", 0.1)
    with pytest.raises(ValueError, match=r"1\.\.3"):
        EarlyExit(small("rrt")[0], "kl", 0.1, n_max=4)


# ---------------------------------------------------------------------------------------------- the CLI, end to end
def save_run(tmp: Path, model, cfg) -> Path:
    """A one-checkpoint run written by the training backend itself."""
    from pipeline.train.backend import SingleProcess
    from pipeline.train.checkpoint import prepare_staging
    from pipeline.train.checkpoint import publish
    from pipeline.train.checkpoint import staging_dir

    root = cfg.run_dir / "checkpoints"
    prepare_staging(root, 5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        SingleProcess(cfg.train).save_model_optimizer(model, torch.optim.AdamW(model.parameters()),
                                                      staging_dir(root, 5), {"step": 5, "recipe": cfg.to_dict()})
    publish(root, 5, cfg.to_yaml(), keep=1)
    return cfg.run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A GRT run, the same GRT with token ids j and EOT swapped (so it emits EOT where it emitted j), a GPT run."""
    tmp = tmp_path_factory.mktemp("generate")
    out = {}
    for name, mtype in (("grt", "grt"), ("gpt", "gpt")):
        cfg = from_dict(recipe_of(mtype, tmp, name))
        torch.manual_seed(0)
        model = perturbed(build_model(cfg.model))
        out[name] = (save_run(tmp, model, cfg), model)
    model = out["grt"][1]
    prompt = ENC.encode_ordinary(PROMPT)
    free = uncached_greedy(model, prompt, 12)
    j = next(j for j in range(1, 12) if free[j] not in prompt + free[:j] and EOT not in free[:j])
    cfg = from_dict(recipe_of("grt", tmp, "grt-eot"))
    swapped = perturbed(build_model(cfg.model))
    swapped.load_state_dict(model.state_dict())
    with torch.no_grad():
        w = swapped.embed.wte.weight  # tied: the head's rows swap with the embeddings
        w[[free[j], EOT]] = w[[EOT, free[j]]].clone()
    out["eot"] = (save_run(tmp, swapped, cfg), free[:j])
    return out


PROMPT = "The gate decides"


def grt_generate(capsys, *argv):
    rc = main(["generate", *map(str, argv), "--device", "cpu"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def expected(tokens: list[int]) -> str:
    return ENC.decode(tokens[:tokens.index(EOT)] if EOT in tokens else tokens)


def test_cli_greedy_stream_batch_and_dense(runs, capsys, tmp_path):
    run, model = runs["grt"]
    want = PROMPT + expected(uncached_greedy(model, ENC.encode_ordinary(PROMPT), 12)) + "\n"
    rc, out, err = grt_generate(capsys, run, PROMPT, "--max-new-tokens", 12)
    assert rc == 0 and out == want
    assert "-- 12 new tokens, ended by --max-new-tokens;" in err and "tokens/s" in err
    assert "3 recurrence steps per token" in err
    rc, out, err = grt_generate(capsys, run, PROMPT, "--max-new-tokens", 12, "--stream")
    assert rc == 0 and out == want
    prompts = ["A", "the shared core proposes an update and the prelude", PROMPT]
    (tmp_path / "p.txt").write_text("\n".join(prompts[:2]) + "\n\n" + prompts[2] + "\n")
    rc, out, err = grt_generate(capsys, run, "--batch-file", tmp_path / "p.txt", "--max-new-tokens", 6)
    assert rc == 0
    assert out == "".join(p + expected(uncached_greedy(model, ENC.encode_ordinary(p), 6)) + "\n" for p in prompts)
    assert err.count("-- prompt ") == 3 and "-- batch of 3:" in err
    gpt_run, gpt = runs["gpt"]
    rc, out, err = grt_generate(capsys, gpt_run, PROMPT, "--max-new-tokens", 6, "--n-steps", 2)
    assert rc == 0 and out == PROMPT + expected(uncached_greedy(gpt, ENC.encode_ordinary(PROMPT), 6, 2)) + "\n"
    assert "exit layer 2 of 3" in err


def test_cli_stop_eot_sampling_and_early_exit(runs, capsys):
    run, model = runs["grt"]
    free = expected(uncached_greedy(model, ENC.encode_ordinary(PROMPT), 12))
    stop = free[len(free) // 2:len(free) // 2 + 3]
    rc, out, err = grt_generate(capsys, run, PROMPT, "--max-new-tokens", 12, "--stream", "--stop", "\\t", stop)
    cut = min(i for i in (free.find(stop), free.find("\t")) if i >= 0)
    assert rc == 0 and out == PROMPT + free[:cut] + "\n" and "ended by a stop string" in err
    eot_run, before = runs["eot"]
    rc, out, err = grt_generate(capsys, eot_run, PROMPT, "--max-new-tokens", 12)
    assert rc == 0 and out == PROMPT + ENC.decode(before) + "\n"
    assert f"-- {len(before) + 1} new tokens, ended by the end-of-text token" in err
    sample = ("--temperature", 1.5, "--top-k", 100, "--top-p", 0.95, "--max-new-tokens", 12)
    a, b, c = (grt_generate(capsys, run, PROMPT, *sample, "--seed", s)[1] for s in (5, 5, 6))
    assert a == b != c
    rc, out, err = grt_generate(capsys, run, PROMPT, "--max-new-tokens", 12, "--exit", "kl", "--exit-threshold", 0)
    assert rc == 0 and out == PROMPT + free + "\n"
    assert "mean recurrence steps used 3.00 of 3 over 11 decoded tokens" in err
    rc, out, err = grt_generate(capsys, run, PROMPT, "--max-new-tokens", 5, "--exit", "latent",
                                "--exit-threshold", 1e9, "--n-steps", 4)
    assert rc == 0 and "mean recurrence steps used 1.00 of 4 over 4 decoded tokens" in err


def test_cli_errors_name_cause_and_fix(runs, capsys, tmp_path):
    run, gpt_run = runs["grt"][0], runs["gpt"][0]
    (tmp_path / "two.txt").write_text("one\ntwo\n")
    cases = [
        ((run, "--batch-file", tmp_path / "two.txt", "--stream"), "drop --stream"),
        ((run, "--batch-file", tmp_path / "two.txt", "--exit", "kl", "--exit-threshold", 0.1), "one by one"),
        ((run, "x", "--exit", "kl"), "needs --exit-threshold"),
        ((run, "x", "--top-k", 5), "temperature > 0"),
        ((run, "x", "--batch-file", tmp_path / "two.txt"), "not both"),
        ((gpt_run, "x", "--exit", "kl", "--exit-threshold", 0.1), "dense"),
        ((gpt_run, "x", "--n-steps", 9), "use --n-steps 1..3"),
    ]
    for argv, fix in cases:
        rc, out, err = grt_generate(capsys, *argv)
        assert rc == 2 and out == "" and fix in err, (argv, err)


def test_cli_batch_file_not_utf8_names_the_file_and_line(runs, capsys, tmp_path):
    """One line, no traceback, non-zero: a --batch-file with a byte that is not UTF-8 on its third line names the
    file and line 3 (counted here by hand)."""
    run = runs["grt"][0]
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"first prompt\n\nthird line \xff here\nfourth\n")  # line 3 holds 0xff
    rc = main(["generate", str(run), "--batch-file", str(bad), "--device", "cpu"])
    cap = capsys.readouterr()
    assert rc != 0 and cap.out == "" and "Traceback" not in cap.err and cap.err.count("\n") == 1, cap.err
    assert str(bad) in cap.err and "line 3 " in cap.err, cap.err


def test_cli_device_cuda_without_cuda_says_pass_device_cpu(runs, capsys, monkeypatch):
    """One line, no traceback, non-zero: --device cuda where torch sees no CUDA says so and names --device cpu, not
    the recipe key train.device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["generate", str(runs["grt"][0]), PROMPT, "--device", "cuda", "--max-new-tokens", "2"])
    cap = capsys.readouterr()
    assert rc != 0 and cap.out == "" and "Traceback" not in cap.err and cap.err.count("\n") == 1, cap.err
    assert "CUDA is not available" in cap.err and "--device cpu" in cap.err and "train.device" not in cap.err, cap.err
