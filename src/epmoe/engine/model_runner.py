"""Runs one scheduled step through the model: packs the tokens, runs eager or replays a CUDA graph.

A step's tokens are packed into one row (no padding between sequences): the single-token rows first
(decodes), then the prefill chunks. Eager steps run the transformers model with the paged attention
function; decode-only steps on CUDA replay the graph captured for the smallest batch bucket that holds
them (padding rows write into the KV cache's padding block and are dropped). The logits are computed
only for the rows that sample.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from epmoe.engine.attention import AttnBatch, PrefillChunk
from epmoe.engine.kv_cache import KVCache
from epmoe.engine.mla_decode import mla_decode_splits
from epmoe.engine.paged_decode import paged_decode_splits, paged_decode_workspace_numel
from epmoe.engine.scheduler import StepPlan


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured up to ``max_bs`` (SGLang's ``--cuda-graph-max-bs``): 1, 2, 4, 8, then
    every multiple of 16 up to 256 and of 32 above, and ``max_bs`` itself.

    Raises:
        ValueError: ``max_bs`` < 1.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_bs}
    sizes |= set(range(16, min(max_bs, 256) + 1, 16)) | set(range(288, max_bs + 1, 32))
    sizes.add(max_bs)
    return sorted(sizes)


@dataclass
class _Graph:
    """One decode bucket: its captured graph (``None``: the static path runs eagerly) and static tensors."""

    graph: torch.cuda.CUDAGraph | None
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    valid_rows: torch.Tensor
    logits: torch.Tensor | None


class ModelRunner:
    """Executes steps of one rank's model over its KV cache.

    Args:
        model: the transformers causal LM (paged attention implementation, ``MoELayer`` blocks).
        kv: the KV cache.
        max_blocks_per_seq: width of the block tables (``ceil(max_model_len / block_size)``).
        device: where the model runs.
    """

    def __init__(self, model: nn.Module, kv: KVCache, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.base = model.model
        self.lm_head = model.lm_head
        self.kv = kv
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self._pool = None
        self._activate = self._deactivate = None

    @property
    def buckets(self) -> list[int]:
        """Captured batch sizes, ascending."""
        return sorted(self.graphs)

    def bucket_for(self, num_decode: int) -> int | None:
        """The smallest captured batch size holding ``num_decode`` rows, or ``None``."""
        sizes = self.buckets
        i = bisect.bisect_left(sizes, num_decode)
        return sizes[i] if i < len(sizes) else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                 rows: torch.Tensor | None) -> torch.Tensor:
        out = self.base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                        epmoe_batch=batch)
        hidden = out[0][0]
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.lm_head(hidden)

    def _host_tensors(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """Packed ``input_ids``, ``positions``, ``slot_mapping`` (int64) and the decode rows' ``block_tables``,
        ``context_lens`` (int32), on the host."""
        bs = self.kv.block_size
        decodes = plan.decodes
        nd = len(decodes)
        ids = [c.seq.token(c.start) for c in decodes]
        pos = [c.start for c in decodes]
        slots = [c.seq.block_table[c.start // bs] * bs + c.start % bs for c in decodes]
        tables = np.zeros((nd, self.max_blocks), dtype=np.int32)
        for i, c in enumerate(decodes):
            row = c.seq.block_table
            tables[i, : len(row)] = row
        ctx = np.asarray(pos, dtype=np.int32) + 1
        for c in plan.prefills:
            ids.extend(c.seq.tokens(c.start, c.start + c.num_tokens))
            p = np.arange(c.start, c.start + c.num_tokens)
            pos.extend(p.tolist())
            slots.extend((np.asarray(c.seq.block_table)[p // bs] * bs + p % bs).tolist())
        return (torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64), torch.from_numpy(tables), torch.from_numpy(ctx))

    @torch.no_grad()
    def run(self, plan: StepPlan, bucket: int | None = None) -> torch.Tensor:
        """Run ``plan`` and return the logits of its sampling rows.

        Args:
            plan: the step (may be empty: a rank with nothing to do in a graph-replayed step).
            bucket: replay the graph captured for this batch size (decode-only plans); ``None`` = eager.

        Returns:
            ``[len(plan.sampling), V]`` float32 logits, in ``plan.sampling`` order.

        Raises:
            ValueError: a bucket that was not captured or is smaller than the plan's rows, or a bucket
                for a plan with prefill chunks.
        """
        ids, pos, slots, tables, ctx = self._host_tensors(plan)
        if bucket is not None:
            return self._replay(plan, bucket, ids, pos, slots, tables, ctx)
        dev = self.device
        bs = self.kv.block_size
        prefills = []
        row = len(plan.decodes)
        for c in plan.prefills:
            positions = np.arange(c.start + c.num_tokens)
            kv_slots = np.asarray(c.seq.block_table)[positions // bs] * bs + positions % bs
            prefills.append(PrefillChunk(row, c.num_tokens, c.start, torch.from_numpy(kv_slots).to(dev)))
            row += c.num_tokens
        batch = AttnBatch(self.kv, slots.to(dev), len(plan.decodes), tables.to(dev), ctx.to(dev), tuple(prefills))
        rows = torch.tensor(plan.sampling_rows, dtype=torch.int64, device=dev)
        return self._forward(ids.to(dev), pos.to(dev), batch, rows).float()

    def _replay(self, plan: StepPlan, bucket: int, ids, pos, slots, tables, ctx) -> torch.Tensor:
        g = self.graphs.get(bucket)
        if g is None:
            raise ValueError(f"no CUDA graph captured for batch size {bucket}; captured: {self.buckets}")
        n = len(plan.decodes)
        if plan.prefills or n > bucket:
            raise ValueError(f"graph bucket {bucket} replays decode-only steps of at most {bucket} rows; "
                             f"the plan has {n} decode rows and {len(plan.prefills)} prefill chunks")
        for static, value in ((g.input_ids, ids), (g.positions, pos), (g.slot_mapping, slots),
                              (g.block_tables, tables), (g.context_lens, ctx)):
            static[:n].copy_(value, non_blocking=True)
            static[n:].zero_()
        g.valid_rows[:n].fill_(1)
        g.valid_rows[n:].zero_()
        if g.graph is not None:
            g.graph.replay()
            return g.logits[:n].float()
        self._activate(bucket, g.valid_rows)
        try:
            batch = AttnBatch(self.kv, g.slot_mapping, bucket, g.block_tables, g.context_lens)
            return self._forward(g.input_ids, g.positions, batch, None)[:n].float()
        finally:
            self._deactivate()

    def _workspace(self, sizes: list[int]) -> torch.Tensor:
        """Split-K scratch of the decode kernel for the largest need over ``sizes``, shared by every
        bucket's graph (graphs never run at once)."""
        heads = self.model.config.num_attention_heads
        layout = self.kv.layout
        if layout.latent:  # MLA: the latent decode kernel, same workspace layout
            positions = self.max_blocks * self.kv.block_size
            return torch.empty(max(paged_decode_workspace_numel(bs, heads, layout.v_head_dim,
                                                                mla_decode_splits(bs, heads, positions, self.device))
                                   for bs in sizes), dtype=torch.float32, device=self.device)
        k0, dv = self.kv.k[0], self.kv.v[0].shape[-1]
        need = 1
        for bs in sizes:  # the split count depends on shapes only: empty tensors of the bucket's shapes
            q = torch.empty(bs, heads, k0.shape[-1], dtype=k0.dtype, device=self.device)
            tables = torch.empty(bs, self.max_blocks, dtype=torch.int32, device=self.device)
            need = max(need, paged_decode_workspace_numel(bs, heads, dv, paged_decode_splits(q, k0, tables)))
        return torch.empty(need, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def capture(self, sizes: list[int], activate, deactivate, cuda_graphs: bool = True) -> None:
        """Prepare one static decode step per batch size: captured as a CUDA graph (largest first, sharing
        one memory pool), or, without ``cuda_graphs``, kept to run eagerly on the same padded static
        tensors (the graph path, testable on CPU).

        Args:
            sizes: batch sizes.
            activate: called with the batch size and its ``[bs]`` int64 row mask (1 = real row, 0 =
                padding; set before every replay) before the static step runs or is captured: the engine
                switches the MoE layers to a dispatcher of that size and masks the load recorder there.
            deactivate: called after, to restore the eager set-up.
            cuda_graphs: capture CUDA graphs (the device must be CUDA).
        """
        self._activate, self._deactivate = activate, deactivate
        dev = self.device
        workspace = self._workspace(sizes) if sizes and cuda_graphs else None
        for bs in sorted(sizes, reverse=True):
            valid_rows = torch.zeros(bs, dtype=torch.int64, device=dev)
            input_ids = torch.zeros(bs, dtype=torch.int64, device=dev)
            positions = torch.zeros(bs, dtype=torch.int64, device=dev)
            slot_mapping = torch.zeros(bs, dtype=torch.int64, device=dev)
            block_tables = torch.zeros(bs, self.max_blocks, dtype=torch.int32, device=dev)
            context_lens = torch.zeros(bs, dtype=torch.int32, device=dev)
            graph, logits = None, None
            if cuda_graphs:
                activate(bs, valid_rows)
                try:
                    graph, logits = self._capture_one(input_ids, positions, slot_mapping, block_tables, context_lens,
                                                      workspace)
                finally:
                    deactivate()
            self.graphs[bs] = _Graph(graph, input_ids, positions, slot_mapping, block_tables, context_lens,
                                     valid_rows, logits)
        if cuda_graphs:
            torch.cuda.synchronize(dev)

    def _capture_one(self, input_ids, positions, slot_mapping, block_tables, context_lens, workspace):
        dev = self.device
        bs = input_ids.shape[0]
        batch = AttnBatch(self.kv, slot_mapping, bs, block_tables, context_lens, workspace=workspace)
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton autotuning and lazy allocations happen outside capture
                self._forward(input_ids, positions, batch, None)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(input_ids, positions, batch, None)
        return graph, logits
