"""Paged MLA decode attention: one latent-space query token per sequence against its latent KV entries.

Multi-head latent attention (DeepSeek-V2 paper, section 2.1; DeepSeek-V3) caches per token one entry of
``Dk = kv_lora_rank + qk_rope_head_dim`` values, the compressed KV ``c_kv`` followed by the rotary key
``k_rope``, shared by every head. With the up-projections absorbed (``engine.mla``) decode is
multi-query attention over these entries: head ``h``'s query is ``[q_nope_h W_UK_h, q_rope_h]`` (``Dk``
values), its logit over position ``p`` is ``scale * q_h . entry_p``, and its output is the softmax
average of the entries' first ``Dv = kv_lora_rank`` values (``c_kv``), which ``W_UV`` then maps to
the head's value space.

The cache holds ``NB`` blocks of ``BS`` entries; sequence ``b`` owns the blocks of row ``b`` of
``block_tables`` in order (position ``p`` in block ``block_tables[b, p // BS]``, slot ``p % BS``). Its
query is the token at position ``ctx_b - 1`` (``ctx_b = context_lens[b]``, already written) and it
attends to positions ``0 .. ctx_b - 1``. ``ctx_b == 0`` marks a padding row: zeros out, nothing read.

Two implementations with the same semantics:

* ``mla_decode_reference``: PyTorch, float32 math, for CPU tensors and as the tests' oracle; it gathers
  all ``MB`` blocks of every row and masks (no host synchronisation).
* ``mla_decode_triton``: the Triton kernel for CUDA tensors (and the Triton interpreter). Program
  ``(b, hb, s)`` serves ``BLOCK_H`` heads of sequence ``b`` (every entry row it reads serves all of
  them), walking its positions in tiles of ``BLOCK_N`` gathered through the block table (each tile's
  block ids read while the tile before it is computed, so a tile's rows are requested at its start): the
  ``c_kv`` part of a tile is loaded once and used for both the logits (``q_latent . c_kv^T`` plus
  ``q_rope . k_rope^T``) and the output (``P . c_kv``), with an online softmax in float32 (base 2).
  With ``S > 1`` splits (flash-decoding) each program takes one contiguous ``S``-th of the context and
  writes its running max, sum and unnormalised accumulator to a float32 workspace in the layout of
  ``paged_decode``'s split-K, whose reduce kernel merges them (``paged_decode_merge_splits``).
  ``BLOCK_H`` is 16 (4 warps), or 64 (8 warps) when the batch's programs of 64 heads alone outnumber the
  SMs or, given the batch's longest context, when the keys to read are many (``mla_decode_tiles``): each entry
  row is then read once for 64 heads instead of once per 16.

Grids and split counts depend on shapes and on the ``max_context`` hint only (never on device values): CUDA-graph
safe with ``out`` and a ``workspace`` (``paged_decode_workspace_numel`` elements) given. The engine captures a
second graph for the batch sizes whose tile the longest context can change (``wide_tile_min_context``) and
replays it for steps whose longest context reaches that threshold.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from epmoe.checks import check_int, describe
from epmoe.engine.paged_decode import check_host_tables, paged_decode_merge_splits, paged_decode_workspace_numel

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
_MIN_DIM = 16            # tl.dot needs at least 16 rows / columns
_BLOCK_H = 16            # query heads per program
_WIDE_BLOCK_H = 64       # query heads per program when the batch fills the GPU (``mla_decode_tiles``)
WIDE_MIN_KEYS = 32768
"""``mla_decode_tiles`` takes the 64-head tile, given the longest context, from this many keys a step reads
counted per 64-head group: ``batch * ceil(heads / 64) * max_context`` (and at least two such groups). Set from an H200
probe of both tiles at Kimi-K2.5's 64 and DeepSeek-V3's 128 heads, 1-64 rows of 148-32768 positions with the graphs'
block-table width (``benchmarks/results/mla_tile_by_context_probe_h200.json``, ``benchmarks/HISTORY.md``): at
every batch of 4 to 64 rows the wide tile turned faster about where this threshold lies and far faster well above
it; below it, and at a single 64-head group at any context, it was slower."""
_SPLIT_MIN_KEYS = 64     # positions a split should have at least
_MAX_SPLITS = 64         # each split's partial output is Dv = kv_lora_rank floats a head: more cost more than they gain


def _check_inputs(q, cache, block_tables, context_lens, scale, v_head_dim, out) -> None:
    """Host-side checks of shapes, dtypes, devices and layouts (never reads device values)."""
    for name, t in (("q", q), ("cache", cache), ("block_tables", block_tables), ("context_lens", context_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, Dk], got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if q.shape[2] > 0 and q.stride(2) != 1:
        raise ValueError(f"q must be contiguous along its last dim, got strides {q.stride()}")
    b, h, dk = q.shape
    if cache.dim() != 3 or cache.shape[2] != dk:
        raise ValueError(f"cache must be [NB, BS, Dk] with q's Dk {dk}, got shape {tuple(cache.shape)}")
    if cache.dtype != q.dtype or cache.device != q.device:
        raise ValueError(f"cache must have q's dtype {q.dtype} and device {q.device}, got {cache.dtype} on "
                         f"{cache.device}")
    if not cache.is_contiguous() or cache.shape[0] < 1 or cache.shape[1] < 1:
        raise ValueError(f"cache must be contiguous with at least one block of one slot, got shape "
                         f"{tuple(cache.shape)} and strides {cache.stride()}")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, numbers.Integral) or not 0 < v_head_dim < dk:
        raise ValueError(f"v_head_dim (kv_lora_rank) must be an int in [1, Dk = {dk}), got {v_head_dim!r}")
    if h < 1:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B, MB] with B = {b} and MB >= 1, got shape "
                         f"{tuple(block_tables.shape)}")
    if (block_tables.dtype != torch.int32 or block_tables.device != q.device
            or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1)):
        raise ValueError(f"block_tables must be int32 on {q.device}, contiguous along its last dim, got "
                         f"{block_tables.dtype} on {block_tables.device} with strides {block_tables.stride()}")
    if context_lens.dim() != 1 or context_lens.shape[0] != b:
        raise ValueError(f"context_lens must be [B] with B = {b}, got shape {tuple(context_lens.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.device != q.device:
        raise ValueError(f"context_lens must be int32 on {q.device}, got {context_lens.dtype} on "
                         f"{context_lens.device}")
    if b > 1 and context_lens.stride(0) != 1:
        raise ValueError(f"context_lens must be contiguous, got stride {context_lens.stride(0)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number, got {scale!r}")
    if out is not None:
        want = (b, h, v_head_dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be None or a [B, H, Dv] = {list(want)} tensor, got {shape}")
        if out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
            raise ValueError(f"out must have q's dtype {q.dtype} and device {q.device}, contiguous along its "
                             f"last dim, got {out.dtype} on {out.device} with strides {out.stride()}")


def mla_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged MLA decode in PyTorch (float32 math); the semantics of ``mla_decode_attention``.

    Gathers all ``MB`` blocks of every block table row (entries past a context are read but masked, so
    they must be valid block ids). No host synchronisation; CPU tables are checked (``check_host_tables``).

    Args:
        q: see ``mla_decode_attention``.
        cache: see ``mla_decode_attention``.
        block_tables: see ``mla_decode_attention``.
        context_lens: see ``mla_decode_attention``.
        scale: see ``mla_decode_attention``.
        v_head_dim: see ``mla_decode_attention``.
        out: see ``mla_decode_attention``.

    Returns:
        ``[B, H, v_head_dim]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ValueError, TypeError: as ``mla_decode_attention``; on the CPU also a block id outside the cache or a
            context length outside ``0 .. MB * BS`` (named).
    """
    _check_inputs(q, cache, block_tables, context_lens, scale, v_head_dim, out)
    check_host_tables(block_tables, context_lens, cache.shape[0], cache.shape[1])
    b, _, dk = q.shape
    mb, bs = block_tables.shape[1], cache.shape[1]
    entries = cache[block_tables.long()].reshape(b, mb * bs, dk).float()      # [B, L, Dk]
    logits = torch.einsum("bhd,bld->bhl", q.float(), entries) * float(scale)  # [B, H, L]
    keep = torch.arange(mb * bs, device=q.device)[None, :] < context_lens.long()[:, None]
    probs = torch.softmax(logits.masked_fill(~keep[:, None, :], float("-inf")), dim=-1)
    res = torch.einsum("bhl,bld->bhd", probs, entries[..., :v_head_dim])
    res = torch.where((context_lens > 0)[:, None, None], res, torch.zeros((), device=q.device)).to(q.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


@functools.cache
def _triton_kernel():
    """The Triton kernel (``decode_kernels.mla_decode_kernel``, imported on first use); raises ImportError
    without Triton."""
    from epmoe.engine import decode_kernels

    return decode_kernels.mla_decode_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(what: str, device: torch.device | str) -> int:
    """SMs of ``device`` (CPU counts 132, an H100's or H200's).

    Raises:
        ValueError: ``device`` is not a device, or CUDA without a GPU (named, with ``what``)."""
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"{what}: device must be a torch.device or its name, got {device!r}") from err
    if device.type != "cuda":
        return 132
    if not torch.cuda.is_available():
        raise ValueError(f"{what}: device {str(device)!r}, but CUDA is not available on this machine")
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _wide_groups(batch: int, heads: int) -> int:
    """The batch's groups of rows and 64 heads: the wide tile's programs before any split."""
    return batch * -(-heads // _WIDE_BLOCK_H)


def mla_decode_tiles(batch: int, heads: int, device: torch.device | str,
                     dtype: torch.dtype = torch.bfloat16, *, max_context: int | None = None) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of the Triton kernel for ``batch`` rows of ``heads`` query heads in ``dtype``.

    64 heads a program on 8 warps where the rows are 16-bit, there are at least 64 heads and either ``batch *
    ceil(heads / 64)`` programs outnumber the SMs (no split needed with either tile) or, with ``max_context`` given,
    there are at least two such groups of rows and heads and ``batch * ceil(heads / 64) * max_context`` reaches
    ``WIDE_MIN_KEYS``; else 16 heads on 4 warps (float32 rows always: the wide tile was timed with bf16 rows only).
    A wide program reads each entry row once for its 64 heads, where 16-head programs read it once each from the
    L2, and it holds the whole SM (registers and shared memory); with fewer programs than SMs it needs splits, which
    pay where the keys are many. Chosen from H200 probes of the two tiles at Kimi-K2.5's and DeepSeek-V3's shapes
    (``benchmarks/results/mla_decode_tiles_probe_h200.json``, ``mla_tile_by_context_probe_h200.json``).

    Args:
        batch: ``B`` query rows.
        heads: ``H`` query heads.
        device: the tensors' device (its SM count; CPU counts 132).
        dtype: the query's and cache's dtype.
        max_context: the longest context of the rows (keys of the longest row), known on the host; ``None``: shapes
            alone choose. Only the tile depends on it; any value gives the same attention.

    Returns:
        ``(BLOCK_H, num_warps)``.

    Raises:
        ValueError: ``batch`` not an integer >= 0, ``heads`` not an integer >= 1, ``max_context`` not None or an
            integer >= 0, ``dtype`` not one of the kernel's (float32, bfloat16, float16), ``device`` not a device or
            CUDA without a GPU (named).
    """
    check_int("mla_decode_tiles: batch", batch, 0)
    check_int("mla_decode_tiles: heads", heads, 1)
    if max_context is not None:
        check_int("mla_decode_tiles: max_context", max_context, 0)
    if dtype not in _DTYPES:
        raise ValueError(f"mla_decode_tiles: dtype must be one of {_DTYPES}, got {dtype!r}")
    sms = _device_sms("mla_decode_tiles", device)
    groups = _wide_groups(batch, heads)
    if dtype != torch.float32 and heads >= _WIDE_BLOCK_H and (
            groups > sms or (max_context is not None and groups >= 2 and groups * max_context >= WIDE_MIN_KEYS)):
        return _WIDE_BLOCK_H, 8
    return _BLOCK_H, 4


def wide_tile_min_context(batch: int, heads: int, device: torch.device | str,
                          dtype: torch.dtype = torch.bfloat16) -> int | None:
    """The smallest longest-context from which ``mla_decode_tiles`` takes the 64-head tile for these shapes where
    shapes alone take the 16-head one, or ``None`` where the context changes nothing (the wide tile always, or
    never). The engine captures a second decode graph for such batch sizes (``model_runner``).

    Raises:
        ValueError: as ``mla_decode_tiles``.
    """
    if mla_decode_tiles(batch, heads, device, dtype)[0] == _WIDE_BLOCK_H:
        return None
    least = -(-WIDE_MIN_KEYS // max(_wide_groups(batch, heads), 1))
    return least if mla_decode_tiles(batch, heads, device, dtype, max_context=least)[0] == _WIDE_BLOCK_H else None


def mla_decode_splits(batch: int, heads: int, max_positions: int, device: torch.device | str, *,
                      max_context: int | None = None) -> int:
    """Number of context splits (a power of two) the Triton path uses for these shapes (and ``max_context`` hint).

    One split when the ``batch * ceil(heads / BLOCK_H)`` programs (``BLOCK_H`` of ``mla_decode_tiles``; where it
    takes the wide tile for 16-bit rows, float32 rows' 16-head programs fill the GPU all the more) fill the GPU or
    the longest context (``max_positions = MB * BS``) is short; otherwise enough splits to reach about two programs
    per SM (one with the wide tile, whose program holds a whole SM: a second wave cost more than the longer splits of
    one, ``benchmarks/results/mla_splits_probe_h200.json``), each with at least ``_SPLIT_MIN_KEYS`` positions, at most
    ``_MAX_SPLITS``. Shapes (and the hint) only, so a CUDA graph captured for a batch shape keeps its split count.

    Args:
        batch: ``B`` query rows.
        heads: ``H`` query heads.
        max_positions: ``MB * BS``, the positions a block table row covers.
        device: the tensors' device (its SM count; CPU counts 132 SMs).
        max_context: the rows' longest context, as ``mla_decode_tiles`` takes it (the tile sets the programs).

    Returns:
        The split count ``S >= 1``.

    Raises:
        ValueError: ``batch`` not an integer >= 0, ``heads`` or ``max_positions`` not an integer >= 1, ``max_context``
            not None or an integer >= 0 (named).
    """
    for name, v, least in (("batch", batch, 0), ("heads", heads, 1), ("max_positions", max_positions, 1)):
        check_int(f"mla_decode_splits: {name}", v, least)
    if max_context is not None:
        check_int("mla_decode_splits: max_context", max_context, 0)
    sms = _device_sms("mla_decode_splits", device)
    block_h = mla_decode_tiles(batch, heads, device, max_context=max_context)[0]
    programs = max(1, batch * -(-heads // block_h))
    per_sm = 1 if block_h == _WIDE_BLOCK_H else 2  # a wide program holds a whole SM
    want = min(_MAX_SPLITS, (per_sm * sms) // programs, max_positions // _SPLIT_MIN_KEYS)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


def mla_decode_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
    *,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    workspace: torch.Tensor | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Paged MLA decode with the Triton kernel (see the module docstring), whatever the device.

    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Arguments as ``mla_decode_attention``, plus:

    Args:
        q: see ``mla_decode_attention``.
        cache: see ``mla_decode_attention``.
        block_tables: see ``mla_decode_attention``.
        context_lens: see ``mla_decode_attention``.
        scale: see ``mla_decode_attention``.
        v_head_dim: see ``mla_decode_attention``.
        out: see ``mla_decode_attention``.
        splits: context splits (a power of two); ``mla_decode_splits`` when None.
        workspace: float32 1-D tensor of at least ``paged_decode_workspace_numel(B, H, v_head_dim, splits)``
            elements for split-K. When ``splits > 1`` and it is None, one is allocated if ``out`` is None;
            with ``out`` given the single-pass kernel runs instead (nothing is allocated).
        max_context: see ``mla_decode_attention``.

    Returns:
        ``[B, H, v_head_dim]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ValueError: as ``mla_decode_attention``; ``splits`` not a power of two; a workspace too small, not
            float32 or on another device.
        ImportError: Triton is not importable.
    """
    _check_inputs(q, cache, block_tables, context_lens, scale, v_head_dim, out)
    b, h, dk = q.shape
    bs = cache.shape[1]
    dv, dr = int(v_head_dim), dk - int(v_head_dim)
    if splits is None:
        splits = mla_decode_splits(b, h, block_tables.shape[1] * bs, q.device, max_context=max_context)
    if isinstance(splits, bool) or not isinstance(splits, numbers.Integral) or splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two >= 1, got {splits!r}")
    if splits > 1:
        need = paged_decode_workspace_numel(b, h, dv, splits)
        if workspace is None:
            workspace = None if out is not None else torch.empty(need, dtype=torch.float32, device=q.device)
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
    kernel = _triton_kernel()
    dv_pad, dr_pad = max(_MIN_DIM, _next_pow2(dv)), max(_MIN_DIM, _next_pow2(dr))
    ml_off = b * h * splits * dv
    block_h, warps = mla_decode_tiles(b, h, q.device, q.dtype, max_context=max_context)
    kernel[(b, -(-h // block_h), splits)](
        q, cache, block_tables, context_lens, out, workspace if splits > 1 else out,
        b, h, dv, dr, ml_off, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * _LOG2E,
        BLOCK_H=block_h, DV_PAD=dv_pad, DR_PAD=dr_pad, BLOCK_SIZE=bs,
        BLOCK_N=16 if q.dtype == torch.float32 else 32, SPLITS=splits, IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=2,
    )
    if splits > 1:
        paged_decode_merge_splits(workspace, context_lens, out, splits)
    return out


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """MLA decode attention of one latent-space query per sequence over a block-paged latent cache.

    CUDA tensors run the Triton kernel (``mla_decode_triton``); CPU tensors run
    ``mla_decode_reference``. Softmax and accumulation are float32. No host synchronisation and, with
    ``out`` given, no allocation (CUDA-graph capture safe); shapes are checked on the host only.

    Args:
        q: ``[B, H, Dk]`` float32/bfloat16/float16: per head the absorbed query ``q_nope W_UK``
            (``v_head_dim`` values) followed by the rotary query (``Dk - v_head_dim``), contiguous along
            ``Dk`` (other strides free).
        cache: ``[NB, BS, Dk]`` latent entries ``[c_kv, k_rope]`` in ``q.dtype``, contiguous.
        block_tables: ``[B, MB]`` int32, contiguous along ``MB``: the blocks of sequence ``b`` in order;
            entries past the context must still be valid block ids (the reference gathers them).
        context_lens: ``[B]`` int32 context lengths, at most ``MB * BS``; ``0`` marks a padding row.
        scale: multiplier of ``q . entry`` (the model's softmax scale, yarn's mscale included).
        v_head_dim: ``kv_lora_rank``: the entries' leading values that are averaged (``c_kv``).
        out: ``[B, H, v_head_dim]`` in ``q.dtype``, contiguous along its last dim, written and returned;
            or None.
        workspace: CUDA only: float32 split-K workspace so that split-K also runs when ``out`` is given;
            ignored on CPU.
        max_context: CUDA only: the longest of ``context_lens``, known on the host, or a lower bound of it; it picks
            the kernel's tile (``mla_decode_tiles``) and so the workspace it needs, never the result. ``None``: the
            tile by shapes alone. Checked on every device, used on CUDA.

    Returns:
        ``[B, H, v_head_dim]`` in ``q.dtype``: the attention-weighted ``c_kv`` per head (``out`` when given).

    Raises:
        ValueError: a wrong rank, shape, dtype, device or layout of an argument, a ``v_head_dim`` outside
            ``[1, Dk)``, a non-finite ``scale``, a ``max_context`` not None or an integer >= 0; the message names
            the argument.
        TypeError: ``q``, ``cache``, ``block_tables`` or ``context_lens`` is not a tensor.
        RuntimeError: CUDA tensors without an importable Triton.
    """
    if max_context is not None:
        check_int("max_context", max_context, 0)
    if isinstance(q, torch.Tensor) and q.is_cuda:
        try:
            _triton_kernel()
        except ImportError as err:
            raise RuntimeError(f"mla_decode_attention needs the triton package for CUDA tensors: {err}") from err
        return mla_decode_triton(q, cache, block_tables, context_lens, scale, v_head_dim, out=out,
                                 workspace=workspace, max_context=max_context)
    return mla_decode_reference(q, cache, block_tables, context_lens, scale, v_head_dim, out=out)
