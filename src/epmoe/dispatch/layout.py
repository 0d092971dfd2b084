"""The send-buffer layout of dispatch and the per-token sum of combine, shared by the multi-rank dispatchers.

Dispatch sends each token once to every EP rank that holds one of its slots. The rows for rank ``g`` form
block ``g`` of the send buffer, in token order: token ``t`` is row ``row_starts[g] + pos[t, g]``, where
``pos[t, g]`` counts the earlier tokens that also go to ``g``. Behind its hidden state each row carries,
packed bit-exactly as ``2K + 1`` float32 values, the token's slots on ``g`` (local ids, ``-1`` = served
elsewhere), their routing weights, and the sender's largest per-rank count ``m`` (the fixed-capacity
dispatcher's overflow signal), written as ``-1 - m`` when the sender had slot ids out of range (one wire
column for two facts; ``unpack_rows`` alone decodes it, into ``sender_count`` and ``sender_bad_slots``). Combine
receives the results in the same buffer positions and sums each token's rows in float32.

Four steps, each one kernel on CUDA (``layout_triton``) and plain PyTorch elsewhere:
``route_layout`` (positions, counts and the row -> token table), ``pack_rows`` (the send buffer),
``unpack_rows`` (slots, weights and the decoded sender column of the received rows), ``combine_rows``
(the per-token sum). None of them reads a count on the host, so a fixed-capacity layer can be captured
in a CUDA graph. Two layouts (``blocks``), always passed explicitly: ``FixedBlocks(C)``, ``C`` rows per
rank (rows past a rank's count are padding with slots ``-1`` and zero hidden state), and
``ExactBlocks(row_starts, num_rows)``, ``row_starts`` the exclusive prefix sum of the counts (the
all-to-all dispatcher).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

import torch

from epmoe.checks import check_int
from epmoe.dispatch.blocks import ExactBlocks, FixedBlocks, RowBlocks, block_rows

Impl = Literal["auto", "torch", "triton"]


def meta_columns(dtype: torch.dtype, top_k: int) -> int:
    """Columns of ``dtype`` that the ``2K + 1`` float32 metadata values take behind each row.

    Raises:
        TypeError: ``dtype`` is not 2 or 4 bytes wide.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if size not in (2, 4):
        raise TypeError(f"dispatch packs rows of 2- or 4-byte dtypes, got {dtype}")
    return (2 * top_k + 1) * 4 // size


@dataclass(frozen=True)
class SendLayout:
    """Where each (token, destination rank) goes in the send buffer (all on the device).

    Attributes:
        pos: ``[T, G]`` int32 position of token ``t`` in block ``g``, ``-1`` = it does not go to ``g``;
            positions ``>= capacity`` overflowed and are not sent.
        counts: ``[G]`` int32 tokens routed to each rank (before the capacity cut).
        starts: ``[G]`` int32 exclusive prefix sum of ``counts``: the first row of each rank's block in the
            exact layout.
        row_token: ``[G, C]`` int32 token of position ``p`` of block ``g``; valid for
            ``p < min(counts[g], C)``, unspecified elsewhere.
        capacity: ``C``, positions per block.
        invalid: ``[]`` int32 tokens with a slot id outside ``[-1, G * S)`` (such a choice goes nowhere;
            ``pack_rows`` flags it in every row it writes, so every receiving rank learns it).
    """

    pos: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor
    row_token: torch.Tensor
    capacity: int
    invalid: torch.Tensor


