"""A decode step's attention projections at one or two rows as one Triton kernel whose weight reads overlap the
kernel before it (Hopper's programmatic dependent launch).

At one row a linear layer only streams its weight, and the kernel before it in a decode step (the attention's
reduction before ``o_proj``, the norm before ``q/k/v``) reads next to nothing: the weight could be on its way while
that kernel runs. cuBLAS cannot start before its predecessor ends, and at one row it runs a split-K product plus a
reduction launch that stream the weight well below the copy bandwidth even from the L2. Here the kernel is launched
as a programmatic dependent (``experts.triton.pdl``): each program loads its whole ``[BLOCK_N, K]`` slice of the
weight into registers first, a tile small enough (``_TILE_ELEMS`` elements) that the programs of a projection of a
few MB (Qwen3-30B-A3B's q/k/v and o) fit on an H200 at once, then waits for the kernel before it
(``griddepcontrol.wait``), reads the rows and reduces: the weight read hides behind the previous kernel, and what is
left after the wait is the multiply and the store. The early reads share the DRAM with the kernel before: its
own reads queue behind them (in a decode step the attention before ``o_proj`` waits on part of that stream, which
the benchmark's one-layer timeline shows). Float32 accumulation, the bias added before the single rounding
to the output dtype (``F.linear``'s rounding up to summation order).

``linear`` runs the kernel for a plain ``nn.Linear`` (no hooks, no gradient to record, a plain weight tensor) where
``gemv_fits`` (CUDA with dependent launches, bf16 or fp16, at most ``GEMV_MAX_ROWS`` rows, ``K`` at most
``GEMV_MAX_K``, at two rows a weight of at most ``GEMV_MAX_WEIGHT_BYTES``) and calls the module otherwise (CPU,
more rows, quantized, hooked or wrapped linear modules): without the early weight reads the kernel is no faster
than cuBLAS beyond one row, so it is not taken without them. ``EPMOE_GEMV=0`` in the environment turns it off (for
measuring what it gains).

``gemv_add_norm`` folds the residual add and RMSNorm before the projection into the same launch (a decoder layer's
input norm before its q/k/v projection, ``layer.FoldedNorm``): after its wait each program reads the block's output
and the residual, adds and normalises the whole row itself (``fused_norm``'s arithmetic and roundings) and
multiplies; the first program also stores the sum, the next residual. A chain of dependent launches one link
shorter; ``linear_after_norm`` runs it for a module and rows ``norm_folds`` accepts.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import nn

from epmoe.checks import check_add_norm, norm_weight_fits
from epmoe.experts.switches import enabled
from epmoe.experts.triton.pdl import pdl_launch
from epmoe.layer import FoldedNorm

GEMV_MAX_ROWS = 2
"""Most rows the kernel takes (beyond, the multiply after the wait outweighs what the early reads hide)."""
GEMV_MAX_K = 16384
"""Largest input width: one program holds a whole row of the weight (``K`` rounded up to a power of two)."""
GEMV_MAX_WEIGHT_BYTES = 24 * 2**20
"""Largest weight ``linear`` gives the kernel at two rows: about what an H200 holds of its programs at once (beyond,
the later programs start only as the first ones end, and their reads no longer overlap the kernel before). At one
row the weight's size is not limited: past what the early reads hide, the kernel still streams the weight closer
to the copy bandwidth than cuBLAS's split-K product and its reduction (``benchmarks/gemv.py``)."""
_TILE_ELEMS = 16384  # weight elements a program holds at one row (at two rows half, down to one weight row)


@functools.cache
def _kernel():
    """``(triton, gemv_kernel)``, imported on first use."""
    import triton

    from epmoe.engine.norm_kernels import gemv_kernel

    return triton, gemv_kernel


