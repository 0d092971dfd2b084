"""A prompt chunk fed as single-token rows (the engine's graph steps) attends as the same chunk fed whole.

Row ``i`` of a chunk of ``n`` tokens at positions ``start .. start + n - 1`` is a decode row with context
``start + i + 1`` over the sequence's block table; ``paged_decode_attention`` over those rows must equal
``dense_attention`` of the chunk (causal, sliding window, Llama-4's chunks, gpt-oss's sinks). CPU: the
reference decode in float32; CUDA: the Triton kernels in bfloat16.
"""

import pytest
import torch

from epmoe.engine.attention import dense_attention
from epmoe.engine.paged_decode import paged_decode_attention

OPTIONS = [dict(), dict(sliding_window=5), dict(chunk_size=8), dict(sinks=True)]


def _check(opts: dict, device: str, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(3)
    h, hkv, d, bs, start, n = 4, 2, 16, 4, 9, 11
    ctx = start + n
    blocks = -(-ctx // bs)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    k_cache = torch.randn(blocks + 3, bs, hkv, d, generator=g)
    v_cache = torch.randn(blocks + 3, bs, hkv, d, generator=g)
    q = torch.randn(n, h, d, generator=g)
    sinks = torch.randn(h, generator=g) * 2 if opts.get("sinks") else None
    window, chunk = opts.get("sliding_window"), opts.get("chunk_size")
    pos = torch.arange(ctx)
    slots = table[pos // bs] * bs + pos % bs
    keys = k_cache.view(-1, hkv, d)[slots]
    values = v_cache.view(-1, hkv, d)[slots]
    want = dense_attention(q, keys, values, start, d ** -0.5, sliding_window=window, chunk_size=chunk, sinks=sinks)
    to = dict(device=device, dtype=dtype)
    got = paged_decode_attention(
        q.to(**to), k_cache.to(**to), v_cache.to(**to), table.to(device, torch.int32).expand(n, blocks).contiguous(),
        torch.arange(start + 1, ctx + 1, dtype=torch.int32, device=device), d ** -0.5, sliding_window=window,
        chunk_size=chunk, sinks=None if sinks is None else sinks.to(device))
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("opts", OPTIONS, ids=["causal", "window", "chunk", "sinks"])
def test_rows_equal_the_chunk_cpu(opts):
    _check(opts, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", OPTIONS, ids=["causal", "window", "chunk", "sinks"])
def test_rows_equal_the_chunk_cuda_bf16(opts):
    _check(opts, "cuda", torch.bfloat16, 3e-2)


def _sink_reference(q, k, v, start, scale, window, chunk, sinks):
    """Sink attention over all of a chunk's queries and keys at once, in float64."""
    n, h, _ = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    qpos, kpos = torch.arange(start, start + n)[:, None], torch.arange(ctx)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    if chunk is not None:
        allowed &= kpos // chunk == qpos // chunk
    kh = k.double().repeat_interleave(h // hkv, dim=1).transpose(0, 1)
    vh = v.double().repeat_interleave(h // hkv, dim=1).transpose(0, 1)
    logits = (q.double().transpose(0, 1) @ kh.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    full = torch.cat([logits, sinks.double().reshape(h, 1, 1).expand(h, n, 1)], dim=-1)
    return (torch.softmax(full, dim=-1)[..., :-1] @ vh).transpose(0, 1)


@pytest.mark.parametrize("opts", OPTIONS[:3], ids=["causal", "window", "chunk"])
@pytest.mark.parametrize("start", [0, 19])  # a whole prompt; a chunk after 19 cached positions
@pytest.mark.parametrize("block", [1024, 3])  # the queries in one block; in blocks of 3
def test_sink_attention_equals_the_softmax_with_the_sink(opts, start, block, monkeypatch):
    # the sinks enter the fused attention as one more key (a whole causal prompt: one square causal call): the same
    # values as the softmax over the logits and the sink, taken at once in float64
    from epmoe.engine import attention

    monkeypatch.setattr(attention, "SINK_QUERY_BLOCK", block)
    g = torch.Generator().manual_seed(5)
    h, hkv, d, n = 4, 2, 16, 11
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((n, h, d), (start + n, hkv, d), (start + n, hkv, d)))
    sinks = torch.randn(h, generator=g) * 2
    window, chunk = opts.get("sliding_window"), opts.get("chunk_size")
    got = dense_attention(q, k, v, start, d ** -0.5, sliding_window=window, chunk_size=chunk, sinks=sinks)
    assert got.shape == (n, h, d) and got.dtype == torch.float32
    want = _sink_reference(q, k, v, start, d ** -0.5, window, chunk, sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # a sink far below the logits takes no weight (the attention without sinks); one far above takes it all
    opts = dict(sliding_window=window, chunk_size=chunk)
    torch.testing.assert_close(dense_attention(q, k, v, start, d ** -0.5, **opts, sinks=torch.full((h,), -1e4)),
                               dense_attention(q, k, v, start, d ** -0.5, **opts), rtol=1e-5, atol=1e-5)
    assert dense_attention(q, k, v, start, d ** -0.5, **opts, sinks=torch.full((h,), 1e4)).abs().max() < 1e-6
