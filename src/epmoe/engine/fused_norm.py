"""RMSNorm as one Triton kernel, swapped in for transformers' RMSNorm modules on CUDA.

Transformers' RMSNorm runs as about seven elementwise kernels (cast, square, mean, add, rsqrt, scale,
weight); in a decode step those launches cost more than the reads. ``FusedRMSNorm`` does the same
arithmetic in one pass per row: the mean of squares and the scale in float32, then either the
weight times the normalised row cast back to the input dtype (Llama style, most families) or the
cast of the float32 product (gpt-oss), as the module it replaces does.

``FusedRMSNorm.add_forward`` also takes the residual add that precedes every norm of a pre-norm decoder
(``engine.decoder``) into the same pass: ``h = r + x`` rounded to the rows' dtype, as the separate add would
round it, is written out as the next residual and normalised (vLLM's ``fused_add_rms_norm``).

On Hopper the kernel is a programmatic dependent launch (``experts.triton.pdl``): it reads its weight while the
kernel before it finishes. It lets the kernel after it be placed at its start, or, for a decoder layer's input norm
(``FusedRMSNorm.late_dependents``), only once its input is complete: the q/k/v projection after that norm requests
its whole weight when it is placed (``engine.gemv``), and those reads would otherwise compete with the expert
down kernel's before it (measured on an H200: ``benchmarks/engine.py``, ``benchmarks/HISTORY.md``). Where the
kernel after a norm takes it into its own launch (``decoder.fold_or_add_norm``: on Hopper, rows up to
``decoder.FOLD_NORM_MAX_WIDTH`` wide, the q/k/v projection at one or two rows, the MoE router at one), the decoder
launches no norm there.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from epmoe.experts.triton.pdl import pdl_launch

# transformers RMSNorm classes that multiply by the weight in float32 and cast afterwards
_WEIGHT_THEN_CAST = frozenset({"GptOssRMSNorm"})


@functools.cache
def _kernel():
    """``(triton, rms_norm_kernel)``, imported on first use."""
    import triton

    from epmoe.engine.norm_kernels import rms_norm_kernel

    return triton, rms_norm_kernel


class FusedRMSNorm(nn.Module):
    """One-kernel RMSNorm over the last dimension (CUDA).

    Args:
        weight: ``[D]`` the replaced module's weight (shared, not copied).
        eps: its epsilon.
        weight_then_cast: multiply by the weight in float32 and cast after (gpt-oss), instead of casting
            the normalised row first (Llama style).
        late_dependents: on Hopper, let the next kernel be placed only after this one's wait for its input, not at
            its start (see the module docstring).
    """

    def __init__(self, weight: nn.Parameter, eps: float, weight_then_cast: bool = False,
                 late_dependents: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.eps = float(eps)
        self.weight_then_cast = weight_then_cast
        self.late_dependents = late_dependents

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` -> ``[..., D]`` in the dtype transformers' module returns (the product's)."""
        return self._run(x, None)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` in one kernel: what ``h = residual + x; norm(h)`` returns.

        Args:
            x: ``[..., D]`` the block's output (bf16/fp16/float32).
            residual: ``[..., D]`` the residual stream, ``x``'s dtype and number of elements.

        Returns:
            The normalised rows (``forward``'s dtype) and the sum ``[..., D]`` in ``x``'s dtype, both of ``x``'s
            shape.

        Raises:
            ValueError: ``residual`` of another dtype or size than ``x``.
        """
        if residual.dtype != x.dtype or residual.numel() != x.numel():
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match the rows "
                             f"{tuple(x.shape)} {x.dtype}")
        return self._run(x, residual)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = x.shape[-1]
        rows = x.reshape(-1, d)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out_dtype = x.dtype if self.weight_then_cast else torch.promote_types(x.dtype, self.weight.dtype)
        out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        res = summed = None
        if residual is not None:
            res = residual.reshape(-1, d)
            if res.stride(-1) != 1:
                res = res.contiguous()
            summed = torch.empty_like(rows, memory_format=torch.contiguous_format)
        if rows.shape[0]:
            triton, kernel = _kernel()
            add = residual is not None
            pdl = pdl_launch(rows)
            kernel[(rows.shape[0],)](rows, self.weight, out, res if add else rows, summed if add else out,
                                     rows.stride(0), out.stride(0), res.stride(0) if add else 0,
                                     summed.stride(0) if add else 0, d, self.eps,
                                     BLOCK=triton.next_power_of_2(d), WEIGHT_THEN_CAST=self.weight_then_cast,
                                     ADD=add, PDL=pdl, LATE=self.late_dependents, num_warps=4 if d <= 4096 else 8,
                                     launch_pdl=pdl)
        return out.reshape(x.shape), summed.reshape(x.shape) if summed is not None else None


def fuse_norms(model: nn.Module) -> int:
    """Replace every transformers ``*RMSNorm`` module of ``model`` (a 1-D weight and an epsilon) by a
    ``FusedRMSNorm`` sharing its weight (modules already fused are kept); those named ``input_layernorm`` (a
    decoder layer's first, after the previous layer's MLP or experts) with ``late_dependents``.

    Returns:
        The number of modules replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            weight = getattr(child, "weight", None)
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            if (kind.endswith("RMSNorm") and not isinstance(child, FusedRMSNorm) and isinstance(weight, torch.Tensor)
                    and weight.dim() == 1 and eps is not None):
                setattr(parent, name, FusedRMSNorm(weight, eps, kind in _WEIGHT_THEN_CAST, name == "input_layernorm"))
                count += 1
    return count
