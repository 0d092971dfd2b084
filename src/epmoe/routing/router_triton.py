"""The top-k routing of ``routing.Router`` after the logits, as one Triton kernel (one program per token).

The PyTorch composition launches a kernel per op: for DeepSeek-V3's grouped sigmoid routing about 16
(sigmoid, bias add, per-group top-2, group top-k, mask scatter and fill, top-k, gather, sum, divide,
scale); in a CUDA-graph-replayed decode layer on an H200 those took about 35 µs of a 289 µs layer at
one token, where the gate's reads are 7 MB (under 2 µs). Here one program per token holds its ``E``
logits in registers and does all of it:

* ``softmax_topk`` (Qwen, Mixtral, OLMoE, DeepSeek-V2): softmax in float32; with groups the experts of
  all but the ``topk_group`` best groups (group score: the largest probability) are zeroed; top-k;
  optional renormalisation; the weights rounded to the logits' dtype for Qwen and OLMoE, as
  transformers does; the routed scaling factor.
* ``sigmoid_topk`` (DeepSeek-V3, Kimi-K2): sigmoid scores; the choice adds the correction bias; with
  groups the best ``topk_group`` groups by the sum of their two best choices (or the best one); top-k
  of the choice; weights are the scores of the chosen experts, renormalised (+1e-20) and scaled.

With a slot table (``route_triton(..., slot_table=...)``, an expert-parallel layer's static replica choice) the
program also writes each chosen expert's physical slot, and with a load record (``loads.LoadRecord``) it adds the
row's pairs to the recorder's counts with integer atomics, as ``count_triton`` does: one launch for what took
three (router, slot lookup, recorder) per MoE layer and step.

Top-k is ``K`` rounds of ``argmax`` and masking, so experts come out by descending choice (ties go to the
lower expert id). The weights equal the PyTorch path's up to float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.loads import LoadRecord
from epmoe.routing.count_triton import add_slot_counts


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, table_ptr, slots_ptr, counts_ptr, pos_ptr, mask_ptr,
                   E, stride_l, scale, layer, num_layers, width,
                   K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOP2_SUM: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, ROUND: tl.constexpr,
                   SCALE: tl.constexpr, TABLE: tl.constexpr, RECORD: tl.constexpr, HAS_MASK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    lg = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
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
        j = tl.argmax(choice, 0)
        top_idx = tl.where(ki == k, j.to(tl.int64), top_idx)
        top_w = tl.where(ki == k, tl.sum(tl.where(e == j, scores, 0.0), 0), top_w)
        choice = tl.where(e == j, float("-inf"), choice)
    if NORM:
        top_w = top_w / (tl.sum(top_w, 0) + EPS)
    if ROUND:
        top_w = top_w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    if SCALE:
        top_w = top_w * scale
    tl.store(idx_ptr + t * K + ki, top_idx, mask=ki < K)
    tl.store(w_ptr + t * K + ki, top_w, mask=ki < K)
    if TABLE:
        slot = tl.load(table_ptr + top_idx, mask=ki < K, other=-1)
        tl.store(slots_ptr + t * K + ki, slot, mask=ki < K)
        if RECORD:
            if HAS_MASK:
                m = tl.zeros([KP], tl.int64) + tl.load(mask_ptr + t).to(tl.int64)
            else:
                m = tl.full([KP], 1, tl.int64)
            add_slot_counts(counts_ptr, pos_ptr, layer, num_layers, width, slot, m, ki < K)


def supports(router_kind: str) -> bool:
    """Whether ``route_triton`` computes this router kind (the two kinds above; others use PyTorch)."""
    return router_kind in ("softmax_topk", "sigmoid_topk")


def route_triton(logits: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int, sigmoid: bool,
                 n_group: int, topk_group: int, top2_sum: bool, normalize: bool, round_weights: bool,
                 scale: float, slot_table: torch.Tensor | None = None, record: LoadRecord | None = None,
                 ) -> tuple[torch.Tensor, ...]:
    """``router.Router``'s top-k after the logits, in one launch (flags: ``router.kernel_flags(spec)``); with
    ``slot_table`` also the chosen experts' slots, and with ``record`` their count.

    Args:
        logits: ``[T, E]`` router logits (float32 for DeepSeek, the model dtype otherwise).
        correction_bias: ``[E]`` float32 ``e_score_correction_bias`` (sigmoid routing), or ``None``.
        top_k: ``K``.
        sigmoid: sigmoid scoring with the correction bias (``sigmoid_topk``); else softmax (``softmax_topk``).
        n_group: expert groups (1 = no grouped routing).
        topk_group: groups kept.
        top2_sum: a group scores by the sum of its two best choices, else by its best one.
        normalize: renormalise the chosen weights.
        round_weights: round the softmax weights to the logits' dtype (Qwen, OLMoE; ignored for float32).
        scale: the routed scaling factor.
        slot_table: ``[E]`` int64 contiguous physical slot of each expert (``SlotMap.static_table``), or ``None``.
        record: the load recorder's counts to add the slots to (needs ``slot_table``), or ``None``.

    Returns:
        ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` float32, experts by descending choice; with
        ``slot_table`` also ``topk_slots [T, K]`` int64.

    Raises:
        ValueError: a ``record`` without a ``slot_table``.
    """
    if record is not None and slot_table is None:
        raise ValueError("route_triton records slot loads only with a slot_table")
    t, e = logits.shape
    k = top_k
    idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    slots = torch.empty(t, k, dtype=torch.int64, device=logits.device) if slot_table is not None else None
    out = (idx, w) if slots is None else (idx, w, slots)
    if t == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    rounds = not sigmoid and round_weights and logits.dtype != torch.float32
    rec = record if record is not None else LoadRecord(idx, idx, 0, None)  # placeholders when not recording
    table = slot_table if slot_table is not None else idx
    _router_kernel[(t,)](
        logits, correction_bias if correction_bias is not None else logits, idx, w, table,
        slots if slots is not None else idx, rec.counts, rec.pos, rec.row_mask if rec.row_mask is not None else idx,
        e, logits.stride(0), float(scale), rec.layer, rec.counts.shape[1] if record is not None else 1,
        rec.counts.shape[2] if record is not None else 1,
        K=k, KP=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(e), SIGMOID=sigmoid,
        HAS_BIAS=sigmoid and correction_bias is not None, N_GROUP=n_group,
        GP=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, TOP2_SUM=top2_sum,
        NORM=normalize, EPS=1e-20 if sigmoid else 0.0, ROUND=rounds, SCALE=sigmoid or scale != 1.0,
        TABLE=slot_table is not None, RECORD=record is not None, HAS_MASK=rec.row_mask is not None, num_warps=4,
    )
    return out
