"""What each model type saves for backward: one function per model type, each the rows of the table below, and
ROWS, the one table from ``model.type`` to the depth its estimate is taken at and its function. The shared terms (the
pre-LN block, the embedding, the head) and what B, T, d, H, V, a and s and saved / region / workspace mean are in
launch/memory_shapes.py. Embeddings, prelude / coda blocks and the head are as there unless said.

    GPT                   n_layer pre-LN blocks on the s stream (core_step does not apply: counted as none)
      blocks              per block only its input
    GRT step, no ckpt     n_core blocks + s BTd (state h) + 6 a BTd (noisy state, LN(h), f_g hidden x2, gate
                          logits, proposal) [one fewer without state noise]; once: LN(h_pre) (a) and h_pre (s);
                          without reinjection or state noise the first core block's input is h (one a BTd fewer);
                          h_pre (s) only when the gate or W_proj reads it and it is not step 1's saved state
      core_step           per step only its inputs: the state h; once: h_pre and the two anchor terms
      blocks              per block only its input; the gate, W_proj and noise are not checkpointed
    GRT backprop_steps k  the first R - k steps (k < R) run under no_grad and save nothing: k steps as above, and
                          h_pre is saved on its own (it is no longer step 1's state)
    GRT hyper_streams n   per step + (n_core (2n + 2) - n + 1) a BTd: per core block the n streams entering each
                          sublayer (the stream mixes' input; the first block's are its input, expanded) and each
                          sublayer's output (scaled by B); LN_1 reads a mix, not the input (+1 for the first block).
                          blocks: a core block after the first holds its n streams (n a BTd); region + (n + 2) a BTd
    Poisson               depth p is random and unbounded, but the first max(p - k, 0) steps run under no_grad and
                          save nothing: the estimate is at k = backprop_steps grad steps, the bound for every p (a
                          step p <= k saves less). The random initial state is drawn without grad: never saved.
      grad step, no ckpt  2 a BTd (the adapter's input [h, h_pre], in the compute dtype) + n_core blocks on the
                          compute-dtype stream (the adapter's output; the coda and the head's LN continue it)
      core_step           per grad step only its input h (a); once h_pre (s). Region: one whole grad step
      blocks              per grad step the adapter input + each core block's input (a BTd); the adapter is not
                          checkpointed
    MoR recursion r       k_r = max(1, floor((N_r - r) T / N_r)) tokens chosen among the n_r = k_{r-1} candidates
                          (n_0 = T), r = 0..N_r-1; attention among the chosen only (a block on k_r tokens)
      no ckpt             n_core blocks on k_r tokens + s BTd (the state h entering r, saved by the gather of the
                          candidates (r > 0) or of the chosen (r = 0)) + s B n_r d (the candidates, r > 0: router
                          input and gather source) + a B n_r d (the router's autocast cast, a != s only) + s B k_r d
                          (the core's output, saved by the weighted update) + (2a + 8) B n_r (router logits and
                          sigmoid, the BCE's fp32 logits and top-k membership target) + (a + 16) B k_r (the gathered
                          weights, int64 indices of the chosen: in the candidates and in the sequence; r = 0: one
                          tensor, a + 8); llama block: + 4 B k_r hd (the chosen's rotary angles, a sub-layout)
      core_step           per recursion only its inputs: h (s BTd) and the previous recursion's indices (8 B n_r).
                          Region: the largest recursion (r = 0: k_0 = T) without its inputs
      blocks              per recursion the routing terms above + each core block's input (s B k_r d) and the core's
                          output; router, gathers and scatter are not checkpointed
    RRT core block        pre-LN block + 4 a BT rank (A_r x of each LoRA'd projection: c_attn, attn c_proj, c_fc,
                          mlp c_proj, saved by B_r; the scale and the sum save nothing) + 2 a BTd when a != s
                          (autocast casts LN's fp32 output once for W and once more for A_r: c_attn and c_fc);
                          N_r recursions of n_core such blocks, the stream in s (x + block(x) keeps x's dtype)
                          [llama block: 7 a BT rank, q/k/v/o_proj and gate/up/down_proj LoRA'd]
      core_step           per recursion only its input h (s BTd); region: one recursion
      blocks              per block only its input
    Ouro loop t           n_layer blocks + s BTd (the loop norm's input) + 8 BT (its statistics) + 4 BT (the
                          per-token fused CE's logsumexp: it saves h_t, which the next loop's first block saves too,
                          and recomputes the logits in backward: no dL/dh, dL/dW) + a BTd when a != s (the exit
                          gate's autocast cast of h_t, loops t < T); once: h_T (s BTd), the int64 targets (8 BT) and
                          the loss over the loops: 12 BT T (the stacked CE_t, p, log p) + 8 BT (T - 1) (the gate
                          logits and their negation, logsigmoid's inputs; on the CPU logsigmoid also keeps a buffer
                          of its input's size, not on CUDA) + BT + 8 (the target mask and the token count)
      core_step           per loop only its input h_{t-1} (s BTd); region: one loop (blocks + loop norm)
      blocks              per block only its input; the loop norm, the heads and the gate are not checkpointed

    RecurTrace loop i     (i = 0..R-1; i earlier loops in the loop memory, R loops in training) n_core loop blocks:
                          without loop keys (the first loop, loop_memory=none) the pre-LN block (SDPA). union: the
                          block + the causal mask T^2 bytes + the stacked earlier keys and values 2 a i BTd (the
                          chunked fp32 kernel recomputes its scores in backward: no [T, T] probabilities kept);
                          separate: the block + a BTd + the loop softmax's fp32 probabilities 4 BHT i and its fp32
                          keys and values 8 i BTd; both + the fp32 attention output 4 BTd when a != 4
                          [llama block: - a BTd (o_proj reads a view of the attention output); union: + 2 a BT
                          (d - d_kv) (keys/values saved repeated to the H heads); union with documents: the bool
                          [B, 1, T, T] mask B T^2 in place of T^2 + SDPA's 4 BTT]
      halting head        per loop i < R - 1: LN(h)'s output 4 BTd (fp32 into the fp32 halting Linear) (its input h
                          is the next loop's, counted there)
                          and statistics 8 BT, the BCE's fp32 logit and target 8 BT; once the target mask BT; the
                          oracle's per-loop losses run under no_grad [llama block, RMSNorm: 8 BTd + 8 BT per loop,
                          + 4 BT with halt_detach=false; measured at a = 4]
      core_step           per loop its input h (s BTd); once the loop memory of loops 0..R-2 (3 a BTd per core
                          block, llama 2 a BT d_kv: k/v_proj's own outputs; held by the later loops' checkpoints
                          even with loop_memory=none). Region: the last
                          loop without its inputs
      blocks              per block its input, the loop memory as in core_step; region: the larger block
    Recurrent Transformer n_layer self-KV layers, T positions in order inside each (dense: core_step is refused and
      self-KV layer       counted as none). 3 s BTd (the layer input and each position's two residuals) + 17 a BTd
                          (the block's 14, LN_1 of each output and its memory key/value 2, but the last position's)
                          + the attention's d-wide rows (4 B d each) and per-head scalars (4 BH each) + 3 x 8 BT (LN
                          statistics) + BHT bytes (the l > 0 masks), counted by self_kv_layout() over the tiled
                          recursion: per cross step the right half's partial (acc rows, m and l); per tile of tau
                          positions under A enclosing right halves (A = the 1-bits of the tile's index when T / tile
                          is a power of two: log2(T / tile) / 2 on average) A merged accs; per position after its
                          tile's first two accs (the partial over the tile's earlier keys and its merge) and 5
                          scalars. The partials save only q and the per-position keys/values
                          (self_kv_attention._RecomputedPartial). Per layer and token, in d-wide rows: about
                          22 - 2 / tile + log2(T / tile) (the dense block: 16). prefill=reference: per position t
                          its t + 1 keys and values concatenated (Theta(T^2 d)) and q_t copied, no qkv.
                          [llama block: + 3 (4 BTd - 4 BT) (three RMSNorms: fp32 normalised input, rsqrt in place
                          of LN's statistics) + a BT (4f - 8d) (SwiGLU for GELU); keys/values saved repeated to the
                          H heads (d wide, as gpt2's); without an own key or with the reference - 2 a BTd (k/v_proj's
                          unread own outputs); QK-norm + (4 + a) BT(d + 2 d_kv) + 4 BT(H + 2 H_kv) (q, own and memory
                          keys), less 4 BT(d_kv + H_kv) without an own key. Exact (<= 40 B) but for QK-norm
                          without an own key (-290 B, 0.05%, a per-head remainder) and QK-norm with the reference
                          (-2 BT(2H - H_kv) bytes unaccounted, ~0.1%: not in the test's rows)]
                          Workspace: the first cross step's T/2 x T/2 scores, about 5 fp32 copies while backward
                          recomputes them (not measured on the CPU), or the head's if larger
      blocks              per layer its input; region: one layer
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from launch.memory_shapes import CHECKPOINTING_MODES
from launch.memory_shapes import CUDA_CE_CHUNK_BYTES
from launch.memory_shapes import Activations
from launch.memory_shapes import Shapes


def dense(c, x: Shapes, mode: str) -> Activations:
    """GPT: n_layer blocks on the s stream (core_step does not apply to a dense model: counted as none)."""
    L, s = c.n_layer, x.s
    head, blk = x.embed() + x.mean_head(s), x.block(s)
    if mode == "blocks":
        return Activations(head + L * s * x.BTd, blk - s * x.BTd, x.mean_head_workspace())
    return Activations(head + L * blk, 0.0, x.mean_head_workspace())



def grt(c, x: Shapes, mode: str) -> Activations:
    a, s, BTd = x.a, x.s, x.BTd
    blk_s, blk_a, ln_stats = x.block(s), x.block(a), x.ln_stats()
    embed, head, head_ws = x.embed(), x.mean_head(s), x.mean_head_workspace()
    n_core, outer, n = c.n_core, c.n_prelude + c.n_coda, c.hyper_streams
    # truncated backprop: the steps before the last k run under no_grad and save nothing (activation_depth)
    R, free = activation_depth(c)[0], c.backprop_steps is not None and c.backprop_steps < c.n_recurrence
    noisy = c.state_noise == "every_step" and c.sigma_x > 0
    gate = c.gate == "elementwise"
    # One step's own tensors beside its blocks: W_proj's input (the noisy state, or its bf16 cast), and the gate's
    # state h, LN(h), f_g's hidden before and after SiLU, the logits z and the proposal o (saved by the update).
    step_extra = (a * BTd if c.reinject and (noisy or a != s or not gate) else 0)
    step_extra += (s + 5 * a) * BTd + ln_stats if gate else 0
    # hyper-connections (n streams): per core block the streams entering each sublayer (n each: the stream mixes'
    # input) and each sublayer's output (scaled by B); the first block's streams are its input expanded (one copy's
    # worth, no n), and its LN_1 reads a mix of them, not the input
    hyper = (n_core * (2 * n + 2) - n + 1) * a * BTd if n > 1 else 0
    # without reinjection or state noise the core's input is the state h itself, already counted with the gate's
    # tensors: the first core block does not save it again
    h_in_core = a * BTd if gate and not c.reinject and not noisy else 0
    # Once per forward: LN(h_pre) for f_g's anchor half; h_pre itself only when an anchor term reads it (the gate's
    # LN, W_proj's h_pre half) and step 1 does not already save it as its state (init_state=prelude, a grad step):
    # the gate's h, or without a gate and state noise W_proj's x half (reinject) or the first core block's input.
    without_gate_saves_h = not gate and not noisy  # without a gate the step's first consumer saves h itself
    # h^(0) = h_pre itself: init_state=prelude without the 'init' state noise (h_pre + eps, a tensor of its own)
    h0_is_pre = c.init_state == "prelude" and not (c.state_noise == "init" and c.sigma_x > 0)
    h_pre_is_state = h0_is_pre and not free and (gate or without_gate_saves_h)
    h_pre_own = 0 if h_pre_is_state or not (gate or c.reinject) else s * BTd
    anchor_once = (a * BTd + ln_stats if gate else 0) + h_pre_own
    if mode == "none":
        saved = embed + outer * blk_s + R * (n_core * blk_a + step_extra + hyper - h_in_core) + anchor_once + head
        return Activations(saved, 0.0, head_ws)
    if mode == "core_step":
        # The checkpoint holds each step's inputs: the state h (h_pre at step 1 when init_state=prelude), h_pre,
        # and the two anchor terms W_a h_pre + b and W1_a LN(h_pre) + b1 that step 1 returns to the others.
        anchors = ((a if c.reinject else 0) + (a if gate else 0)) * BTd
        h_pre_ckpt = 0 if h0_is_pre and not free else s * BTd
        saved = embed + outer * blk_s + R * s * BTd + h_pre_ckpt + anchors + head
        # Recomputing step 1 (the largest: it also computes the anchor terms); its inputs are counted above.
        # The step's input h is a checkpoint input: not new where the gate or (without one) its first consumer saves it
        region = (n_core * blk_a + step_extra + hyper - h_in_core - (s * BTd if gate else 0)
                  - (a * BTd if without_gate_saves_h else 0)
                  + (a * BTd + ln_stats if gate else 0))
        return Activations(saved, region, head_ws)
    # blocks: every block keeps only its input (a hyper-connected core block after the first: its n streams); W_proj,
    # the gate and the noise are not checkpointed
    core_inputs = (1 + (n_core - 1) * n) * a * BTd - h_in_core
    saved = embed + outer * s * BTd + R * (core_inputs + step_extra) + anchor_once + head
    core_region = blk_a - a * BTd if n == 1 else blk_a + (n + 2) * a * BTd  # its input (x or n streams) held
    region = max(blk_s - s * BTd if outer else 0, core_region)
    return Activations(saved, region, head_ws)



def poisson(c, x: Shapes, mode: str) -> Activations:
    """k grad steps (activation_depth): the no-grad steps before them save nothing. The core's stream is the
    adapter's output (compute dtype); the coda and the final LN continue it."""
    a, s, BTd = x.a, x.s, x.BTd
    k, n_core, blk_a = c.backprop_steps, c.n_core, x.block(a)
    adapter_in = 2 * a * BTd  # [h, h_pre] (the fp32 concatenation's autocast cast when a != s)
    outside = x.embed() + x.mean_head(a)
    prelude, coda = c.n_prelude * x.block(s), c.n_coda * blk_a
    if mode == "none":
        return Activations(outside + prelude + k * (adapter_in + n_core * blk_a) + coda, 0.0, x.mean_head_workspace())
    if mode == "core_step":
        # the checkpoint holds each grad step's state h (a) and, once, h_pre (s); recomputing a step saves it whole
        saved = outside + prelude + k * a * BTd + s * BTd + coda
        return Activations(saved, adapter_in + n_core * blk_a, x.mean_head_workspace())
    saved = outside + c.n_prelude * s * BTd + k * (adapter_in + n_core * a * BTd) + c.n_coda * a * BTd
    region = max(x.block(s) - s * BTd if c.n_prelude else 0, blk_a - a * BTd)
    return Activations(saved, region, x.mean_head_workspace())


