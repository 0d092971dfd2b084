"""RMSNorm as one Triton kernel, swapped in for transformers' RMSNorm modules on CUDA.

Transformers' RMSNorm runs as about seven elementwise kernels (cast, square, mean, add, rsqrt, scale,
weight); in a decode step those launches cost more than the reads. ``FusedRMSNorm`` does the same
arithmetic in one pass per row: the mean of squares and the scale in float32, then either the
weight times the normalised row cast back to the input dtype (Llama style, most families) or the
cast of the float32 product (gpt-oss), as the module it replaces does.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# transformers RMSNorm classes that multiply by the weight in float32 and cast afterwards
_WEIGHT_THEN_CAST = frozenset({"GptOssRMSNorm"})


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
                        BLOCK: tl.constexpr, WEIGHT_THEN_CAST: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = x * r
        if WEIGHT_THEN_CAST:
            out = w.to(tl.float32) * y
        else:
            out = y.to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    return triton, rms_norm_kernel


class FusedRMSNorm(nn.Module):
    """One-kernel RMSNorm over the last dimension (CUDA).

    Args:
        weight: ``[D]`` the replaced module's weight (shared, not copied).
        eps: its epsilon.
        weight_then_cast: multiply by the weight in float32 and cast after (gpt-oss), instead of casting
            the normalised row first (Llama style).
    """

    def __init__(self, weight: nn.Parameter, eps: float, weight_then_cast: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.eps = float(eps)
        self.weight_then_cast = weight_then_cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` -> ``[..., D]`` in the dtype transformers' module returns (the product's)."""
        d = x.shape[-1]
        rows = x.reshape(-1, d)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out_dtype = x.dtype if self.weight_then_cast else torch.promote_types(x.dtype, self.weight.dtype)
        out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        if rows.shape[0]:
            triton, kernel = _kernel()
            kernel[(rows.shape[0],)](rows, self.weight, out, rows.stride(0), out.stride(0), d, self.eps,
                                     BLOCK=triton.next_power_of_2(d), WEIGHT_THEN_CAST=self.weight_then_cast,
                                     num_warps=4 if d <= 4096 else 8)
        return out.reshape(x.shape)


def fuse_norms(model: nn.Module) -> int:
    """Replace every transformers ``*RMSNorm`` module of ``model`` (a 1-D weight and an epsilon) by a
    ``FusedRMSNorm`` sharing its weight.

    Returns:
        The number of modules replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            weight = getattr(child, "weight", None)
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            if kind.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1 and eps is not None:
                setattr(parent, name, FusedRMSNorm(weight, eps, kind in _WEIGHT_THEN_CAST))
                count += 1
    return count
