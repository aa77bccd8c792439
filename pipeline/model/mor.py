"""Mixture-of-Recursions (Bae et al. 2025), expert-choice routing, middle-cycle sharing: prelude blocks, the n_core
middle blocks cycled N_r times with one router per recursion, coda blocks, final LN and a tied head.

Recursion r = 0..N_r-1 (written from MoR's code, raymin0223/mixture_of_recursions, expert_choice_router.py):
    candidates C_r = the tokens chosen at recursion r-1 (C_0 = every token)             (hierarchical)
    z_i = router_r(h_i),  a_i = alpha * sigmoid(z_i)          for i in C_r       (router_r: Linear(d, 1, bias=False))
    chosen K_r = top-k_r of a over C_r, k_r = max(1, floor((N_r - r) T / N_r)),  sorted back into causal order
    o = core(h[K_r])                      the blocks run on the chosen tokens alone, so they attend only to each
                                          other (positions were added at embedding time: nothing else to gather)
    h_i <- h_i + a_i * o_i               for i in K_r (MoR's scatter_add of weight * block output); h_i unchanged else
Since block(x) = x + attn(..) + mlp(..) already carries its residual, writing o_i = h_i + f(h_i) gives
    h_i <- (1 + a_i) h_i + a_i f(h_i),   a_i in (0, alpha)
i.e. a chosen token's state is scaled up by (1 + a_i) and gets an a_i-damped block update. This follows MoR's code
(the issue asks for it), not the residual-free reading of the paper's equation h <- g f(h) + h.

Training loss = CE + aux_loss_coef * sum_r BCE_with_logits(z over C_r, 1[i in K_r]) (MoR's "aux_loss" sampling), the
BCE averaged over the candidate tokens of each recursion as theirs is, then summed over recursions: MoR returns one
sampling loss per recursion layer and the LM loss adds each of them (a mean would shrink the router signal with N_r).

Routing modes (the attribute ``MoR.routing``, not a recipe key): "topk" (training and default evaluation: expert
choice as trained, not causal: a token's selection depends on later tokens' scores) and "threshold" (causal: token i
takes recursion r iff it took r-1 and sigmoid(z_i) >= 0.5, the rule the auxiliary loss trains the router for).
Threshold mode runs each recursion at full length with the unchosen keys masked out and the unchosen tokens' outputs
discarded; with a KV cache the routing is always threshold and each cache slot keeps every token's keys plus its
chosen flag.

Blocks: ``model.block`` (GPT-2's, the paper's, or the llama block). A recursion's blocks run on the chosen tokens
with those tokens' own positions (their rotary angles) and documents: a sub-:class:`TokenLayout` of the chosen
tokens, which stay in causal order, so their document ids stay non-decreasing.

Document masking (``docs``): expert choice over the whole window would let one document's router scores decide
which tokens of another are chosen. With documents, top-k routing chooses within each document: a document of L
tokens gets capacity k_r(L) = max(1, floor((N_r - r) L / N_r)) and its own candidates compete for it, exactly what
that document run alone gets, so each document routes and attends as it would alone. The rows of a batch then choose
different numbers of tokens; the recursion runs on the most any row chose, the shorter rows padded with tokens of a
document of their own whose outputs are discarded (weight 0). Threshold routing is per token and needs nothing more.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.configs import MoRConfig
from pipeline.model.fp32_linear import FP32Linear
from pipeline.model.layers import KVCache
from pipeline.model.layers import KVCacheAtStep
from pipeline.model.layers import at_step
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import token_layout
from pipeline.model.layers import transformer_block
from pipeline.model.layout import TokenLayout
from pipeline.model.layout import document_positions
from pipeline.model.recurrent import RecurrentLM

ROUTINGS = ("topk", "threshold")


def capacity_tokens(n_recurrence: int, r: int, seq_len: int) -> int:
    """k_r = max(1, floor((N_r - r)/N_r * T)): tokens chosen at recursion r (0-based); never 0, so every recursion
    runs on every rank (FSDP / ZeRO-3 need the same module calls everywhere). Integer arithmetic: MoR's
    int(capacity * T) without its float rounding."""
    return max(1, (n_recurrence - r) * seq_len // n_recurrence)


class DocumentCapacity:
    """Top-k routing within documents, for one forward: each token's rank slot in its document (its position in
    it), each document's capacity at every recursion (k_r of its length, per token) and the slots a recursion runs
    on (the most tokens any row chooses). Depends on the documents alone, so one host sync per forward."""

    def __init__(self, docs: torch.Tensor, n_recurrence: int):
        T = docs.shape[1]
        self.rank = document_positions(docs)  # [B, T]: slot p of the window is the rank-th slot of its document
        first = torch.arange(T, device=docs.device) - self.rank  # where each token's document starts
        length = torch.zeros_like(first).scatter_add_(1, first, torch.ones_like(first)).gather(1, first)
        self.capacity = [((n_recurrence - r) * length // n_recurrence).clamp(min=1) for r in range(n_recurrence)]
        chosen = torch.stack([torch.where(self.rank == 0, k, 0).sum(1).amax() for k in self.capacity])
        # recursion r runs on slots[r].shape[0] tokens per row: a size, not an int, because compile specialises an
        # int (one graph per value, a recompile per batch) and compiles a size marked dynamic once for all values
        self.slots = [torch.empty(k, 0, device=docs.device) for k in chosen.tolist()]
        for size in self.slots:
            torch._dynamo.maybe_mark_dynamic(size, 0)


class MoRRecursion(nn.Module):
    """One recursion: route, run the shared core on the chosen tokens, weighted update. A module of its own so that
    activation checkpointing and compilation wrap exactly one recursion; it holds every recursion's router."""

    def __init__(self, cfg: MoRConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.blocks = nn.ModuleList(transformer_block(cfg) for _ in range(cfg.n_core))
        # MoR: one linear router per recursion, no bias; GPT-2's N(0, 0.02) init like every other Linear here. Scores
        # in fp32: a bf16 router rounds the fp32 stream and the score to 8 bits, and top-k then chooses among the
        # ties and reversals that makes
        self.routers = nn.ModuleList(FP32Linear(d, 1, bias=False) for _ in range(cfg.n_recurrence))

    def forward(self, h: torch.Tensor, r: int, chosen: torch.Tensor | None, threshold: bool = False,
                cache: KVCacheAtStep | None = None, layout: TokenLayout | None = None,
                capacity: DocumentCapacity | None = None):
        """(h after recursion r, the tokens it chose, BCE aux loss or None). ``chosen``: what recursion r-1 returned
        (None at r = 0): sorted indices [B, k] in top-k mode, a [B, T] bool mask in threshold mode and in top-k
        mode within documents (``capacity``, needed whenever ``layout`` has documents)."""
        if threshold:
            return self._threshold(h, r, chosen, cache, layout)
        if cache is not None:
            raise ValueError("top-k routing is not causal and cannot decode with a KV cache; use threshold routing")
        if layout is not None and layout.docs is not None:
            return self._topk_documents(h, r, chosen, layout, capacity)
        B, T, d = h.shape
        x = h if chosen is None else h.gather(1, chosen[..., None].expand(-1, -1, d))  # the candidates
        logits = self.routers[r](x).squeeze(-1)  # [B, n_candidates]
        weight = self.cfg.router_alpha * torch.sigmoid(logits)
        k = capacity_tokens(self.cfg.n_recurrence, r, T)
        # top-k of the logits, the same order as the weights' (sigmoid is increasing, alpha > 0) without the ties of a
        # saturated sigmoid (1.0 in fp32 from z ~ 17); sorted: causal order among the chosen
        top = logits.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        index = top if chosen is None else chosen.gather(1, top)  # positions in the full sequence
        o = x.gather(1, top[..., None].expand(-1, -1, d))
        sub = None if layout is None else layout.select(index)
        for block in self.blocks:
            o = block(o, layout=sub)
        h = h.scatter_add(1, index[..., None].expand(-1, -1, d), weight.gather(1, top)[..., None] * o)
        aux = None
        if self.training:  # MoR "aux_loss": the router learns top-k membership, so inference can threshold it
            member = torch.zeros_like(logits).scatter(1, top, 1.0)
            aux = F.binary_cross_entropy_with_logits(logits, member)
        return h, index, aux

    def _topk_documents(self, h: torch.Tensor, r: int, chosen: torch.Tensor | None, layout: TokenLayout,
                        capacity: DocumentCapacity):
        """Top-k within each document (module docstring): ``chosen`` and the result are [B, T] bool masks."""
        B, T, d = h.shape
        capacity = capacity or DocumentCapacity(layout.docs, self.cfg.n_recurrence)
        candidate = torch.ones(B, T, dtype=torch.bool, device=h.device) if chosen is None else chosen
        logits = self.routers[r](h).squeeze(-1)  # [B, T]; each token's score from its own state, only candidates count
        # rank the candidates inside their document, best first: sort by score, then stably by document. Documents are
        # contiguous, so document j fills the same slots after the sort as before, and slot p holds the
        # (p - start of its document)-th best: capacity.rank
        by_score = logits.masked_fill(~candidate, -torch.inf).argsort(dim=1, descending=True, stable=True)
        order = by_score.gather(1, layout.docs.gather(1, by_score).argsort(dim=1, stable=True))
        take = torch.zeros_like(candidate).scatter(1, order, capacity.rank < capacity.capacity[r])
        # the chosen tokens in causal order, then (rows that chose fewer) padding up to the slots of the busiest row
        t = torch.arange(T, device=h.device)
        index = torch.where(take, t, T + t).argsort(dim=1)[:, : capacity.slots[r].shape[0]]
        real = take.gather(1, index)
        o = h.gather(1, index[..., None].expand(-1, -1, d))
        sub = layout.select(index, real)
        for block in self.blocks:
            o = block(o, layout=sub)
        weight = torch.where(real, self.cfg.router_alpha * torch.sigmoid(logits.gather(1, index)), 0.0)
        h = h.scatter_add(1, index[..., None].expand(-1, -1, d), weight[..., None] * o)
        aux = None
        if self.training:  # the same BCE as without documents: the mean over every candidate of the batch
            bce = F.binary_cross_entropy_with_logits(logits, take.to(logits.dtype), reduction="none")
            aux = (bce * candidate).sum() / candidate.sum()
        return h, take, aux

    def _threshold(self, h: torch.Tensor, r: int, chosen: torch.Tensor | None, cache: KVCacheAtStep | None,
                   layout: TokenLayout | None):
        logits = self.routers[r](h).squeeze(-1)  # [B, T]: every token, each from its own state alone (causal)
        # Recursion 0 has capacity 1: top-k keeps every token there, so thresholding its router could only depart
        # from training (whose BCE targets at r = 0 are all 1).
        take = torch.ones_like(logits, dtype=torch.bool) if r == 0 else logits >= 0  # sigmoid(z) >= 0.5
        if chosen is not None:
            take = take & chosen
        o = h
        for block in self.blocks:  # full length, unchosen keys masked: the same outputs at the chosen tokens
            o = block(o, cache_slot(cache, block), key_mask=take, layout=layout)
        weight = torch.where(take, self.cfg.router_alpha * torch.sigmoid(logits), 0.0)
        return h + weight[..., None] * o, take, None


class MoR(RecurrentLM):

    def __init__(self, cfg: MoRConfig):
        super().__init__(cfg, MoRRecursion(cfg))
        self.routing = "topk"  # "topk" (as trained) | "threshold" (causal); not a parameter, not in the checkpoint

    def init_weights(self, seed: int, assign=copy_full) -> None:
        """GPT-2 init with the residual depth of every block at full length (Eq. 1's block executions)."""
        init_gpt2_weights(self, self.block_executions(self.cfg), seed, assign)

    def _depth(self, n_steps: int | None) -> int:
        n = self.cfg.n_recurrence if n_steps is None else n_steps
        if not 0 <= n <= self.cfg.n_recurrence:
            raise ValueError(f"MoR depth n_steps={n} is outside 0..{self.cfg.n_recurrence} (model.n_recurrence): "
                             f"there is no router, and no capacity left, past the last recursion")
        return n

    def _threshold(self, cache: KVCache | None) -> bool:
        """Whether this call routes by threshold: in threshold mode, and always with a KV cache."""
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoR.routing={self.routing!r} (the model attribute, not a recipe key); set it to one of "
                             f"{ROUTINGS}")
        threshold = cache is not None or self.routing == "threshold"
        if threshold and self.training:
            raise ValueError("MoR trains with top-k routing; threshold routing and KV caches are for evaluation: "
                             "call model.eval() or set model.routing = 'topk'")
        return threshold

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits, None) without targets, (None, loss) with them; training: CE + aux_loss_coef * sum_r BCE_r,
        evaluation: plain CE after ``n_steps`` recursions (default N_r). With a ``cache`` (threshold routing),
        ``idx`` holds only the new tokens. ``docs`` [B, T]: each token's document (attention and top-k routing stay
        inside it)."""
        n = self._depth(n_steps)
        threshold = self._threshold(cache)
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(self.cfg, idx, start, docs)
        capacity = self._capacity(layout, threshold)
        h = self.encode(idx, start, cache, layout)
        chosen, aux = None, []
        for r in range(n):
            h, chosen, bce = self.recur(h, r, chosen, threshold, at_step(cache, r), layout, capacity)
            if bce is not None:
                aux.append(bce)
        logits, loss = head_output(self.lm_head, self.readout(h, cache, layout), targets)
        if cache is not None:
            cache.advance()
        if loss is not None and aux and self.cfg.aux_loss_coef > 0:
            loss = loss + self.cfg.aux_loss_coef * torch.stack(aux).sum()
        return logits, loss

    def _capacity(self, layout: TokenLayout | None, threshold: bool) -> DocumentCapacity | None:
        """The per-document capacities of top-k routing under document masking (None otherwise)."""
        if threshold or layout is None or layout.docs is None:
            return None
        return DocumentCapacity(layout.docs, self.cfg.n_recurrence)

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """One pass, yielding (e, coda + final LN after e recursions) for each e in ``exits`` (0 = prelude only),
        routed per ``self.routing``. ``gates`` stays untouched (MoR has none)."""
        if noise:  # nothing to turn on: this model trains without noise too (dropout is not inference noise)
            raise ValueError("model.type=mor has no inference noise: eval.noise=true is for the types in "
                             "pipeline.model.registry.NOISY_TYPES (grt, poisson); set eval.noise=false")
        wanted = sorted(set(exits))
        for e in (wanted[0], wanted[-1]):
            self._depth(e)  # every exit within 0..N_r
        threshold = self._threshold(None)
        layout = token_layout(self.cfg, idx, docs=docs)
        capacity = self._capacity(layout, threshold)
        h, chosen = self.encode(idx, layout=layout), None
        for e in range(wanted[-1] + 1):
            if e > 0:
                h, chosen, _ = self.recur(h, e - 1, chosen, threshold, layout=layout, capacity=capacity)
            if e in wanted:
                yield e, self.readout(h, layout=layout)

    @torch.no_grad()
    def routing_statistics(self, idx: torch.Tensor, docs: torch.Tensor | None = None) -> dict:
        """Fraction of the tokens of ``idx`` that reach recursion 1..N_r under the current ``self.routing``."""
        threshold = self._threshold(None)
        B, T = idx.shape
        layout = token_layout(self.cfg, idx, docs=docs)
        capacity = self._capacity(layout, threshold)
        h, chosen, fractions = self.encode(idx, layout=layout), None, []
        for r in range(self.cfg.n_recurrence):
            h, chosen, _ = self.recur(h, r, chosen, threshold, layout=layout, capacity=capacity)
            mask = threshold or capacity is not None  # chosen is a [B, T] mask, else the indices of the top k
            fractions.append(chosen.double().mean().item() if mask else chosen.shape[1] / T)
        return {"routing": self.routing, "recursion": list(range(1, self.cfg.n_recurrence + 1)),
                "fraction": fractions}

    # --------------------------------------------------------------------------------------------- accounting
    def train_depth(self, seed: int, step: int, micro_step: int | None = None) -> None:
        return None  # every recursion in every step: the routers, not a sampled depth, set each token's depth

    @staticmethod
    def executed_flops(cfg: MoRConfig, n_steps: int, seq_len: int) -> float:
        """Forward FLOPs per token that top-k routing runs: recursion r's blocks on k_r of the S tokens (projections
        2W k_r / S, W the block's matmul weights, 12d^2 for GPT-2's; attention 4 k_r d k_r / S as queries and keys
        both shrink), router r on its k_{r-1} candidates (2d each); prelude and coda at full length. Within
        documents the count stays this one (see :meth:`flops_notes`)."""
        d, S = cfg.d_model, seq_len
        total = (cfg.n_prelude + cfg.n_coda) * S * block_flops_per_token(cfg, S)
        candidates = S
        for r in range(n_steps):
            k = capacity_tokens(cfg.n_recurrence, r, S)
            total += cfg.n_core * k * block_flops_per_token(cfg, k) + 2 * d * candidates
            candidates = k
        return total / S

    @staticmethod
    def flops_per_token(cfg: MoRConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1: (n_pre + n_core N_r + n_coda)(2W + 4Sd) + N_r * 2d (the routers on every token), plus
        2dV with the head; W the block's matmul weights (``block_weight_params``: 12d^2 for GPT-2's block).
        ``executed``: what top-k routing runs, with the capacities (:meth:`executed_flops`)."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        S = seq_len or cfg.block_size
        if executed:
            f = round(MoR.executed_flops(cfg, n, S))
        else:
            f = MoR.block_executions(cfg, n) * block_flops_per_token(cfg, S) + n * 2 * cfg.d_model
        return f + (head_flops_per_token(cfg) if with_head else 0)

    @staticmethod
    def training_flops_per_token(cfg: MoRConfig, n_steps: int | None = None) -> int:
        """Model FLOPs of one training step (3x the forward top-k routing executes, head included): the trainer's
        MFU."""
        return 3 * MoR.flops_per_token(cfg, n_steps, with_head=True, executed=True)

    @staticmethod
    def flops_notes(cfg: MoRConfig) -> list[str]:
        S, N = cfg.block_size, cfg.n_recurrence
        ks = [capacity_tokens(N, r, S) for r in range(N)]
        eq1, run = MoR.flops_per_token(cfg), MoR.flops_per_token(cfg, executed=True)
        return [f"MoR top-k (training, default eval) runs recursion r on k_r = {', '.join(map(str, ks))} of S={S} "
                f"tokens (capacity (N_r - r)/N_r): projections scale with k_r/S, attention's 4Sd with (k_r/S)^2; "
                f"executed {run:,} FLOPs/token = {run / eq1:.3f} x Eq. 1",
                "MoR threshold routing (causal eval, KV-cache decoding) runs every recursion at full length with "
                "the unchosen keys masked: Eq. 1's cost, not the routed tokens' share",
                "MoR top-k under document masking chooses within each document: a row runs on the sum of its "
                "documents' capacities (k_r, give or take one token per document from the rounding), padded to "
                "the busiest row of the batch, and the routers score all S tokens; the model FLOPs keep the k_r "
                "figure above"]
