"""The dummy fill of ``--load-format dummy`` (``models.materialise``): large packed and FP8 expert tensors are drawn in
parts of at most ``_FILL_CHUNK`` elements (so no temporary several times a layer's experts is made), and every part
is drawn, with the spread of a whole draw."""

import torch

from epmoe.experts.mxfp4 import E8M0_BIAS
from epmoe.models import materialise


def test_large_tensors_are_filled_in_parts_that_cover_them(monkeypatch):
    monkeypatch.setattr(materialise, "_FILL_CHUNK", 1000)
    gen = torch.Generator().manual_seed(0)
    fp8 = torch.zeros(9, 500, dtype=torch.float8_e4m3fn)
    words = torch.zeros(7, 600, dtype=torch.int32)
    blocks = torch.zeros(5, 900, dtype=torch.uint8)
    scales = torch.zeros(5, 30, dtype=torch.uint8)
    materialise._fill_dummy("mlp.experts.w13_weight", fp8, gen)
    materialise._fill_dummy("mlp.experts.gate_up_proj.weight_packed", words, gen)
    materialise._fill_dummy("mlp.experts.gate_up_proj_blocks", blocks, gen)
    materialise._fill_dummy("mlp.experts.gate_up_proj_scales", scales, gen)
    assert len(materialise._parts(fp8)) == 5  # 4500 elements in parts of 1000
    values = fp8.float().view(-1)
    for part in values.split(1000):  # every part drawn: the spread of normal(0, 4.2) in each, not one left at 0
        assert 3.5 < float(part.std()) < 5.0 and float(part.abs().mean()) > 2.5
    nibbles = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1).view(-1)
    for part in nibbles.split(8000):
        assert int(part.min()) >= 1 and abs(float(part.float().mean()) - 8.0) < 0.2  # q in -7..7, mean 0
    for part in blocks.view(-1).split(1000):
        assert int(part.max()) > 200 and abs(float(part.float().mean()) - 127.5) < 12
    assert torch.equal(scales, torch.full_like(scales, E8M0_BIAS - 7))


def test_a_tensor_that_is_not_contiguous_is_drawn_whole():
    t = torch.zeros(4, 6, dtype=torch.int32).t()
    assert materialise._parts(t) == (t,)
