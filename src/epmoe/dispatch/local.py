"""The EP = 1 dispatcher: every slot is local, nothing moves (the reference of every other dispatcher)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.checks import check_positive_int
from epmoe.comm import Comm
from epmoe.dispatch.base import DispatchHandle, check_expert_output, check_inputs, check_slot_range, slot_range


@dataclass(frozen=True, kw_only=True)
class LocalHandle(DispatchHandle):
    """A local dispatch's handle: ``recv_*`` are the inputs themselves (``R = T``)."""


class LocalDispatcher:
    """EP = 1, the reference: every slot is local, nothing moves.

    Args:
        num_slots: ``P`` slots, all on this rank.
        comm: the EP group, of one rank (``Comm(None)`` when omitted).

    Raises:
        ValueError: ``num_slots`` not a positive integer, or ``comm`` of more than one rank.
    """

    def __init__(self, num_slots: int, comm: Comm | None = None) -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        self.comm = Comm(None) if comm is None else comm
        if self.comm.size != 1:
            raise ValueError(f"the local dispatcher serves EP size 1 only, the EP group has {self.comm.size} ranks")
        self.slots_per_rank = self.num_slots

    def dispatch(self, x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> LocalHandle:
        """See ``Dispatcher.dispatch``; the handle's ``recv_*`` are the inputs themselves.

        Raises:
            ValueError: on CPU, a slot id outside ``[-1, P)`` (on CUDA the check would stall the stream:
                the layers' slots come from a validated placement).
        """
        check_inputs(x, topk_slots, topk_weights)
        rng = slot_range(topk_slots) if not topk_slots.is_cuda else None
        if rng is not None:
            check_slot_range(*rng.tolist(), self.num_slots, "local dispatcher")
        return LocalHandle(recv_x=x, recv_slots=topk_slots.to(torch.int64), recv_weights=topk_weights.float(),
                           num_tokens=x.shape[0])

    def combine(self, y: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        """See ``Dispatcher.combine``: returns ``y``.

        Raises:
            TypeError: ``handle`` is not a local dispatch's.
            ValueError: ``y`` is not ``[T, D]`` like the dispatched rows.
        """
        if type(handle) is not LocalHandle:
            raise TypeError("LocalDispatcher.combine needs the handle its dispatch returned")
        check_expert_output(y, handle.recv_x.shape, "[T, D]")
        return y
