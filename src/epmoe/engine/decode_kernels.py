"""The Triton kernels of decode attention over the paged caches: ``engine.paged_decode``'s and ``engine.mla_decode``'s
(see their docstrings for what they compute). This module imports Triton, so those modules import it on the first
use of their Triton paths only (a machine without Triton imports them and serves CPU tensors with the references).

* ``paged_decode_kernel``, grid ``(B, Hkv, S)``: one kv head's query group of one row over one split of its keys.
* ``paged_decode_reduce_kernel``, grid ``(B, H)``: merges the splits (and the sinks).
* ``mla_decode_kernel``, grid ``(B, cdiv(H, BLOCK_H), S)``: ``engine.mla_decode``'s attention over the latent cache
  (its docstring says what it computes); its splits are merged by ``paged_decode_reduce_kernel`` too.
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, sink_ptr, out_ptr, ws_ptr,
    B, H, DK, DV, ml_off, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_btb, stride_ob, stride_oh, qk_scale, window, chunk,
    G: tl.constexpr, G_PAD: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the cache and the queries come from the kernel before: wait at once
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, G_PAD)
    heads = kvh * G + rows
    row_ok = rows < G
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    dk_ok = offs_dk < DK
    dv_ok = offs_dv < DV
    ctx = tl.load(ctx_ptr + b)
    lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, ctx - window)
    if HAS_CHUNK:
        lo = tl.maximum(lo, ((tl.maximum(ctx, 1) - 1) // chunk) * chunk)
    lo, hi = split_span(lo, ctx, split, SPLITS, BLOCK_N)
    live = hi > lo  # an empty split (a context shorter than the splits cover) stores its max and sum only
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :],
                mask=row_ok[:, None] & dk_ok[None, :] & live, other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        ok, blk, slot = page_slots(bt_row, start + offs_n, hi, BLOCK_SIZE)
        k_rows = k_ptr + blk * stride_kb + slot * stride_ks + kvh * stride_kh
        v_rows = v_ptr + blk * stride_vb + slot * stride_vs + kvh * stride_vh
        k = tl.load(k_rows[:, None] + offs_dk[None, :], mask=ok[:, None] & dk_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = softmax_accumulate(s, ok, qk_scale, v, m_i, l_i, acc, IEEE)
    if SPLITS == 1 and HAS_SINKS:
        sink = tl.load(sink_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
    store_split(acc, m_i, l_i, ctx, live, b, heads, row_ok, offs_dv, dv_ok, out_ptr, ws_ptr, stride_ob, stride_oh, B,
                H, DV, ml_off, split, SPLITS)


@triton.jit
def split_span(lo, hi, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions ``[lo, hi)`` of context split ``split`` of ``SPLITS`` over the visible span ``[lo, hi)``: whole
    ``BLOCK_N`` tiles each, so the splits follow the context's actual length (trailing splits may be empty). Shared
    with the MLA decode kernel."""
    if SPLITS > 1:
        per = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)
    return lo, hi


@triton.jit
def page_slots(bt_row, pos, hi, BLOCK_SIZE: tl.constexpr):
    """For positions ``pos`` of a sequence (its block-table row ``bt_row``): which are before ``hi``, their cache
    block (int64; block 0 for the others) and their slot in it. Shared with the MLA decode kernel."""
    ok = pos < hi
    return ok, tl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64), pos % BLOCK_SIZE