def _use_triton(t: torch.Tensor, impl: Impl) -> bool:
    if impl == "torch" or (impl == "auto" and not t.is_cuda):
        return False
    if impl not in ("auto", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    try:
        importlib.import_module("epmoe.dispatch.layout_triton")
    except ImportError as err:
        if impl == "triton":
            raise RuntimeError(f"dispatch layout impl 'triton' needs the triton package: {err}") from err
        return False
    return True


def route_layout(
    topk_slots: torch.Tensor, slots_per_rank: int, num_ranks: int, capacity: int, impl: Impl = "auto"
) -> SendLayout:
    """Positions of every (token, destination rank) pair in the send buffer.

    Args:
        topk_slots: ``[T, K]`` int64 global physical slot ids, ``-1`` = none; rank ``g`` holds slots
            ``[g * slots_per_rank, (g + 1) * slots_per_rank)``. Ids outside ``[0, G * S)`` go nowhere
            (the dispatchers check the range and report it).
        slots_per_rank: ``S``, positive.
        num_ranks: ``G``, positive.
        capacity: ``C`` positions per block (``T`` for the exact layout: nothing can overflow).
        impl: ``auto`` (Triton on CUDA, PyTorch elsewhere), ``torch`` or ``triton``.

    Returns:
        The ``SendLayout``.

    Raises:
        ValueError: ``topk_slots`` not ``[T, K]``, or a size argument not a positive integer (``capacity``
            may be 0 when there are no tokens).
        TypeError: ``topk_slots`` not int32/int64.
    """
    if topk_slots.dim() != 2:
        raise ValueError(f"topk_slots must be [T, K], got shape {tuple(topk_slots.shape)}")
    if topk_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_slots must be int32 or int64 slot ids, got {topk_slots.dtype}")
    slots_per_rank = check_int("slots_per_rank", slots_per_rank, 1)
    num_ranks = check_int("num_ranks", num_ranks, 1)
    capacity = check_int("capacity", capacity, 0)
    if _use_triton(topk_slots, impl):
        from epmoe.dispatch.layout_triton import route_layout_triton

        pos, counts, starts, row_token, invalid = route_layout_triton(topk_slots, slots_per_rank, num_ranks, capacity)
        return SendLayout(pos, counts, starts, row_token, capacity, invalid)
    t, dev = topk_slots.shape[0], topk_slots.device
    inside = (topk_slots >= 0) & (topk_slots < num_ranks * slots_per_rank)
    dest = torch.where(inside, topk_slots // slots_per_rank, num_ranks)
    goes = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :num_ranks]
    pos = torch.where(goes, torch.cumsum(goes.t().to(torch.int32), dim=1).t() - 1, -1).to(torch.int32)
    counts = goes.sum(dim=0).to(torch.int32)
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    block_first = torch.arange(num_ranks, device=dev) * capacity
    flat = torch.where(goes & (pos < capacity), block_first + pos, num_ranks * capacity)
    row_token = torch.zeros(num_ranks * capacity + 1, dtype=torch.int32, device=dev)
    tokens = torch.arange(t, dtype=torch.int32, device=dev).unsqueeze(1).expand(t, num_ranks)
    row_token.scatter_(0, flat.reshape(-1), tokens.reshape(-1))
    invalid = ((topk_slots < -1) | (topk_slots >= num_ranks * slots_per_rank)).any(dim=1).sum().to(torch.int32)
    return SendLayout(pos, counts, starts, row_token[:-1].view(num_ranks, capacity), capacity, invalid)


def _check_blocks(blocks: RowBlocks, g: int, num_rows: int, who: str) -> None:
    """``blocks`` is a layout of ``g`` ranks over ``num_rows`` rows (the exact layout's row count is the sum
    of the counts, which only the caller's host copy of them can confirm)."""
    want = block_rows(blocks, g)  # raises TypeError for anything but the two layouts
    if isinstance(blocks, ExactBlocks) and tuple(blocks.row_starts.shape) != (g,):
        raise ValueError(f"{who}: row_starts must be [G={g}], got shape {tuple(blocks.row_starts.shape)}")
    if num_rows != want:
        what = (f"fixed blocks of {blocks.capacity} rows for {g} ranks are" if isinstance(blocks, FixedBlocks)
                else "exact blocks of")
        raise ValueError(f"{who}: {what} {want} rows, got {num_rows}")


def pack_rows(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: SendLayout,
    slots_per_rank: int,
    blocks: RowBlocks,
    impl: Impl = "auto",
) -> torch.Tensor:
    """The send buffer: each sent token's hidden state with its metadata packed behind it.

    Args:
        x: ``[T, D]`` hidden states (2- or 4-byte dtype).
        topk_slots: ``[T, K]`` int64 global slot ids, ``-1`` = none.
        topk_weights: ``[T, K]`` routing weights (any float dtype; sent as float32).
        layout: ``route_layout`` of ``topk_slots``.
        slots_per_rank: ``S``.
        blocks: ``FixedBlocks(layout.capacity)``, blocks of ``C`` rows starting at ``g * C`` (padding rows:
            slots ``-1``, weights 0, zero hidden state), or ``ExactBlocks(layout.starts, N)`` with ``N`` the sum
            of the counts (the layout routed with ``capacity >= T``, so nothing overflows).
        impl: see ``route_layout``.

    Returns:
        ``[N, D + meta_columns(x.dtype, K)]`` in ``x.dtype``; ``N = G * C`` for fixed blocks.

    Raises:
        ValueError: ``x``, ``topk_slots``, ``topk_weights`` and ``layout`` disagree on ``T`` or ``K``; fixed
            blocks of another capacity than the layout's; exact blocks of a layout that can overflow
            (``capacity < T``) or with ``row_starts`` not ``[G]``; ``slots_per_rank`` not positive. (In the exact
            layout ``num_rows`` must be the sum of the counts: not checked, it would read them.)
        TypeError: ``blocks`` neither ``FixedBlocks`` nor ``ExactBlocks``; ``x`` not a 2- or 4-byte float dtype.
    """
    g, c = layout.pos.shape[1], layout.capacity
    t, k = topk_slots.shape
    if x.dim() != 2 or x.shape[0] != t or topk_weights.shape != (t, k) or layout.pos.shape[0] != t:
        raise ValueError(f"x {tuple(x.shape)}, topk_slots {(t, k)}, topk_weights {tuple(topk_weights.shape)} and "
                         f"layout.pos {tuple(layout.pos.shape)} must agree on T (and K)")
    num_rows = block_rows(blocks, g)
    if isinstance(blocks, FixedBlocks) and blocks.capacity != c:
        raise ValueError(f"pack_rows: fixed blocks of {blocks.capacity} rows, but the layout was routed with "
                         f"capacity {c}")
    if isinstance(blocks, ExactBlocks) and c < t:
        raise ValueError(f"pack_rows: exact blocks need a layout that cannot overflow (capacity >= T = {t}), "
                         f"got capacity {c}")
    _check_blocks(blocks, g, num_rows, "pack_rows")
    check_int("slots_per_rank", slots_per_rank, 1)
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
    meta_cols = meta_columns(x.dtype, k)
    d = x.shape[1]
    if _use_triton(x, impl) and (d * x.element_size()) % 4 == 0:
        from epmoe.dispatch.layout_triton import pack_rows_triton

        return pack_rows_triton(x, topk_slots, topk_weights, layout.counts, layout.invalid, layout.row_token,
                                slots_per_rank, blocks, c, meta_cols)
    dev = x.device
    r = torch.arange(num_rows, device=dev)
    starts = torch.arange(g, device=dev) * c if isinstance(blocks, FixedBlocks) else blocks.row_starts.to(torch.int64)
    rank = torch.searchsorted(starts, r, right=True) - 1
    p = r - starts[rank]
    real = p < torch.clamp(layout.counts.to(torch.int64), max=c)[rank]
    tok = torch.where(real, layout.row_token.reshape(-1)[(rank * c + p.clamp(max=c - 1))].to(torch.int64), t)
    rows = torch.cat([x, x.new_zeros(1, d)])[tok]  # row T: zeros for padding rows
    sl = torch.cat([topk_slots, topk_slots.new_full((1, k), -1)])[tok]
    wt = torch.cat([topk_weights.float(), topk_weights.new_zeros(1, k, dtype=torch.float32)])[tok]
    here = (sl >= 0) & (sl // slots_per_rank == rank.unsqueeze(1))
    local = torch.where(here, sl - rank.unsqueeze(1) * slots_per_rank, -1).float()
    own = layout.counts.max().float()
    own_max = torch.where(layout.invalid > 0, -1.0 - own, own).expand(num_rows, 1)
    meta = torch.cat([local, torch.where(here, wt, 0.0), own_max], dim=1)
    if x.dtype == torch.float32:
        return torch.cat([rows, meta], dim=1)
    return torch.cat([rows, meta.contiguous().view(x.dtype)], dim=1)


def unpack_rows(
    recv: torch.Tensor, d: int, top_k: int, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split received rows into hidden states and metadata, decoding the sender column (the one place that does).

    Args:
        recv: ``[R, D + meta_columns(dtype, K)]`` rows as ``pack_rows`` wrote them.
        d: ``D``.
        top_k: ``K``.
        impl: see ``route_layout``.

    Returns:
        ``recv_x`` ``[R, D]`` (a view of ``recv``, row stride ``recv.shape[1]``), ``recv_slots`` ``[R, K]``
        int64 local slot ids (``-1`` = none), ``recv_weights`` ``[R, K]`` float32, ``sender_count`` ``[R]``
        int32 the sending rank's largest per-rank count ``m`` (before any capacity cut), and
        ``sender_bad_slots`` ``[R]`` bool whether the sending rank had slot ids outside ``[-1, G * S)``.

    Raises:
        ValueError: ``recv`` is not ``[R, D + meta_columns(dtype, K)]`` of a float dtype.
    """
    k = top_k
    if recv.dim() != 2 or not recv.is_floating_point() or recv.shape[1] != d + meta_columns(recv.dtype, k):
        raise ValueError(f"recv must be float rows [R, D + meta columns] = [R, {d} + "
                         f"{meta_columns(recv.dtype, k) if recv.is_floating_point() else '?'}] for K={k}, "
                         f"got {tuple(recv.shape)} {recv.dtype}")
    if recv.dtype == torch.float32:
        meta = recv[:, d:]
    elif (d * recv.element_size()) % 4 == 0:
        meta = recv[:, d:].view(torch.float32)
    else:  # the metadata starts off a 4-byte boundary: a fresh copy (even of one row) starts on one
        meta = recv[:, d:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    if _use_triton(recv, impl) and recv.shape[0] and meta.stride(1) == 1:
        from epmoe.dispatch.layout_triton import unpack_meta_triton

        slots, weights, count, bad = unpack_meta_triton(meta, k)
    else:
        slots, weights = meta[:, :k].to(torch.int64), meta[:, k : 2 * k].contiguous()
        column = meta[:, 2 * k]  # m, or -1 - m when the sender had slot ids out of range (see pack_rows)
        bad = column < 0
        count = torch.where(bad, -1.0 - column, column).to(torch.int32)
    return recv[:, :d], slots, weights, count, bad


def combine_rows(back: torch.Tensor, pos: torch.Tensor, blocks: RowBlocks, impl: Impl = "auto") -> torch.Tensor:
    """Each token's sum of the rows it got back, accumulated in float32 (ranks in order).

    Args:
        back: ``[N, D]`` the results, in the send buffer's row order (row stride may exceed ``D``).
        pos: ``[T, G]`` int32 ``SendLayout.pos``.
        blocks: as for ``pack_rows``: ``FixedBlocks(C)`` (positions ``>= C`` were not sent and count as
            zero) or ``ExactBlocks(row_starts, N)`` (every position was sent).
        impl: see ``route_layout``.

    Returns:
        ``[T, D]`` in ``back.dtype``.

    Raises:
        ValueError: ``back`` or ``pos`` not 2-D, ``back`` not of the blocks' row count (``G * C`` for fixed
            blocks, ``N`` for exact ones), or ``row_starts`` not ``[G]``.
        TypeError: ``blocks`` neither ``FixedBlocks`` nor ``ExactBlocks``.
    """
    if back.dim() != 2 or pos.dim() != 2:
        raise ValueError(f"back must be [N, D] and pos [T, G], got {tuple(back.shape)} and {tuple(pos.shape)}")
    t, g = pos.shape
    _check_blocks(blocks, g, back.shape[0], "combine_rows")
    fixed = isinstance(blocks, FixedBlocks)
    capacity = blocks.capacity if fixed else t  # exact blocks: every position (< T) was sent
    if _use_triton(back, impl) and back.stride(1) == 1:
        from epmoe.dispatch.layout_triton import combine_rows_triton

        return combine_rows_triton(back, pos, blocks, capacity)
    n, dev = back.shape[0], back.device
    starts = torch.arange(g, device=dev) * capacity if fixed else blocks.row_starts.to(torch.int64)
    sent = (pos >= 0) & (pos < capacity)
    rows = torch.where(sent, starts.unsqueeze(0) + pos, n)
    padded = torch.cat([back, back.new_zeros(1, back.shape[1])])
    out = torch.zeros(t, back.shape[1], dtype=torch.float32, device=dev)
    for rank in range(g):  # in rank order, as the kernel sums: both give the same bits
        out += padded[rows[:, rank]].float()
    return out.to(back.dtype)
