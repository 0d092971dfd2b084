"""Paged decode attention: one query token per sequence against its keys in a block-paged KV cache.

The cache holds ``NB`` blocks of ``BS`` token slots each; sequence ``b`` owns the blocks listed in row
``b`` of ``block_tables`` in order, so its key at position ``p`` lives at
``k_cache[block_tables[b, p // BS], p % BS]``. The query of sequence ``b`` is the token at position
``ctx_b - 1`` (``ctx_b = context_lens[b]``), already written to the cache, and it attends to the
positions ``0 .. ctx_b - 1`` that its mask keeps:

* a sliding window ``W`` keeps ``p > (ctx_b - 1) - W`` (the window includes the current token, as in
  transformers' ``sliding_window_overlay``);
* a chunk size ``C`` (Llama-4 chunked attention) keeps ``p // C == (ctx_b - 1) // C``;
* attention sinks (gpt-oss) add ``exp(sink_h)`` to the softmax denominator of head ``h`` with a zero
  value (a logit column that is dropped after the softmax).

``ctx_b == 0`` marks a padding row (CUDA-graph batches padded to a captured size): its output is zeros
and the kernel reads nothing of its block table row or the cache for it.

Two implementations with the same semantics:

* ``paged_decode_reference``: PyTorch, float32 math, used for CPU tensors and as the tests' oracle. It
  gathers all ``MB`` blocks of every row (``MB * BS`` positions) and masks, so it has no host
  synchronisation either.
* ``paged_decode_triton``: the Triton kernels for CUDA tensors (and the Triton interpreter). Program
  ``(b, g, s)`` of ``decode_kernels.paged_decode_kernel`` serves the whole GQA group of kv head ``g`` (``H // Hkv``
  query heads, padded to at least 16 rows for ``tl.dot``), so every K/V row is read once per kv head.
  It walks its keys in tiles of ``BLOCK_N`` positions gathered through the block table (one block id
  per key, so any ``BS``, aligned or not), with an online softmax in float32 (base 2) and the
  length/window/chunk masks. Only positions inside the mask are visited: the loop starts at the
  window's or chunk's first position. With one split (``s`` always 0) the program normalises, adds
  the sink and writes ``out``; with ``S > 1`` splits (flash-decoding, for few sequences times kv heads
  with long contexts) each program takes one contiguous ``S``-th of the sequence's visible positions
  (a multiple of ``BLOCK_N``, so the splits follow the actual context lengths on the device) and writes
  its running max, sum and unnormalised accumulator to a float32 workspace;
  ``decode_kernels.paged_decode_reduce_kernel`` (grid ``(B, H)``) merges the splits and the sink.

Grids and the number of splits depend on shapes only (``B``, ``Hkv``, ``MB * BS``, the window and chunk
sizes, the SM count), never on device values: no host synchronisation, CUDA-graph safe. With ``out``
given nothing is allocated, so split-K then needs a ``workspace`` (``paged_decode_workspace``); without
one the single-pass kernel runs. On Hopper both kernels are programmatic dependent launches
(``experts.triton.pdl``): each is placed while the kernel before it finishes and waits for it before reading.

Triton is imported on first use of the Triton path (``_triton_kernels``), so this module imports on
machines without Triton and serves CPU tensors there.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from epmoe.checks import describe
from epmoe.experts.triton.pdl import pdl_launch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
_MIN_ROWS = 16           # tl.dot needs at least 16 rows / columns
_SPLIT_MIN_KEYS = 64     # positions a split should have at least
_BOUNDED_SPLIT_MIN_KEYS = 32  # the same where a window or chunk bounds the span: one key tile
_MAX_SPLITS = 128
_PROGRAMS_PER_SM = 4     # the split count aims at this many programs an SM


def _check_int_option(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be None or a positive int, got {value!r}")


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, chunk_size, sinks,
                  out) -> None:
    """Host-side checks of shapes, dtypes, devices and layouts (never reads device values)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, Dk], got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if q.shape[2] > 0 and q.stride(2) != 1:
        raise ValueError(f"q must be contiguous along its last dim, got strides {q.stride()}")
    b, h, dk = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [NB, BS, Hkv, D], got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    nb, bs, hkv, dk_cache = k_cache.shape
    if dk_cache != dk:
        raise ValueError(f"k_cache's head dim must equal q's Dk {dk}, got shape {tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (nb, bs, hkv):
        raise ValueError(f"v_cache must be [NB, BS, Hkv, Dv] = [{nb}, {bs}, {hkv}, Dv] like k_cache, "
                         f"got shape {tuple(v_cache.shape)}")
    if nb < 1 or bs < 1 or hkv < 1 or dk < 1 or v_cache.shape[3] < 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have no "
                         f"empty dim (and q's Dk {dk} must be positive)")
    if h < 1 or h % hkv:
        raise ValueError(f"q's head count must be a positive multiple of the caches' Hkv {hkv}, got H = {h}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B, MB] with B = {b} and MB >= 1, got shape "
                         f"{tuple(block_tables.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables must be on q's device {q.device}, got {block_tables.device}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous along its last dim, got strides {block_tables.stride()}")
    if context_lens.dim() != 1 or context_lens.shape[0] != b:
        raise ValueError(f"context_lens must be [B] with B = {b}, got shape {tuple(context_lens.shape)}")
    if context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32, got {context_lens.dtype}")
    if context_lens.device != q.device:
        raise ValueError(f"context_lens must be on q's device {q.device}, got {context_lens.device}")
    if b > 1 and context_lens.stride(0) != 1:
        raise ValueError(f"context_lens must be contiguous, got stride {context_lens.stride(0)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number, got {scale!r}")
    _check_int_option("sliding_window", sliding_window)
    _check_int_option("chunk_size", chunk_size)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != h:
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be None or a [H] = [{h}] tensor, got {shape}")
        if not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must have a float dtype, got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    if out is not None:
        want = (b, h, v_cache.shape[3])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be None or a [B, H, Dv] = {list(want)} tensor, got {shape}")
        if out.dtype != q.dtype:
            raise ValueError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
        if out.device != q.device:
            raise ValueError(f"out must be on q's device {q.device}, got {out.device}")
        if out.stride(2) != 1:
            raise ValueError(f"out must be contiguous along its last dim, got strides {out.stride()}")


