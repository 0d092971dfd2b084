"""The paged MLA decode Triton kernel on CUDA against ``mla_decode_reference`` on the same GPU, and the engine's
latent cache on CUDA.

    PYTHONPATH=src python -m pytest -q tests/engine/test_mla_decode_gpu.py

Full-width shapes (Kimi-K2.5: 64 heads, DeepSeek-V3: 128 heads, both a 512-value latent and a 64-value rotary
key) with long contexts, single pass and split-K, bf16 and float32 (IEEE dots); a CUDA graph captured with
``out`` and a workspace given, replayed with other context lengths (padding rows included); the engine on the
tiny DeepSeek-V2 and Kimi-K2.5 checkpoints in float32 against transformers (Kimi's with split-K), and with CUDA
graphs and split-K against its eager steps in bf16 (``test_engine_gpu`` covers Kimi-K2.5 at the default
context).
"""

import pytest
import torch

from epmoe.engine.mla_decode import mla_decode_attention, mla_decode_reference, mla_decode_splits
from epmoe.engine.paged_decode import paged_decode_workspace_numel

from .test_mla import _case, _naive

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2    # the kernel rounds the softmax weights to bf16 for the P.c_kv dot; output rounded to bf16
MODELS = {"kimi-k2.5": (64, 512, 64), "deepseek-v3": (128, 512, 64), "tiny": (4, 16, 8)}  # H, R, rope


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("ctx", [[4096], [1, 4096, 0, 2000, 17], [300] * 16])
@pytest.mark.parametrize("model", list(MODELS))
def test_model_shapes(model, ctx, splits, dtype):
    from epmoe.engine.mla_decode import mla_decode_triton

    h, r, dr = MODELS[model]
    q, cache, tables, lens = _case(len(ctx) + h, ctx, h, r, dr, 16, dtype=dtype, device="cuda")
    scale = 192 ** -0.5
    got = mla_decode_triton(q, cache, tables, lens, scale, r, splits=splits)
    assert got.shape == (len(ctx), h, r) and got.dtype == dtype
    if dtype == torch.float32:
        assert _rel(got.cpu(), _naive(q.cpu(), cache.cpu(), tables.cpu(), lens.cpu(), scale, r)) < 2e-5
    else:
        assert _rel(got, mla_decode_reference(q, cache, tables, lens, scale, r)) < BF16_TOL
    for j, n in enumerate(ctx):
        if n == 0:
            assert torch.equal(got[j], torch.zeros_like(got[j]))


@pytest.mark.parametrize("model", ["kimi-k2.5", "deepseek-v3"])
def test_wide_programs_at_large_batches(model):
    """A batch whose 64-head programs outnumber the SMs takes the wide tile (``mla_decode_tiles``) and agrees with
    the reference, padding rows included."""
    from epmoe.engine.mla_decode import mla_decode_tiles, mla_decode_triton

    h, r, dr = MODELS[model]
    ctx = [(37 * i) % 700 for i in range(300)]
    assert mla_decode_tiles(len(ctx), h, "cuda") == (64, 8)
    q, cache, tables, lens = _case(5, ctx, h, r, dr, 16, dtype=torch.bfloat16, device="cuda")
    got = mla_decode_triton(q, cache, tables, lens, 192 ** -0.5, r)
    assert _rel(got, mla_decode_reference(q, cache, tables, lens, 192 ** -0.5, r)) < BF16_TOL
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_auto_splits():
    assert mla_decode_splits(1, 64, 8192, "cuda") > 1   # one long sequence: split-K
    assert mla_decode_splits(128, 64, 8192, "cuda") == 1  # 512 programs fill the GPU
    assert mla_decode_splits(1, 64, 64, "cuda") == 1    # short context


