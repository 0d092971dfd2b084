"""Attention over the paged KV cache, as a transformers attention function.

The engine keeps transformers' attention modules (projections, q/k norms, rotary embeddings, MLA's
low-rank projections) and replaces only the attention itself: the modules call the function registered
here under ``ATTN_IMPLEMENTATION`` with the new tokens' queries, keys and values, and the step's
``AttnBatch`` travels to it as the keyword ``epmoe_batch`` (transformers forwards unknown keywords from
the model's ``forward`` to every attention call). The function writes the new keys and values into
the pages, then attends: one kernel for the single-token rows (decode, ``paged_decode``), and per
prefill chunk a dense attention over the sequence's cached prefix and the chunk itself.

Masks follow the attention variants of the served families: causal; sliding window (gpt-oss, Mistral:
keys within the last ``sliding_window`` positions, the current one included); chunked attention
(Llama-4's ``chunked_attention`` layers: keys in the same ``attention_chunk_size`` chunk); attention
sinks (gpt-oss: a per-head logit added to the softmax denominator with no value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epmoe.engine.kv_cache import KVCache
from epmoe.engine.paged_decode import paged_decode_attention
from epmoe.engine.piecewise import Pieces

ATTN_IMPLEMENTATION = "epmoe_paged"


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's rows of a step that are not single-token rows.

    Attributes:
        q_start: first row of the chunk in the step's packed tokens.
        q_len: rows (tokens) in the chunk.
        start_pos: position of its first token (tokens before it are in the cache).
        kv_slots: ``[start_pos + q_len]`` int64 flat cache slot of each of the sequence's keys so far
            (computed once per step, read by every layer).
    """

    q_start: int
    q_len: int
    start_pos: int
    kv_slots: torch.Tensor


@dataclass(frozen=True)
class AttnBatch:
    """Everything attention needs for one step, for every layer.

    Rows ``[0, num_decode)`` of the packed tokens are single-token rows (decode, or a one-token
    prompt): row ``b`` attends to ``context_lens[b]`` keys through ``block_tables[b]``; padding rows
    of a graph replay have context length 0 and write into the padding block. The other rows are the
    ``prefills`` chunks, in order.

    Attributes:
        kv: the cache pools.
        slot_mapping: ``[T]`` int64 flat cache slot of every new token.
        num_decode: single-token rows.
        block_tables: ``[num_decode, max_blocks]`` int32.
        context_lens: ``[num_decode]`` int32 keys of each row, its own included.
        prefills: the multi-token chunks.
        workspace: float32 scratch of the decode kernel's split-K inside a graph (``None`` in eager steps,
            which let the kernel allocate its own).
        pieces: a piecewise forward's cuts (``engine.piecewise``): attention goes through ``pieces.cut`` and runs on
            the step's real batch there; the other fields then serve only the cache writes (``slot_mapping``).
        max_context: the longest of ``context_lens`` (or, in a captured graph, the least longest context the graph
            serves), known on the host; it picks the MLA decode kernel's tile (``mla_decode.mla_decode_tiles``).
            ``None``: the tile by shapes alone.
    """

    kv: KVCache
    slot_mapping: torch.Tensor
    num_decode: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    prefills: tuple[PrefillChunk, ...] = ()
    workspace: torch.Tensor | None = None
    pieces: Pieces | None = None
    max_context: int | None = None


def engine_batch(module: str, rows: torch.Tensor, epmoe_batch: AttnBatch | None) -> AttnBatch:
    """The step's ``AttnBatch`` an engine attention module was called with, checked.

    Args:
        module: the calling module's name, for the error.
        rows: the module's input, batch dimension first (the engine packs a step's tokens in one row).
        epmoe_batch: the keyword the engine passes through the model's ``forward``.

    Raises:
        ValueError: no ``epmoe_batch`` (the model runs outside the engine), or a batch dimension other than 1.
    """
    if epmoe_batch is None:
        raise ValueError(f"{module} needs the engine's epmoe_batch: this model runs through epmoe.engine.Engine")
    if rows.shape[0] != 1:
        raise ValueError(f"the engine packs tokens in one row: batch dimension must be 1, got {rows.shape[0]}")
    return epmoe_batch


