"""The paged decode Triton kernels on CUDA against ``paged_decode_reference`` on the same GPU.

    python -m pytest -q tests/engine/test_paged_decode_gpu.py

The shared cases in bf16 (and float32, whose dots run in IEEE float32), the model shapes that matter
(Qwen3-30B-A3B, DeepSeek-V3's expanded MLA, gpt-oss with sinks and a window, a tiny test model) with
long contexts, single pass and split-K, and a CUDA graph captured with ``out`` given and replayed with
other context lengths (padding rows included).
"""

import pytest
import torch

from epmoe.engine.paged_decode import (
    paged_decode_attention,
    paged_decode_reference,
    paged_decode_splits,
    paged_decode_workspace,
)

from .paged_decode_cases import CASES, make_case, naive_dense, rel_err

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2    # the kernel rounds the softmax weights to bf16 for the P.V dot; output rounded to bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i", range(len(CASES)))
def test_cases_match_reference(i, dtype):
    ctx, h, hkv, dk, dv, bs, opts = CASES[i]
    c = make_case(i, ctx, h, hkv, dk, dv, bs, dtype=dtype, device="cuda", **opts)
    got = paged_decode_attention(*c.args(), **c.options())
    assert got.shape == (len(ctx), h, dv) and got.dtype == dtype and got.is_cuda
    if dtype == torch.float32:
        assert rel_err(got, naive_dense(c)) < 2e-5
    else:
        assert rel_err(got, paged_decode_reference(*c.args(), **c.options())) < BF16_TOL
    for j, n in enumerate(ctx):
        if n == 0:
            assert torch.equal(got[j], torch.zeros_like(got[j]))


MODELS = {
    # name: (H, Hkv, Dk, Dv, options)
    "qwen3-30b-a3b": (32, 4, 128, 128, {}),
    "deepseek-v3-mla": (128, 128, 192, 128, {}),
    "gpt-oss": (64, 8, 64, 64, {"window": 128, "sinks": True}),
    "llama4-chunked": (40, 8, 128, 128, {"chunk": 8192 // 8}),
    "tiny": (4, 2, 16, 16, {}),
}


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("ctx", [[4096], [1, 4096, 0, 2000, 17], [300] * 16])
@pytest.mark.parametrize("model", list(MODELS))
def test_model_shapes(model, ctx, splits):
    from epmoe.engine.paged_decode import paged_decode_triton

    h, hkv, dk, dv, opts = MODELS[model]
    c = make_case(len(ctx) + h, ctx, h, hkv, dk, dv, 16, dtype=torch.bfloat16, device="cuda", **opts)
    want = paged_decode_reference(*c.args(), **c.options())
    got = paged_decode_triton(*c.args(), **c.options(), splits=splits)
    assert rel_err(got, want) < BF16_TOL


def test_auto_splits_for_long_single_sequence():
    h, hkv, dk, dv, _ = MODELS["qwen3-30b-a3b"]
    c = make_case(5, [4096], h, hkv, dk, dv, 16, dtype=torch.bfloat16, device="cuda")
    assert paged_decode_splits(c.q, c.k_cache, c.block_tables) > 1
    many = make_case(6, [64] * 128, h, hkv, dk, dv, 16, dtype=torch.bfloat16, device="cuda")
    assert paged_decode_splits(many.q, many.k_cache, many.block_tables) == 1


@pytest.mark.parametrize("use_workspace", [False, True])
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss", "deepseek-v3-mla"])
def test_cuda_graph_replay_with_new_context_lens(model, use_workspace):
    h, hkv, dk, dv, opts = MODELS[model]
    bs, mb, b = 16, 64, 4
    c = make_case(7, [mb * bs, 5, 0, 700], h, hkv, dk, dv, bs, mb=mb, dtype=torch.bfloat16, device="cuda",
                  **opts)
    out = torch.empty(b, h, dv, dtype=torch.bfloat16, device="cuda")
    splits = paged_decode_splits(c.q, c.k_cache, c.block_tables, c.sliding_window, c.chunk_size)
    ws = paged_decode_workspace(c.q, c.v_cache, splits) if use_workspace else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):       # warm-up: compile outside the capture
            paged_decode_attention(*c.args(), **c.options(), out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*c.args(), **c.options(), out=out, workspace=ws)
    gen = torch.Generator(device="cuda").manual_seed(8)
    for lens in ([1, 0, 1024, 333], [0, 0, 0, 0], [17, 900, 16, 1]):
        c.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        c.q.copy_(torch.randn(c.q.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        want = paged_decode_reference(*c.args(), **c.options())
        if max(lens) == 0:
            assert torch.equal(out, torch.zeros_like(out))
        else:
            assert rel_err(out, want) < BF16_TOL
            for j, n in enumerate(lens):
                if n == 0:
                    assert torch.equal(out[j], torch.zeros_like(out[j]))