@pytest.mark.parametrize("model", ["kimi-k2.5", "deepseek-v3"])
def test_cuda_graph_replay_with_new_context_lens(model):
    h, r, dr = MODELS[model]
    bs, mb = 16, 64
    q, cache, tables, lens = _case(7, [mb * bs, 5, 0, 700], h, r, dr, bs, dtype=torch.bfloat16, device="cuda")
    b = q.shape[0]
    out = torch.empty(b, h, r, dtype=torch.bfloat16, device="cuda")
    splits = mla_decode_splits(b, h, mb * bs, q.device)
    assert splits > 1
    ws = torch.empty(paged_decode_workspace_numel(b, h, r, splits), dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):       # warm-up: compile outside the capture
            mla_decode_attention(q, cache, tables, lens, 0.1, r, out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_attention(q, cache, tables, lens, 0.1, r, out=out, workspace=ws)
    gen = torch.Generator(device="cuda").manual_seed(8)
    for new in ([1, 0, 1024, 333], [0, 0, 0, 0], [17, 900, 16, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        if max(new) == 0:
            assert torch.equal(out, torch.zeros_like(out))
            continue
        assert _rel(out, mla_decode_reference(q, cache, tables, lens, 0.1, r)) < BF16_TOL
        for j, n in enumerate(new):
            if n == 0:
                assert torch.equal(out[j], torch.zeros_like(out[j]))


def _long_kimi(tmp_path):
    """The tiny Kimi-K2.5 checkpoint with a 4096-token context (block tables wide enough for split-K)."""
    from epmoe.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint("kimi-k2.5", tmp_path / "kimi-4k", overrides={"max_position_embeddings": 4096})


@pytest.mark.parametrize("family, max_model_len", [("deepseek-v2", None), ("kimi-k2.5", 4096)])
def test_cuda_engine_latent_matches_transformers(tiny_checkpoints, tmp_path, family, max_model_len):
    """float32, eager; with block tables 4096 positions wide the decode kernel runs split-K."""
    from epmoe.engine import Engine, EngineConfig, SamplingParams

    from .test_engine_gpu import PROMPTS, _reference

    d = _long_kimi(tmp_path) if max_model_len else tiny_checkpoints(family)
    engine = Engine(EngineConfig(model=str(d), device="cuda", max_num_seqs=8, enforce_eager=True,
                                 max_model_len=max_model_len))
    assert engine.kv_report()["kind"] == "latent"
    if max_model_len:
        assert mla_decode_splits(len(PROMPTS), 4, max_model_len, "cuda") > 1
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == _reference(d, [engine.encode(p) for p in PROMPTS], 12)


def test_cuda_graphs_with_split_k_agree_with_eager_bf16(tmp_path):
    """Graph-replayed decode over the latent cache with split-K in the runner's shared workspace gives the
    eager steps' tokens (prompts eager on both sides: as graph rows they take the absorbed decode path)."""
    from epmoe.engine import Engine, EngineConfig, SamplingParams

    from .test_engine_gpu import PROMPTS

    d = _long_kimi(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for eager in (False, True):
        engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                     max_num_seqs=8, cuda_graph_max_bs=8, cuda_graph_max_tokens=0,
                                     piecewise_cuda_graph_max_tokens=0, enforce_eager=eager, max_model_len=4096))
        tokens.append([o.token_ids for o in engine.generate(PROMPTS, params)])
        assert (engine.stats["graph_steps"] > 0) != eager
    assert mla_decode_splits(4, 4, 4096, "cuda") > 1
    assert tokens[0] == tokens[1]


def test_wide_tile_by_the_longest_context(monkeypatch):
    """Below the SM count, the longest context picks the wide tile (``mla_decode_tiles(..., max_context=...)``),
    with more splits; it agrees with the reference, padding rows included."""
    from epmoe.engine.mla_decode import mla_decode_tiles, mla_decode_triton, wide_tile_min_context

    h, r, dr = MODELS["kimi-k2.5"]
    ctx = [4096, 0, 17, 3000, 4096, 1, 2048, 4095]
    least = wide_tile_min_context(len(ctx), h, "cuda")
    assert least == 4096 and mla_decode_tiles(len(ctx), h, "cuda", max_context=max(ctx)) == (64, 8)
    q, cache, tables, lens = _case(9, ctx, h, r, dr, 16, dtype=torch.bfloat16, device="cuda")
    got = mla_decode_triton(q, cache, tables, lens, 192 ** -0.5, r, max_context=max(ctx))
    assert _rel(got, mla_decode_reference(q, cache, tables, lens, 192 ** -0.5, r)) < BF16_TOL
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_long_context_graphs_replayed_on_cuda(tmp_path, monkeypatch):
    """With the wide tile's threshold lowered so that the tiny 64-head Kimi-K2.5 reaches it, the runner captures a
    long-context graph per bucket of two rows or more and replays it for long steps; greedy tokens equal those of
    the engine without such graphs (threshold as shipped)."""
    from epmoe.engine import Engine, EngineConfig, SamplingParams, mla_decode
    from epmoe.models.tiny import build_tiny_checkpoint

    from .test_engine_gpu import PROMPTS

    d = build_tiny_checkpoint("kimi-k2.5", tmp_path / "kimi64", overrides=dict(num_attention_heads=64,
                                                                              max_position_embeddings=4096))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens, stats = [], []
    for least_keys in (64, mla_decode.WIDE_MIN_KEYS):
        monkeypatch.setattr(mla_decode, "WIDE_MIN_KEYS", least_keys)
        engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                     max_num_seqs=8, cuda_graph_max_bs=8, cuda_graph_max_tokens=0,
                                     piecewise_cuda_graph_max_tokens=0, max_model_len=4096))
        tokens.append([o.token_ids for o in engine.generate(PROMPTS, params)])
        stats.append(dict(engine.stats))
    assert stats[0]["long_context_graph_steps"] > 0 and stats[1]["long_context_graph_steps"] == 0
    assert tokens[0] == tokens[1]
