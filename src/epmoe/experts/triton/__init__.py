"""The Triton expert kernels for CUDA: routing-to-slot alignment (``align``, pure PyTorch, imports
anywhere), the decode kernels for a few (token, expert) pairs (``decode``) and the fused grouped GEMMs
(``grouped``). ``decode`` and ``grouped`` import Triton at module import, so only the backend factory in
``experts.backends`` imports them, on first use.
"""
