"""Dispatch and combine: move each token to the EP ranks holding its chosen slots and back.

Contract (DESIGN.md rule 4): ``dispatch`` returns a ``DispatchHandle``; ``combine`` consumes it. A
dispatcher keeps no state between the two, so several micro-batches may be in flight at once.

A token's hidden state travels to a given rank once, even when several of its top-k slots live there;
that rank computes all of them, sums the weighted results and sends one row back.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .comm import Comm
from .dispatch_layout import combine_rows, pack_rows, route_layout, unpack_rows


@dataclass(frozen=True)
class DispatchHandle:
    """What a rank received, and how to send the results back.

    Attributes:
        recv_x: ``[R, D]`` rows this rank computes (may be a view with row stride above ``D``).
        recv_slots: ``[R, K]`` int64 local slot ids on this rank, ``-1`` = not computed here.
        recv_weights: ``[R, K]`` float32 routing weights matching ``recv_slots``.
        send_pos: ``[T, G]`` int32 row of token ``t`` within the block sent to rank ``g``, ``-1`` = not
            sent (``dispatch_layout.SendLayout.pos``); ``None`` for the local path.
        send_row_starts: ``[G]`` int32 first row of each rank's block in the send buffer; ``None`` when
            the blocks have a fixed size (fixed capacity) or nothing was sent (local path).
        send_splits: rows sent to each rank (host list of ``G`` ints); ``None`` where no count reaches
            the host (local and fixed-capacity paths).
        recv_splits: rows received from each rank (host list of ``G`` ints); ``None`` likewise.
        num_tokens: ``T`` tokens of the caller.
    """

    recv_x: torch.Tensor
    recv_slots: torch.Tensor
    recv_weights: torch.Tensor
    send_pos: torch.Tensor | None
    send_row_starts: torch.Tensor | None
    send_splits: list[int] | None
    recv_splits: list[int] | None
    num_tokens: int


class Dispatcher(Protocol):
    """Moves tokens to experts and results back."""

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> DispatchHandle:
        """Send tokens to the ranks holding their slots.

        Args:
            x: ``[T, D]`` hidden states.
            topk_slots: ``[T, K]`` int64 global physical slot ids, ``-1`` = none.
            topk_weights: ``[T, K]`` float32 routing weights.
        """
        ...

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return ``[T, D]``: each token's summed expert outputs ``y`` (``[R, D]``) brought home."""
        ...


def _check_inputs(x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x.shape)}")
    if topk_slots.shape != topk_weights.shape or topk_slots.dim() != 2 or topk_slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_slots {tuple(topk_slots.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, K]"
        )
    if topk_slots.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_slots must be int64 (or int32) slot ids, got dtype {topk_slots.dtype}")


