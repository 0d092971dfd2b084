"""Fixed-capacity dispatch: static buffer shapes and device-side counts, so decode can be graph captured.

Every rank sends every rank exactly ``capacity`` rows (one ``all_to_all_single`` of ``G * capacity``
rows with equal splits, then one back): the rows of the tokens that have a slot on that rank, then
padding rows whose slots are all ``-1`` (the expert backends skip them). No count ever goes to the host,
so route + dispatch + experts + combine can be captured in one CUDA graph and replayed.

On a one-rank group with ``T <= capacity`` nothing moves: ``dispatch`` pads the inputs to ``capacity``
rows and ``combine`` returns the first ``T`` rows (a handful of device ops, for graph-replayed decode).

Overflow: a rank that routes more than ``capacity`` tokens to one rank sends only the first
``capacity`` of them. The dispatcher never hides this: each row carries its sender's largest count (and
whether the sender had slot ids out of range, in the same wire column, decoded by ``layout.unpack_rows``),
so every rank learns the group-wide largest count from the rows it receives (no extra collective), and
``FixedCapacityHandle.check_capacity()`` raises ``CapacityExceededError`` naming the capacity and the
count. ``combine`` calls it itself unless a CUDA graph is being captured; after a graph replay the
caller calls it on the handle returned at capture (its tensors are the graph's static buffers), at a
point where a host sync is acceptable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.checks import check_positive_int
from epmoe.comm import Comm
from epmoe.dispatch.base import (
    DispatchHandle,
    check_expert_output,
    check_inputs,
    check_row_dtype,
    check_slot_range,
    slot_range,
)
from epmoe.dispatch.blocks import FixedBlocks
from epmoe.dispatch.layout import combine_rows, pack_rows, route_layout, unpack_rows


class CapacityExceededError(RuntimeError):
    """More tokens were routed from one rank to one rank than the fixed capacity holds."""


@dataclass(frozen=True, kw_only=True)
class FixedCapacityHandle(DispatchHandle):
    """A fixed-capacity dispatch's handle: the received rows and the bookkeeping (all on the device).

    Attributes:
        send_pos: ``[T, G]`` int32 row of token ``t`` within the block of ``C`` rows sent to rank ``g``, ``-1``
            = not sent; ``None`` on the one-rank path, where token ``t`` is row ``t`` and nothing moves.
        sender_count: ``[G * C]`` int32, for each received row its sender's largest per-rank count (before
            the capacity cut); ``None`` on the one-rank path, where ``recv_slots`` tells.
        sender_bad_slots: ``[G * C]`` bool, for each received row whether its sender had slot ids outside
            ``[-1, P)``; ``None`` on the one-rank path, where this rank's ``slot_range`` tells.
        capacity: ``C`` rows per (source, destination) pair.
        slot_range: ``[2]`` int64 smallest and largest slot id of the caller's ``topk_slots``, checked with
            the capacity; ``None`` when dispatched inside a CUDA graph capture (not checked there) or empty.
        num_slots: ``P``, the group's slots (the valid ids are ``[-1, P)``).
    """

    send_pos: torch.Tensor | None
    sender_count: torch.Tensor | None
    sender_bad_slots: torch.Tensor | None
    capacity: int
    slot_range: torch.Tensor | None
    num_slots: int

    @property
    def max_count(self) -> torch.Tensor:
        """``[]`` int64: the largest number of tokens any rank of the group routed to one rank.

        Reduced from the received rows' ``sender_count`` when asked (one small reduction), so a graph-captured
        layer pays nothing for it; after a replay it reads the graph's static buffers.
        """
        if self.sender_count is None:
            return (self.recv_slots >= 0).any(dim=1).sum()
        return self.sender_count.max().to(torch.int64)

    @property
    def bad_senders(self) -> torch.Tensor:
        """``[]`` bool: some rank of the group sent with slot ids out of range (always False on one rank)."""
        if self.sender_bad_slots is None:
            return torch.zeros((), dtype=torch.bool, device=self.recv_slots.device)
        return self.sender_bad_slots.any()

    def check_capacity(self) -> None:
        """Raise if any rank routed more tokens to one rank than the capacity, or a slot id was out of range.

        One host read of a few device scalars: the count and the flag of the rows received (both also
        valid after a CUDA-graph replay) and, unless dispatched in a graph capture, this rank's slot range.

        Raises:
            ValueError: a slot id outside ``[-1, P)`` on this rank (named) or on another rank of the group
                (flagged in its rows); such a choice was computed nowhere.
            CapacityExceededError: the count exceeded the capacity; rows past it were not computed.
        """
        parts = [self.max_count.reshape(1), self.bad_senders.reshape(1).to(torch.int64)]
        host = torch.cat(parts + ([self.slot_range] if self.slot_range is not None else [])).tolist()
        if self.slot_range is not None:
            check_slot_range(host[2], host[3], self.num_slots, "fixed_capacity dispatcher")
        if host[1]:  # flagged in the rows received from another rank
            raise ValueError(f"fixed_capacity dispatcher: topk_slots must be global slot ids in [-1, {self.num_slots}) "
                             f"(-1 = none); another EP rank sent ids outside it")
        count = host[0]
        if count > self.capacity:
            raise CapacityExceededError(
                f"fixed_capacity dispatcher: a rank routed {count} tokens to one EP rank but the capacity is "
                f"{self.capacity}; rows past the capacity were dropped. Build the dispatcher with capacity >= {count}."
            )


class FixedCapacityDispatcher:
    """Dispatch/combine through two equal-split all-to-alls of ``G * capacity`` rows each.

    Args:
        comm: the EP group (gloo on CPU, NCCL on CUDA; size 1 runs without communication).
        slots_per_rank: ``P / G``; rank ``g`` holds global slots ``[g*P/G, (g+1)*P/G)``.
        capacity: ``C``, the most tokens one rank may send to one rank per call. ``C >= T`` (tokens per
            rank) can never overflow.

    ``combine`` checks the capacity and the slot-id range (one host read) whenever no CUDA graph is being captured;
    there is no opt-out, since an unchecked overflow gives a token zeros from the ranks it overflowed. Inside a
    captured graph nothing can be read back: the engine sizes the capacity to the batch bucket, so no graph step
    can overflow.

    Raises:
        ValueError: ``slots_per_rank`` or ``capacity`` not a positive integer.
    """

    def __init__(self, comm: Comm, slots_per_rank: int, capacity: int) -> None:
        self.comm = comm
        self.slots_per_rank = check_positive_int("slots_per_rank", slots_per_rank)
        self.capacity = check_positive_int("capacity", capacity)
        self.num_slots = self.slots_per_rank * comm.size

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> FixedCapacityHandle:
        """See ``Dispatcher.dispatch``; ``recv_x`` is ``[G * C, D]`` (a view of the receive buffer), padding rows
        zero with slots ``-1``."""
        check_inputs(x, topk_slots, topk_weights)
        g, s, c = self.comm.size, self.slots_per_rank, self.capacity
        t, k = topk_slots.shape
        capturing = topk_slots.is_cuda and torch.cuda.is_current_stream_capturing()
        rng = None if capturing else slot_range(topk_slots)
        check_row_dtype(x)  # also on one rank, where nothing is packed: the same rows work on any group size
        if g == 1 and t <= c:
            return self._dispatch_one_rank(x, topk_slots, topk_weights, rng)
        layout = route_layout(topk_slots, s, g, c)
        payload = pack_rows(x, topk_slots, topk_weights, layout, s, FixedBlocks(c))
        recv = torch.empty_like(payload)
        self.comm.all_to_all_single(recv, payload)
        recv_x, recv_slots, recv_weights, sender_count, sender_bad_slots = unpack_rows(recv, x.shape[1], k)
        return FixedCapacityHandle(
            recv_x=recv_x,
            recv_slots=recv_slots,
            recv_weights=recv_weights,
            num_tokens=t,
            send_pos=layout.pos,
            sender_count=sender_count,
            sender_bad_slots=sender_bad_slots,
            capacity=c,
            slot_range=rng,
            num_slots=g * s,
        )

    def _dispatch_one_rank(
        self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, rng: torch.Tensor | None
    ) -> FixedCapacityHandle:
        """One rank and ``T <= C``: token ``t`` is row ``t``, rows ``[T, C)`` are padding; nothing moves.

        The same handle contents as the general path up to the order of rows (a token with no slot
        takes its row with slots ``-1`` instead of no row), in four device ops or fewer: decode layers
        replayed from a CUDA graph pay per op. Overflow is impossible (``T <= C``); ``max_count`` is still
        the exact count of tokens with a slot on this rank.
        """
        t, pad = x.shape[0], self.capacity - x.shape[0]
        # ids outside [-1, S) pass as they are: every expert backend skips them, as ranks do (combine reports them)
        recv_x, recv_slots, recv_weights = x, topk_slots.to(torch.int64), topk_weights.float()
        if pad:
            recv_x = torch.nn.functional.pad(recv_x, (0, 0, 0, pad))
            recv_slots = torch.nn.functional.pad(recv_slots, (0, 0, 0, pad), value=-1)
            recv_weights = torch.nn.functional.pad(recv_weights, (0, 0, 0, pad))
        return FixedCapacityHandle(
            recv_x=recv_x,
            recv_slots=recv_slots,
            recv_weights=recv_weights,
            num_tokens=t,
            send_pos=None,
            sender_count=None,
            sender_bad_slots=None,
            capacity=self.capacity,
            slot_range=rng,
            num_slots=self.slots_per_rank,
        )

    def combine(self, y: torch.Tensor, handle: FixedCapacityHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``: one equal-split all-to-all back, then a sum over ranks per token.

        Raises:
            TypeError: ``handle`` is not this dispatcher's.
            ValueError: ``y`` is not ``[G * C, D]``; or, no CUDA graph being captured, a slot id was out of range.
            CapacityExceededError: no CUDA graph being captured, the capacity was exceeded.
        """
        if type(handle) is not FixedCapacityHandle or handle.capacity != self.capacity:
            raise TypeError("FixedCapacityDispatcher.combine needs the handle its dispatch returned")
        g, c = self.comm.size, self.capacity
        check_expert_output(y, (g * c, handle.recv_x.shape[1]), "[received rows, D]")
        if g == 1 and handle.num_tokens <= c:
            out = y[: handle.num_tokens]  # one rank, no overflow possible: row t is token t's sum
        elif handle.send_pos is None:
            raise TypeError("FixedCapacityDispatcher.combine needs the handle its dispatch returned")
        else:
            back = torch.empty(y.shape, dtype=y.dtype, device=y.device)
            self.comm.all_to_all_single(back, y.contiguous())
            out = combine_rows(back, handle.send_pos, FixedBlocks(c))
        capturing = y.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            handle.check_capacity()
        return out
