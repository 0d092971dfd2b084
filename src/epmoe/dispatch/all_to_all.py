"""The all-to-all dispatcher: exchange the counts, then variable-size blocks of rows, and back.

A token's hidden state travels to a given rank once, even when several of its top-k slots live there;
that rank computes all of them, sums the weighted results and sends one row back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.checks import check_positive_int
from epmoe.comm import Comm
from epmoe.dispatch.base import DispatchHandle, check_expert_output, check_inputs, check_row_dtype, slot_range
from epmoe.dispatch.blocks import ExactBlocks
from epmoe.dispatch.layout import combine_rows, pack_rows, route_layout, unpack_rows


@dataclass(frozen=True, kw_only=True)
class AllToAllHandle(DispatchHandle):
    """An all-to-all dispatch's handle: what was received and how to send the results back.

    Attributes:
        send_pos: ``[T, G]`` int32 row of token ``t`` within the block sent to rank ``g``, ``-1`` = not
            sent (``layout.SendLayout.pos``).
        send_blocks: the send buffer's exact blocks (``[G]`` int32 first row of each rank's block, and its
            row count ``sum(send_splits)``), which the returned rows keep.
        send_splits: rows sent to each rank (host list of ``G`` ints).
        recv_splits: rows received from each rank (host list of ``G`` ints).
    """

    send_pos: torch.Tensor
    send_blocks: ExactBlocks
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher:
    """Dispatch/combine with ``all_to_all_single`` over the EP group, after exchanging counts.

    Per call: one all-to-all of the ``G`` row counts (host sync: the split sizes must be known), one
    all-to-all of the rows (hidden state with the slot ids and weights packed bit-exactly beside it, the
    exact layout of ``layout``), and one all-to-all back in ``combine``. Works with gloo on CPU
    and NCCL on CUDA (the layout steps are Triton kernels there).

    Args:
        comm: the EP group.
        slots_per_rank: ``P / G``; rank ``g`` holds global slots ``[g*P/G, (g+1)*P/G)``.

    Raises:
        ValueError: ``slots_per_rank`` not a positive integer.
    """

    def __init__(self, comm: Comm, slots_per_rank: int) -> None:
        self.comm = comm
        self.slots_per_rank = check_positive_int("slots_per_rank", slots_per_rank)
        self.num_slots = self.slots_per_rank * comm.size

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> AllToAllHandle:
        """See ``Dispatcher.dispatch``.

        Raises:
            ValueError: bad shapes, or a slot id outside ``[-1, G * S)`` on any rank of the group (each
                rank's flag travels with its counts, so every rank raises, before the rows move).
            TypeError: ``x`` not float32/bf16/fp16, or slots not integer.
        """
        check_inputs(x, topk_slots, topk_weights)
        check_row_dtype(x)
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
        blocks = ExactBlocks(layout.starts, sum(send_splits))
        payload = pack_rows(x, topk_slots, topk_weights, layout, s, blocks)
        recv = payload.new_empty((sum(recv_splits), payload.shape[1]))
        self.comm.all_to_all_single(recv, payload, recv_splits, send_splits)
        recv_x, recv_slots, recv_weights, _, _ = unpack_rows(recv, x.shape[1], k)  # flags came with the counts
        return AllToAllHandle(
            recv_x=recv_x,
            recv_slots=recv_slots,
            recv_weights=recv_weights,
            send_pos=layout.pos,
            send_blocks=blocks,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_tokens=t,
        )

    def combine(self, y: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``: one all-to-all back, then each token's rows summed in float32.

        Raises:
            TypeError: ``handle`` did not come from an all-to-all dispatch.
        """
        if type(handle) is not AllToAllHandle:
            raise TypeError("AllToAllDispatcher.combine needs the handle its dispatch returned")
        check_expert_output(y, (sum(handle.recv_splits), handle.recv_x.shape[1]), "[received rows, D]")
        back = y.new_empty((sum(handle.send_splits), y.shape[1]))
        self.comm.all_to_all_single(back, y.contiguous(), handle.send_splits, handle.recv_splits)
        return combine_rows(back, handle.send_pos, handle.send_blocks)
