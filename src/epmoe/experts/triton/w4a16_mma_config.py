"""The tiles of the W4A16 tensor-core (MMA) kernels of ``w4a16_mma``: ``MmaConfig``, the ones the backend takes
(``default_mma_config``, with its register caps) and what the kernels refuse (``check_mma_config``). Plain Python: the
choices and checks import without Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MmaConfig:
    """Tile shapes of the two kernels (powers of two).

    Attributes:
        block_n1: gate (and up) rows per gate/up program, a multiple of ``16 * num_warps``.
        block_kw1: int32 words (8 inputs each) of ``D`` per step of the gate/up program: at least 8 and at least
            ``G / 2`` (a thread's words of a row, ``block_kw / 4``, cover whole groups).
        block_n2: ``w2`` rows (output columns) per down program, a multiple of ``16 * num_warps``.
        block_kw2: words of ``F`` per step of the down program, as ``block_kw1``.
        num_warps: warps per program (each owns ``block_n / num_warps`` rows).
        split_max: a (row block, column tile)'s reduction is split over up to this many programs (a power of two)
            when the launch has few row blocks; the split in use is chosen on the device from the active blocks.
        block_m: token rows of a row block (8, 16 or 32): up to ``block_m / 8`` sub-blocks of 8 rows share each
            widened register (the module docstring).
        maxnreg: registers a thread may use at most (``None``: the compiler's choice); fewer registers let more
            programs share an SM.
    """

    block_n1: int = 32
    block_kw1: int = 32
    block_n2: int = 64
    block_kw2: int = 32
    num_warps: int = 2
    split_max: int = 8
    block_m: int = 16
    maxnreg: int | None = None


MMA_SPARSE_REGS = 128
"""Registers a thread of the kernels may use when the pairs are sparse over the local slots (at most
``MMA_SPARSE_MAX_PAIRS_PER_SLOT`` a slot: most row blocks hold one or two rows, so little work hides each weight
load): four warps per SM sub-partition instead of the compiler's two or three, at the price of a few spilled
registers (sm_90 build). Chosen from an H200 probe of the sub-block kernels on Kimi-K2.5 shapes
(``benchmarks/results/int4_mma_regs_probe_h200.json``: 128, 168 and the compiler's choice, interleaved): the cap of
128 was the fastest up to about 1.5 pairs a slot on 384 experts and on an EP-8 shard, and slower at 5.3 pairs a slot
on 384 experts."""

MMA_SPARSE_MAX_PAIRS_PER_SLOT = 2
"""Pairs per local slot up to which ``default_mma_config`` caps the registers at ``MMA_SPARSE_REGS``."""

MMA_FEW_REGS = 168
"""Registers a thread of the kernels may use for the other one-token steps and expert-parallel shards (at most
``MMA_FEW_REGS_MAX_SLOTS`` local slots): the compiler's own choice allows two warps per SM sub-partition, 168 three,
so that more weight loads are in flight when few row blocks are active. Set from an H200 sweep of Kimi-K2.5 shapes
(``benchmarks/int4_mma_configs.py``, ``benchmarks/results/int4_mma_configs_h200.txt``) with the 8-row kernels of
before the sub-blocks; on the sub-block kernels it was as fast as the compiler's choice at 4.9 pairs a slot on an
EP-8 shard (``int4_mma_regs_probe_h200.json``)."""

MMA_FEW_REGS_MAX_SLOTS = 64
"""Local slots up to which ``default_mma_config`` caps the registers (``MMA_FEW_REGS``) at every size."""


def default_mma_config(group_size: int, num_pairs: int = 0, num_slots: int = 1) -> MmaConfig:
    """``MmaConfig()`` (16-row blocks) with steps of at least half a group (``block_kw >= G / 2``) and, for
    ``num_pairs`` pairs over ``num_slots`` local slots, the registers capped at ``MMA_SPARSE_REGS`` for sparse pairs
    (at most ``MMA_SPARSE_MAX_PAIRS_PER_SLOT`` a slot), else at ``MMA_FEW_REGS`` for a one-token step (at most 8
    pairs) or a shard of up to ``MMA_FEW_REGS_MAX_SLOTS`` slots, uncapped otherwise (``num_pairs`` 0, unknown, is
    not sparse and not a one-token step)."""
    kw = max(MmaConfig.block_kw1, group_size // 2)
    if 0 < num_pairs <= MMA_SPARSE_MAX_PAIRS_PER_SLOT * num_slots:
        return MmaConfig(block_kw1=kw, block_kw2=kw, maxnreg=MMA_SPARSE_REGS)
    few = 0 < num_pairs <= 8 or num_slots <= MMA_FEW_REGS_MAX_SLOTS
    return MmaConfig(block_kw1=kw, block_kw2=kw, maxnreg=MMA_FEW_REGS if few else None)


def check_mma_config(cfg: MmaConfig, group_size: int) -> None:
    """Refuse tiles ``packed_mma_experts`` cannot run for groups of ``group_size`` inputs.

    Raises:
        ValueError: a field outside what the kernels take (named, with its value): ``block_n1`` / ``block_n2`` not a
            power of two and a multiple of ``16 num_warps``, ``block_m`` not 8, 16 or 32, ``split_max`` not a power of
            two, ``block_kw1`` / ``block_kw2`` not a power of two of at least 8 words and half the group size.
    """
    for name in ("block_n1", "block_n2"):
        v = getattr(cfg, name)
        if v % (16 * cfg.num_warps) or v & (v - 1):
            raise ValueError(f"MmaConfig.{name} must be a power of two and a multiple of 16 * num_warps "
                             f"({16 * cfg.num_warps}), got {v}")
    if cfg.block_m not in (8, 16, 32):
        raise ValueError(f"MmaConfig.block_m must be 8, 16 or 32, got {cfg.block_m}")
    if cfg.split_max < 1 or cfg.split_max & (cfg.split_max - 1):
        raise ValueError(f"MmaConfig.split_max must be a power of two, got {cfg.split_max}")
    for name in ("block_kw1", "block_kw2"):
        v = getattr(cfg, name)
        if v < 8 or v & (v - 1) or 2 * v < group_size:
            raise ValueError(f"MmaConfig.{name} must be a power of two of at least 8 words and of half the group size "
                             f"{group_size} (a thread's words of a row cover whole groups), got {v}")