def gemv_fits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear`` runs the kernel for ``rows [M, K]``: CUDA with dependent launches (``pdl_launch``),
    ``M <= GEMV_MAX_ROWS``, bf16 or fp16 rows contiguous along ``K``, ``1 <= K <= GEMV_MAX_K``, a contiguous
    ``[N, K]`` weight on the rows' device (of at most ``GEMV_MAX_WEIGHT_BYTES`` where ``M > 1``), a bias (or none)
    of the rows' dtype; not with ``EPMOE_GEMV=0``."""
    return (enabled("EPMOE_GEMV") and rows.dim() == 2 and rows.shape[0] <= GEMV_MAX_ROWS
            and rows.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == rows.dtype and weight.dim() == 2 and weight.is_contiguous()
            and weight.device == rows.device and 1 <= weight.shape[1] == rows.shape[1] <= GEMV_MAX_K
            and rows.stride(-1) == 1
            and (rows.shape[0] == 1 or weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES)
            and (bias is None or bias.dtype == rows.dtype) and pdl_launch(rows))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool | None = None
         ) -> torch.Tensor:
    """``x @ weight.T + bias`` by the kernel (CUDA, or CPU tensors under the Triton interpreter).

    Args:
        x: ``[M, K]`` float16, bfloat16 or float32, ``M <= GEMV_MAX_ROWS``, contiguous along ``K``; on CUDA, or on
            the CPU under ``TRITON_INTERPRET=1`` (without ``pdl``).
        weight: ``[N, K]`` contiguous, ``K <= GEMV_MAX_K``, ``x``'s dtype and device.
        bias: ``[N]`` (any stride), ``x``'s dtype and device, or ``None``.
        pdl: launch as a programmatic dependent (``None``: where ``pdl_launch(x)``).

    Returns:
        ``[M, N]`` in ``x.dtype`` (the bias alone where ``K`` is 0).

    Raises:
        ValueError: shapes that do not agree, other dtypes or devices, more than ``GEMV_MAX_ROWS`` rows, a weight
            not contiguous, ``K`` above ``GEMV_MAX_K``, rows not contiguous along ``K`` (named); rows to compute on
            the CPU outside the interpreter, or with ``pdl`` under it.
    """
    _check_operands(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if k == 0:
        y = torch.zeros(m, n, dtype=x.dtype, device=x.device)
        return y + bias if bias is not None else y
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    _launch(x, weight, bias, y, pdl)
    return y


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``gemv``'s operand checks (its ValueErrors)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or (
            bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not agree (x [M, K], weight [N, K], "
                         f"bias [N])")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if x.dtype not in floats or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"gemv takes float16, bfloat16 or float32 rows and a weight and bias of their dtype: x "
                         f"{x.dtype}, weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"gemv: x on {x.device}, weight on {weight.device} and bias on "
                         f"{None if bias is None else bias.device}: one device")
    m, k = x.shape
    if m > GEMV_MAX_ROWS or k > GEMV_MAX_K or not weight.is_contiguous() or (k > 1 and x.stride(1) != 1):
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, K <= {GEMV_MAX_K}, a contiguous weight and "
                         f"rows contiguous along K: {m} rows, K {k}, weight strides {weight.stride()}, x strides "
                         f"{x.stride()}")


