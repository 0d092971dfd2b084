"""``routing.count_triton.count_slots_triton`` against the recorder's PyTorch path (CUDA, or CPU under the Triton
interpreter, numpy<2.4 first:
``PYTHONPATH=/tmp/np23 TRITON_INTERPRET=1 python -m pytest -q tests/routing/test_count_triton.py``)."""

import os

import pytest
import torch

from epmoe.loads import ExpertLoadRecorder


def _both(device: str) -> None:
    from epmoe.routing.count_triton import count_slots_triton

    g = torch.Generator().manual_seed(0)
    ref = ExpertLoadRecorder(num_layers=3, num_slots=10, window=4)
    got = ExpertLoadRecorder(num_layers=3, num_slots=10, window=4, device=device)
    for step in range(3):
        mask = (torch.rand(300, generator=g) > 0.3).long()
        for layer in range(3):
            slots = torch.randint(-1, 10, (300, 4), generator=g)
            for rec, m in ((ref, mask), (got, mask.to(device))):
                rec.mask_rows(m if layer != 1 else None)  # layer 1: every row counts
            ref.record(layer, slots)
            count_slots_triton(got._counts, got._pos, layer, slots.to(device), None if layer == 1 else mask.to(device))
        assert torch.equal(got._counts.cpu(), ref._counts), step
        ref.step()
        got.step()


@pytest.mark.interpret
def test_kernel_matches_torch_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _both("cpu")


@pytest.mark.gpu
def test_kernel_matches_torch_cuda():
    _both("cuda")
