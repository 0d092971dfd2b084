"""The tiles of the W4A16 warpgroup (prefill) kernels of ``w4a16_wgmma``: ``WgmmaConfig``, the ones the backend takes
(``default_wgmma_config``) and what the kernels refuse (``check_wgmma_config``). Plain Python: the choices and checks
import without Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WgmmaConfig:
    """Tile shapes of the two kernels.

    Attributes:
        block_m: token rows of a row block, the ``N`` of the ``wgmma`` (64 or 128).
        block_kw1: int32 words (8 inputs each) of ``D`` per step of the gate/up program (16, 32 or 64): at least
            ``G / 2`` (a thread's words of a row, ``block_kw / 4``, cover whole groups).
        block_kw2: words of ``F`` per step of the down program, as ``block_kw1``.
        stages: activation buffers in shared memory (3 or 4): the copies run ``stages - 2`` steps ahead.
        num_warps: warps of a program, 4 or 8 (one or two warpgroups, each ``64`` weight rows of a ``wgmma``).
        block_n1: gate (and up) rows of a gate/up program: ``16 num_warps`` or twice that (each warpgroup then
            issues its ``wgmma`` twice, for rows ``r`` and ``r + 16 num_warps``, on the same shared activations).
        block_n2: ``w2`` rows (output columns) of a down program, as ``block_n1``.
        tail_rows: a slot's last row block has its rows rounded up to a multiple of ``tail_rows`` (``align``;
            ``None``: ``block_m``, whole blocks): ``block_m / 2`` or, for ``block_m`` 128, ``block_m / 4`` (32), at
            least 32. A last block of ``r < block_m`` rows runs the same code with ``r`` rows a block (a second
            compiled branch; with 32-row tails a 96-row block is a 64-row and a 32-row ``wgmma`` on the same widened
            weights, a third and a fourth branch), so a slot computes its whole blocks and its last rows rounded up
            to a multiple of ``tail_rows`` instead of to ``block_m``.
        maxnreg2: registers a thread of the down program may use at most (``None``: the compiler's choice, which
            leaves one 8-warp program an SM). At 128, two 8-warp down programs share an SM where their activation
            buffers fit twice in its shared memory (``stages block_m block_kw2 16`` bytes each: 16-word steps).
        words_smem: the gate/up program copies its weight words into shared memory by ``cp.async`` with the
            activations, ``stages - 2`` steps ahead, and reads a step's words from there (instead of loading them
            into registers one step ahead): the words' latency is hidden by as many steps as the activations', and
            the registers of the next step's words are freed.
    """

    block_m: int = 128
    block_kw1: int = 16
    block_kw2: int = 16
    stages: int = 3
    num_warps: int = 8
    block_n1: int = 128
    block_n2: int = 128
    tail_rows: int | None = None
    maxnreg2: int | None = None
    words_smem: bool = False


WGMMA_BLOCK128_MIN_PAIRS_PER_SLOT = 64
"""``default_wgmma_config`` takes 128-row blocks (each widened register feeding 16 tensor-core products of 8 tokens)
from this many ``(token, k)`` pairs per local slot on average, 64-row blocks below (fewer padding rows, the same
32-row tails). Set from the H200 run of ``benchmarks/int4_prefill.py --sizes 512,1024,2048,4096`` (columns
``wg_t32`` against ``wg64_t32``: 64-row blocks 1.5x faster at 43 pairs a slot, 128-row blocks 1-7% faster at 85)."""


WGMMA_DOWN_REGS = 128
"""Registers a thread of a down program may use where two programs share an SM (with 16-word steps, whose buffers fit
twice in its shared memory): the 128-row blocks of ``default_wgmma_config`` and every MXFP4 tile
(``mxfp4.mxfp4_wgmma_config``)."""


def default_wgmma_config(group_size: int, num_pairs: int = 0, num_slots: int = 1) -> WgmmaConfig:
    """The tiles ``packed_wgmma_experts`` takes for ``num_pairs`` pairs over ``num_slots`` local slots (``num_pairs``
    0: unknown): steps of at least half a group (``block_kw >= G / 2``) and 32-row tail blocks; 128-row blocks from
    ``WGMMA_BLOCK128_MIN_PAIRS_PER_SLOT`` pairs a slot on for groups of 32, 64-row blocks otherwise (128-row blocks of
    the 32-word gate/up steps of groups of 64 and 128 spill registers and take 192 KiB of shared memory, compiled for
    sm_90a). The 128-row blocks stage their gate/up words through shared memory (``words_smem``) and run their down
    programs two an SM (16-word steps, at most ``WGMMA_DOWN_REGS`` registers a thread); the 64-row blocks' down steps
    are at least 32 words. Two warpgroups a program share each step's activations in shared memory. Set from the H200
    runs of ``benchmarks/int4_prefill.py`` and of a tile sweep at 1024-4096 tokens
    (``benchmarks/results/int4_wgmma_sweep_h200.txt``: 32-word down steps faster than 16-word ones at every size but
    one, 64-word ones slower), and the 128-row blocks' down programs from two A/Bs at 4096 tokens on an H200
    (``benchmarks/HISTORY.md``, 2026-12-07)."""
    kw = max(WgmmaConfig.block_kw1, group_size // 2)
    big = kw == WgmmaConfig.block_kw1 and num_pairs >= WGMMA_BLOCK128_MIN_PAIRS_PER_SLOT * max(num_slots, 1)
    if big:
        return WgmmaConfig(block_m=128, block_kw1=kw, block_kw2=16, tail_rows=32, maxnreg2=WGMMA_DOWN_REGS,
                           words_smem=True)
    return WgmmaConfig(block_m=64, block_kw1=kw, block_kw2=max(32, kw), tail_rows=32)


SMEM_MAX = 232448
"""Shared memory bytes a program may have on compute capability 9.0 (227 KiB)."""


def check_wgmma_config(cfg: WgmmaConfig, group_size: int) -> None:
    """Refuse tiles ``packed_wgmma_experts`` cannot run for groups of ``group_size`` inputs.

    Raises:
        ValueError: a field outside what the kernels take (named, with its value): ``block_m`` not 64 or 128,
            ``tail_rows`` not ``None``, ``block_m / 2`` or ``block_m / 4`` (at least 32), ``stages`` not 3 or 4,
            ``maxnreg2`` outside 32-255, ``num_warps`` not 4 or 8, ``block_n1`` / ``block_n2`` not 16 or 32 times
            ``num_warps``, ``block_kw1`` / ``block_kw2`` not 16, 32 or 64 words or below half the group size; then,
            with every field allowed, buffers of more than ``SMEM_MAX`` bytes.
    """
    if cfg.block_m not in (64, 128):
        raise ValueError(f"WgmmaConfig.block_m must be 64 or 128, got {cfg.block_m!r}")
    if cfg.tail_rows is not None and (cfg.tail_rows not in (cfg.block_m // 2, cfg.block_m // 4)
                                      or cfg.tail_rows < 32):
        raise ValueError(f"WgmmaConfig.tail_rows must be None, block_m / 2 or block_m / 4 (block_m {cfg.block_m}) "
                         f"and at least 32 (the smallest wgmma N here), got {cfg.tail_rows!r}")
    if cfg.stages not in (3, 4):
        raise ValueError(f"WgmmaConfig.stages must be 3 or 4, got {cfg.stages!r}")
    if cfg.maxnreg2 is not None and not 32 <= cfg.maxnreg2 <= 255:
        raise ValueError(f"WgmmaConfig.maxnreg2 must be None or 32 to 255 registers a thread, got {cfg.maxnreg2!r}")
    if cfg.num_warps not in (4, 8):
        raise ValueError(f"WgmmaConfig.num_warps must be 4 or 8 (whole warpgroups), got {cfg.num_warps!r}")
    for name in ("block_n1", "block_n2"):
        v = getattr(cfg, name)
        if v not in (16 * cfg.num_warps, 32 * cfg.num_warps):
            raise ValueError(f"WgmmaConfig.{name} must be 16 or 32 times num_warps ({cfg.num_warps}), got {v!r}")
    for name in ("block_kw1", "block_kw2"):
        v = getattr(cfg, name)
        if v not in (16, 32, 64) or 2 * v < group_size:
            raise ValueError(f"WgmmaConfig.{name} must be 16, 32 or 64 words and at least half the group size "
                             f"{group_size} (a thread's words of a row cover whole groups), got {v!r}")
    words = cfg.stages * 2 * cfg.block_n1 * cfg.block_kw1 * 4 if cfg.words_smem else 0
    smem = max(16 * cfg.stages * cfg.block_m * cfg.block_kw1 + words, 16 * cfg.stages * cfg.block_m * cfg.block_kw2)
    if smem > SMEM_MAX:
        raise ValueError(f"WgmmaConfig stages {cfg.stages} x block_m {cfg.block_m} x block_kw "
                         f"{max(cfg.block_kw1, cfg.block_kw2)}{' with words_smem' if cfg.words_smem else ''} takes "
                         f"{smem} bytes of shared memory, more than the {SMEM_MAX} a Hopper program may have")
