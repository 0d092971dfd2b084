"""Fixed-capacity dispatch: static buffer shapes and device-side counts, so decode can be graph captured.

Every rank sends every rank exactly ``capacity`` rows (one ``all_to_all_single`` of ``G * capacity``
rows with equal splits, then one back): the rows of the tokens that have a slot on that rank, then
padding rows whose slots are all ``-1`` (the expert backends skip them). No count ever goes to the host,
so route + dispatch + experts + combine can be captured in one CUDA graph and replayed.

On a one-rank group with ``T <= capacity`` nothing moves: ``dispatch`` pads the inputs to ``capacity``
rows and ``combine`` returns the first ``T`` rows (a handful of device ops, for graph-replayed decode).

Overflow: a rank that routes more than ``capacity`` tokens to one rank sends only the first
``capacity`` of them. The dispatcher never hides this: each row carries its sender's largest count, so
every rank learns the group-wide largest count from the rows it receives (no extra collective), and
``FixedCapacityHandle.check_capacity()`` raises ``CapacityExceededError`` naming the capacity and the
count. ``combine`` calls it itself unless a CUDA graph is being captured; after a graph replay the
caller calls it on the handle returned at capture (its tensors are the graph's static buffers), at a
point where a host sync is acceptable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import Comm
from .dispatch import DispatchHandle, _check_inputs, _pack, _unpack


class CapacityExceededError(RuntimeError):
    """More tokens were routed from one rank to one rank than the fixed capacity holds."""


@dataclass(frozen=True)
class FixedCapacityHandle(DispatchHandle):
    """A ``DispatchHandle`` with the fixed-capacity bookkeeping (all on the device).

    Attributes:
        send_rows: ``[T, G]`` int64 row of each (token, destination rank) in the ``[G * C]`` send buffer;
            ``G * C`` = not sent.
        max_count: ``[]`` int64, the largest number of tokens any rank of the group routed to one rank.
        capacity: ``C`` rows per (source, destination) pair.
    """

    send_rows: torch.Tensor | None = None
    max_count: torch.Tensor | None = None
    capacity: int = 0

    def check_capacity(self) -> None:
        """Raise if any rank routed more tokens to one rank than the capacity (reads one device scalar).

        Raises:
            CapacityExceededError: the count exceeded the capacity; rows past it were not computed.
        """
        assert self.max_count is not None, "handle was not built by FixedCapacityDispatcher"
        count = int(self.max_count.item())
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
        check_overflow: let ``combine`` check the capacity when no CUDA graph is being captured.

    Raises:
        ValueError: ``slots_per_rank`` or ``capacity`` not positive.
    """

    def __init__(self, comm: Comm, slots_per_rank: int, capacity: int, check_overflow: bool = True) -> None:
        if slots_per_rank <= 0:
            raise ValueError(f"slots_per_rank must be positive, got {slots_per_rank}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.comm = comm
        self.slots_per_rank = slots_per_rank
        self.capacity = capacity
        self.check_overflow = check_overflow

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> FixedCapacityHandle:
        """See ``Dispatcher.dispatch``; ``recv_x`` is ``[G * C, D]``, padding rows with slots ``-1``."""
        _check_inputs(x, topk_slots, topk_weights)
        g, s, c = self.comm.size, self.slots_per_rank, self.capacity
        t, k = topk_slots.shape
        if g == 1 and t <= c:
            return self._dispatch_one_rank(x, topk_slots, topk_weights)
        d = x.shape[1]
        dev = x.device
        dest = torch.where(topk_slots >= 0, topk_slots // s, g)  # [T, K], g = none
        goes = torch.zeros(t, g + 1, dtype=torch.bool, device=dev)
        goes.scatter_(1, dest, True)
        goes = goes[:, :g]  # [T, G]
        pos = torch.cumsum(goes.to(torch.int64), dim=0) - 1  # [T, G] row within the block for that rank
        counts = goes.sum(dim=0)  # [G]
        ranks = torch.arange(g, device=dev)
        send_rows = torch.where(goes & (pos < c), ranks * c + pos, g * c)  # [T, G]

        rank_of_choice = dest.unsqueeze(0) == ranks.view(g, 1, 1)  # [G, T, K]
        local_slots = torch.where(rank_of_choice, topk_slots.unsqueeze(0) - ranks.view(g, 1, 1) * s, -1)
        local_w = torch.where(rank_of_choice, topk_weights.float().unsqueeze(0), 0.0)
        own_max = counts.max().to(torch.float32) if t else torch.zeros((), device=dev)

        idx = send_rows.t().reshape(-1)  # [G*T]
        send_x = x.new_zeros((g * c + 1, d))
        send_x[idx] = x.repeat(g, 1)
        meta = torch.zeros(g * c + 1, 2 * k + 1, dtype=torch.float32, device=dev)
        meta[:, :k] = -1.0
        meta[idx, : 2 * k] = torch.cat([local_slots.float(), local_w], dim=2).reshape(g * t, 2 * k)
        meta[:, 2 * k] = own_max
        payload = _pack(send_x[:-1], meta[:-1])

        recv = torch.empty_like(payload)
        self.comm.all_to_all_single(recv, payload)
        recv_x, recv_meta = _unpack(recv, d)
        return FixedCapacityHandle(
            recv_x=recv_x,
            recv_slots=recv_meta[:, :k].to(torch.int64),
            recv_weights=recv_meta[:, k : 2 * k],
            send_token_idx=None,
            send_splits=None,
            recv_splits=None,
            num_tokens=t,
            send_rows=send_rows,
            max_count=recv_meta[:, 2 * k].max().to(torch.int64),
            capacity=c,
        )

    def _dispatch_one_rank(
        self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor
    ) -> FixedCapacityHandle:
        """One rank and ``T <= C``: token ``t`` is row ``t``, rows ``[T, C)`` are padding; nothing moves.

        The same handle contents as the general path up to the order of rows (a token with no slot
        takes its row with slots ``-1`` instead of no row), in four device ops or fewer: decode layers
        replayed from a CUDA graph pay per op. Overflow is impossible (``T <= C``); ``max_count`` is still
        the exact count of tokens with a slot on this rank.
        """
        t, pad = x.shape[0], self.capacity - x.shape[0]
        recv_x, recv_slots, recv_weights = x, topk_slots.to(torch.int64), topk_weights.float()
        if pad:
            recv_x = torch.nn.functional.pad(recv_x, (0, 0, 0, pad))
            recv_slots = torch.nn.functional.pad(recv_slots, (0, 0, 0, pad), value=-1)
            recv_weights = torch.nn.functional.pad(recv_weights, (0, 0, 0, pad))
        return FixedCapacityHandle(
            recv_x=recv_x,
            recv_slots=recv_slots,
            recv_weights=recv_weights,
            send_token_idx=None,
            send_splits=None,
            recv_splits=None,
            num_tokens=t,
            send_rows=torch.arange(t, device=x.device).unsqueeze(1),
            max_count=(topk_slots >= 0).any(dim=1).sum(),
            capacity=self.capacity,
        )

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``: one equal-split all-to-all back, then a sum over ranks per token.

        Raises:
            CapacityExceededError: ``check_overflow`` is set, no CUDA graph is being captured, and the
                capacity was exceeded.
        """
        if not isinstance(handle, FixedCapacityHandle) or handle.send_rows is None:
            raise TypeError("FixedCapacityDispatcher.combine needs the handle its dispatch returned")
        g, c = self.comm.size, self.capacity
        if y.shape[0] != g * c:
            raise ValueError(f"y must have one row per received row ({g * c}), got {tuple(y.shape)}")
        if g == 1 and handle.num_tokens <= c:
            return y[: handle.num_tokens]  # one rank, no overflow possible: row t is token t's sum
        back = torch.empty_like(y)
        self.comm.all_to_all_single(back, y.contiguous())
        back = torch.cat([back, back.new_zeros((1, back.shape[1]))])  # row g*c: not sent
        out = back[handle.send_rows].sum(dim=1, dtype=torch.float32).to(y.dtype)  # [T, D]
        capturing = y.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.check_overflow and not capturing:
            handle.check_capacity()
        return out