def mor(c, x: Shapes, mode: str) -> Activations:
    """Recursion r runs the core on its k_r chosen tokens (pipeline/model/mor.py's capacity_tokens)."""
    from pipeline.model.mor import capacity_tokens

    a, s, B, d, BTd = x.a, x.s, x.B, x.d, x.BTd
    N, T = c.n_recurrence, x.T
    chosen = [capacity_tokens(N, r, T) for r in range(N)]
    candidates = [T] + chosen[:-1]

    def routing(r: int) -> float:
        """Recursion r's tensors outside its blocks and its input state (the gathers, router, update, aux BCE)."""
        n, k = candidates[r], chosen[r]
        gathered = s * B * n * d if r > 0 else 0  # the candidates h[C_r]: the router's input, the chosen's source
        cast = a * B * n * d if a != s else 0  # the router's own autocast cast of its input
        # logits, sigmoid, BCE fp32 logits/target; the gathered weights and the chosen's int64 indices among the
        # candidates and (r > 0) in the sequence: at r = 0 one tensor (top-k's own indices are freed with its values)
        small = (2 * a + 8) * B * n + (a + (16 if r > 0 else 8)) * B * k
        rope = 4 * B * k * (d // x.H) if x.llama is not None else 0  # the chosen's rotary angles (their sub-layout)
        return gathered + cast + s * B * k * d + small + rope  # + the core's output (weighted update)

    outside = x.embed() + (c.n_prelude + c.n_coda) * x.block(s) + x.mean_head(s)
    if mode == "none":
        saved = outside + sum(s * BTd + routing(r) + c.n_core * x.block(s, chosen[r]) for r in range(N))
        return Activations(saved, 0.0, x.mean_head_workspace())
    if mode == "core_step":
        # held by the checkpoint: each recursion's state h and the previous recursion's indices (int64)
        saved = outside + N * s * BTd + sum(8 * B * candidates[r] for r in range(1, N))
        region = max(routing(r) + c.n_core * x.block(s, chosen[r]) for r in range(N))
        return Activations(saved, region, x.mean_head_workspace())
    outside = x.embed() + (c.n_prelude + c.n_coda) * s * BTd + x.mean_head(s)
    saved = outside + sum(s * BTd + routing(r) + c.n_core * s * B * chosen[r] * d for r in range(N))
    region = max(x.block(s) - s * BTd if c.n_prelude + c.n_coda else 0, x.block(s, chosen[0]) - s * B * chosen[0] * d)
    return Activations(saved, region, x.mean_head_workspace())


def rrt(c, x: Shapes, mode: str) -> Activations:
    """N_r recursions of the n_core LoRA'd blocks, the stream in s throughout."""
    a, s, BTd = x.a, x.s, x.BTd
    n_lora = 4 if x.llama is None else 7  # the LoRA'd projections: their A outputs (c_attn ... / q_proj ... down_proj)
    core = x.block(s) + n_lora * a * x.BT * c.lora_rank + (2 * a * BTd if a != s else 0)
    N, outer = c.n_recurrence, c.n_prelude + c.n_coda
    outside = x.embed() + x.mean_head(s)
    if mode == "none":
        return Activations(outside + outer * x.block(s) + N * c.n_core * core, 0.0, x.mean_head_workspace())
    if mode == "core_step":
        saved = outside + outer * x.block(s) + N * s * BTd
        return Activations(saved, c.n_core * core - s * BTd, x.mean_head_workspace())
    saved = outside + (outer + N * c.n_core) * s * BTd
    region = max(x.block(s) - s * BTd if outer else 0, core - s * BTd)
    return Activations(saved, region, x.mean_head_workspace())


def ouro(c, x: Shapes, mode: str) -> Activations:
    """T loops of the n_layer blocks and the loop norm, a per-token head at every loop, T - 1 exit gates."""
    a, s, BT, BTd = x.a, x.s, x.BT, x.BTd
    L, T_loops = c.n_layer, c.n_recurrence
    gate_casts = (T_loops - 1) * a * BTd if a != s else 0
    per_loop = s * BTd + x.norm_stats() + 4 * BT  # loop norm input and statistics, the CE's logsumexp
    loss = 12 * BT * T_loops + 8 * BT * (T_loops - 1)
    # + h_T and the targets, saved by the last CE; the mean over the tokens with a target: the bool mask (BT) and
    # the int64 count it divides by
    outside = x.embed() + s * BTd + 8 * BT + gate_casts + loss + BT + 8
    # the per-token CE's backward (once per loop): a recomputed chunk of logits (fp32 + its compute-dtype softmax),
    # dL/dW in fp32 with one chunk's product, dL/dh, the weight cast
    workspace = x.chunk_rows() * x.V * (4 + a) + 8 * x.V * x.d + s * BTd + x.weight_cast()
    if mode == "none":
        return Activations(outside + T_loops * (L * x.block(s) + per_loop), 0.0, workspace)
    if mode == "core_step":
        saved = outside + T_loops * (s * BTd + 4 * BT)  # the checkpoint holds each loop's input h_{t-1}
        return Activations(saved, L * x.block(s) + x.norm_stats(), workspace)
    saved = outside + T_loops * (L * s * BTd + per_loop)
    return Activations(saved, x.block(s) - s * BTd, workspace)


def recurtrace(c, x: Shapes, mode: str) -> Activations:
    """R loops of the n_core loop-memory blocks (all of them in training), the halting head's BCE after loops
    1..R-1 (pipeline/model/recurtrace.py)."""
    a, s, B, H, T, BT, BTd = x.a, x.s, x.B, x.H, x.T, x.BT, x.BTd
    R, n_core, outer = c.n_recurrence, c.n_core, c.n_prelude + c.n_coda
    memory = c.loop_memory != "none" and R > 1  # union and separate save the same: one softmax's columns or two

    def loop_block(i: int) -> float:
        """A loop block at loop i (i earlier loops in its memory)."""
        if not memory or i == 0:  # no loop keys: SDPA, the pre-LN block's tensors
            return x.block(s)
        upcast = 4 * BTd if a != 4 else 0  # the fp32 copy of the attention output the fp32 scores produce
        # llama: o_proj reads a view of the attention output, counted once (its q/k/v_proj are separate tensors)
        view = a * BTd if x.llama is not None else 0
        if c.loop_memory == "union":  # the chunked fp32 kernel: the mask, the stacked earlier keys and values
            # its bool mask: causal [T, T], or [B, 1, T, T] with documents (in place of SDPA's fp32 one); GQA keys and
            # values saved repeated to every query head
            mask = B * T * T - 4 * B * T * T if x.docs else T * T
            gqa = 2 * a * x.BT * (x.d - x.llama[0]) if x.llama is not None else 0
            return x.block(s) + mask + 2 * a * i * BTd + upcast - view + gqa
        # separate: SDPA for the positions, an fp32 softmax over the i loop keys (their fp32 keys and values kept)
        return x.block(s) + a * BTd + 4 * B * H * T * i + 8 * i * BTd + upcast - view

    # the halting norm's fp32 output (and RMSNorm's fp32 normalised input) and statistics, the BCE's logit and target
    # (RMSNorm of a detached state keeps no rsqrt for its input's gradient: + 4 BT when the head reads h itself)
    halt_loop = 4 * BTd + 16 * BT if x.llama is None else 8 * BTd + 8 * BT + (0 if c.halt_detach else 4 * BT)
    halting = (R - 1) * halt_loop + BT if c.halt_coef > 0 and R > 1 else 0
    outside = x.embed() + x.mean_head(s) + halting
    if mode == "none":
        saved = outside + outer * x.block(s) + n_core * sum(loop_block(i) for i in range(R))
        return Activations(saved, 0.0, x.mean_head_workspace())
    # the loop memory of loops 0..R-2 (their qkv tensors): inputs of the later loops' checkpoints, carried even
    # when loop_memory=none reads none of it
    # (gpt2: k and v are views of c_attn's qkv output; llama: k_proj's and v_proj's own, d_kv wide)
    held = n_core * (R - 1) * a * (3 * BTd if x.llama is None else 2 * x.BT * x.llama[0])
    if mode == "core_step":
        saved = outside + outer * x.block(s) + R * s * BTd + held
        return Activations(saved, n_core * loop_block(R - 1) - s * BTd, x.mean_head_workspace())
    saved = outside + (outer + R * n_core) * s * BTd + held
    region = max(x.block(s) - s * BTd if outer else 0, loop_block(R - 1) - s * BTd)
    return Activations(saved, region, x.mean_head_workspace())


def self_kv_layout(T: int, tile: int, own_key: bool = True) -> tuple[float, float]:
    """(d-wide rows, per-head scalars) that one self-KV layer's attention saves beyond its qkv, o and memory
    keys/values, walking pipeline/model/self_kv_attention.py's recursion: a cross step's partial (rows = the right
    half: acc, and m, l per head); per tile of tau rows under A enclosing right halves, the A merges with their
    partials (acc, and m, l, two weights per head; the last merge's m, l are read only by the tile's later
    positions), its own-key statistics (s and l = 1 per head, or m = EMPTY, l = 0 and a zero acc without one); per
    position after the first of its tile, the partial over the tile's earlier keys and the merge with it (two
    accs; m, l, two weights and the normaliser per head); the first only its normaliser."""
    rows = scalars = 0.0

    def solve(lo: int, hi: int, A: int) -> None:
        nonlocal rows, scalars
        if hi - lo <= tile:
            tau = hi - lo
            rows += A * tau + 2 * (tau - 1) + (0 if own_key else tau)
            read = A > 0 or tau > 1  # the own-key statistics are read by a merge
            scalars += (2 * tau if read else 0) + 4 * A * tau - (2 * tau if A and tau == 1 else 0)
            scalars += 5 * (tau - 1) + 1
            return
        mid = (lo + hi) // 2
        solve(lo, mid, A)
        rows += hi - mid
        scalars += 2 * (hi - mid)
        solve(mid, hi, A + 1)

    solve(0, T, 0)
    return rows, scalars


def recurrent_transformer(c, x: Shapes, mode: str) -> Activations:
    """n_layer self-KV layers (pipeline/model/recurrent_transformer.py), positions in order inside each."""
    a, s, B, H, T, BTd = x.a, x.s, x.B, x.H, x.T, x.BTd
    L = c.n_layer
    own = c.own_key == "input"
    if c.prefill == "reference":  # position t's keys and values concatenated: t + own rows each, two probabilities
        keys = T * (T - 1) // 2 + own * T  # (softmax, nan_to_num) per key and head, its key mask (bool)
        rows, scalars, masks = 2 * keys - 2 * T, 2 * keys, B * keys  # q_t copied (+1), qkv not saved (-3)
    else:
        (rows, scalars), masks = self_kv_layout(T, c.tile, own), B * H * T  # the normaliser's l > 0 (bool)
    # the layer input x and the two per-position residuals y, y2 (s); LN_1(x), qkv 3, o, LN_2(y), MLP 4 + 4,
    # LN_1(y2) and the memory keys/values 2 of every position but the last (a); the attention's rows and scalars
    layer = (2 * s + 14 * a) * BTd + (s + 3 * a) * BTd - 2 * a * B * x.d
    layer += 4 * B * x.d * rows + 4 * B * H * scalars + masks + 3 * x.ln_stats()
    if x.llama is not None:  # the llama block's parts: its keys/values are saved repeated to every query head (d wide)
        d_kv, H_kv, f, qk_norm = x.llama
        # three RMSNorms (LN_1(x), LN_2(y), LN_1(y)): + the fp32 normalised input, an rsqrt in place of LN's two
        # statistics; SwiGLU's gate, silu, up, product (4 a BTf) in place of GELU's 4 + 4 a BTd
        layer += 3 * (4 * BTd - 4 * x.BT) + a * x.BT * (4 * f - 8 * x.d)
        if c.own_key == "none" or c.prefill == "reference":  # k_proj's and v_proj's outputs: their own tensors,
            # unread without an own key, copied into each position's keys by the reference (gpt2: views of c_attn's)
            layer -= 2 * a * BTd
        if qk_norm:  # q_norm of q, k_norm of the own and of the memory keys: input, fp32 normalised, rsqrt per head
            layer += (4 + a) * x.BT * (x.d + 2 * d_kv) + 4 * x.BT * (H + 2 * H_kv)
            if c.own_key == "none":  # the unread own keys' k_norm: its fp32 normalised input and rsqrt freed
                layer -= 4 * x.BT * (d_kv + H_kv)
    outside = x.embed() + x.mean_head(s)
    # the first cross step's scores over T/2 x T/2 (fp32), transient: about five at once (s, p, dp, ds, the ties)
    # when backward recomputes them, beside everything saved; not measured on the CPU, like the head's
    half = T // 2 if c.prefill == "tiled" and T > c.tile else 0
    workspace = max(x.mean_head_workspace(), 5 * 4 * B * H * half * half)
    if mode == "blocks":
        return Activations(outside + L * s * BTd, layer - s * BTd, workspace)
    return Activations(outside + L * layer, 0.0, workspace)


# ------------------------------------------------------------------------------------------------ the table
def grt_depth(c) -> tuple[int, str]:
    k = c.backprop_steps
    if k is not None and k < c.n_recurrence:
        return k, (f"k = model.backprop_steps grad steps of the largest sampled depth R = {c.n_recurrence}: its "
                   f"first R - k steps save nothing")
    return c.n_recurrence, "R, the largest sampled depth"


@dataclass(frozen=True)
class Row:
    """One model type: (depth, what it counts) of its estimate, and its activations under each checkpointing mode."""

    depth: Callable[[object], tuple[int, str]]
    activations: Callable[[object, Shapes, str], Activations]


ROWS = {
    "gpt": Row(lambda c: (c.n_layer, "n_layer"), dense),
    "grt": Row(grt_depth, grt),
    "poisson": Row(lambda c: (c.backprop_steps, f"k = model.backprop_steps grad steps: the depth p is random (mean "
                                                f"{c.n_recurrence + 1}), its first max(p - k, 0) steps save nothing"),
                   poisson),
    "mor": Row(lambda c: (c.n_recurrence, "N_r recursions, recursion r on (N_r - r)/N_r of the tokens"), mor),
    "rrt": Row(lambda c: (c.n_recurrence, "N_r recursions"), rrt),
    "ouro": Row(lambda c: (c.n_recurrence, "T loops, a head and an exit gate at each"), ouro),
    "recurtrace": Row(lambda c: (c.n_recurrence, "R loops (training runs them all), each looped layer reading its "
                                                 "earlier loops"), recurtrace),
    "recurrent_transformer": Row(lambda c: (c.n_layer, "n_layer self-KV layers, positions in order"),
                                 recurrent_transformer),
}


def _unknown(model_type: str) -> str:
    return (f"launch/memory_rows.py has no activation model for model.type={model_type!r}; add one (derived from "
            f"what the model's forward saves for backward: a row of the module docstring's table, a function and an "
            f"entry of ROWS) and measure it in tests/test_preflight.py")


def activation_depth(model_cfg) -> tuple[int, str]:
    """(depth, what it counts) at which :func:`activation_bytes` estimates each model type: its deepest training
    forward, or for Poisson (random depth p) the k steps that run with gradient whatever p is."""
    if model_cfg.type not in ROWS:
        raise ValueError(_unknown(model_cfg.type))
    return ROWS[model_cfg.type].depth(model_cfg)


def activation_bytes(model_cfg, micro_batch: int, mode: str, a: int = 4, s: int = 4,
                     chunk_bytes: int = CUDA_CE_CHUNK_BYTES, document_masking: bool = False) -> Activations:
    """Activations of one micro-batch (``micro_batch`` x ``model.block_size``) at the depth of
    :func:`activation_depth` under activation checkpointing ``mode``; ``a``/``s``: compute / residual-stream
    bytes. One function per model type (ROWS), each the module docstring's rows for it."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r}; use one of {CHECKPOINTING_MODES}")
    llama = None
    if model_cfg.block == "llama":

        c = model_cfg
        llama = (c.kv_dim(), c.kv_heads(),
                 c.mlp_hidden(), c.qk_norm)
    x = Shapes(micro_batch, model_cfg.block_size, model_cfg.d_model, model_cfg.n_head, model_cfg.vocab_size, a, s,
               chunk_bytes, llama, document_masking)
    if model_cfg.type not in ROWS:
        raise ValueError(_unknown(model_cfg.type))
    return ROWS[model_cfg.type].activations(model_cfg, x, mode)