def _chunk_size(module) -> int | None:
    """Llama-4's attention chunk for a ``chunked_attention`` layer, else ``None``."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if types and types[module.layer_idx] == "chunked_attention":
        return int(config.attention_chunk_size)
    return None


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float, *,
                    sliding_window: int | None = None, chunk_size: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``n`` consecutive query tokens over a sequence's first ``start_pos + n`` keys.

    Args:
        q: ``[n, H, Dk]`` queries at positions ``start_pos .. start_pos + n - 1``.
        k: ``[start_pos + n, Hkv, Dk]`` keys at positions ``0 ..``; v: ``[start_pos + n, Hkv, Dv]``.
        start_pos: position of the first query.
        scale: multiplier of ``q . k``.
        sliding_window, chunk_size, sinks: as in ``paged_decode.paged_decode_attention``. ``sinks`` enter as one
            more key (``_sink_attention``).

    Returns:
        ``[n, H, Dv]`` in ``q.dtype``.
    """
    n, h, _ = q.shape
    if sinks is not None:
        return _sink_attention(q, k, v, start_pos, scale, sliding_window, chunk_size, sinks)
    ctx = k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, Dk]: 4-D, so SDPA can pick its fused kernels
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = h != k.shape[1]
    if start_pos == 0 and sliding_window is None and chunk_size is None:
        # a whole prompt from its start: plain causal attention, no mask to build (a prefill runs this per layer)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    allowed = _allowed(start_pos, n, 0, ctx, sliding_window, chunk_size, q.device)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _allowed(start_pos: int, n: int, lo: int, hi: int, sliding_window: int | None, chunk_size: int | None,
             device: torch.device) -> torch.Tensor:
    """``[n, hi - lo]`` bool: which of the keys at positions ``lo .. hi - 1`` each query at ``start_pos ..
    start_pos + n - 1`` attends (causal, within its window and its chunk)."""
    qpos = torch.arange(start_pos, start_pos + n, device=device).unsqueeze(1)
    kpos = torch.arange(lo, hi, device=device).unsqueeze(0)
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed &= kpos > qpos - sliding_window
    if chunk_size is not None:
        allowed &= (kpos // chunk_size) == (qpos // chunk_size)
    return allowed


SINK_QUERY_BLOCK = 1024
"""``_sink_attention`` takes a windowed or chunked layer's queries, or a chunk after cached positions, this many at
a time, each block over the keys it may attend (one fused call a block, not one over every key)."""


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float,
                    sliding_window: int | None, chunk_size: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """``dense_attention`` with gpt-oss's sinks (a per-head logit in the softmax's denominator, with no value) through
    ``scaled_dot_product_attention``: the sink is one more key, first, that every query attends. The queries gain a
    component ``sinks[h] / scale``, the keys a zero there and the sink key a one (its value zero), so that its logit
    is ``sinks[h]``; the head size is padded with zeros to a multiple of 8 for the fused kernels, and the key heads are
    repeated to the query heads (their grouped form may leave the fused kernels). A whole causal prompt runs as one
    square causal call with a query row of zeros ahead of the prompt's (row ``i + 1`` then attends the sink and keys
    ``0 .. i``; no mask tensor); otherwise blocks of ``SINK_QUERY_BLOCK`` queries with their masks. ``sinks[h] /
    scale`` is rounded to ``q``'s dtype: exact for a power-of-two ``scale`` (gpt-oss's ``1/8``)."""
    n, h, dk = q.shape
    ctx, hkv, dv = k.shape[0], k.shape[1], v.shape[-1]
    d = (dk + 8) // 8 * 8  # dk + 1 rounded up to a multiple of 8
    qa = q.new_zeros(n + 1, h, d)  # row 0: the causal call's extra row
    qa[1:, :, :dk] = q
    qa[1:, :, dk] = (sinks.float() / scale).to(q.dtype)
    ka = k.new_zeros(ctx + 1, hkv, d)
    ka[1:, :, :dk] = k
    ka[0, :, dk] = 1
    va = v.new_zeros(ctx + 1, hkv, dv)
    va[1:] = v
    rep = h // hkv
    kh = ka.transpose(0, 1).repeat_interleave(rep, dim=0)  # [H, ctx + 1, d]
    vh = va.transpose(0, 1).repeat_interleave(rep, dim=0)
    if start_pos == 0 and sliding_window is None and chunk_size is None:
        out = F.scaled_dot_product_attention(qa.transpose(0, 1)[None], kh[None], vh[None], is_causal=True, scale=scale)
        return out[0, :, 1:].transpose(0, 1)
    out = q.new_empty(n, h, dv)
    for a in range(0, n, SINK_QUERY_BLOCK):
        b = min(n, a + SINK_QUERY_BLOCK)
        first, end = start_pos + a, start_pos + b
        lo = 0
        if sliding_window is not None:
            lo = max(lo, first - sliding_window + 1)
        if chunk_size is not None:
            lo = max(lo, first // chunk_size * chunk_size)
        keys = torch.cat([kh[:, :1], kh[:, 1 + lo:1 + end]], dim=1)
        values = torch.cat([vh[:, :1], vh[:, 1 + lo:1 + end]], dim=1)
        allowed = torch.cat([torch.ones(b - a, 1, dtype=torch.bool, device=q.device),
                             _allowed(first, b - a, lo, end, sliding_window, chunk_size, q.device)], dim=1)
        rows = qa[1 + a:1 + b].transpose(0, 1)[None]
        out[a:b] = F.scaled_dot_product_attention(rows, keys[None], values[None], attn_mask=allowed,
                                                  scale=scale)[0].transpose(0, 1)
    return out


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                            epmoe_batch: AttnBatch | None = None, **kwargs):
    """The attention function transformers calls (registered as ``ATTN_IMPLEMENTATION``).

    Args:
        module: the attention module (``layer_idx``, ``config``).
        query: ``[1, H, T, Dk]``; key: ``[1, Hkv, T, Dk]``; value: ``[1, Hkv, T, Dv]`` for the ``T`` new
            tokens of the step, packed (batch dimension 1).
        attention_mask: ignored (the engine's masks come from positions).
        scaling: softmax scale (``Dk ** -0.5`` when ``None``).
        sliding_window: the layer's window, if any.
        s_aux: ``[H]`` attention sinks (gpt-oss), if any.
        epmoe_batch: the step's ``AttnBatch``.

    Returns:
        ``([1, T, H, Dv], None)`` as transformers' attention functions do.

    Raises:
        ValueError: called without ``epmoe_batch`` (the model was run outside the engine), or with a
            batch dimension other than 1.
    """
    epmoe_batch = engine_batch(f"attention implementation {ATTN_IMPLEMENTATION!r}", query, epmoe_batch)
    q = query[0].transpose(0, 1)
    epmoe_batch.kv.write(module.layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1), epmoe_batch.slot_mapping)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    return attend(module, q, epmoe_batch, scale, sliding_window, s_aux).unsqueeze(0), None


