"""What every dispatcher shares: the ``Dispatcher`` protocol, the handle base type and the input checks.

Contract (DESIGN.md rule 4): ``dispatch`` returns a handle; ``combine`` consumes it. Each dispatcher has
its own handle type (a frozen, keyword-only subclass of ``DispatchHandle``) and its ``combine`` accepts
that type only. A dispatcher keeps no state between the two, so several micro-batches may be in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from epmoe.comm import Comm


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """What a rank received: the rows it computes (the fields every dispatcher's handle has).

    Attributes:
        recv_x: ``[R, D]`` rows this rank computes (may be a view with row stride above ``D``).
        recv_slots: ``[R, K]`` int64 local slot ids on this rank, ``-1`` = not computed here.
        recv_weights: ``[R, K]`` float32 routing weights matching ``recv_slots``.
        num_tokens: ``T`` tokens of the caller.
    """

    recv_x: torch.Tensor
    recv_slots: torch.Tensor
    recv_weights: torch.Tensor
    num_tokens: int


class Dispatcher(Protocol):
    """Moves tokens to experts and results back.

    Attributes:
        comm: the EP group.
        num_slots: ``P``, the group's slots (valid ids ``[-1, P)``).
        slots_per_rank: ``P / G``.
    """

    comm: Comm
    num_slots: int
    slots_per_rank: int

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


def check_inputs(x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """A dispatch's inputs: ``x [T, D]``, ``topk_slots`` and ``topk_weights`` both ``[T, K]``, integer slot ids.

    Raises:
        ValueError: a shape that is not as above.
        TypeError: ``topk_slots`` not int64 or int32.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x.shape)}")
    if topk_slots.shape != topk_weights.shape or topk_slots.dim() != 2 or topk_slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_slots {tuple(topk_slots.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, K]"
        )
    if topk_slots.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_slots must be int64 (or int32) slot ids, got dtype {topk_slots.dtype}")


def check_row_dtype(x: torch.Tensor) -> None:
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
