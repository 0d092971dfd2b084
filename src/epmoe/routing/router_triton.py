"""The routing of ``routing.Router`` as one Triton launch: the top-k after the logits (``route_triton``, one
program per token) or, for a few tokens, the gate's logits and the top-k together (``route_gate_triton``).

The PyTorch composition launches a kernel per op: for DeepSeek-V3's grouped sigmoid routing about 16
(sigmoid, bias add, per-group top-2, group top-k, mask scatter and fill, top-k, gather, sum, divide,
scale), each a launch's latency at decode sizes, where the gate's weight takes far less to read. Here one
program per token holds its ``E`` logits in registers and does all of it:

* ``softmax_topk`` (Qwen, Mixtral, OLMoE, DeepSeek-V2): softmax in float32; with groups the experts of
  all but the ``topk_group`` best groups (group score: the largest probability) are zeroed; top-k;
  optional renormalisation; the weights rounded to the logits' dtype for Qwen and OLMoE, as
  transformers does; the routed scaling factor.
* ``sigmoid_topk`` (DeepSeek-V3, Kimi-K2): sigmoid scores; the choice adds the correction bias; with
  groups the best ``topk_group`` groups by the sum of their two best choices (or the best one); top-k
  of the choice; weights are the scores of the chosen experts, renormalised (+1e-20) and scaled.
* ``topk_softmax`` (gpt-oss) and ``topk_sigmoid`` (Llama-4): top-k of the raw logits; the weights are the softmax
  over the chosen logits, or their sigmoid, in float32, rounded to the logits' dtype as transformers does.

With a slot table (``route_triton(..., slot_table=...)``, an expert-parallel layer's static replica choice) the
program also writes each chosen expert's physical slot, and with a load record (``loads.LoadRecord``) it adds the
row's pairs to the recorder's counts with integer atomics, as ``count_triton`` does: one launch for what took
three (router, slot lookup, recorder) per MoE layer and step. With a row mask (``row_mask``: the padding rows of
the engine's CUDA-graph steps) a masked row's slots are -1, so no expert computes it and no rank receives it.

At decode sizes the gate's matrix product before it is a launch of its own whose latency far exceeds the time
its weight takes to read. ``route_gate_triton`` (for a few tokens: ``router.FUSED_GATE_MAX_TOKENS``) computes
the logits in the same launch: several programs per token each compute a few of the token's logits (float32
accumulation, rounded to the logits' dtype as ``F.linear`` returns them) into a scratch row, then take a ticket
from the token's arrival counter (the threadfence reduction: a barrier, then an acquire-release atomic); the
program that arrives last routes the token as above and sets the counter back to 0 for the next launch, so the
launch needs no memset and replays in a CUDA graph. On Hopper that launch is a programmatic dependent one
(``experts.triton.pdl``): its programs request their gate rows (at one token a program per row, the whole row)
while the kernel before it (the norm) finishes. At one token the launch may also take the residual add and RMSNorm
before it (``NormBefore``, ``layer.FoldedNorm``: the post-attention norm folded into the router): each program adds
and normalises the row after its wait, and the token's first program stores the sum and the normalised row, which
the experts read after the router; the kernel before it is then the attention's output projection.

Top-k is ``K`` rounds of ``argmax`` and masking, so experts come out by descending choice (ties go to the
lower expert id). The weights equal the PyTorch path's up to float32 summation order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epmoe.checks import check_add_norm, check_int, is_int
from epmoe.engine.norm_kernels import add_rms_norm
from epmoe.experts.triton.pdl import pdl_launch
from epmoe.loads import LoadRecord
from epmoe.routing.count_triton import add_slot_counts

_GATE_PROGRAMS = 128  # programs _gate_router_kernel aims at (about one per SM of a large GPU)
_GATE_TILE = 4096  # gate weight elements a program reads per step of its D loop (more than one token)
_GATE_ROW_PER_WARP = 4096  # at one token, weight row values per warp (the row held whole in registers)


@triton.jit
def _round_to(v, TY: tl.constexpr):
    """Round float32 ``v`` to ``TY`` (to nearest, ties to even) and widen it back to float32. bfloat16 by bit
    arithmetic (torch's ``c10::round_to_nearest_even``; NaN kept): the same on the GPU and in the Triton
    interpreter, whose float32 -> bfloat16 cast truncates."""
    if TY == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(v == v, r, v)
    else:
        return v.to(TY).to(tl.float32)


@triton.jit
def _route_token(lg, t, bias_ptr, idx_ptr, w_ptr, table_ptr, slots_ptr, counts_ptr, pos_ptr, mask_ptr,
                 E, scale, layer, num_layers, width, LOGIT_TY: tl.constexpr,
                 K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                 HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 TOP2_SUM: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, ROUND: tl.constexpr,
                 SCALE: tl.constexpr, TABLE: tl.constexpr, RECORD: tl.constexpr, HAS_MASK: tl.constexpr,
                 MASK_SLOTS: tl.constexpr, CHOSEN: tl.constexpr):
    """Token ``t``'s routing from its logits ``lg [BLOCK_E]`` float32 (``-inf`` past ``E``; values of
    ``LOGIT_TY``): scores, grouped top-k, weights, slots and load counts, stored at row ``t``; with
    ``MASK_SLOTS`` a row the mask marks 0 gets slots -1 (and is not counted); with ``CHOSEN`` the top-k of the
    logits themselves, weighed by the softmax over the chosen logits (or, with ``SIGMOID``, their sigmoid)."""
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    if CHOSEN:
        scores = lg
        choice = lg
        fill = float("-inf")
    elif SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-lg))
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0)
        fill = float("-inf")
    else:
        p = tl.exp(lg - tl.max(lg, 0))
        scores = p / tl.sum(p, 0)
        choice = scores
        fill = 0.0
    choice = tl.where(ok, choice, float("-inf"))
    if N_GROUP > 1:
        size = E // N_GROUP
        grp = e // size
        gi = tl.arange(0, GP)
        gscore = tl.full([GP], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = ok & (grp == g)
            vals = tl.where(in_g, choice, float("-inf"))
            best = tl.max(vals, 0)
            if TOP2_SUM:
                first = tl.argmax(vals, 0)
                best = best + tl.max(tl.where(e == first, float("-inf"), vals), 0)
            gscore = tl.where(gi == g, best, gscore)
        kept = e < 0
        for _ in tl.static_range(TOPK_GROUP):
            g_best = tl.argmax(gscore, 0)
            kept = kept | (grp == g_best)
            gscore = tl.where(gi == g_best, float("-inf"), gscore)
        choice = tl.where(ok, tl.where(kept, choice, fill), float("-inf"))
    ki = tl.arange(0, KP)
    top_idx = tl.zeros([KP], dtype=tl.int64)
    top_w = tl.zeros([KP], dtype=tl.float32)
    for k in tl.static_range(K):
        best, j = tl.max(choice, 0, return_indices=True, return_indices_tie_break_left=True)
        top_idx = tl.where(ki == k, j.to(tl.int64), top_idx)
        if HAS_BIAS or N_GROUP > 1:  # the choice is not the score: look the score up
            best = tl.sum(tl.where(e == j, scores, 0.0), 0)
        top_w = tl.where(ki == k, best, top_w)
        choice = tl.where(e == j, float("-inf"), choice)
    if CHOSEN:
        if SIGMOID:
            top_w = 1.0 / (1.0 + tl.exp(-top_w))
        else:
            top_w = tl.where(ki < K, top_w, float("-inf"))
            top_w = tl.exp(top_w - tl.max(top_w, 0))
            top_w = top_w / tl.sum(top_w, 0)
    if NORM:
        top_w = top_w / (tl.sum(top_w, 0) + EPS)
    if ROUND:
        top_w = _round_to(top_w, LOGIT_TY)
    if SCALE:
        top_w = top_w * scale
    tl.store(idx_ptr + t * K + ki, top_idx, mask=ki < K)
    tl.store(w_ptr + t * K + ki, top_w, mask=ki < K)
    if TABLE:
        slot = tl.load(table_ptr + top_idx, mask=ki < K, other=-1)
        if HAS_MASK:
            m = (tl.zeros([KP], tl.int64) + tl.load(mask_ptr + t).to(tl.int64) != 0).to(tl.int64)
            if MASK_SLOTS:  # a padding row routes nowhere
                slot = tl.where(m != 0, slot, -1)
        else:
            m = tl.full([KP], 1, tl.int64)
        tl.store(slots_ptr + t * K + ki, slot, mask=ki < K)
        if RECORD:
            add_slot_counts(counts_ptr, pos_ptr, layer, num_layers, width, slot, m, ki < K)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, table_ptr, slots_ptr, counts_ptr, pos_ptr, mask_ptr,
                   E, stride_l, scale, layer, num_layers, width,
                   K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOP2_SUM: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, ROUND: tl.constexpr,
                   SCALE: tl.constexpr, TABLE: tl.constexpr, RECORD: tl.constexpr, HAS_MASK: tl.constexpr,
                   MASK_SLOTS: tl.constexpr, CHOSEN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    lg = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    _route_token(lg, t, bias_ptr, idx_ptr, w_ptr, table_ptr, slots_ptr, counts_ptr, pos_ptr, mask_ptr,
                 E, scale, layer, num_layers, width, logits_ptr.dtype.element_ty,
                 K, KP, BLOCK_E, SIGMOID, HAS_BIAS, N_GROUP, GP, TOPK_GROUP, TOP2_SUM, NORM, EPS, ROUND, SCALE,
                 TABLE, RECORD, HAS_MASK, MASK_SLOTS, CHOSEN)


@triton.jit
def _gate_router_kernel(x_ptr, gw_ptr, gb_ptr, scratch_ptr, arrive_ptr,
                        bias_ptr, idx_ptr, w_ptr, table_ptr, slots_ptr, counts_ptr, pos_ptr, mask_ptr,
                        r_ptr, nw_ptr, sum_ptr, xn_ptr, eps,
                        E, stride_x, stride_gw, scale, layer, num_layers, width, D: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, GATE_BIAS: tl.constexpr,
                        ROUND_LOGITS: tl.constexpr,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        TOP2_SUM: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, ROUND: tl.constexpr,
                        SCALE: tl.constexpr, TABLE: tl.constexpr, RECORD: tl.constexpr, HAS_MASK: tl.constexpr,
                        MASK_SLOTS: tl.constexpr, CHOSEN: tl.constexpr, PDL: tl.constexpr, ADD_NORM: tl.constexpr,
                        WEIGHT_THEN_CAST: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    n_ok = n < E
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    d = tl.arange(0, BLOCK_D)
    w_rows = gw_ptr + n.to(tl.int64)[:, None] * stride_gw
    wv = tl.load(w_rows + d[None, :], mask=n_ok[:, None] & (d < D)[None, :], other=0.0)  # a weight: before the wait
    if ADD_NORM:
        nw = tl.load(nw_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        xv = tl.load(x_ptr + t * stride_x + d, mask=d_ok, other=0.0).to(tl.float32)
        if ADD_NORM:  # one token, its whole row in this one step: fused_norm's add and RMSNorm, in every program
            r = tl.load(r_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
            h, xv = add_rms_norm(xv, r, nw, D, eps, x_ptr.dtype.element_ty, True, WEIGHT_THEN_CAST)
            xv = xv.to(x_ptr.dtype.element_ty)
            if tl.program_id(1) == 0:
                tl.store(sum_ptr + t * D + d, h.to(x_ptr.dtype.element_ty), mask=d_ok)
                tl.store(xn_ptr + t * D + d, xv, mask=d_ok)
            xv = xv.to(tl.float32)
        acc += wv.to(tl.float32) * xv[None, :]
        wv = tl.load(w_rows + BLOCK_D + d[None, :], mask=n_ok[:, None] & (d + BLOCK_D < D)[None, :], other=0.0)
    lg = tl.sum(acc, 1)
    if GATE_BIAS:
        lg += tl.load(gb_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if ROUND_LOGITS:  # the logits F.linear returns in the model dtype
        lg = _round_to(lg, x_ptr.dtype.element_ty)
    tl.store(scratch_ptr + t * E + n, lg, mask=n_ok)
    # the threadfence reduction: every tile's logits are visible to the program that takes the last ticket
    tl.debug_barrier()
    ticket = tl.atomic_add(arrive_ptr + t, 1, sem="acq_rel")
    if ticket == TILES - 1:
        tl.store(arrive_ptr + t, 0)  # ready for the next launch (stream order), no host memset
        e = tl.arange(0, BLOCK_E)
        row = tl.load(scratch_ptr + t * E + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")
        _route_token(row, t, bias_ptr, idx_ptr, w_ptr, table_ptr, slots_ptr, counts_ptr, pos_ptr, mask_ptr,
                     E, scale, layer, num_layers, width, x_ptr.dtype.element_ty,
                     K, KP, BLOCK_E, SIGMOID, HAS_BIAS, N_GROUP, GP, TOPK_GROUP, TOP2_SUM, NORM, EPS, ROUND, SCALE,
                     TABLE, RECORD, HAS_MASK, MASK_SLOTS, CHOSEN)


def supports(router_kind: str) -> bool:
    """Whether ``route_triton`` computes this router kind (the four kinds above: all of ``spec.RouterKind``)."""
    return router_kind in ("softmax_topk", "sigmoid_topk", "topk_softmax", "topk_sigmoid")


def route_triton(logits: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int, sigmoid: bool,
                 n_group: int, topk_group: int, top2_sum: bool, normalize: bool, round_weights: bool,
                 scale: float, slot_table: torch.Tensor | None = None, record: LoadRecord | None = None,
                 row_mask: torch.Tensor | None = None, chosen: bool = False) -> tuple[torch.Tensor, ...]:
    """``router.Router``'s top-k after the logits, in one launch (flags: ``router.kernel_flags(spec)``); with
    ``slot_table`` also the chosen experts' slots, and with ``record`` their count.

    Args:
        logits: ``[T, E]`` router logits (float32 for DeepSeek, the model dtype otherwise).
        correction_bias: ``[E]`` float32 ``e_score_correction_bias`` (sigmoid routing), or ``None``.
        top_k: ``K``.
        sigmoid: sigmoid scoring with the correction bias (``sigmoid_topk``); else softmax (``softmax_topk``); with
            ``chosen``, the sigmoid of the chosen logits (``topk_sigmoid``), else their softmax (``topk_softmax``).
        n_group: expert groups (1 = no grouped routing).
        topk_group: groups kept.
        top2_sum: a group scores by the sum of its two best choices, else by its best one.
        normalize: renormalise the chosen weights.
        round_weights: round the softmax weights to the logits' dtype (Qwen, OLMoE; ignored for float32).
        scale: the routed scaling factor.
        slot_table: ``[E]`` int64 contiguous physical slot of each expert (``SlotMap.static_table``), or ``None``.
        record: the load recorder's counts to add the slots to (needs ``slot_table``), or ``None``.
        row_mask: ``[T]`` int64, 0 = a padding row: its slots are -1 (no expert computes it) and it is not
            counted (needs ``slot_table``; it replaces ``record.row_mask``), or ``None``.
        chosen: the top-k of the logits themselves, weighed by a function of the chosen logits only (gpt-oss's
            ``topk_softmax``, Llama-4's ``topk_sigmoid``), rounded to the logits' dtype; no correction bias, groups,
            renormalisation or ``round_weights`` (the rounding is the kind's own).

    Returns:
        ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` float32, experts by descending choice; with
        ``slot_table`` also ``topk_slots [T, K]`` int64.

    Raises:
        ValueError: ``logits`` not a 2-D tensor on a CUDA device (any device under ``TRITON_INTERPRET=1``);
            ``top_k`` not in ``1..E``, ``n_group`` below 1; a ``record`` or a ``row_mask`` without a ``slot_table``;
            a ``row_mask`` not ``[T]`` int64; ``chosen`` with expert groups (``n_group`` above 1).
    """
    _check_rows("route_triton", "logits", logits)
    t, e = logits.shape
    out, args = _routing_args("route_triton", t, e, logits.dtype, logits.device, correction_bias, top_k, sigmoid,
                              n_group, topk_group, top2_sum, normalize, round_weights, scale, slot_table, record,
                              row_mask, chosen)
    if t == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    # one warp a token: the top-k's reductions stay within the warp (faster at every size benchmarks/router.py
    # times on an H200 than four warps)
    _router_kernel[(t,)](logits_ptr=logits, stride_l=logits.stride(0), **args, num_warps=1)
    return out


def route_gate_triton(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None,
                      arrivals: torch.Tensor, correction_bias: torch.Tensor | None, *, fp32_logits: bool, top_k: int,
                      sigmoid: bool, n_group: int, topk_group: int, top2_sum: bool, normalize: bool,
                      round_weights: bool, scale: float, slot_table: torch.Tensor | None = None,
                      record: LoadRecord | None = None, row_mask: torch.Tensor | None = None,
                      norm: NormBefore | None = None, chosen: bool = False) -> tuple[torch.Tensor, ...]:
    """``route_triton`` of the gate's logits ``x @ gate_weight.T (+ gate_bias)``, computed in the same launch
    (for a few tokens: every token's programs read the whole weight; ``router.FUSED_GATE_MAX_TOKENS``).

    The logits are accumulated in float32 and, unless ``fp32_logits``, rounded to ``x``'s dtype as
    ``F.linear`` returns them; with ``fp32_logits`` (DeepSeek) ``x`` and the weight are widened to float32.
    Several programs per token each compute ``ROWS`` of the token's ``E`` logits into a float32 scratch and
    take a ticket from the token's arrival counter; the last to arrive routes the token (``route_triton``'s
    top-k) and sets the counter back to 0, so a CUDA graph may replay the launch.

    Args:
        x: ``[T, D]`` hidden states.
        gate_weight: ``[E, D]`` the gate's weight (``x``'s dtype, or float32 with ``fp32_logits``).
        gate_bias: ``[E]`` the gate's bias (gpt-oss), or ``None``.
        arrivals: ``[>= T]`` int32 arrival counters, all 0 (they are 0 again after the launch; one
            buffer must not serve two launches running at once).
        correction_bias: as ``route_triton``.
        fp32_logits: the router computes its logits in float32 (``MoESpec.router_fp32_logits``).
        top_k, sigmoid, n_group, topk_group, top2_sum, normalize, round_weights, scale, slot_table, record,
            row_mask, chosen: as ``route_triton`` (the logits' dtype is float32 with ``fp32_logits``, else ``x``'s).
        norm: the rows are ``x`` plus a residual, still to normalise (``NormBefore``; one token): every program
            adds and normalises the row itself, the first of the token's programs writes the sum and the
            normalised row, which the logits are of.

    Returns:
        As ``route_triton``.

    Raises:
        ValueError: ``x`` not a 2-D tensor on a CUDA device (any device under ``TRITON_INTERPRET=1``); more tokens
            than ``arrivals`` counters (or not int32 contiguous), shapes or dtypes
            of ``x``, ``gate_weight``, ``gate_bias`` that ``F.linear`` would not take, or as ``route_triton``;
            with ``norm``, more than one token or its tensors not of ``x``'s shape, dtype and device (named).
        TypeError: ``norm`` not a ``NormBefore``, or a field of it not a tensor (``NormBefore.check``).
    """
    _check_rows("route_gate_triton", "x", x)
    t, d = x.shape
    e = gate_weight.shape[0]
    if arrivals.dtype != torch.int32 or not arrivals.is_contiguous() or t > arrivals.numel():
        raise ValueError(f"route_gate_triton needs an int32 contiguous arrival counter per token: {t} tokens, "
                         f"arrivals {tuple(arrivals.shape)} {arrivals.dtype}")
    if gate_weight.shape[1] != d or (gate_bias is not None and gate_bias.shape != (e,)):
        raise ValueError(f"gate_weight {tuple(gate_weight.shape)} and gate_bias "
                         f"{None if gate_bias is None else tuple(gate_bias.shape)} do not fit x {tuple(x.shape)}")
    if not fp32_logits and not (x.dtype == gate_weight.dtype and (gate_bias is None or gate_bias.dtype == x.dtype)):
        raise ValueError(f"x ({x.dtype}), gate_weight ({gate_weight.dtype}) and gate_bias "
                         f"({None if gate_bias is None else gate_bias.dtype}) must share one dtype")
    if norm is not None:
        if not isinstance(norm, NormBefore):
            raise TypeError(f"route_gate_triton: norm must be a NormBefore, got {type(norm).__name__}")
        norm.check(x)
    logit_dtype = torch.float32 if fp32_logits else x.dtype
    out, args = _routing_args("route_gate_triton", t, e, logit_dtype, x.device, correction_bias, top_k, sigmoid,
                              n_group, topk_group, top2_sum, normalize, round_weights, scale, slot_table, record,
                              row_mask, chosen)
    if t == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_weight = gate_weight.contiguous()
    nargs = dict(r_ptr=x, nw_ptr=x, sum_ptr=x, xn_ptr=x, eps=0.0) if norm is None else dict(
        r_ptr=norm.residual, nw_ptr=norm.weight, sum_ptr=norm.summed, xn_ptr=norm.normed, eps=norm.eps)
    rows = _gate_rows(t, e)
    # one token: each program's whole weight row in one step, requested before the wait; more: steps of _GATE_TILE
    block_d = triton.next_power_of_2(d) if t == 1 else min(triton.next_power_of_2(d), max(128, _GATE_TILE // rows))
    tiles = triton.cdiv(e, rows)
    scratch = torch.empty(t, e, dtype=torch.float32, device=x.device)
    pdl = pdl_launch(x)
    _gate_router_kernel[(t, tiles)](
        x_ptr=x, gw_ptr=gate_weight, gb_ptr=gate_bias if gate_bias is not None else gate_weight,
        scratch_ptr=scratch, arrive_ptr=arrivals, D=d, stride_x=x.stride(0), stride_gw=gate_weight.stride(0),
        ROWS=rows, BLOCK_D=block_d, TILES=tiles, GATE_BIAS=gate_bias is not None,
        ROUND_LOGITS=logit_dtype != torch.float32, **args, **nargs, PDL=pdl, ADD_NORM=norm is not None,
        WEIGHT_THEN_CAST=norm is not None and norm.weight_then_cast, num_warps=_gate_warps(t, d, fp32_logits),
        launch_pdl=pdl,
    )
    return out


@dataclass(frozen=True)
class NormBefore:
    """The RMSNorm ``route_gate_triton`` computes before the gate (``layer.FoldedNorm``'s tensors, as rows): the
    rows to route are ``RMSNorm(residual + x)``.

    Attributes:
        residual: ``[1, D]`` the residual stream (``x``'s dtype, contiguous).
        weight: ``[D]`` the norm's weight, contiguous (``x``'s dtype unless ``weight_then_cast``).
        eps: the norm's epsilon.
        weight_then_cast: multiply by the weight in float32 and cast after (``FusedRMSNorm.weight_then_cast``).
        summed: ``[1, D]`` written with ``residual + x`` (``x``'s dtype, contiguous).
        normed: ``[1, D]`` written with the normalised row (``x``'s dtype, contiguous).
    """

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    weight_then_cast: bool
    summed: torch.Tensor
    normed: torch.Tensor

    def check(self, x: torch.Tensor) -> None:
        """Raise (naming the field) unless these fit the rows ``x``: one token; ``residual``, ``summed`` and
        ``normed`` of ``x``'s shape, dtype and device, contiguous, ``summed`` and ``normed`` sharing no memory with
        ``x``, ``residual`` or each other; the weight a contiguous ``[D]`` float tensor (``x``'s dtype unless
        ``weight_then_cast``); ``eps`` finite ``>= 0`` (``checks.check_add_norm``).

        Raises:
            TypeError: a field that is not a tensor, ``weight_then_cast`` not a bool.
            ValueError: anything else that does not fit.
        """
        if x.shape[0] != 1:
            raise ValueError(f"route_gate_triton normalises one token's row, got {x.shape[0]} tokens")
        for name in ("summed", "normed"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"route_gate_triton norm: {name} must be a torch.Tensor, got "
                                f"{type(getattr(self, name)).__name__}")
        check_add_norm("route_gate_triton norm", x, self.residual, self.weight, self.eps, self.weight_then_cast,
                       {"summed": self.summed, "normed": self.normed})
        for name in ("residual", "summed", "normed"):
            if not getattr(self, name).is_contiguous():
                raise ValueError(f"route_gate_triton norm: {name} strides {getattr(self, name).stride()} must be "
                                 f"contiguous")


def _gate_warps(num_tokens: int, hidden_size: int, fp32_logits: bool) -> int:
    """Warps per program of ``_gate_router_kernel``. One token: one warp per ``_GATE_ROW_PER_WARP`` values of the
    program's weight row (``D`` rounded up to a power of two), which it holds whole (the launch's time is the wait,
    one read of ``x`` and the last program's top-k, whose reductions stay within a warp at one warp); more: four for
    a model-dtype gate, two for a float32 one (DeepSeek's). Chosen from ``benchmarks/router.py`` and a one-token
    sweep on an H200 (``benchmarks/HISTORY.md``: one-token gate of Kimi-K2.5 and DeepSeek-V3 with two warps)."""
    if num_tokens == 1:
        return max(1, triton.next_power_of_2(hidden_size) // _GATE_ROW_PER_WARP)
    return 2 if fp32_logits else 4


def _gate_rows(num_tokens: int, num_experts: int) -> int:
    """Gate rows per program of ``_gate_router_kernel``: one for one token (a program per row, the row read whole
    before the wait); else a power of two from 1 to 8 that makes about ``_GATE_PROGRAMS`` programs in all (many
    programs read the weight at once: it is all the launch reads)."""
    rows = 1
    while num_tokens > 1 and rows < 8 and num_tokens * num_experts // (2 * rows) >= _GATE_PROGRAMS:
        rows *= 2
    return rows


def _check_rows(where: str, name: str, rows: object) -> None:
    """Raise unless ``rows`` is a 2-D tensor the kernels can read: on a CUDA device, or any device under the Triton
    interpreter (``TRITON_INTERPRET=1``)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        shown = (f"a {rows.dim()}-D tensor {tuple(rows.shape)}" if isinstance(rows, torch.Tensor)
                 else type(rows).__name__)
        raise ValueError(f"{where}: {name} must be a 2-D [T, ...] tensor, got {shown}")
    if not rows.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # as engine.gemv reads it
        raise ValueError(f"{where} runs on CUDA tensors (or under TRITON_INTERPRET=1), got {name} on {rows.device}; "
                         f"routing.Router routes other devices in PyTorch")


def _routing_args(where: str, t: int, e: int, logit_dtype: torch.dtype, device: torch.device,
                  correction_bias: torch.Tensor | None, top_k: int, sigmoid: bool, n_group: int, topk_group: int,
                  top2_sum: bool, normalize: bool, round_weights: bool, scale: float,
                  slot_table: torch.Tensor | None, record: LoadRecord | None, row_mask: torch.Tensor | None,
                  chosen: bool):
    """The outputs and the keyword arguments both kernels pass to ``_route_token`` (pointers, scalars and
    constexprs): ``(outputs, kwargs)``; ``where`` names the caller in errors."""
    if not is_int(top_k) or not 1 <= top_k <= e:
        raise ValueError(f"{where}: top_k must be an int in 1..{e} (the experts), got {top_k!r}")
    check_int(f"{where}: n_group", n_group, 1, wording="an int >= 1")
    if chosen and n_group > 1:
        raise ValueError(f"{where}: chosen-logit routing (topk_softmax, topk_sigmoid) has no expert groups, "
                         f"got n_group={n_group}")
    if record is not None and slot_table is None:
        raise ValueError(f"{where} records slot loads only with a slot_table")
    if row_mask is not None and (slot_table is None or row_mask.shape != (t,) or row_mask.dtype != torch.int64):
        raise ValueError(f"{where} masks rows only with a slot_table and a [T] int64 row_mask: {t} tokens, "
                         f"row_mask {tuple(row_mask.shape)} {row_mask.dtype}")
    k = top_k
    idx = torch.empty(t, k, dtype=torch.int64, device=device)
    w = torch.empty(t, k, dtype=torch.float32, device=device)
    slots = torch.empty(t, k, dtype=torch.int64, device=device) if slot_table is not None else None
    out = (idx, w) if slots is None else (idx, w, slots)
    rec = record if record is not None else LoadRecord(idx, idx, 0, None)  # placeholders when not recording
    mask = row_mask if row_mask is not None else rec.row_mask
    args = dict(
        bias_ptr=correction_bias if correction_bias is not None else w, idx_ptr=idx, w_ptr=w,
        table_ptr=slot_table if slot_table is not None else idx, slots_ptr=slots if slots is not None else idx,
        counts_ptr=rec.counts, pos_ptr=rec.pos, mask_ptr=mask if mask is not None else idx,
        E=e, scale=float(scale), layer=rec.layer, num_layers=rec.counts.shape[1] if record is not None else 1,
        width=rec.counts.shape[2] if record is not None else 1,
        K=k, KP=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(e), SIGMOID=sigmoid,
        HAS_BIAS=sigmoid and not chosen and correction_bias is not None, N_GROUP=n_group,
        GP=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, TOP2_SUM=top2_sum, NORM=normalize and not chosen,
        EPS=1e-20 if sigmoid else 0.0,
        ROUND=(chosen or (not sigmoid and round_weights)) and logit_dtype != torch.float32,
        SCALE=(sigmoid and not chosen) or scale != 1.0, TABLE=slot_table is not None, RECORD=record is not None,
        HAS_MASK=mask is not None, MASK_SLOTS=row_mask is not None, CHOSEN=chosen,
    )
    return out, args
