"""The Triton kernels of the engine's row-wise norm and one-row projections: ``fused_norm``'s and ``gemv``'s (see
their docstrings for what they compute). This module imports Triton, so those modules import it on the first use of a
kernel (a machine without Triton imports them and serves CPU tensors).

* ``add_rms_norm``: the residual add and RMSNorm of one row, a Triton function: the arithmetic and roundings of
  ``FusedRMSNorm``, which every kernel that computes a norm calls (``rms_norm_kernel``; ``gemv_kernel`` and
  ``routing.router_triton``'s gate, which fold a norm into their launch), so that all give the same bits.
* ``rms_norm_kernel``, grid ``(rows,)``: ``fused_norm.FusedRMSNorm``'s (with the residual add before it).
* ``gemv_kernel``, grid ``(cdiv(N, BLOCK_N),)``: ``gemv.gemv`` and ``gemv.gemv_add_norm``.
"""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm(x, r, w, n, eps, DT: tl.constexpr, ADD: tl.constexpr, WEIGHT_THEN_CAST: tl.constexpr):
    """``(h, y)`` of one row: ``x``, ``r`` (read only with ``ADD``) and ``w`` float32 ``[BLOCK]`` (the row, the
    residual, the weight; 0 past the ``n`` columns); ``h`` the row after the add, rounded to ``DT`` (the rows' dtype;
    float32 values); ``y`` the normalised row times the weight in float32, before its rounding to the output dtype:
    ``(h * rstd)`` rounded to ``DT`` times ``w``, or with ``WEIGHT_THEN_CAST`` ``w * (h * rstd)`` (gpt-oss)."""
    if ADD:  # h = r + x in the rows' dtype (the add it replaces rounds there)
        x = (x + r).to(DT).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    if WEIGHT_THEN_CAST:
        y = w * y
    else:
        y = y.to(DT).to(tl.float32) * w
    return x, y


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, sum_ptr, stride_x, stride_o, stride_r, stride_s, n_cols, eps,
                    BLOCK: tl.constexpr, WEIGHT_THEN_CAST: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr,
                    LATE: tl.constexpr):
    if PDL and not LATE:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)  # a weight: before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
        if LATE:
            tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = x
    if ADD:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    h, out = add_rms_norm(x, r, w.to(tl.float32), n_cols, eps, x_ptr.dtype.element_ty, ADD, WEIGHT_THEN_CAST)
    if ADD:  # the sum, the next residual
        tl.store(sum_ptr + row * stride_s + cols, h.to(sum_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, s_ptr, N, K, stride_xm, stride_wn, stride_b,
                stride_ym, stride_rm, stride_sm, eps,
                M: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
                PDL: tl.constexpr, NORM: tl.constexpr, WEIGHT_THEN_CAST: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_PAD)
    n_ok = offs_n < N
    k_ok = offs_k < K
    # the weight and bias (no kernel writes them): all of this program's slice, before the wait
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n * stride_b, mask=n_ok, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for m in tl.static_range(M):
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:  # fused_norm's add and RMSNorm, each program for itself; the first one stores the sum
            r = tl.load(r_ptr + m * stride_rm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            h, x = add_rms_norm(x, r, nw, K, eps, x_ptr.dtype.element_ty, True, WEIGHT_THEN_CAST)
            if tl.program_id(0) == 0:
                tl.store(s_ptr + m * stride_sm + offs_k, h.to(s_ptr.dtype.element_ty), mask=k_ok)
            x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            y += b
        tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