def _check_row_dtype(x: torch.Tensor) -> None:
    """The multi-rank dispatchers pack float32 metadata behind each row: rows must be 2- or 4-byte floats
    (checked on any group size, so that rows accepted on one rank work on several)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16 (the dtypes the multi-rank dispatchers pack), "
                        f"got {x.dtype}")


def check_expert_output(y: torch.Tensor, shape: tuple[int, int], what: str) -> None:
    """A combine's ``y``: the expert outputs of the received rows, ``shape`` (named ``what``), float.

    Raises:
        ValueError: another shape.
        TypeError: not a float dtype.
    """
    if tuple(y.shape) != tuple(shape):
        raise ValueError(f"y must be {what} = {tuple(shape)}, got {tuple(y.shape)}")
    if not y.is_floating_point():
        raise TypeError(f"y must be a float tensor (the expert outputs), got {y.dtype}")


def slot_range(topk_slots: torch.Tensor) -> torch.Tensor | None:
    """``[2]`` int64 (smallest, largest) slot id on the device, for one host read later; ``None`` when empty."""
    if topk_slots.numel() == 0:
        return None
    lo, hi = torch.aminmax(topk_slots)
    return torch.stack([lo, hi]).to(torch.int64)


def check_slot_range(lo: int, hi: int, num_slots: int, who: str) -> None:
    """Raise unless every slot id is in ``[-1, num_slots)``.

    Raises:
        ValueError: naming the dispatcher, the valid range and the ids seen.
    """
    if lo < -1 or hi >= num_slots:
        raise ValueError(f"{who}: topk_slots must be global slot ids in [-1, {num_slots}) (-1 = none), "
                         f"got ids from {lo} to {hi}")


class LocalDispatcher:
    """EP = 1, the reference: every slot is local, nothing moves.

    Args:
        num_slots: ``P`` slots, all on this rank.
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, numbers.Integral) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.num_slots = int(num_slots)

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> DispatchHandle:
        """See ``Dispatcher.dispatch``; the handle's ``recv_*`` are the inputs themselves.

        Raises:
            ValueError: on CPU, a slot id outside ``[-1, P)`` (on CUDA the check would stall the stream:
                the layers' slots come from a validated placement).
        """
        _check_inputs(x, topk_slots, topk_weights)
        rng = slot_range(topk_slots) if not topk_slots.is_cuda else None
        if rng is not None:
            check_slot_range(*rng.tolist(), self.num_slots, "local dispatcher")
        return DispatchHandle(x, topk_slots.to(torch.int64), topk_weights.float(), None, None, None, None, x.shape[0])

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``: returns ``y``.

        Raises:
            TypeError: ``handle`` is not a local dispatch's.
            ValueError: ``y`` is not ``[T, D]`` like the dispatched rows.
        """
        if type(handle) is not DispatchHandle or handle.send_pos is not None:
            raise TypeError("LocalDispatcher.combine needs the handle its dispatch returned")
        check_expert_output(y, handle.recv_x.shape, "[T, D]")
        return y


class AllToAllDispatcher:
    """Dispatch/combine with ``all_to_all_single`` over the EP group, after exchanging counts.

    Per call: one all-to-all of the ``G`` row counts (host sync: the split sizes must be known), one
    all-to-all of the rows (hidden state with the slot ids and weights packed bit-exactly beside it, the
    exact layout of ``dispatch_layout``), and one all-to-all back in ``combine``. Works with gloo on CPU
    and NCCL on CUDA (the layout steps are Triton kernels there).

    Args:
        comm: the EP group.
        slots_per_rank: ``P / G``; rank ``g`` holds global slots ``[g*P/G, (g+1)*P/G)``.
    """

    def __init__(self, comm: Comm, slots_per_rank: int) -> None:
        if slots_per_rank <= 0:
            raise ValueError(f"slots_per_rank must be positive, got {slots_per_rank}")
        self.comm = comm
        self.slots_per_rank = slots_per_rank

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> DispatchHandle:
        """See ``Dispatcher.dispatch``.

        Raises:
            ValueError: bad shapes, or a slot id outside ``[-1, G * S)`` on any rank of the group (each
                rank's flag travels with its counts, so every rank raises, before the rows move).
            TypeError: ``x`` not float32/bf16/fp16, or slots not integer.
        """
        _check_inputs(x, topk_slots, topk_weights)
        _check_row_dtype(x)
        g, s = self.comm.size, self.slots_per_rank
        t, k = topk_slots.shape
        layout = route_layout(topk_slots, s, g, t)  # capacity T: the exact layout never overflows
        # the counts travel with this rank's "has a slot id outside [-1, P)" flag, so every rank learns it
        send_info = torch.stack([layout.counts, (layout.invalid > 0).to(torch.int32).expand(g)], dim=1)  # [G, 2]
        recv_info = torch.empty_like(send_info)
        self.comm.all_to_all_single(recv_info, send_info)
        host = torch.cat([layout.counts, recv_info.reshape(-1)]).tolist()  # the one host read
        send_splits, recv_splits, flags = host[:g], host[g : 3 * g : 2], host[g + 1 : 3 * g : 2]
        if any(flags):  # the error path alone reads this rank's range, to name its ids
            rng = slot_range(topk_slots) if flags[self.comm.rank] else None
            mine = f"; here ids from {int(rng[0])} to {int(rng[1])}" if rng is not None else ""
            raise ValueError(f"all_to_all dispatcher: topk_slots must be global slot ids in [-1, {g * s}) (-1 = none); "
                             f"EP rank(s) {[r for r, f in enumerate(flags) if f]} sent ids outside it{mine}")
        payload = pack_rows(x, topk_slots, topk_weights, layout, s, layout.starts, sum(send_splits))
        recv = payload.new_empty((sum(recv_splits), payload.shape[1]))
        self.comm.all_to_all_single(recv, payload, recv_splits, send_splits)
        recv_x, recv_slots, recv_weights, _ = unpack_rows(recv, x.shape[1], k)
        return DispatchHandle(
            recv_x=recv_x,
            recv_slots=recv_slots,
            recv_weights=recv_weights,
            send_pos=layout.pos,
            send_row_starts=layout.starts,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_tokens=t,
        )

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``: one all-to-all back, then each token's rows summed in float32.

        Raises:
            TypeError: ``handle`` did not come from an all-to-all dispatch.
        """
        if handle.send_splits is None or handle.recv_splits is None or handle.send_pos is None:
            raise TypeError("AllToAllDispatcher.combine needs the handle its dispatch returned")
        check_expert_output(y, (sum(handle.recv_splits), handle.recv_x.shape[1]), "[received rows, D]")
        back = y.new_empty((sum(handle.send_splits), y.shape[1]))
        self.comm.all_to_all_single(back, y.contiguous(), handle.send_splits, handle.recv_splits)
        return combine_rows(back, handle.send_pos, handle.send_row_starts, handle.num_tokens)


def _fixed_capacity(comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    from .dispatch_fixed import FixedCapacityDispatcher  # its module imports this one

    return FixedCapacityDispatcher(comm, slots_per_rank, **options)


def _no_options(name: str, options: dict) -> None:
    if options:
        raise TypeError(f"dispatcher {name!r} takes no options, got {', '.join(sorted(options))}")


def _local(comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    _no_options("local", options)
    return LocalDispatcher(slots_per_rank * comm.size)


def _all_to_all(comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    _no_options("all_to_all", options)
    return AllToAllDispatcher(comm, slots_per_rank)


DISPATCHERS: dict[str, Callable[..., Dispatcher]] = {
    "local": _local,
    "all_to_all": _all_to_all,
    "fixed_capacity": _fixed_capacity,
}


def make_dispatcher(name: str, comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    """Build the dispatcher registered as ``name`` for the EP group ``comm``.

    Args:
        name: ``local`` (EP = 1 only) or ``all_to_all`` (plus any registered fast path).
        comm: the EP group.
        slots_per_rank: ``P / G``.
        options: backend-specific options (for example a capacity).

    Raises:
        KeyError: unknown name (the message lists the registered ones).
        ValueError: ``local`` asked for with more than one EP rank.
    """
    if name not in DISPATCHERS:
        raise KeyError(f"unknown dispatcher {name!r}; supported: {sorted(DISPATCHERS)}")
    if name == "local" and comm.size != 1:
        raise ValueError(f"the local dispatcher serves EP size 1 only, the EP group has {comm.size} ranks")
    return DISPATCHERS[name](comm, slots_per_rank, **options)
