"""A process group made explicit, with the collectives it runs counted.

Every layer that communicates is given a ``Comm`` at construction: the group, its rank and size, and a
``CommStats`` that counts each collective by kind with the bytes this rank sends. Nothing here reads
the default process group unless a caller passes it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

COLLECTIVE_KINDS = ("all_to_all", "all_reduce", "all_gather")


@dataclass
class CommStats:
    """Per-kind collective counts and bytes sent by this rank.

    Attributes:
        calls: collective kind -> number of calls.
        bytes_sent: collective kind -> bytes this rank put on the wire (payload sent to other ranks;
            for all-reduce and all-gather the full input size).
    """

    calls: dict[str, int] = field(default_factory=lambda: {k: 0 for k in COLLECTIVE_KINDS})
    bytes_sent: dict[str, int] = field(default_factory=lambda: {k: 0 for k in COLLECTIVE_KINDS})

    def add(self, kind: str, nbytes: int) -> None:
        """Count one collective of ``kind`` moving ``nbytes`` bytes."""
        self.calls[kind] += 1
        self.bytes_sent[kind] += int(nbytes)

    def snapshot(self) -> "CommStats":
        """A copy of the current counters."""
        return CommStats(dict(self.calls), dict(self.bytes_sent))

    def since(self, earlier: "CommStats") -> "CommStats":
        """Counters accumulated after ``earlier`` was taken."""
        return CommStats(
            {k: self.calls[k] - earlier.calls[k] for k in COLLECTIVE_KINDS},
            {k: self.bytes_sent[k] - earlier.bytes_sent[k] for k in COLLECTIVE_KINDS},
        )


class Comm:
    """One process group, explicit, with counted collectives.

    Args:
        group: a ``torch.distributed`` process group, or ``None`` for a single process (size 1, no
            communication at all). The default group is used only if the caller passes it.
        stats: counters to add to; a fresh ``CommStats`` when omitted.

    Raises:
        ValueError: a group is given but ``torch.distributed`` is not initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        if group is not None and not dist.is_initialized():
            raise ValueError("a process group was given but torch.distributed is not initialised")
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, size={self.size})"

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """``dist.all_to_all_single`` over this group; returns ``output``.

        Bytes counted: rows sent to other ranks (the row kept on this rank does not travel).
        """
        if self.size == 1:
            output.copy_(input)
            return output
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        if input_split_sizes is None:
            sent_rows = input.shape[0] - input.shape[0] // self.size
        else:
            sent_rows = sum(input_split_sizes) - input_split_sizes[self.rank]
        self.stats.add("all_to_all", sent_rows * row_bytes)
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=self.group)
        return output

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group; returns ``tensor``."""
        if self.size == 1:
            return tensor
        self.stats.add("all_reduce", tensor.numel() * tensor.element_size())
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather ``tensor`` from every rank; returns ``[size, *tensor.shape]``."""
        if self.size == 1:
            return tensor.unsqueeze(0).clone()
        self.stats.add("all_gather", tensor.numel() * tensor.element_size())
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def barrier(self) -> None:
        """Wait for every rank of the group (not counted: it moves no data)."""
        if self.size > 1:
            dist.barrier(group=self.group)
