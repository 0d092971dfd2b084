"""Matrix products of a few rows by a large weight (a decode step's projections) as one split-K Triton kernel.

At one to a few tokens a projection ``y = x W^T (+ b)`` only streams ``W`` (``N x K``) from memory. cuBLAS runs
such a shape as a GEMM whose tile covers 64 columns, so a 2048-column output has only 32 column tiles to spread
over the GPU's 132 SMs; it adds a split-K reduction kernel when it splits. Here every program reads one
``BLOCK_N x (K / SPLIT_K)`` block of ``W`` (the tokens' rows padded to 16 for the tensor cores), so a launch has
``(N / BLOCK_N) x SPLIT_K`` programs, about two per SM, each with two weight tiles in flight (register double
buffering: the next tile is requested before the current one's product; Triton does not software-pipeline
these loads, which reach the 16-row ``mma`` through registers). With ``SPLIT_K > 1`` each program stores its
float32 partial product and takes a ticket from its column tile's arrival counter; the program that arrives last
sums the ``SPLIT_K`` partials in a fixed order, adds the bias and writes the tile (the threadfence-reduction
pattern of the CUDA samples, as ``experts.triton.decode``: no float atomics, bitwise reproducible), then sets the
counter back to 0 for the next launch. No host synchronisation, static grid: CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

SKINNY_MAX_ROWS = 16  # the most rows (tokens) ``skinny_linear`` takes: one 16-row tensor-core tile
_BLOCK_N = 32
_BLOCK_K = 256
_MIN_PROGRAMS = 256  # split K until a launch has at least this many programs (about two per SM of an H200)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, stride_xm, stride_wn, stride_ym,
                      K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, 16)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_len: tl.constexpr = K // SPLIT_K
        k_start = pid_k * k_len
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        steps: tl.constexpr = k_len // BLOCK_K
        xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        for i in range(steps):  # register double buffering: step i + 1's tiles are requested before step i's dot
            more = i + 1 < steps
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_next = tl.load(x_ptrs, mask=m_ok[:, None] & more, other=0.0)
            w_next = tl.load(w_ptrs, mask=n_ok[:, None] & more, other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc)
            xt = x_next
            wt = w_next
        mask = m_ok[:, None] & n_ok[None, :]
        out_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            part = ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
            tl.store(part, acc, mask=mask)
            tl.debug_barrier()
            ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:
                tl.store(count_ptr + pid_n, 0)  # ready for the next launch (stream order)
                total = tl.zeros((16, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):
                    total += tl.load(ws_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)

    return triton, skinny_kernel


def split_k(n: int, k: int) -> int:
    """``SPLIT_K`` for an ``N x K`` weight: the smallest power of two giving ``_MIN_PROGRAMS`` programs, as long as
    every split still holds whole ``_BLOCK_K`` steps."""
    tiles = -(-n // _BLOCK_N)
    s = 1
    while tiles * s < _MIN_PROGRAMS and k % (2 * s * _BLOCK_K) == 0:
        s *= 2
    return s


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear`` takes ``x [M, K]`` by ``weight [N, K]``: at most ``SKINNY_MAX_ROWS`` rows, bf16 or
    fp16 of one dtype, ``K`` a multiple of the K step, both contiguous along ``K``, on CUDA (or CPU tensors under
    the Triton interpreter, which the tests use)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and x.shape[1] % _BLOCK_K == 0 and x.stride(1) == 1 and weight.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
                  ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows (see the module docstring).

    Args:
        x: ``[M, K]`` bf16/fp16, ``M <= SKINNY_MAX_ROWS``, contiguous along ``K``.
        weight: ``[N, K]`` the same dtype, contiguous along ``K``.
        bias: ``[N]`` or ``None``.
        counters: int32 arrival counters, at least ``ceil(N / 32)``, zero (the kernel leaves them zero).

    Returns:
        ``[M, N]`` in ``x.dtype``: fp32 accumulation, rounded once.

    Raises:
        ValueError: ``supported`` is false, or the counters are too few or not int32.
    """
    if not supported(x, weight):
        raise ValueError(f"skinny_linear takes [M <= {SKINNY_MAX_ROWS}, K] by [N, K] bf16/fp16 with K a multiple of "
                         f"{_BLOCK_K}, contiguous along K; got x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    tiles = -(-n // _BLOCK_N)
    if counters.dtype != torch.int32 or counters.numel() < tiles:
        raise ValueError(f"skinny_linear needs {tiles} int32 arrival counters, got {counters.numel()} "
                         f"{counters.dtype}")
    s = split_k(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(s * m * n if s > 1 else 1, dtype=torch.float32, device=x.device)
    _, kernel = _kernel()
    kernel[(tiles, s)](x, weight, bias if bias is not None else weight, y, ws, counters, m, n, x.stride(0),
                       weight.stride(0), y.stride(0), K=k, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, SPLIT_K=s,
                       HAS_BIAS=bias is not None, num_warps=4)
    return y


class SkinnyLinear(nn.Module):
    """An ``nn.Linear`` (its weight and bias shared, not copied) whose CUDA calls of at most ``SKINNY_MAX_ROWS``
    rows go through ``skinny_linear``; other calls are ``F.linear``.

    Args:
        linear: the module replaced.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._counters: torch.Tensor | None = None

    def _arrival_counters(self, device: torch.device) -> torch.Tensor:
        """The kernel's arrival counters: zeroed once and kept at zero by the kernel, so a captured graph holds their
        address; made during a capture (no eager call came first), zeroed inside the graph and not kept."""
        counters = self._counters
        if counters is None or counters.device != device:
            counters = torch.zeros(-(-self.out_features // _BLOCK_N), dtype=torch.int32, device=device)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return counters
            self._counters = counters
        return counters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]``."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.is_cuda and supported(rows, self.weight):
            y = skinny_linear(rows, self.weight, self.bias, self._arrival_counters(rows.device))
            return y.reshape(*x.shape[:-1], self.out_features)
        return nn.functional.linear(x, self.weight, self.bias)