@triton.jit
def softmax_accumulate(s, ok, qk_scale, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of keys into a decode program's online softmax (base 2): scores ``s [rows, BLOCK_N]`` (before
    ``qk_scale``; columns not ``ok`` dropped), values ``v [BLOCK_N, DV_PAD]``; returns the new running max, sum and
    unnormalised accumulator. Shared with the MLA decode kernel (whose values are the latent rows)."""
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def store_split(acc, m_i, l_i, ctx, live, b, heads, row_ok, offs_dv, dv_ok, out_ptr, ws_ptr, stride_ob, stride_oh, B,
                H, DV, ml_off, split, SPLITS: tl.constexpr):
    """A decode program's result for its heads ``heads`` of row ``b``: with one split the normalised output (zeros
    for a padding row, ``ctx`` 0) into ``out``; with ``SPLITS`` splits its unnormalised accumulator, running max and
    sum into the workspace, for ``paged_decode_reduce_kernel`` (layout: acc ``[B, H, S, DV]``, then m ``[B, H, S]``,
    then l ``[B, H, S]``). An empty split (``live`` false: no position in its span) stores m = -inf and l = 0 and
    leaves its accumulator unwritten: the reduce reads the accumulators of splits with a finite m only. Shared with
    the MLA decode kernel."""
    if SPLITS == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        res = tl.where(ctx > 0, res, 0.0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        r = (b.to(tl.int64) * H + heads) * SPLITS + split
        tl.store(ws_ptr + r[:, None] * DV + offs_dv[None, :], acc, mask=row_ok[:, None] & dv_ok[None, :] & live)
        tl.store(ws_ptr + ml_off + r, m_i, mask=row_ok)
        tl.store(ws_ptr + ml_off + B * H * SPLITS + r, l_i, mask=row_ok)

@triton.jit
def paged_decode_reduce_kernel(
    ws_ptr, ctx_ptr, sink_ptr, out_ptr, B, H, DV, ml_off, stride_ob, stride_oh,
    DV_PAD: tl.constexpr, SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_dv = tl.arange(0, DV_PAD)
    dv_ok = offs_dv < DV
    r = (b.to(tl.int64) * H + h) * SPLITS + offs_s
    m = tl.load(ws_ptr + ml_off + r)
    lsum = tl.load(ws_ptr + ml_off + B * H * SPLITS + r)
    m_fin = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_fin, sink)
    m_fin = tl.where(m_fin > float("-inf"), m_fin, 0.0)   # all splits empty, no sink: every weight 0
    w = tl.exp2(m - m_fin)
    denom = tl.sum(lsum * w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_fin)
    # an empty split's accumulator was never written (``store_split``): its weight is 0, its rows are not read
    acc = tl.load(ws_ptr + r[:, None] * DV + offs_dv[None, :], mask=dv_ok[None, :] & (m > float("-inf"))[:, None],
                  other=0.0)
    res = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    ctx = tl.load(ctx_ptr + b)
    res = tl.where(ctx > 0, res, 0.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_dv,
             res.to(out_ptr.dtype.element_ty), mask=dv_ok)


@triton.jit
def mla_decode_kernel(
    q_ptr, c_ptr, bt_ptr, ctx_ptr, out_ptr, ws_ptr,
    B, H, DV, DR, ml_off, stride_qb, stride_qh, stride_cb, stride_cs, stride_btb, stride_ob, stride_oh,
    qk_scale,
    BLOCK_H: tl.constexpr, DV_PAD: tl.constexpr, DR_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < H
    offs_v = tl.arange(0, DV_PAD)
    offs_r = tl.arange(0, DR_PAD)
    v_ok = offs_v < DV
    r_ok = offs_r < DR
    ctx = tl.load(ctx_ptr + b)
    lo, hi = split_span(ctx * 0, ctx, split, SPLITS, BLOCK_N)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    live = hi > lo  # as in paged_decode_kernel
    q_lat = tl.load(q_rows + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :] & live, other=0.0)
    q_rope = tl.load(q_rows + DV + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :] & live, other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    # the block-table entries of each tile are read a tile ahead, so a tile's rows are requested at its start
    ok_n, blk_n, slot_n = page_slots(bt_row, lo + offs_n, hi, BLOCK_SIZE)
    for start in range(lo, hi, BLOCK_N):
        ok, blk, slot = ok_n, blk_n, slot_n
        ok_n, blk_n, slot_n = page_slots(bt_row, start + BLOCK_N + offs_n, hi, BLOCK_SIZE)
        rows = c_ptr + blk * stride_cb + slot * stride_cs
        c = tl.load(rows[:, None] + offs_v[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
        kr = tl.load(rows[:, None] + DV + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_rope, tl.trans(kr), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c))
            s += tl.dot(q_rope, tl.trans(kr))
        m_i, l_i, acc = softmax_accumulate(s, ok, qk_scale, c, m_i, l_i, acc, IEEE)
    store_split(acc, m_i, l_i, ctx, live, b, heads, h_ok, offs_v, v_ok, out_ptr, ws_ptr, stride_ob, stride_oh, B, H,
                DV, ml_off, split, SPLITS)