def check_host_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                      block_size: int) -> None:
    """For CPU tensors only (reading them costs no device synchronisation): raise ``ValueError`` naming the
    argument and the value unless every entry of ``block_tables [B, MB]`` is a block id in ``[0, num_blocks)`` and
    every ``context_lens [B]`` is in ``[0, MB * block_size]``. CUDA tensors are not read (the kernels trust them).
    Shared with ``engine.mla_decode``."""
    if block_tables.is_cuda or context_lens.is_cuda:
        return
    if block_tables.numel():
        lo, hi = int(block_tables.min()), int(block_tables.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"block_tables holds block id {bad}; the cache has blocks 0..{num_blocks - 1}")
    if context_lens.numel():
        span = block_tables.shape[1] * block_size
        lo, hi = int(context_lens.min()), int(context_lens.max())
        if lo < 0 or hi > span:
            bad = lo if lo < 0 else hi
            raise ValueError(f"context_lens holds {bad}; a context must be in 0..{span} (MB * BS = "
                             f"{block_tables.shape[1]} * {block_size})")


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention in PyTorch (float32 math); the semantics of ``paged_decode_attention``.

    Gathers all ``MB`` blocks of every block table row (entries past a context are read but masked, so
    they must be valid block ids) into ``[B, MB * BS]`` positions, masks them and takes a softmax with
    the optional sink column. No host synchronisation.

    Args:
        q: see ``paged_decode_attention``.
        k_cache: see ``paged_decode_attention``.
        v_cache: see ``paged_decode_attention``.
        block_tables: see ``paged_decode_attention``.
        context_lens: see ``paged_decode_attention``.
        scale: see ``paged_decode_attention``.
        sliding_window: see ``paged_decode_attention``.
        chunk_size: see ``paged_decode_attention``.
        sinks: see ``paged_decode_attention``.
        out: see ``paged_decode_attention``.

    Returns:
        ``[B, H, Dv]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ValueError: as ``paged_decode_attention``; on the CPU also a block id outside the cache or a context
            length outside ``0 .. MB * BS`` (``check_host_tables``, named).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, chunk_size, sinks, out)
    check_host_tables(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])
    b, h, dk = q.shape
    _, bs, hkv, dv = v_cache.shape
    g = h // hkv
    mb = block_tables.shape[1]
    blocks = block_tables.long()
    k = k_cache[blocks].reshape(b, mb * bs, hkv, dk).float()                   # [B, L, Hkv, Dk]
    v = v_cache[blocks].reshape(b, mb * bs, hkv, dv).float()                   # [B, L, Hkv, Dv]
    qf = q.float().reshape(b, hkv, g, dk)
    logits = torch.einsum("bkgd,blkd->bkgl", qf, k) * float(scale)            # [B, Hkv, G, L]
    pos = torch.arange(mb * bs, device=q.device)[None, :]
    ctx = context_lens.long()[:, None]
    keep = pos < ctx
    if sliding_window is not None:
        keep &= pos > ctx - 1 - sliding_window
    if chunk_size is not None:
        keep &= pos // chunk_size == (ctx - 1) // chunk_size
    logits = logits.masked_fill(~keep[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, g, 1).expand(b, hkv, g, 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    res = torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(b, h, dv)
    res = torch.where((context_lens > 0)[:, None, None], res, torch.zeros((), device=q.device))
    res = res.to(q.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


@functools.cache
def _triton_kernels():
    """The Triton kernels (``decode_kernels``, imported on first use); raises ImportError without Triton."""
    from epmoe.engine import decode_kernels as kernels

    return kernels.paged_decode_kernel, kernels.paged_decode_reduce_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_n(dk: int, dv: int, dtype: torch.dtype) -> int:
    """Keys per tile: 32, 16 for float32 with a head dim over 64. With the whole tile's gathered row pointers
    in registers, 64 keys of 128-wide bf16 heads (or 32 of float32) spill on sm_90 with 4 warps
    (compile-time register counts)."""
    return 16 if dtype == torch.float32 and max(dk, dv) > 64 else 32


def paged_decode_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                        sliding_window: int | None = None, chunk_size: int | None = None) -> int:
    """Number of context splits (a power of two) the Triton path uses for these shapes.

    One split when the ``B * Hkv`` programs fill the GPU or the longest visible span (``MB * BS``, at most
    the window or chunk size) is short; otherwise enough splits to reach about ``_PROGRAMS_PER_SM`` programs per SM,
    each with at least ``_SPLIT_MIN_KEYS`` positions of the longest span (``_BOUNDED_SPLIT_MIN_KEYS``, one key tile,
    where a window or chunk bounds it, and never more splits than without them), at most ``_MAX_SPLITS``: a program
    reads its keys one tile after the other, so one long context needs many programs to approach the memory's rate
    (measured on an H200, ``benchmarks/HISTORY.md``, as the windowed bound). Depends on shapes and options only, so a
    CUDA graph captured for a batch shape keeps its split count.

    Args:
        q: ``[B, H, Dk]`` query (its device picks the SM count; CPU counts 132 SMs).
        k_cache: ``[NB, BS, Hkv, Dk]``.
        block_tables: ``[B, MB]``.
        sliding_window: the window, or None.
        chunk_size: the chunk size, or None.

    Returns:
        The split count ``S >= 1``.
    """
    b = q.shape[0]
    hkv = k_cache.shape[2]
    table_span = block_tables.shape[1] * k_cache.shape[1]
    span = min([table_span] + [n for n in (sliding_window, chunk_size) if n is not None])
    min_keys = _BOUNDED_SPLIT_MIN_KEYS if span < table_span else _SPLIT_MIN_KEYS
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else 132
    programs = max(1, b * hkv)
    # never more than without the window or chunk, so that a workspace sized for the table's span holds any layer's
    want = min(_MAX_SPLITS, (_PROGRAMS_PER_SM * sms) // programs, span // min_keys, table_span // _SPLIT_MIN_KEYS)
    if want < 2:
        return 1
    return 1 << (want.bit_length() - 1)


def paged_decode_workspace(q: torch.Tensor, v_cache: torch.Tensor, splits: int) -> torch.Tensor:
    """A float32 workspace for split-K with ``splits`` splits: ``B * H * splits * (Dv + 2)`` elements.

    Allocate it outside CUDA-graph capture (or let it live in the graph's pool) and pass it to
    ``paged_decode_attention(..., workspace=...)`` along with ``out`` to keep split-K in captured graphs.

    Args:
        q: ``[B, H, Dk]`` query.
        v_cache: ``[NB, BS, Hkv, Dv]``.
        splits: the split count (``paged_decode_splits``).

    Returns:
        An uninitialised 1-D float32 tensor on ``q.device``.
    """
    b, h, _ = q.shape
    return torch.empty(paged_decode_workspace_numel(b, h, v_cache.shape[3], splits), dtype=torch.float32,
                       device=q.device)


def paged_decode_workspace_numel(batch: int, heads: int, v_head_dim: int, splits: int) -> int:
    """float32 elements of split-K's workspace: per row, head and split, ``Dv`` partial outputs plus the
    running max and sum."""
    return batch * heads * splits * (v_head_dim + 2)


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention with the Triton kernels (see the module docstring), whatever the device.

    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Arguments as ``paged_decode_attention``,
    plus:

    Args:
        q: see ``paged_decode_attention``.
        k_cache: see ``paged_decode_attention``.
        v_cache: see ``paged_decode_attention``.
        block_tables: see ``paged_decode_attention``.
        context_lens: see ``paged_decode_attention``.
        scale: see ``paged_decode_attention``.
        sliding_window: see ``paged_decode_attention``.
        chunk_size: see ``paged_decode_attention``.
        sinks: see ``paged_decode_attention``.
        out: see ``paged_decode_attention``.
        splits: context splits (a power of two); ``paged_decode_splits`` when None.
        workspace: float32 1-D tensor of at least ``paged_decode_workspace``'s size for split-K. When
            ``splits > 1`` and it is None, one is allocated if ``out`` is None; with ``out`` given the
            single-pass kernel runs instead (nothing is allocated).

    Returns:
        ``[B, H, Dv]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ValueError: as ``paged_decode_attention``; ``splits`` not a power of two; a workspace too small,
            not float32 or on another device.
        ImportError: Triton is not importable.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, chunk_size, sinks, out)
    b, h, dk = q.shape
    _, bs, hkv, dv = v_cache.shape
    if splits is None:
        splits = paged_decode_splits(q, k_cache, block_tables, sliding_window, chunk_size)
    if isinstance(splits, bool) or not isinstance(splits, numbers.Integral) or splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two >= 1, got {splits!r}")
    if splits > 1:
        need = b * h * splits * (dv + 2)
        if workspace is None:
            workspace = paged_decode_workspace(q, v_cache, splits) if out is None else None
        elif (not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32
              or workspace.device != q.device or workspace.dim() != 1
              or workspace.numel() < need):
            raise ValueError(f"workspace must be a 1-D float32 tensor on {q.device} with at least {need} elements, "
                             f"got {describe(workspace)}")
        if workspace is None:
            splits = 1
    if out is None:
        out = torch.empty((b, h, dv), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    kernel, _ = _triton_kernels()
    g = h // hkv
    dk_pad, dv_pad = max(_MIN_ROWS, _next_pow2(dk)), max(_MIN_ROWS, _next_pow2(dv))
    sink_arg = sinks if sinks is not None else context_lens
    ws_arg = workspace if splits > 1 else out
    ml_off = b * h * splits * dv
    pdl = pdl_launch(q)
    kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, sink_arg, out, ws_arg,
        b, h, dk, dv, ml_off, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), float(scale) * _LOG2E, sliding_window or 0, chunk_size or 1,
        G=g, G_PAD=max(_MIN_ROWS, _next_pow2(g)), DK_PAD=dk_pad, DV_PAD=dv_pad, BLOCK_SIZE=bs,
        BLOCK_N=_block_n(dk, dv, q.dtype), SPLITS=splits, HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None, HAS_SINKS=sinks is not None, IEEE=q.dtype == torch.float32,
        PDL=pdl, num_warps=4, num_stages=2, launch_pdl=pdl,
    )
    if splits > 1:
        paged_decode_merge_splits(workspace, context_lens, out, splits, sinks)
    return out


def paged_decode_merge_splits(workspace: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, splits: int,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge split-K partial results into ``out`` (the reduce kernel; also used by ``mla_decode``).

    Args:
        workspace: float32, the layout ``paged_decode_workspace_numel`` sizes: per row ``b``, head ``h`` and split
            ``s`` (``r = (b * H + h) * S + s``) the unnormalised accumulator at ``r * Dv``, then the running max
            (base 2) at ``B * H * S * Dv + r`` and the running sum at ``B * H * S * (Dv + 1) + r``.
        context_lens: ``[B]`` int32; rows with 0 get zeros.
        out: ``[B, H, Dv]``, contiguous along ``Dv``, written and returned.
        splits: ``S``, a power of two.
        sinks: ``[H]`` sink logits added to the denominator, or None.

    Returns:
        ``out``.
    """
    _, reduce_kernel = _triton_kernels()
    b, h, dv = out.shape
    pdl = pdl_launch(out)
    reduce_kernel[(b, h)](
        workspace, context_lens, sinks if sinks is not None else context_lens, out, b, h, dv, b * h * splits * dv,
        out.stride(0), out.stride(1), DV_PAD=max(_MIN_ROWS, _next_pow2(dv)), SPLITS=splits,
        HAS_SINKS=sinks is not None, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a block-paged KV cache.

    CUDA tensors run the Triton kernels (``paged_decode_triton``); CPU tensors run
    ``paged_decode_reference``. Softmax and accumulation are float32. No host synchronisation and, with
    ``out`` given, no allocation (CUDA-graph capture safe); shapes are checked on the host, device values
    never read.

    Args:
        q: ``[B, H, Dk]`` float32/bfloat16/float16 queries, contiguous along ``Dk`` (other strides free).
        k_cache: ``[NB, BS, Hkv, Dk]`` keys in ``q.dtype``, contiguous; ``H`` a multiple of ``Hkv``
            (query head ``h`` uses kv head ``h // (H // Hkv)``).
        v_cache: ``[NB, BS, Hkv, Dv]`` values in ``q.dtype``, contiguous (``Dv`` may differ from ``Dk``).
        block_tables: ``[B, MB]`` int32, ``MB >= 1``, contiguous along ``MB``: the blocks of sequence ``b``
            in order (position ``p`` in block ``block_tables[b, p // BS]``, slot ``p % BS``); entries past
            the context must still be valid block ids (the reference gathers them; the kernel does not).
        context_lens: ``[B]`` int32 context lengths, at most ``MB * BS``; the query is the token at
            position ``ctx - 1``; ``0`` marks a padding row (zeros out, nothing read).
        scale: multiplier of ``q . k``.
        sliding_window: keep only positions ``p > ctx - 1 - sliding_window``; None for no window.
        chunk_size: keep only positions ``p // chunk_size == (ctx - 1) // chunk_size``; None for none.
        sinks: ``[H]`` float (any float dtype) sink logits adding ``exp(sink_h)`` to the denominator; or None.
        out: ``[B, H, Dv]`` in ``q.dtype``, contiguous along ``Dv``, written and returned; or None.
        workspace: CUDA only: float32 split-K workspace (``paged_decode_workspace``) so that split-K also
            runs when ``out`` is given; ignored on CPU.

    Returns:
        ``[B, H, Dv]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ValueError: a wrong rank, shape, dtype, device or layout of an argument, a non-positive
            ``sliding_window``/``chunk_size``, a non-finite ``scale``; the message names the argument.
        TypeError: ``q``, a cache, ``block_tables`` or ``context_lens`` is not a tensor.
        RuntimeError: CUDA tensors without an importable Triton.
    """
    if isinstance(q, torch.Tensor) and q.is_cuda:
        try:
            _triton_kernels()
        except ImportError as err:
            raise RuntimeError(f"paged_decode_attention needs the triton package for CUDA tensors: {err}") from err
        return paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                   sliding_window=sliding_window, chunk_size=chunk_size, sinks=sinks, out=out,
                                   workspace=workspace)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale,
                                  sliding_window=sliding_window, chunk_size=chunk_size, sinks=sinks, out=out)
