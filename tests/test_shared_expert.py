"""``layer.SharedExpert``: the gate and up weights as the halves of one tensor (what the checkpoint loader's copies
fill), the three-product path on CPU, and on CUDA a decode row through the decode expert kernels against the three
products (bf16), including inside a CUDA graph; more rows through one joined gate/up product."""

import copy

import pytest
import torch

from epmoe.experts import Activation
from epmoe.layer import SHARED_DECODE_MAX_ROWS, SharedExpert


def _expert(d=64, f=48, device="cpu", dtype=torch.float32) -> SharedExpert:
    torch.manual_seed(0)
    return SharedExpert(d, f, Activation(act="silu"), dtype, device)


def test_weights_are_halves_of_one_tensor_and_loader_copies_reach_them():
    m = _expert()
    gate, up = torch.randn(48, 64), torch.randn(48, 64)
    m.gate_proj.weight.copy_(gate)
    m.up_proj.weight.copy_(up)
    assert torch.equal(m._w13[0], gate) and torch.equal(m._w13[1], up)
    assert [n for n, _ in m.named_parameters()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert set(m.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    x = torch.randn(3, 64)
    want = m.down_proj.weight @ (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)).T
    torch.testing.assert_close(m(x), want.T, rtol=1e-5, atol=1e-5)
    # the joined tensor is a plain leaf (no autograd history): the module deep-copies (the copy's halves are tensors
    # of their own, so on CUDA it would run the three products)
    assert not m._w13.requires_grad and m._w13.grad_fn is None
    twin = copy.deepcopy(m)
    assert torch.equal(twin(x), m(x))


@pytest.mark.gpu
@pytest.mark.parametrize("d, f", [(64, 48), (7168, 2048)])
def test_decode_row_matches_three_products(d, f):
    m = _expert(d, f, "cuda", torch.bfloat16)
    for p in m.parameters():
        p.normal_(0, 0.02)
    x = torch.randn(SHARED_DECODE_MAX_ROWS, d, device="cuda", dtype=torch.bfloat16)
    want = m.down_proj(m.activation(m.gate_proj(x).float(), m.up_proj(x).float()).to(x.dtype))
    got = m(x)
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 2e-2
    g = torch.cuda.CUDAGraph()
    out = m(x)
    with torch.cuda.graph(g):
        out = m(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    want = m.down_proj(m.activation(m.gate_proj(x).float(), m.up_proj(x).float()).to(x.dtype))
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 2e-2


@pytest.mark.gpu
def test_separated_halves_fall_back():
    m = _expert(64, 48, "cuda", torch.bfloat16)
    # no longer the shared tensor's half
    m.gate_proj.weight = torch.nn.Parameter(torch.randn_like(m.gate_proj.weight) * 0.02, requires_grad=False)
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    want = m.down_proj(m.activation(m.gate_proj(x), m.up_proj(x)))
    assert torch.equal(m(x), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [SHARED_DECODE_MAX_ROWS + 1, 256])
def test_more_rows_join_gate_and_up(rows):
    """Above the decode rows the gate and up halves run as one product of twice the width: the three products'
    result up to the order of their sums (bf16 rounding of each value either way)."""
    m = _expert(7168, 2048, "cuda", torch.bfloat16)
    for p in m.parameters():
        p.normal_(0, 0.02)
    x = torch.randn(rows, 7168, device="cuda", dtype=torch.bfloat16)
    want = m.down_proj(m.activation(m.gate_proj(x), m.up_proj(x)))
    got = m(x)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert not torch.equal(got, torch.zeros_like(got))
