"""How the destination ranks' blocks of rows lie in a send buffer: the two layouts of ``layout``.

``FixedBlocks``: every rank's block is ``C`` rows, block ``g`` is rows ``[g * C, (g + 1) * C)``, rows past a
rank's count are padding (the fixed-capacity dispatcher: static shapes, no count on the host).
``ExactBlocks``: block ``g`` starts at ``row_starts[g]`` and holds exactly the rows sent to ``g`` (the
all-to-all dispatcher, whose host knows the counts). ``pack_rows`` and ``combine_rows`` (and their Triton
twins) take one of the two, so the layout is always said, never implied by a missing argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from epmoe.checks import check_int


@dataclass(frozen=True)
class FixedBlocks:
    """Blocks of ``capacity`` rows per destination rank: ``G * C`` rows in all.

    Attributes:
        capacity: ``C`` rows per block, ``>= 0`` (the ``capacity`` the ``SendLayout`` was routed with).

    Raises:
        ValueError: ``capacity`` not an integer ``>= 0``.
    """

    capacity: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", check_int("FixedBlocks.capacity", self.capacity, 0))

    def num_rows(self, num_ranks: int) -> int:
        """``G * C``: the rows of a buffer of ``num_ranks`` blocks."""
        return num_ranks * self.capacity


@dataclass(frozen=True)
class ExactBlocks:
    """Blocks of exactly the rows sent to each rank, one after the other (nothing overflows, no padding).

    Attributes:
        row_starts: ``[G]`` int32/int64 first row of each rank's block (``SendLayout.starts``, the exclusive
            prefix sum of the counts), on the buffer's device.
        num_rows: ``N``, the rows of the buffer: the sum of the counts (only the caller's host copy of the
            counts knows it; it is not checked against the device counts).

    Raises:
        TypeError: ``row_starts`` not a 1-D int32/int64 tensor.
        ValueError: ``num_rows`` not an integer ``>= 0``.
    """

    row_starts: torch.Tensor
    num_rows: int

    def __post_init__(self) -> None:
        rs = self.row_starts
        if not isinstance(rs, torch.Tensor) or rs.dim() != 1 or rs.dtype not in (torch.int32, torch.int64):
            got = f"{tuple(rs.shape)} {rs.dtype}" if isinstance(rs, torch.Tensor) else type(rs).__name__
            raise TypeError(f"ExactBlocks.row_starts must be a [G] int32/int64 tensor, got {got}")
        object.__setattr__(self, "num_rows", check_int("ExactBlocks.num_rows", self.num_rows, 0))


RowBlocks = Union[FixedBlocks, ExactBlocks]
"""One of the two send-buffer layouts."""


def block_rows(blocks: RowBlocks, num_ranks: int) -> int:
    """The rows of a buffer of ``num_ranks`` blocks laid out as ``blocks``.

    Raises:
        TypeError: ``blocks`` is neither ``FixedBlocks`` nor ``ExactBlocks``.
    """
    if isinstance(blocks, FixedBlocks):
        return blocks.num_rows(num_ranks)
    if isinstance(blocks, ExactBlocks):
        return blocks.num_rows
    raise TypeError(f"blocks must be FixedBlocks or ExactBlocks, got {type(blocks).__name__}")
