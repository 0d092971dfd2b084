"""Linear layers over a few rows as one Triton matrix-vector kernel (CUDA), for the decode step's projections.

At one to sixteen rows a linear layer only streams its weight, but cuBLAS picks tiles made for larger
products: in a batch-1 decode step of Qwen3-30B-A3B the q/k/v, output and router projections took about 2x
their weight-read time each, the output projection as a split-K product plus a reduction launch. Here one
program computes ``BLOCK_N`` outputs of every row over the whole ``K``, streaming its ``[BLOCK_N, K]`` slice
of the weight in ``BLOCK_K`` steps (software-pipelined: the loads feed ``tl.dot``), so the grid is
``N / BLOCK_N`` programs that each read a contiguous part of the weight once, and nothing is reduced across
programs. Float32 accumulation; the bias is added before the single rounding to the output dtype.

``small_linear`` runs the kernel for CUDA tensors in bf16/fp16 with at most ``GEMV_MAX_ROWS`` rows and
falls back to ``F.linear`` otherwise (CPU, larger batches, float32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the kernel: ``block_n`` outputs per program, ``block_k`` inputs per step, warps, pipeline stages."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_GEMV_CONFIG = GemvConfig()


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        m_ok = offs_m < M
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return triton, gemv_kernel


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig = DEFAULT_GEMV_CONFIG) -> torch.Tensor:
    """``x @ weight.T + bias`` by the Triton kernel (CUDA, or CPU tensors under the Triton interpreter).

    Args:
        x: ``[M, K]`` with ``M <= GEMV_MAX_ROWS``, contiguous along ``K``.
        weight: ``[N, K]`` contiguous, in ``x.dtype``.
        bias: ``[N]`` or ``None``.
        config: tiles.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        ValueError: more than ``GEMV_MAX_ROWS`` rows, or shapes that do not agree (named).
    """
    m, k = x.shape
    n = weight.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"gemv_triton takes at most {GEMV_MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x [{m}, {k}], weight {list(weight.shape)} and bias "
                         f"{None if bias is None else list(bias.shape)} do not agree")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        triton, kernel = _kernel()
        kernel[(triton.cdiv(n, config.block_n),)](
            x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return y


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``gemv_triton`` for CUDA bf16/fp16 inputs of at most
    ``GEMV_MAX_ROWS`` rows (``x [..., K]`` flattened to rows; the result keeps the leading dimensions)."""
    rows = x.reshape(-1, x.shape[-1])
    if (x.is_cuda and rows.shape[0] <= GEMV_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.is_contiguous() and rows.stride(-1) == 1
            and (bias is None or bias.dtype == x.dtype)):
        return gemv_triton(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
