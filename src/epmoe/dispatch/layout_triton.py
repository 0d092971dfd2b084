"""The dispatch layout steps of ``layout`` as Triton kernels: one launch each, no host sync.

The PyTorch versions in ``layout`` take one kernel per tensor op. At one token per rank that is
about 25 launches around the two all-to-alls (about 33 µs of a 90 µs dispatch + combine measured on two
H200s as a graph replay), and at 4096 tokens the outer-dimension ``cumsum`` of the position scan alone
took 373 µs and the gathers, ``cat`` copies and index writes about 1 ms more, against 453 µs for the two
all-to-alls themselves. Here:

1. ``_route_kernel``, one program per block of ``BLOCK_T`` tokens: one load of the block's ``[BLOCK_T, K]``
   slots, the ``[BLOCK_T, G]`` "goes to rank" matrix, an in-block ``tl.cumsum`` plus the counts of the
   earlier blocks for the positions; each sent pair writes its token into the row table. One block (and
   one launch) up to a few hundred tokens; above, ``_route_count_kernel`` first writes each block's counts
   (two launches, all blocks in parallel: a single program looping over 4096 tokens took 52 µs).
2. ``_pack_kernel``, one program per send-buffer row: finds its rank block, copies the token's hidden
   state (or zeros, for a padding row) and writes the metadata floats. One read of each sent row and one
   write of the buffer.
3. ``_unpack_kernel``: the received metadata into int64 slots, float32 weights and the decoded sender
   column (count and bad-slot flag), so the decode costs no launch of its own.
4. ``_combine_kernel``, grid ``(T, cdiv(D, BLOCK_D))``: each token's rows summed in float32, ranks in
   order (deterministic, no atomics). One read of the returned buffer and one write of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.dispatch.blocks import ExactBlocks, FixedBlocks, RowBlocks, block_rows


@triton.jit
def _goes(slots_ptr, b, T, K, S, G, BLOCK_T: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr):
    """Tokens of block ``b``, their ``[BLOCK_T, GP]`` int32 "has a slot on rank g" matrix, and how many of
    them have a slot id outside ``[-1, G * S)``."""
    tok = b * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, KP)
    sl = tl.load(slots_ptr + tok[:, None].to(tl.int64) * K + kk[None, :],
                 mask=(tok[:, None] < T) & (kk[None, :] < K), other=-1)
    inside = (sl >= 0) & (sl < G * S)
    dest = tl.where(inside, sl // S, -1).to(tl.int32)
    goes = tl.max((dest[:, :, None] == tl.arange(0, GP)[None, None, :]).to(tl.int32), axis=1)
    bad = tl.sum(tl.max((~inside & (sl != -1)).to(tl.int32), axis=1), 0)
    return tok, goes, bad


@triton.jit
def _route_count_kernel(slots_ptr, block_counts_ptr, T, K, S, G,
                        BLOCK_T: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr):
    b = tl.program_id(0)
    _, goes, bad = _goes(slots_ptr, b, T, K, S, G, BLOCK_T, KP, GP)
    ranks = tl.arange(0, GP)
    tl.store(block_counts_ptr + b * (G + 1) + ranks, tl.sum(goes, 0), mask=ranks < G)
    tl.store(block_counts_ptr + b * (G + 1) + G, bad)


@triton.jit
def _route_kernel(slots_ptr, block_counts_ptr, pos_ptr, row_token_ptr, counts_ptr, starts_ptr, T, K, S, G, C, NB,
                  BLOCK_T: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    ranks = tl.arange(0, GP)
    tok, goes, bad = _goes(slots_ptr, b, T, K, S, G, BLOCK_T, KP, GP)
    carry = tl.zeros([GP], dtype=tl.int32)  # tokens of earlier blocks per rank
    total = tl.sum(goes, 0)
    if NB > 1:
        total = tl.zeros([GP], dtype=tl.int32)
        bad = bad * 0
        for c0 in range(0, NB, CHUNK):
            blk = c0 + tl.arange(0, CHUNK)
            bc = tl.load(block_counts_ptr + blk[:, None] * (G + 1) + ranks[None, :],
                         mask=(blk[:, None] < NB) & (ranks[None, :] < G), other=0)
            carry += tl.sum(tl.where(blk[:, None] < b, bc, 0), 0)
            total += tl.sum(bc, 0)
            bad += tl.sum(tl.load(block_counts_ptr + blk * (G + 1) + G, mask=blk < NB, other=0), 0)
    pos = tl.cumsum(goes, 0) - 1 + carry[None, :]
    sent = goes > 0
    in_g = (tok[:, None] < T) & (ranks[None, :] < G)
    tl.store(pos_ptr + tok[:, None].to(tl.int64) * G + ranks[None, :], tl.where(sent, pos, -1), mask=in_g)
    tok_2d = tok[:, None] + tl.zeros([BLOCK_T, GP], dtype=tl.int32)
    tl.store(row_token_ptr + ranks[None, :].to(tl.int64) * C + pos, tok_2d, mask=in_g & sent & (pos < C))
    if b == 0:
        tl.store(counts_ptr + ranks, total, mask=ranks < G)
        tl.store(counts_ptr + G, bad)  # counts[G]: tokens with an id out of range
        tl.store(starts_ptr + ranks, tl.cumsum(total, 0) - total, mask=ranks < G)


@triton.jit
def _pack_kernel(x_ptr, slots_ptr, w_ptr, counts_ptr, invalid_ptr, row_token_ptr, row_starts_ptr, out_ptr, meta_ptr,
                 D, K, S, G, C, stride_x, stride_out, meta_off, stride_meta,
                 FIXED: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    ranks = tl.arange(0, GP)
    counts = tl.load(counts_ptr + ranks, mask=ranks < G, other=0)
    if FIXED:
        g = r // C
        start = g * C
    else:
        starts = tl.load(row_starts_ptr + ranks, mask=ranks < G, other=2147483647).to(tl.int32)
        g = tl.sum((starts <= r).to(tl.int32), 0) - 1
        start = tl.sum(tl.where(ranks == g, starts, 0), 0)
    p = r - start
    count = tl.sum(tl.where(ranks == g, counts, 0), 0)
    real = p < tl.minimum(count, C)
    tok = tl.load(row_token_ptr + g.to(tl.int64) * C + p, mask=real, other=0).to(tl.int64)
    row = out_ptr + r.to(tl.int64) * stride_out
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(x_ptr + tok * stride_x + offs, mask=(offs < D) & real, other=0.0)
        tl.store(row + offs, v, mask=offs < D)
    kk = tl.arange(0, KP)
    k_ok = (kk < K) & real
    sl = tl.load(slots_ptr + tok * K + kk, mask=k_ok, other=-1)
    here = (sl >= 0) & (sl // S == g)
    wt = tl.load(w_ptr + tok * K + kk, mask=k_ok, other=0.0)
    meta = meta_ptr + r.to(tl.int64) * stride_meta + meta_off
    tl.store(meta + kk, tl.where(here, sl - g * S, -1).to(tl.float32), mask=kk < K)
    tl.store(meta + K + kk, tl.where(here, wt, 0.0), mask=kk < K)
    own = tl.max(counts, 0).to(tl.float32)
    tl.store(meta + 2 * K, tl.where(tl.load(invalid_ptr) > 0, -1.0 - own, own))


@triton.jit
def _unpack_kernel(meta_ptr, slots_ptr, w_ptr, count_ptr, bad_ptr, R, K, stride_meta,
                   BLOCK_R: tl.constexpr, KP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kk = tl.arange(0, KP)
    ok = (rows[:, None] < R) & (kk[None, :] < K)
    src = meta_ptr + rows[:, None].to(tl.int64) * stride_meta + kk[None, :]
    dst = rows[:, None].to(tl.int64) * K + kk[None, :]
    tl.store(slots_ptr + dst, tl.load(src, mask=ok, other=-1.0).to(tl.int64), mask=ok)
    tl.store(w_ptr + dst, tl.load(src + K, mask=ok, other=0.0), mask=ok)
    row_ok = rows < R
    column = tl.load(meta_ptr + rows.to(tl.int64) * stride_meta + 2 * K, mask=row_ok, other=0.0)
    bad = column < 0  # m, or -1 - m when the sender had slot ids out of range (layout.pack_rows)
    tl.store(count_ptr + rows, tl.where(bad, -1.0 - column, column).to(tl.int32), mask=row_ok)
    tl.store(bad_ptr + rows, bad, mask=row_ok)


@triton.jit
def _combine_kernel(back_ptr, pos_ptr, row_starts_ptr, out_ptr, D, G, C, stride_back,
                    FIXED: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for g in range(G):
        p = tl.load(pos_ptr + t * G + g)
        if FIXED:
            start = g * C
        else:
            start = tl.load(row_starts_ptr + g).to(tl.int32)
        sent = (p >= 0) & (p < C)
        row = (start + p).to(tl.int64)
        acc += tl.load(back_ptr + row * stride_back + offs, mask=d_ok & sent, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def route_layout_triton(topk_slots: torch.Tensor, slots_per_rank: int, num_ranks: int,
                        capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layout.route_layout`` in one or two launches: ``(pos [T, G], counts [G], starts [G],
    row_token [G, C], invalid [])``, all int32."""
    t, k = topk_slots.shape
    dev = topk_slots.device
    topk_slots = topk_slots.contiguous()
    pos = torch.empty(t, num_ranks, dtype=torch.int32, device=dev)
    counts = torch.empty(num_ranks + 1, dtype=torch.int32, device=dev)  # [G]: tokens with an id out of range
    starts = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    row_token = torch.empty(num_ranks, capacity, dtype=torch.int32, device=dev)
    gp, kp = triton.next_power_of_2(num_ranks), triton.next_power_of_2(k)
    limit = max(16, 16384 // (gp * kp))  # the [BLOCK_T, KP, GP] compare stays in registers
    # one block (one launch) up to 256 tokens; above, blocks of at most 128 in parallel (on an H200 one
    # 1024-token block took 16.8 µs, while 16 blocks of 256 took 11.4 µs at 4096 tokens)
    block_t = max(16, triton.next_power_of_2(t)) if t <= min(limit, 256) else min(limit, 128)
    nb = max(1, triton.cdiv(t, block_t))
    block_counts = torch.empty(nb if nb > 1 else 0, num_ranks + 1, dtype=torch.int32, device=dev)
    if nb > 1:
        _route_count_kernel[(nb,)](topk_slots, block_counts, t, k, slots_per_rank, num_ranks,
                                   BLOCK_T=block_t, KP=kp, GP=gp, num_warps=4)
    _route_kernel[(nb,)](topk_slots, block_counts if nb > 1 else pos, pos, row_token, counts, starts, t, k,
                         slots_per_rank, num_ranks, capacity, nb, BLOCK_T=block_t, KP=kp, GP=gp,
                         CHUNK=max(16, 2048 // gp), num_warps=4)
    return pos, counts[:num_ranks], starts, row_token, counts[num_ranks]


def pack_rows_triton(x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, counts: torch.Tensor,
                     invalid: torch.Tensor, row_token: torch.Tensor, slots_per_rank: int, blocks: RowBlocks,
                     capacity: int, meta_cols: int) -> torch.Tensor:
    """``layout.pack_rows`` in one launch (``D`` times the element size a multiple of 4 bytes); ``blocks`` as
    checked there, ``capacity`` the layout's, ``meta_cols`` is ``layout.meta_columns(x.dtype, K)``."""
    t, k = topk_slots.shape
    d, esize = x.shape[1], x.element_size()
    g = counts.shape[0]
    num_rows = block_rows(blocks, g)
    width = d + meta_cols
    out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    meta = out.view(torch.float32) if esize != 4 else out
    fixed = isinstance(blocks, FixedBlocks)
    block_d = min(2048, triton.next_power_of_2(d))
    _pack_kernel[(num_rows,)](
        x, topk_slots.contiguous(), topk_weights.float().contiguous(), counts, invalid, row_token,
        _row_starts(blocks, counts), out, meta, d, k, slots_per_rank, g, capacity, x.stride(0), width,
        d * esize // 4, width * esize // 4,
        FIXED=fixed, GP=triton.next_power_of_2(g), KP=triton.next_power_of_2(k), BLOCK_D=block_d, num_warps=4,
    )
    return out


def unpack_meta_triton(
    meta: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots ``[R, K]`` int64, weights ``[R, K]`` float32, sender counts ``[R]`` int32 and sender bad-slot flags
    ``[R]`` bool from float32 metadata rows ``[R, >= 2K + 1]`` (unit stride), as ``layout.unpack_rows``."""
    r = meta.shape[0]
    slots = torch.empty(r, top_k, dtype=torch.int64, device=meta.device)
    weights = torch.empty(r, top_k, dtype=torch.float32, device=meta.device)
    count = torch.empty(r, dtype=torch.int32, device=meta.device)
    bad = torch.empty(r, dtype=torch.bool, device=meta.device)
    block_r = 64
    _unpack_kernel[(triton.cdiv(r, block_r),)](meta, slots, weights, count, bad, r, top_k, meta.stride(0),
                                                BLOCK_R=block_r, KP=triton.next_power_of_2(top_k), num_warps=4)
    return slots, weights, count, bad


def _row_starts(blocks: RowBlocks, dummy: torch.Tensor) -> torch.Tensor:
    """The kernels' row-starts pointer: ``ExactBlocks.row_starts``, or any tensor (not read) for fixed blocks."""
    return blocks.row_starts if isinstance(blocks, ExactBlocks) else dummy


def combine_rows_triton(back: torch.Tensor, pos: torch.Tensor, blocks: RowBlocks, capacity: int) -> torch.Tensor:
    """``layout.combine_rows`` in one launch (``back`` of unit column stride; ``blocks`` as checked there,
    ``capacity`` the positions sent per block: ``C`` for fixed blocks, ``T`` for exact ones)."""
    t, g = pos.shape
    d = back.shape[1]
    out = torch.empty(t, d, dtype=back.dtype, device=back.device)
    if t == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(d))
    fixed = isinstance(blocks, FixedBlocks)
    _combine_kernel[(t, triton.cdiv(d, block_d))](
        back, pos, _row_starts(blocks, pos), out, d, g, capacity, back.stride(0),
        FIXED=fixed, BLOCK_D=block_d, num_warps=4,
    )
    return out
