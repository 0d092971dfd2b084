"""``transfer.to_device``: values, dtypes and shapes kept; on CUDA, no host synchronisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epmoe.engine.transfer import to_device


def test_to_device_on_cpu_keeps_values_dtype_and_shape():
    cpu = torch.device("cpu")
    t = to_device([3, 1, 2], cpu, torch.int64)
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert to_device(np.array([[1, 2], [3, 4]], dtype=np.int32), cpu).tolist() == [[1, 2], [3, 4]]
    assert to_device([0.5, 2.0], cpu, torch.float32).tolist() == [0.5, 2.0]
    assert to_device([], cpu, torch.int64).shape == (0,)
    src = torch.arange(4, dtype=torch.int32)
    assert to_device(src, cpu, torch.int64).dtype == torch.int64 and src.dtype == torch.int32


@pytest.mark.gpu
def test_to_device_on_cuda_does_not_synchronise():
    cuda = torch.device("cuda")
    want = torch.arange(1000, dtype=torch.int64)
    busy = torch.randn(4096, 4096, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):  # queue work, so that a synchronising copy would have something to wait for
            busy = busy @ busy.T / 4096
        got = [to_device(want.tolist(), cuda, torch.int64), to_device(want.numpy(), cuda),
               to_device(want.to(torch.int32), cuda, torch.int64)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g in got:
        assert g.device.type == "cuda" and g.dtype == torch.int64 and torch.equal(g.cpu(), want)
    # the blocking copy it replaces does synchronise (what the sync debug mode catches)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor(want.tolist(), device=cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
