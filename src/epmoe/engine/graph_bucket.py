"""A captured bucket of ``model_runner.ModelRunner``: its step's CUDA graphs and the static input buffers they read,
filled from pinned host buffers by one copy each before every replay."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.engine.packing import Packed
from epmoe.engine.piecewise import Cut


@dataclass
class GraphBucket:
    """One bucket: its captured graphs, replayed in order (``None``: the static path runs eagerly), and its static
    inputs. A decode bucket's graphs are one per segment of decoder layers and their static output ``out`` is the
    logits; a piecewise bucket's (``engine.piecewise``) are the pieces between its ``cuts`` and ``out`` is the final
    hidden states (the sampling rows' logits are computed after the replay).

    The inputs live in two device buffers, filled from two host buffers of the same layout (pinned on CUDA) by
    one copy each: ``ints [5, bs]`` int64, rows ``input_ids``, ``positions``, ``slot_mapping``, ``valid_rows``,
    ``sources`` (the token-buffer row of an id still on the device, -1 = the id given);
    ``tables [bs * max_blocks + bs]`` int32, the block tables row after row, then ``context_lens`` (empty in a
    piecewise bucket, whose attention runs eagerly). ``copied`` (CUDA) marks when the last copies out of the host
    buffers were done, before they are written again. ``min_context``: a long-context graph's least longest context
    (its attention was captured with the tile ``AttnBatch.max_context`` picks there); ``None``: the tile by shapes.
    """

    graph: tuple[torch.cuda.CUDAGraph, ...] | None
    ints: torch.Tensor
    tables: torch.Tensor
    host_ints: torch.Tensor
    host_tables: torch.Tensor
    max_blocks: int
    out: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    used: int = 0
    cuts: tuple[Cut, ...] = ()
    min_context: int | None = None

    @classmethod
    def empty(cls, bs: int, max_blocks: int, device: torch.device) -> GraphBucket:
        """Zeroed static inputs for ``bs`` rows (no tables when ``max_blocks`` is 0), host buffers pinned on CUDA."""
        pin = device.type == "cuda"
        n_tables = bs * max_blocks + bs if max_blocks else 0
        return cls(None, torch.zeros(5, bs, dtype=torch.int64, device=device),
                   torch.zeros(n_tables, dtype=torch.int32, device=device),
                   torch.zeros(5, bs, dtype=torch.int64, pin_memory=pin),
                   torch.zeros(n_tables, dtype=torch.int32, pin_memory=pin), max_blocks)

    @property
    def bs(self) -> int:
        return self.ints.shape[1]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.ints[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.ints[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.ints[2]

    @property
    def valid_rows(self) -> torch.Tensor:
        return self.ints[3]

    @property
    def sources(self) -> torch.Tensor:
        return self.ints[4]

    @property
    def block_tables(self) -> torch.Tensor:
        return self.tables[: self.bs * self.max_blocks].view(self.bs, self.max_blocks)

    @property
    def context_lens(self) -> torch.Tensor:
        return self.tables[self.bs * self.max_blocks:]

    def load(self, packed: Packed) -> None:
        """Write ``packed``'s ``n`` rows (and zero padding rows after them) into the static inputs: the host
        buffers are filled, then copied to the device in two copies (one without tables)."""
        n, mb, bs = packed.input_ids.numel(), self.max_blocks, self.bs
        if self.copied is not None:
            self.copied.synchronize()
        hi, ht = self.host_ints, self.host_tables
        tail = max(self.used, n)
        hi[:, n:tail].zero_()
        hi[4, n:tail] = -1
        hi[0, :n] = packed.input_ids
        hi[1, :n] = packed.positions
        hi[2, :n] = packed.slot_mapping
        hi[3, :n] = 1
        if packed.sources is None:
            hi[4, :n] = -1
        else:
            hi[4, :n] = packed.sources
        self.used = n
        cuda = self.ints.is_cuda
        self.ints.copy_(hi, non_blocking=cuda)
        if mb:  # a decode bucket: every row is a single-token row
            ht[n * mb: tail * mb].zero_()
            ht[bs * mb + n: bs * mb + tail].zero_()
            ht[: n * mb].view(n, mb).copy_(packed.block_tables)
            ht[bs * mb: bs * mb + n] = packed.context_lens
            self.tables.copy_(ht, non_blocking=cuda)
        if cuda:
            if self.copied is None:
                self.copied = torch.cuda.Event()
            self.copied.record()
