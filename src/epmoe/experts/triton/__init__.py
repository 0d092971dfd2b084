"""The Triton expert kernels for CUDA: routing-to-slot alignment (``align``, pure PyTorch, imports
anywhere), the decode kernels for a few (token, expert) pairs (``decode``), the fused grouped GEMMs
(``grouped``), the INT4 (W4A16) kernels (``int4``) and the MXFP4 ones (``mxfp4``). All but ``align`` import
Triton at module import, so only the backend factory in ``experts.backends`` imports them, on first use.
"""
