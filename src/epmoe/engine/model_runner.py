"""Runs one scheduled step through the model: packs the tokens, runs eager or replays a CUDA graph.

A step's tokens are packed into one row (no padding between sequences; ``packing``): the single-token rows first
(decodes, and the rows of a speculative verify step: a request's last token and each proposed token is a
decode row of its own), then the prefill chunks. Eager steps run the transformers model with the paged
attention function (``decoder.decoder_forward``: the model's layers, residual adds fused into the norms);
decode-only steps on CUDA replay the graph captured for the smallest bucket of rows
that holds them (padding rows write into the KV cache's padding block and are dropped). The logits are
computed only for the rows that sample (and a prompt's rows whose log-probabilities are asked for). A runner
built with ``aux_layers`` also returns those decoder layers' outputs for every row (EAGLE-3 reads them).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from epmoe.engine.attention import AttnBatch
from epmoe.engine.decoder import check_decoder, decoder_forward
from epmoe.engine.graph_bucket import GraphBucket
from epmoe.engine.kv_cache import KVCache
from epmoe.engine.mla_decode import mla_decode_splits, wide_tile_min_context
from epmoe.engine.packing import Feed, Packed, pack, plan_feeds
from epmoe.engine.paged_decode import paged_decode_splits, paged_decode_workspace_numel
from epmoe.engine.piecewise import Pieces
from epmoe.engine.scheduler import StepPlan
from epmoe.engine.transfer import to_device


@dataclass(frozen=True)
class StepOutput:
    """What a step returns.

    Attributes:
        logits: ``[S, V]`` float32 logits of the sampling rows, in packed order.
        aux: ``[T, n D]`` the ``aux_layers`` outputs of every fed row, concatenated, in packed order (``None``
            without ``aux_layers``).
        long_context: the step replayed its bucket's long-context graph (``ModelRunner.capture``).
    """

    logits: torch.Tensor
    aux: torch.Tensor | None = None
    long_context: bool = False


def _smallest_holding(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending ``sizes`` that is at least ``n``, or ``None``."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class ModelRunner:
    """Executes steps of one rank's model over its KV cache.

    Args:
        model: the transformers causal LM (paged attention implementation, ``MoELayer`` blocks).
        kv: the KV cache.
        max_blocks_per_seq: width of the block tables (``ceil(max_model_len / block_size)``).
        device: where the model runs.
        aux_layers: decoder layers whose outputs every step also returns (``StepOutput.aux``).
        graph_segments: graphs a captured step is split into along its decoder layers (``None``: one per 8
            layers, 1 to 4): one launch of a whole step's kernels keeps the host busy for a while before the GPU
            starts; segments overlap the next segment's launch with the previous one's execution.
        token_rows: rows of the device token buffer (``keep_sampled``), the most tokens a step samples; 0 = none
            (every fed token id is known on the host).

    Raises:
        ValueError: an ``aux_layers`` index outside the model's decoder layers.
    """

    def __init__(self, model: nn.Module, kv: KVCache, max_blocks_per_seq: int, device: torch.device,
                 aux_layers: Sequence[int] = (), graph_segments: int | None = None, token_rows: int = 0) -> None:
        self.model = model
        self.base = model.model
        self.lm_head = model.lm_head
        self.kv = kv
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.graphs: dict[int, GraphBucket] = {}
        self.long_graphs: dict[int, GraphBucket] = {}  # bucket -> its graph for long contexts (``_long_context``)
        self.piece_graphs: dict[int, GraphBucket] = {}
        self.pieces: Pieces | None = None
        self._graph_workspace: torch.Tensor | None = None
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._activate = self._deactivate = None
        self.aux_layers = tuple(aux_layers)
        self._before_layer = None  # a graph capture's cut between segments (``_capture_one``)
        # a step's sampled tokens, read by the next step's forward on the device (never reallocated: graphs hold it)
        self.tokens = torch.zeros(token_rows, dtype=torch.int64, device=device) if token_rows else None
        check_decoder(self.base)
        layers = self.base.layers
        self.graph_segments = graph_segments if graph_segments is not None else max(1, min(4, len(layers) // 8))
        for i in self.aux_layers:
            if not 0 <= i < len(layers):
                raise ValueError(f"aux layer {i} is not a decoder layer of the {len(layers)}-layer model")

    @property
    def buckets(self) -> list[int]:
        """Captured row counts, ascending."""
        return sorted(self.graphs)

    def bucket_for(self, num_decode: int) -> int | None:
        """The smallest captured row count holding ``num_decode`` rows, or ``None``."""
        return _smallest_holding(self.buckets, num_decode)

    @property
    def piece_buckets(self) -> list[int]:
        """Token counts of the piecewise graphs, ascending."""
        return sorted(self.piece_graphs)

    def piece_bucket_for(self, rows: int) -> int | None:
        """The smallest piecewise bucket holding a step of ``rows`` rows, or ``None``."""
        return _smallest_holding(self.piece_buckets, rows)

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled ``tokens [N]`` int64 (on the device) in rows ``[0, N)`` of the token buffer, where
        the next step's forward reads the ones it feeds (``Feed.sources``); stream-ordered, no host sync.

        Raises:
            ValueError: no token buffer, or more tokens than its rows.
        """
        if self.tokens is None or tokens.numel() > self.tokens.numel():
            have = 0 if self.tokens is None else self.tokens.numel()
            raise ValueError(f"{tokens.numel()} sampled tokens do not fit the token buffer of {have} rows")
        self.tokens[: tokens.numel()].copy_(tokens)

    def _body(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
              sources: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder's final hidden states ``[T, D]`` and the aux layers' outputs."""
        if sources is not None and self.tokens is not None:
            input_ids = torch.where(sources >= 0, self.tokens[sources.clamp(min=0)], input_ids)
        hidden, aux = decoder_forward(self.base, input_ids, positions, batch, self.aux_layers, self._before_layer)
        return hidden, torch.cat(aux, dim=-1) if aux else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                 rows: torch.Tensor | None, sources: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, aux = self._body(input_ids, positions, batch, sources)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.lm_head(hidden), aux

    @torch.no_grad()
    def run(self, plan: StepPlan, bucket: int | None = None,
            drafts: Sequence[Sequence[int]] | None = None, piece: int | None = None, *,
            max_context: int | None = None) -> StepOutput:
        """Run ``plan`` (with ``drafts[i]`` proposed tokens after decode chunk ``i``: a verify step).

        Args:
            plan: the step (may be empty: a rank with nothing to do in a graph-replayed step).
            bucket: replay the graph captured for this many rows, the prefill chunks fed one row per token;
                ``None`` = eager.
            drafts: per decode chunk, the proposed tokens verified after its token (``None``: none).
            piece: instead, replay the piecewise graphs of this many rows (prefill chunks as chunks, attention
                eager between the pieces; ``engine.piecewise``).
            max_context: with ``bucket``, the longest context the ranks of the step agreed on (``Engine``): the
                bucket's long-context graph (``capture``) is replayed from its ``min_context`` on, the same choice
                on every rank; ``None``: this rank's own longest context decides.

        Returns:
            The logits of the sampling rows (every row of a decode chunk, then each sampling prefill chunk's
            last row) and the aux layers' outputs of every row.

        Raises:
            ValueError: a bucket that was not captured or is smaller than the plan's rows.
        """
        return self.execute(plan_feeds(plan, drafts, rowwise_prefill=bucket is not None), bucket, piece,
                            max_context=max_context)

    @torch.no_grad()
    def execute(self, feeds: Sequence[Feed], bucket: int | None = None, piece: int | None = None, *,
                max_context: int | None = None) -> StepOutput:
        """Run ``feeds`` (see ``run``); the row-wise feeds first in the packed order, then the chunks."""
        packed = pack(feeds, self.kv.block_size, self.max_blocks)
        if packed.sources is not None and self.tokens is None:
            raise ValueError("a feed reads a token on the device, but the runner has no token buffer")
        if bucket is not None:
            return self._replay(packed, bucket, max_context)
        if piece is not None:
            return self._replay_pieces(packed, piece)
        dev = self.device
        batch = packed.attn_batch(self.kv, dev)
        rows = to_device(packed.sample_rows, dev, torch.int64)
        sources = None if packed.sources is None else to_device(packed.sources, dev)
        logits, aux = self._forward(to_device(packed.input_ids, dev), to_device(packed.positions, dev), batch, rows,
                                    sources)
        return StepOutput(logits.float(), aux)

    def _replay(self, packed: Packed, bucket: int, max_context: int | None = None) -> StepOutput:
        g = self.graphs.get(bucket)
        if g is None:
            raise ValueError(f"no CUDA graph captured for {bucket} rows; captured: {self.buckets}")
        n = packed.num_decode
        if packed.chunks or n > bucket:
            raise ValueError(f"graph bucket {bucket} replays steps of at most {bucket} single-token rows; "
                             f"the step has {n} such rows and {len(packed.chunks)} prefill chunks")
        long = self.long_graphs.get(bucket)
        longest = packed.max_context if max_context is None else max_context
        use_long = long is not None and longest is not None and longest >= long.min_context
        if use_long:
            g = long
        rows = None if packed.sample_rows == list(range(n)) else to_device(packed.sample_rows, self.device,
                                                                               torch.int64)
        g.load(packed)
        if g.graph is not None:
            for segment in g.graph:  # segment i runs on the GPU while segment i + 1 is launched
                segment.replay()
            logits, aux = g.out, g.aux
        else:
            self._activate(bucket, g.valid_rows)
            try:
                batch = AttnBatch(self.kv, g.slot_mapping, bucket, g.block_tables, g.context_lens,
                                  max_context=g.min_context)
                logits, aux = self._forward(g.input_ids, g.positions, batch, None, g.sources)
            finally:
                self._deactivate()
        logits = logits[:n] if rows is None else logits.index_select(0, rows)
        return StepOutput(logits.float(), None if aux is None else aux[:n], use_long)

    def _replay_pieces(self, packed: Packed, piece: int) -> StepOutput:
        g = self.piece_graphs.get(piece)
        n = packed.input_ids.numel()
        if g is None or n > piece:
            raise ValueError(f"no piecewise graphs of {piece} rows for a step of {n} rows; captured: "
                             f"{self.piece_buckets}")
        dev = self.device
        batch = packed.attn_batch(self.kv, dev)
        g.load(packed)
        if g.graph is not None:
            for i, graph in enumerate(g.graph):  # attention i runs (eagerly) after piece i, before piece i + 1
                graph.replay()
                if i < len(g.cuts):
                    g.cuts[i].run(batch, n)
            hidden, aux = g.out, g.aux
        else:
            self._activate(piece, g.valid_rows)
            self.pieces.set_batch(batch, n)
            try:
                hidden, aux = self._body(g.input_ids, g.positions, self._piece_batch(g), g.sources)
            finally:
                self.pieces.set_batch(None, 0)
                self._deactivate()
        rows = to_device(packed.sample_rows, dev, torch.int64)
        return StepOutput(self.lm_head(hidden.index_select(0, rows)).float(), None if aux is None else aux[:n])

    def _piece_batch(self, g: GraphBucket) -> AttnBatch:
        """The ``AttnBatch`` a piecewise forward runs with: the static slot mapping (cache writes) and the cuts."""
        none = torch.zeros(0, dtype=torch.int32, device=self.device)
        return AttnBatch(self.kv, g.slot_mapping, 0, none.view(0, 0), none, pieces=self.pieces)

    def _long_context(self, bs: int) -> int | None:
        """The least longest context from which a step of ``bs`` rows attends with another MLA decode tile than its
        shapes give (``mla_decode.wide_tile_min_context``), if the block tables reach it; else ``None`` (one graph
        serves every context)."""
        if not self.kv.layout.latent:
            return None
        least = wide_tile_min_context(bs, self.model.config.num_attention_heads, self.device, self.kv.k[0].dtype)
        return least if least is not None and least <= self.max_blocks * self.kv.block_size else None

    def _workspace(self, sizes: list[int]) -> torch.Tensor:
        """Split-K scratch of the decode kernel for the largest need over ``sizes``, shared by every
        bucket's graph (graphs never run at once)."""
        heads = self.model.config.num_attention_heads
        layout = self.kv.layout
        if layout.latent:  # MLA: the latent decode kernel, same workspace layout; long-context graphs' tiles too
            positions = self.max_blocks * self.kv.block_size
            return torch.empty(max(paged_decode_workspace_numel(bs, heads, layout.v_head_dim,
                                                                mla_decode_splits(bs, heads, positions, self.device,
                                                                                  max_context=least))
                                   for bs in sizes for least in (None, self._long_context(bs))),
                               dtype=torch.float32, device=self.device)
        k0, dv = self.kv.k[0], self.kv.v[0].shape[-1]
        need = 1
        for bs in sizes:  # the split count depends on shapes only: empty tensors of the bucket's shapes
            q = torch.empty(bs, heads, k0.shape[-1], dtype=k0.dtype, device=self.device)
            tables = torch.empty(bs, self.max_blocks, dtype=torch.int32, device=self.device)
            need = max(need, paged_decode_workspace_numel(bs, heads, dv, paged_decode_splits(q, k0, tables)))
        return torch.empty(need, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def capture(self, sizes: list[int], activate, deactivate, cuda_graphs: bool = True) -> None:
        """Prepare one static decode step per row count: captured as a CUDA graph (largest first, sharing
        one memory pool), or, without ``cuda_graphs``, kept to run eagerly on the same padded static
        tensors (the graph path, testable on CPU). With a latent (MLA) cache, a row count whose decode tile the
        longest context changes (``_long_context``) gets a second graph, replayed for steps whose longest context
        reaches its ``min_context``: the graphs differ only in the attention kernel's tile and split count (its grid
        and split merge). The engine agrees on the step's longest context with its other per-step values
        (``run(..., max_context=...)``), so the ranks of an EP group replay the same kind of graph.

        Args:
            sizes: row counts (decode batch sizes; with speculation also ``batch x (K + 1)``).
            activate: called with the row count and its ``[bs]`` int64 row mask (1 = real row, 0 =
                padding; set before every replay) before the static step runs or is captured: the engine
                switches the MoE layers to a dispatcher of that size and masks the load recorder there.
            deactivate: called after, to restore the eager set-up.
            cuda_graphs: capture CUDA graphs (the device must be CUDA).
        """
        self._activate, self._deactivate = activate, deactivate
        dev = self.device
        # the graphs write into this scratch at every replay: it lives as long as they do (freed, the caching
        # allocator would hand its memory to other tensors or return it to the driver under memory pressure)
        workspace = self._graph_workspace = self._workspace(sizes) if sizes and cuda_graphs else None
        for bs in sorted(sizes, reverse=True):
            g = GraphBucket.empty(bs, self.max_blocks, dev)
            long = self._long_context(bs)
            kinds = [g]
            if long is not None:  # a second graph whose MLA decode takes the tile of contexts from ``long`` on
                kinds.append(GraphBucket.empty(bs, self.max_blocks, dev))
                kinds[1].min_context = long
            for one in kinds:
                if cuda_graphs:
                    activate(bs, one.valid_rows)
                    try:
                        one.graph, one.out, one.aux = self._capture_one(one, workspace)
                    finally:
                        deactivate()
            self.graphs[bs] = g
            if long is not None:
                self.long_graphs[bs] = kinds[1]
        if cuda_graphs:
            torch.cuda.synchronize(dev)

    @torch.no_grad()
    def capture_pieces(self, sizes: list[int], activate, deactivate, cuda_graphs: bool = True) -> None:
        """Prepare the piecewise forward of each token count in ``sizes`` (``engine.piecewise``): captured as
        graphs between the attention calls (largest first, in the decode graphs' memory pool), or, without
        ``cuda_graphs``, kept to run on the same padded static tensors with each attention run at once (the
        piecewise path, testable on CPU). ``activate``/``deactivate`` as in ``capture``.
        """
        self._activate, self._deactivate = activate, deactivate
        self.piece_graphs = {}
        if not sizes:
            self.pieces = None
            return
        self.pieces = Pieces(max(sizes))
        for n in sorted(sizes, reverse=True):
            g = GraphBucket.empty(n, 0, self.device)
            if cuda_graphs:
                activate(n, g.valid_rows)
                try:
                    g.graph, g.cuts, g.out, g.aux = self._capture_pieces_one(g)
                finally:
                    deactivate()
            self.piece_graphs[n] = g
        if cuda_graphs:
            torch.cuda.synchronize(self.device)

    def _side_stream(self) -> torch.cuda.Stream:
        """The one stream every bucket's warm-up and capture runs on: the blocks a warm-up leaves in the caching
        allocator belong to its stream, so with a stream per bucket no bucket could reuse another's, and the graph
        pool, which cannot make the allocator hand cached blocks back during a capture, would run out of memory."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=self.device)
        return self._capture_stream

    def _capture_pieces_one(self, g: GraphBucket):
        """One piecewise bucket: warm-up forwards recording cuts without graphs (they allocate the staging buffers),
        then the capture, a new graph begun at each cut."""
        dev = self.device
        batch = self._piece_batch(g)
        g.sources.fill_(-1)
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.pieces.record(None)
                try:
                    self._body(g.input_ids, g.positions, batch, g.sources)
                finally:
                    self.pieces.stop()
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = [torch.cuda.CUDAGraph()]

        def next_piece() -> None:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self._pool)

        torch.cuda.synchronize(dev)
        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=self._pool)
            self.pieces.record(next_piece)
            try:
                hidden, aux = self._body(g.input_ids, g.positions, batch, g.sources)
            finally:
                graphs[-1].capture_end()
                cuts = self.pieces.stop()
        torch.cuda.current_stream(dev).wait_stream(stream)
        return tuple(graphs), tuple(cuts), hidden, aux

    def segment_starts(self) -> list[int]:
        """Decoder layers that begin a new graph segment: the layers split into ``graph_segments`` runs."""
        n = len(self.base.layers)
        parts = max(1, min(self.graph_segments, n))
        return [round(i * n / parts) for i in range(1, parts)]

    def _capture_one(self, g: GraphBucket, workspace: torch.Tensor | None):
        """Capture one bucket's step as consecutive graphs, a new one at each ``segment_starts`` layer (called by
        ``decoder_forward`` before the layer, it ends the running capture and begins the next, all in one memory
        pool): replaying them in order
        lets the GPU run a segment while the host launches the next, instead of waiting for one launch of the
        whole step's kernels."""
        dev = self.device
        batch = AttnBatch(self.kv, g.slot_mapping, g.bs, g.block_tables, g.context_lens, workspace=workspace,
                          max_context=g.min_context)
        g.sources.fill_(-1)
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton autotuning and lazy allocations happen outside capture
                self._forward(g.input_ids, g.positions, batch, None, g.sources)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        starts = self.segment_starts()
        graphs = [torch.cuda.CUDAGraph() for _ in range(len(starts) + 1)]
        current = [0]

        def next_segment(layer: int) -> None:
            if layer in starts:
                graphs[current[0]].capture_end()
                current[0] += 1
                graphs[current[0]].capture_begin(pool=self._pool)

        self._before_layer = next_segment
        torch.cuda.synchronize(dev)
        try:
            with torch.cuda.stream(stream):
                graphs[0].capture_begin(pool=self._pool)
                try:
                    logits, aux = self._forward(g.input_ids, g.positions, batch, None, g.sources)
                finally:
                    graphs[current[0]].capture_end()
        finally:
            self._before_layer = None
        torch.cuda.current_stream(dev).wait_stream(stream)
        return tuple(graphs), logits, aux
