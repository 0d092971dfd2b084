"""The Triton dispatch layout kernels equal the PyTorch steps, under the Triton interpreter (CPU).

    PYTHONPATH=/path/to/cpu/triton:src TRITON_INTERPRET=1 pytest -q tests/test_dispatch_interpret.py

fp16 and float32 (the interpreter has no bf16); the same cases run in bf16 on the GPU in
``tests/test_dispatch_gpu.py``.
"""

import os

import pytest
import torch

from .dispatch_cases import assert_triton_steps_equal_torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("t,k,g,s,cap,d,dtype", [
    (1, 8, 2, 16, 1, 64, torch.float16),       # decode: one token, two ranks
    (37, 4, 3, 5, 9, 100, torch.float16),      # ragged D, overflow (capacity below the counts)
    (300, 6, 8, 4, 300, 40, torch.float32),    # two position blocks, no overflow
    (2000, 8, 2, 16, 1500, 16, torch.float16), # eight position blocks, overflow
    (0, 2, 2, 3, 2, 8, torch.float16),         # no tokens
])
@pytest.mark.parametrize("fixed", [True, False])
def test_triton_steps_equal_torch(t, k, g, s, cap, d, dtype, fixed):
    assert_triton_steps_equal_torch(t, k, g, s, cap, d, dtype, fixed, "cpu")