def attend(module, q: torch.Tensor, batch: AttnBatch, scale: float, sliding_window: int | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a step's queries over the cache, the step's own keys and values already written.

    Args:
        module: the attention module (``layer_idx``, ``config``: Llama-4's chunked layers).
        q: ``[T, H, Dk]`` the step's queries, packed as ``batch`` says.
        batch: the step's ``AttnBatch``.
        scale: multiplier of ``q . k``.
        sliding_window: the layer's window, if any; sinks: ``[H]`` attention sinks (gpt-oss), if any.

    Returns:
        ``[T, H, Dv]`` in ``q.dtype``.
    """
    layer = module.layer_idx
    kc, vc = batch.kv.k[layer], batch.kv.v[layer]
    if batch.pieces is not None:  # a piecewise forward: the cut runs this again on the step's real batch
        return batch.pieces.cut(lambda real, rows: attend(module, rows, real, scale, sliding_window, sinks),
                                (q.shape[1], vc.shape[-1]), q.dtype, q)
    chunk = _chunk_size(module)
    out = q.new_empty(q.shape[0], q.shape[1], vc.shape[-1])
    nd = batch.num_decode
    if nd:
        opts = dict(sliding_window=sliding_window, chunk_size=chunk, sinks=sinks)
        if batch.workspace is not None:  # graph capture: write in place, split-K in the given scratch
            paged_decode_attention(q[:nd], kc, vc, batch.block_tables, batch.context_lens, scale, **opts,
                                   out=out[:nd], workspace=batch.workspace)
        else:
            out[:nd] = paged_decode_attention(q[:nd], kc, vc, batch.block_tables, batch.context_lens, scale, **opts)
    for p in batch.prefills:
        keys, values = batch.kv.read(layer, p.kv_slots)
        out[p.q_start:p.q_start + p.q_len] = dense_attention(
            q[p.q_start:p.q_start + p.q_len], keys, values, p.start_pos, scale,
            sliding_window=sliding_window, chunk_size=chunk, sinks=sinks,
        )
    return out


def register_attention() -> str:
    """Register ``paged_attention_forward`` with transformers' attention registry (idempotent).

    Returns:
        The implementation name to give a model's config (``ATTN_IMPLEMENTATION``).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
