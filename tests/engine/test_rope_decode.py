"""``paged_decode_rope`` (rotary, cache write and decode attention in one launch) against ``rope_qkv`` followed by
``paged_decode_attention``: the same attention and the same cache, for the rotary families' cases (norms, partial
rotary, GQA), one and several splits, a sliding window with sinks, and a padding row. Under the Triton interpreter
on CPU (``TRITON_INTERPRET=1``; float32 and float16, the interpreter has no bf16) against the PyTorch references,
and on CUDA in bf16 against the two launches it replaces."""

import pytest
import torch

from epmoe.engine.paged_decode import paged_decode_attention, paged_decode_reference
from epmoe.engine.rope_attention import paged_decode_rope, rope_qkv, rope_qkv_reference

from .rope_cases import CASES, make_rope_case

VARIANTS = [(1, None, False), (4, None, False), (2, 5, True)]  # (splits, sliding window, sinks)


def _check(case, dtype, device, splits, window, sinks, two_launches, tol):
    h, hkv, d = case[0], case[1], case[2]
    b, num_blocks, bs = 4, 12, 4
    qkv, cos, sin, qn, kn, kc, vc, _ = make_rope_case(*case, dtype, t=b, num_blocks=num_blocks, block_size=bs)
    gen = torch.Generator().manual_seed(1)
    kc.copy_(torch.randn(kc.shape, generator=gen).to(dtype))  # earlier tokens' keys and values
    vc.copy_(torch.randn(vc.shape, generator=gen).to(dtype))
    ctx = torch.tensor([7, 1, 11, 0], dtype=torch.int32)  # the last row pads a graph batch: block 0, no context
    tables = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], dtype=torch.int32)
    last = (ctx - 1).clamp(min=0).long()
    slots = tables.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    sink = torch.randn(h, generator=gen) if sinks else None
    qkv, cos, sin, kc, vc, ctx, tables, slots = (x.to(device) for x in (qkv, cos, sin, kc, vc, ctx, tables, slots))
    qn, kn, sink = (x.to(device) if x is not None else None for x in (qn, kn, sink))
    ref_k, ref_v = kc.clone(), vc.clone()
    q = two_launches[0](qkv, cos, sin, h, hkv, qn, kn, 1e-6, ref_k, ref_v, slots)
    want = two_launches[1](q, ref_k, ref_v, tables, ctx, d ** -0.5, sliding_window=window, sinks=sink)
    got = paged_decode_rope(qkv, cos, sin, h, hkv, qn, kn, 1e-6, kc, vc, slots, tables, ctx, d ** -0.5,
                            sliding_window=window, sinks=sink, splits=splits)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    real = slice(bs, None)  # block 0 is the padding block: the padding row's write there may differ
    torch.testing.assert_close(kc.view(-1, hkv, d)[real], ref_k.view(-1, hkv, d)[real], rtol=tol, atol=tol)
    assert torch.equal(vc.view(-1, hkv, d)[real], ref_v.view(-1, hkv, d)[real])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits, window, sinks", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_interpreter_equals_rotary_then_attention(case, dtype, splits, window, sinks):
    _check(case, dtype, "cpu", splits, window, sinks, (rope_qkv_reference, paged_decode_reference),
           1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("splits, window, sinks", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_cuda_equals_the_two_launches(case, splits, window, sinks):
    _check(case, torch.bfloat16, "cuda", splits, window, sinks, (rope_qkv, paged_decode_attention), 2e-2)
