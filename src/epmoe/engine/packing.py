"""A step's tokens as the model runner feeds them: each sequence's tokens (``Feed``) packed into one row of host
tensors (``pack`` -> ``Packed``): the single-token rows first (decodes, and the rows of a speculative verify step:
a request's last token and each proposed token is a decode row of its own), then the prefill chunks, with each
token's KV slot, the decode rows' block tables and context lengths, the rows that sample, and the token-buffer rows
a token still on the device is read from (the overlap schedule). ``plan_feeds`` makes a scheduled step's feeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from epmoe.engine.attention import AttnBatch, PrefillChunk
from epmoe.engine.kv_cache import KVCache
from epmoe.engine.scheduler import ScheduledChunk, StepPlan
from epmoe.engine.transfer import to_device


@dataclass(frozen=True)
class Feed:
    """Tokens of one sequence fed at one step.

    Attributes:
        token_ids: the tokens, at positions ``start, start + 1, ...``.
        start: position of the first (the tokens before it have their keys in the cache).
        block_table: the sequence's KV block ids (covering every position fed).
        rowwise: each token is a decode row of its own (decodes, verify rows, prompts in graph steps); else one
            prefill chunk.
        sample: how many of the last rows return logits: every row of a decode or verify feed, 1 for the last
            token of a prompt, 0 for a chunk that does not sample, every row of a chunk whose prompt
            log-probabilities are asked for.
        sources: ``(i, r)`` pairs: ``token_ids[i]`` is a placeholder for a token still on the device, in row ``r``
            of the runner's token buffer (``ModelRunner.keep_sampled``; the overlap schedule).
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    rowwise: bool
    sample: int
    sources: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Packed:
    """A step's host tensors: ``input_ids``, ``positions``, ``slot_mapping`` ``[T]`` int64, the decode rows'
    ``block_tables [num_decode, max_blocks]`` and ``context_lens [num_decode]`` int32, the prefill chunks as
    ``(row, num_tokens, start, kv_slots)``, the sampling rows, and ``sources [T]`` int64 (the token-buffer row
    each input id is read from on the device, -1 = the id given; ``None`` when no id is read there)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_decode: int
    chunks: tuple[tuple[int, int, int, np.ndarray], ...]
    sample_rows: list[int]
    sources: torch.Tensor | None = None

    def attn_batch(self, kv: KVCache, device: torch.device) -> AttnBatch:
        """The eager step's ``AttnBatch`` on ``device`` (copied without a host synchronisation:
        ``transfer.to_device``)."""
        prefills = tuple(PrefillChunk(row, n, start, to_device(slots, device))
                         for row, n, start, slots in self.chunks)
        return AttnBatch(kv, to_device(self.slot_mapping, device), self.num_decode,
                         to_device(self.block_tables, device), to_device(self.context_lens, device), prefills,
                         max_context=self.max_context)

    @property
    def max_context(self) -> int | None:
        """The decode rows' longest context (host), ``None`` without decode rows."""
        return int(self.context_lens.max()) if self.num_decode else None


def _cat(parts: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts)).long() if parts else torch.zeros(0, dtype=torch.int64)