def gemv_add_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_then_cast: bool = False,
                  pdl: bool | None = None, summed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemv(norm(residual + x), weight, bias)`` and ``residual + x`` in one launch: ``fused_norm``'s add and
    RMSNorm (its arithmetic and roundings) folded into the projection after it, each program normalising the rows
    itself after its wait (a decoder layer's input norm before its q/k/v projection: one launch fewer in the chain).
    With no rows, ``K`` of 0 or no outputs, ``gemv``'s result (the bias where ``K`` is 0) and the sum.

    Args:
        x: ``[M, K]`` the block's output rows, as ``gemv``'s ``x`` (float16, bfloat16 or float32, ``M <=
            GEMV_MAX_ROWS``, contiguous along ``K``).
        residual: ``[M, K]`` the residual stream, ``x``'s dtype and device, contiguous along ``K``.
        norm_weight: ``[K]`` the RMSNorm's weight, contiguous, ``x``'s dtype unless ``weight_then_cast``.
        eps: the norm's epsilon.
        weight: ``[N, K]`` as ``gemv``'s.
        bias: ``[N]`` or ``None``, as ``gemv``'s.
        weight_then_cast: the norm multiplies by its weight in float32 and casts after (``FusedRMSNorm``'s flag).
        pdl: as ``gemv``'s.
        summed: ``[M, K]`` of ``x``'s dtype and device, contiguous along ``K``, to write the sum into; or ``None``
            (a new tensor).

    Returns:
        ``y [M, N]`` in ``x.dtype`` and the sum ``residual + x`` ``[M, K]`` (rounded to ``x.dtype``; ``summed`` when
        given).

    Raises:
        TypeError: an operand that is not a tensor, ``weight_then_cast`` not a bool (named).
        ValueError: as ``gemv``; ``residual``, ``norm_weight`` or ``summed`` of another shape, dtype or device, or
            not contiguous along ``K``; ``eps`` not a finite real ``>= 0``; ``summed`` sharing memory with ``x`` or
            ``residual`` (the programs read them while the first writes the sum; ``checks.check_add_norm``).
    """
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gemv_add_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
    _check_operands(x, weight, bias)
    check_add_norm("gemv_add_norm", x, residual, norm_weight, eps, weight_then_cast, {"summed": summed})
    m, k = x.shape
    if summed is None:
        summed = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m == 0 or k == 0 or weight.shape[0] == 0:  # nothing to normalise or no outputs: gemv's results, the sum
        summed.copy_(x + residual)
        return gemv(x, weight, bias, pdl=False) if m == 0 or k == 0 else x.new_empty(m, 0), summed
    y = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, y, pdl, (residual, norm_weight, float(eps), weight_then_cast, summed))
    return y, summed


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, pdl: bool | None,
            norm: tuple | None = None) -> None:
    """One launch of the kernel into ``y`` (operands checked by the callers); ``norm``: ``(residual,
    norm_weight, eps, weight_then_cast, summed)`` for ``gemv_add_norm``."""
    m, k = x.shape
    n = weight.shape[0]
    pdl = pdl_launch(x) if pdl is None else pdl
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not ((x.is_cuda and not interpret) or (interpret and not pdl)):
        raise ValueError(f"gemv runs on CUDA tensors, or under TRITON_INTERPRET=1 without pdl: x on {x.device}, "
                         f"pdl {pdl}, TRITON_INTERPRET {os.environ.get('TRITON_INTERPRET')!r}")
    triton, kernel = _kernel()
    k_pad = triton.next_power_of_2(k)
    block_n = max(1, _TILE_ELEMS // triton.next_power_of_2(m) // k_pad)
    residual, norm_weight, eps, weight_then_cast, summed = norm if norm is not None else (x, weight, 0.0, False, y)
    kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, residual, norm_weight, summed, n, k, x.stride(0),
        weight.stride(0), bias.stride(0) if bias is not None else 0, y.stride(0), residual.stride(0),
        summed.stride(0), eps, M=m, BLOCK_N=block_n, K_PAD=k_pad, HAS_BIAS=bias is not None, PDL=pdl,
        NORM=norm is not None, WEIGHT_THEN_CAST=weight_then_cast, num_warps=4, launch_pdl=pdl)


def norm_folds(module: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, weight_then_cast: bool) -> bool:
    """Whether ``linear_after_norm`` folds an RMSNorm of weight ``norm_weight`` into ``module``'s kernel for the
    rows ``x [..., K]``: where ``linear`` would run the kernel, with a contiguous ``[K]`` norm weight on the rows'
    device of their dtype (any float dtype with ``weight_then_cast``)."""
    if not (isinstance(x, torch.Tensor) and isinstance(norm_weight, torch.Tensor) and x.dim() >= 1
            and _plain_linear(module, x) and x.shape[-1] > 0 and math.prod(x.shape[:-1]) <= GEMV_MAX_ROWS):
        return False
    rows = x.reshape(-1, x.shape[-1])
    return gemv_fits(rows, module.weight, module.bias) and norm_weight_fits(x, norm_weight, weight_then_cast)


def linear_after_norm(module: nn.Module, folded: FoldedNorm) -> torch.Tensor:
    """``module(norm(residual + x))`` for a ``FoldedNorm``, in one launch (``gemv_add_norm``), the sum written into
    ``folded.summed``; the result keeps ``x``'s leading dimensions.

    Raises:
        TypeError: ``folded`` is not a ``FoldedNorm``.
        ValueError: ``norm_folds`` is false for ``module`` and these rows (the module and rows named).
    """
    if not isinstance(folded, FoldedNorm):
        raise TypeError(f"linear_after_norm takes a FoldedNorm, got {type(folded).__name__}")
    if not norm_folds(module, folded.x, folded.weight, folded.weight_then_cast):
        raise ValueError(f"linear_after_norm: {type(module).__name__} does not fold a norm into its kernel for rows "
                         f"{tuple(folded.x.shape)} {folded.x.dtype} on {folded.x.device} (norm_folds is false)")
    x, residual, summed = folded.rows()  # operands checked when the FoldedNorm was made, the module's just now
    y = torch.empty(x.shape[0], module.weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, module.weight, module.bias, y, True, (residual, folded.weight, float(folded.eps),
                                                     folded.weight_then_cast, summed))
    return y.reshape(*folded.x.shape[:-1], module.weight.shape[0])


def _plain_linear(module: nn.Module, x: torch.Tensor) -> bool:
    """``module`` computes exactly ``F.linear(x, weight, bias)`` when called: an ``nn.Linear`` (not a subclass)
    without hooks or an instance ``forward``, its weight a plain tensor, and no gradient to record."""
    return (type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and "forward" not in vars(module) and type(module.weight.data) is torch.Tensor
            and not (torch.is_grad_enabled() and (module.weight.requires_grad or x.requires_grad)))


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through ``gemv`` for a plain ``nn.Linear`` (no hooks, no gradient to record, a plain weight
    tensor) where ``gemv_fits`` (``x [..., K]`` flattened to rows; the result keeps the leading dimensions)."""
    if (_plain_linear(module, x) and x.dim() >= 1 and x.shape[-1] > 0
            and math.prod(x.shape[:-1]) <= GEMV_MAX_ROWS):
        rows = x.reshape(-1, x.shape[-1])
        weight = module.weight
        if gemv_fits(rows, weight, module.bias):
            return gemv(rows, weight, module.bias, pdl=True).reshape(*x.shape[:-1], weight.shape[0])
    return module(x)
