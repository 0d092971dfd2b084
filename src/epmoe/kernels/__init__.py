"""Fast expert compute for CUDA: routing-to-slot alignment, fused grouped GEMMs, FP8 block weights.

``align`` and ``fp8`` are pure PyTorch and import anywhere; ``grouped_mm`` is the plain PyTorch
composition; ``triton_moe`` holds the Triton kernels and imports Triton at module import, so only the
backend factory in ``experts.py`` imports it, on first use.
"""