def pack(feeds: Sequence[Feed], block_size: int, max_blocks: int) -> Packed:
    """Pack ``feeds`` into one row of tokens: the row-wise feeds first, in order, then the chunks.

    Raises:
        ValueError: a feed past its block table (``max_blocks`` wide).
    """
    bs = block_size
    rowwise = [f for f in feeds if f.rowwise]
    chunked = [f for f in feeds if not f.rowwise]
    nd = sum(len(f.token_ids) for f in rowwise)
    ids: list[int] = []
    pos_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    tables = np.zeros((nd, max_blocks), dtype=np.int32)
    sample_rows: list[int] = []
    sources: list[tuple[int, int]] = []  # (packed row, token-buffer row)
    row = 0
    for f in rowwise:
        n = len(f.token_ids)
        table = np.asarray(f.block_table, dtype=np.int64)
        p = np.arange(f.start, f.start + n)
        if len(table) > max_blocks or (n and p[-1] // bs >= len(table)):
            raise ValueError(f"feed at positions {f.start}..{f.start + n - 1} runs past its {len(table)} KV blocks")
        ids.extend(f.token_ids)
        pos_parts.append(p)
        slot_parts.append(table[p // bs] * bs + p % bs)
        tables[row:row + n, : len(table)] = table
        sample_rows.extend(range(row + n - f.sample, row + n))
        sources.extend((row + i, r) for i, r in f.sources)
        row += n
    ctx = np.concatenate(pos_parts).astype(np.int32) + 1 if pos_parts else np.zeros(0, dtype=np.int32)
    chunks = []
    for f in chunked:
        n = len(f.token_ids)
        if not 0 <= f.sample <= n:
            raise ValueError(f"a prefill chunk of {n} rows returns the logits of 0 to {n} last rows, not {f.sample}")
        table = np.asarray(f.block_table, dtype=np.int64)
        p = np.arange(f.start + n)
        if (p[-1] // bs) >= len(table):
            raise ValueError(f"feed at positions {f.start}..{f.start + n - 1} runs past its {len(table)} KV blocks")
        kv_slots = table[p // bs] * bs + p % bs
        ids.extend(f.token_ids)
        pos_parts.append(p[f.start:])
        slot_parts.append(kv_slots[f.start:])
        chunks.append((row, n, f.start, kv_slots))
        sample_rows.extend(range(row + n - f.sample, row + n))
        sources.extend((row + i, r) for i, r in f.sources)
        row += n
    src = None
    if sources:
        src = torch.full((row,), -1, dtype=torch.int64)
        at, buf = zip(*sources)
        src[list(at)] = torch.tensor(buf, dtype=torch.int64)
    return Packed(torch.tensor(ids, dtype=torch.int64), _cat(pos_parts), _cat(slot_parts), torch.from_numpy(tables),
                  torch.from_numpy(ctx), nd, tuple(chunks), sample_rows, src)


def _sources(c: ScheduledChunk) -> tuple[tuple[int, int], ...]:
    """Where chunk ``c`` feeds its sequence's token still on the device (at most its newest one is, when a step
    is planned): ``((index in the chunk, token-buffer row),)``, else ``()``."""
    seq = c.seq
    if not seq.num_pending:
        return ()
    if seq.num_pending > 1:
        raise ValueError(f"request {seq.request_id!r} has {seq.num_pending} tokens on the device; a step is planned "
                         f"with at most its newest one there")
    last = seq.num_tokens - 1
    return ((last - c.start, seq.device_row),) if c.start <= last < c.start + c.num_tokens else ()


def plan_feeds(plan: StepPlan, drafts: Sequence[Sequence[int]] | None = None,
               rowwise_prefill: bool = False) -> list[Feed]:
    """The feeds of a scheduled step: each decode chunk's token followed by its proposed tokens
    (``drafts[i]`` for ``plan.decodes[i]``), row-wise; then the prefill chunks (row-wise too with
    ``rowwise_prefill``: a graph step), each returning the logits of its ``prefill_logit_rows`` last rows (its
    last row if it reaches its sequence's end; every row for prompt log-probabilities). A token still on the
    device (the overlap schedule) is fed from the runner's token buffer.

    Raises:
        ValueError: a sequence with more than one token on the device.
    """
    feeds = []
    for i, c in enumerate(plan.decodes):
        extra = list(drafts[i]) if drafts is not None else []
        feeds.append(Feed([c.seq.token(c.start)] + extra, c.start, c.seq.block_table, True, 1 + len(extra),
                          _sources(c)))
    for c in plan.prefills:
        feeds.append(Feed(c.seq.tokens(c.start, c.start + c.num_tokens), c.start, c.seq.block_table, rowwise_prefill,
                          c.prefill_logit_rows, _sources(c)))
    return feeds
