"""Split reduction of the W4A16 tensor-core kernels (``w4a16_mma``) at decode sizes.

When a launch has few row blocks (``SPLIT_MAX > 1``), the programs of the active blocks count them and split each
(row block, column tile)'s reduction over ``K`` ``split`` ways so that the GPU is filled (``split_count``); each
split stores its partial accumulator (``store_partial``) and takes a ticket from the tile's arrival counter
(``is_last_split``), and the last sums the partials in split order (``reduced_partials``: bitwise reproducible) and
finishes the tile. The grid is ``SPLIT_MAX`` rounds of (block, tile) (``split_program_ids``); the rounds past the
split in use leave at once.

Source: the threadfence-reduction pattern of the CUDA samples (``threadFenceReduction``). The code is our own.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_WARPS_PER_SM = 16
"""Warps an SM the split-K choice aims at (``MmaConfig.split_max``): a launch whose row blocks (at most, as
``align.num_aligned_blocks`` bounds them) times column tiles give fewer programs may split each tile's reduction."""


@gluon.jit
def split_program_ids(num_tiles, SPLIT_MAX: gl.constexpr):
    """This program's row block, column tile and split: the grid is ``SPLIT_MAX`` rounds of (block, tile), split 0
    first (the rounds past the split in use only leave)."""
    pid = gl.program_id(0)
    tiles = gl.num_programs(0) // SPLIT_MAX
    rest = pid % tiles
    return rest // num_tiles, rest % num_tiles, pid // tiles


@gluon.jit
def split_count(block_slot_ptr, num_blocks, num_tiles, NB_PAD: gl.constexpr, SPLIT_MAX: gl.constexpr,
                TARGET: gl.constexpr):
    """The launch's split count: the largest power of two up to ``SPLIT_MAX`` that keeps the programs of the active
    row blocks within ``TARGET`` (few active blocks: each tile's reduction split, so the SMs stay busy). Read by the
    programs of active blocks only (an inactive block's programs have left)."""
    split = 1
    if SPLIT_MAX > 1:
        bl = gl.arange(0, NB_PAD, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        active = gl.sum((gl.load(block_slot_ptr + bl, mask=bl < num_blocks, other=-1) >= 0).to(gl.int32), 0)
        ratio = TARGET // gl.maximum(active * num_tiles, 1)
        for _ in gl.static_range(SPLIT_MAX.bit_length() - 1):
            split = gl.where(ratio >= 2 * split, 2 * split, split)
    return split


@gluon.jit
def split_k_range(pid_s, split, KW, BLOCK_KW: gl.constexpr, EVEN: gl.constexpr):
    """Words ``[begin, end)`` of split ``pid_s`` of ``split`` (whole steps; trailing splits may be empty). ``KW`` is a
    multiple of 4 (``load_tile``), which the compiler is told: the split's first tiles then load as 16-byte vectors."""
    KW = (KW // 4) * 4
    chunk = gl.cdiv(gl.cdiv(KW, split), BLOCK_KW) * BLOCK_KW
    begin = gl.minimum(pid_s * chunk, KW)
    if EVEN:  # KW a multiple of BLOCK_KW: so is begin (the activation loads are 16-byte vectors)
        begin = gl.multiple_of(begin, BLOCK_KW)
    return begin, gl.minimum(begin + chunk, KW)


@gluon.jit
def _tile_ptrs(ws_ptr, p, tile, pid_s, NUM_ACC: gl.constexpr, SPLIT_MAX: gl.constexpr, BLOCK_N: gl.constexpr,
               MMA: gl.constexpr):
    """Pointers of accumulator ``p`` (of ``NUM_ACC``, each a sub-block's ``[BLOCK_N, 8]``) of split ``pid_s`` of
    ``tile`` (row block x column tile) in the partial workspace ``ws [tiles, SPLIT_MAX, NUM_ACC, BLOCK_N, 8]``
    float32."""
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    off = ((tile.to(gl.int64) * SPLIT_MAX + pid_s) * NUM_ACC + p) * (BLOCK_N * 8)
    return ws_ptr + off + r[:, None] * 8 + m[None, :]


@gluon.jit
def store_partial(ws_ptr, acc, p, tile, pid_s, NUM_ACC: gl.constexpr, SPLIT_MAX: gl.constexpr, BLOCK_N: gl.constexpr,
                  MMA: gl.constexpr):
    """Store partial accumulator ``p`` of split ``pid_s`` of ``tile`` (see ``_tile_ptrs``)."""
    gl.store(_tile_ptrs(ws_ptr, p, tile, pid_s, NUM_ACC, SPLIT_MAX, BLOCK_N, MMA), acc)


@gluon.jit
def reduced_partials(ws_ptr, p, tile, split, NUM_ACC: gl.constexpr, SPLIT_MAX: gl.constexpr, BLOCK_N: gl.constexpr,
                     MMA: gl.constexpr):
    """Accumulator ``p`` of ``tile`` summed over its ``split`` partials, in split order (reproducible)."""
    tot = gl.zeros([BLOCK_N, 8], gl.float32, layout=MMA)
    for s in range(0, split):
        tot += gl.load(_tile_ptrs(ws_ptr, p, tile, s, NUM_ACC, SPLIT_MAX, BLOCK_N, MMA),
                       cache_modifier=".cg")
    return tot


@gluon.jit
def is_last_split(count_ptr, tile_id, split):
    """After the partial stores: take a ticket from the tile's arrival counter; the last of ``split`` resets it (the
    counters are zero between launches) and reduces (the threadfence-reduction pattern of the CUDA samples)."""
    gl.thread_barrier()
    ticket = gl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel")
    last = ticket == split - 1
    if last:
        gl.atomic_xchg(count_ptr + tile_id, 0)
    return last


@gluon.jit
def first_word(begin, KW, BLOCK_KW: gl.constexpr, EVEN: gl.constexpr):
    """Where a split's first word tile is read: ``begin``, or for an empty split of ``EVEN`` tiles (unmasked loads)
    the last whole step, valid words it never uses. Either is a multiple of ``BLOCK_KW`` when ``EVEN``, which the
    compiler is told: the tiles' rows are then 16-byte aligned and load as 16-byte vectors (from the minimum alone it
    proves the two-word alignment of ``KW`` and loads 8-byte pieces)."""
    if EVEN:
        return gl.multiple_of(gl.minimum(begin, KW - BLOCK_KW), BLOCK_KW)
    else:
        return begin


def split_workspace(split_max: int, nb: int, tiles: int, values: int, target: int,
                    placeholder: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A launch's ``SPLIT_MAX`` (``split_max`` when its row blocks (at most ``nb``) times ``tiles`` column tiles give
    fewer than ``target`` programs, else 1), its partial workspace (``values`` accumulator values a tile) and its
    arrival counters, not zeroed: the caller zeroes them before the launch (``w4a16_mma``'s prologue); the kernels
    leave them zero. With ``SPLIT_MAX`` 1 both are ``placeholder``."""
    if split_max == 1 or nb * tiles >= target:
        return 1, placeholder, placeholder
    dev = placeholder.device
    ws = torch.empty(nb * tiles * split_max * values, dtype=torch.float32, device=dev)
    return split_max, ws, torch.empty(nb * tiles, dtype=torch.int32, device=dev)


def programs_wanted(device: torch.device, num_warps: int) -> int:
    """Programs that fill the GPU (``_WARPS_PER_SM`` warps an SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count * _WARPS_PER_SM // num_warps
