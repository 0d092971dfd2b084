"""``paged_decode_reference`` (the CPU path of ``paged_decode_attention``) against a naive dense oracle,
and the argument checks."""

import pytest
import torch

from epmoe.engine.mla_decode import mla_decode_splits
from epmoe.engine.paged_decode import paged_decode_attention, paged_decode_reference, paged_decode_splits

from .paged_decode_cases import CASES, make_case, naive_dense, rel_err


@pytest.mark.parametrize("i", range(len(CASES)))
def test_reference_matches_dense(i):
    ctx, h, hkv, dk, dv, bs, opts = CASES[i]
    c = make_case(i, ctx, h, hkv, dk, dv, bs, **opts)
    want = naive_dense(c)
    got = paged_decode_reference(*c.args(), **c.options())
    assert got.shape == (len(ctx), h, dv) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5
    for j, n in enumerate(ctx):
        if n == 0:
            assert torch.equal(got[j], torch.zeros_like(got[j]))
    # the public entry point serves CPU tensors with the reference, writing into out
    out = torch.full_like(got, float("nan"))
    res = paged_decode_attention(*c.args(), **c.options(), out=out)
    assert res is out and torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision(dtype):
    c = make_case(11, [40, 3, 0], 8, 2, 32, 16, 16, window=16, sinks=True, dtype=dtype)
    got = paged_decode_reference(*c.args(), **c.options())
    assert got.dtype == dtype
    assert rel_err(got, naive_dense(c)) < 1e-2


def test_sinks_dtype_and_scale():
    c = make_case(12, [20, 9], 4, 2, 16, 16, 16, sinks=True)
    c.scale = 0.3
    c.sinks = c.sinks.to(torch.bfloat16)      # any float dtype; used as given (widened to float32)
    got = paged_decode_reference(*c.args(), **c.options())
    assert rel_err(got, naive_dense(c)) < 1e-5


def _bad(c, **changes):
    args = dict(zip(["q", "k_cache", "v_cache", "block_tables", "context_lens", "scale"], c.args(), strict=True))
    args.update(c.options())
    args.update(changes)
    return args


@pytest.mark.parametrize("name,change,match", [
    ("q", lambda c: c.q[0], r"q must be \[B, H, Dk\]"),
    ("q", lambda c: c.q.double(), "q must be float32"),
    ("q", lambda c: c.q.transpose(1, 2).contiguous().transpose(1, 2), "q must be contiguous along its last dim"),
    ("q", lambda c: c.q[:, :3], "head count must be a positive multiple"),
    ("k_cache", lambda c: c.k_cache[0], r"k_cache must be \[NB, BS, Hkv, D\]"),
    ("k_cache", lambda c: c.k_cache.half(), "k_cache must have q's dtype"),
    ("k_cache", lambda c: c.k_cache[..., :8], "k_cache"),
    ("v_cache", lambda c: c.v_cache[:, :4], "v_cache must be"),
    ("v_cache", lambda c: c.v_cache.transpose(0, 1), "v_cache must be"),
    ("block_tables", lambda c: c.block_tables.long(), "block_tables must be int32"),
    ("block_tables", lambda c: c.block_tables[:1], r"block_tables must be \[B, MB\]"),
    ("block_tables", lambda c: c.block_tables[:, :0], r"block_tables must be \[B, MB\]"),
    ("context_lens", lambda c: c.context_lens.long(), "context_lens must be int32"),
    ("context_lens", lambda c: c.context_lens[:1], r"context_lens must be \[B\]"),
    ("context_lens", lambda c: torch.stack([c.context_lens, c.context_lens], 1)[:, 0],
     "context_lens must be contiguous, got stride 2"),
    ("context_lens", lambda c: torch.tensor([33, 9], dtype=torch.int32), r"context_lens holds 33; .* 0\.\.32"),
    ("context_lens", lambda c: torch.tensor([20, -1], dtype=torch.int32), "context_lens holds -1"),
    ("block_tables", lambda c: torch.full_like(c.block_tables, c.k_cache.shape[0]),
     r"block_tables holds block id 6; the cache has blocks 0\.\.5"),
    ("block_tables", lambda c: torch.full_like(c.block_tables, -1), "block_tables holds block id -1"),
    ("scale", lambda c: float("nan"), "scale must be a finite real"),
    ("scale", lambda c: torch.tensor(1.0), "scale must be a finite real"),
    ("sliding_window", lambda c: 0, "sliding_window must be None or a positive int"),
    ("chunk_size", lambda c: 2.5, "chunk_size must be None or a positive int"),
    ("sinks", lambda c: torch.zeros(3), r"sinks must be None or a \[H\]"),
    ("sinks", lambda c: torch.zeros(4, dtype=torch.int32), "sinks must have a float dtype"),
    ("out", lambda c: torch.empty(2, 4, 15), r"out must be None or a \[B, H, Dv\]"),
    ("out", lambda c: torch.empty(2, 4, 16, dtype=torch.float16), "out must have q's dtype"),
])
@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_reference])
def test_bad_arguments(fn, name, change, match):
    c = make_case(13, [20, 9], 4, 2, 16, 16, 16)
    with pytest.raises(ValueError, match=match):
        fn(**_bad(c, **{name: change(c)}))


def test_block_table_of_one_column_needs_no_unit_stride():
    c = make_case(15, [12, 3], 4, 2, 16, 16, 16)
    assert c.block_tables.shape[1] == 1
    strided = c.block_tables.reshape(1, 2).t()  # [2, 1] with strides (1, 2)
    assert strided.stride(1) != 1
    got = paged_decode_attention(c.q, c.k_cache, c.v_cache, strided, c.context_lens, c.scale)
    assert torch.equal(got, paged_decode_attention(*c.args()))


def test_non_tensor_argument():
    c = make_case(14, [5], 4, 2, 16, 16, 16)
    with pytest.raises(TypeError, match="block_tables must be a torch.Tensor"):
        paged_decode_attention(c.q, c.k_cache, c.v_cache, [[0]], c.context_lens, c.scale)


@pytest.mark.parametrize("rows, span, want", [
    (1, 65536, 128),   # one long sequence: 4 programs a split, 128 splits (about 4 programs an SM of 132)
    (4, 65536, 32),    # 16 programs a split
    (1, 4096, 64),     # 64 positions a split at least
    (64, 65536, 2),
    (128, 65536, 1),   # 512 programs: the GPU is full without splits
    (1, 64, 1),        # too short to split
])
def test_paged_decode_split_counts(rows, span, want):
    # Qwen3-30B-A3B's heads (32 queries over 4 key-value heads), 16-position blocks; CPU tensors count 132 SMs
    q = torch.zeros(rows, 32, 128)
    k_cache = torch.zeros(1, 16, 4, 128)
    assert paged_decode_splits(q, k_cache, torch.zeros(rows, span // 16, dtype=torch.int32)) == want


@pytest.mark.parametrize("rows, window, chunk, want", [
    (1, 128, None, 4),     # gpt-oss's 128-position window: one 32-key tile a split at least, 4 splits
    (8, 128, None, 4),     # 64 programs: 8 splits would fill the GPU, the window allows 4
    (64, 128, None, 1),    # 512 programs: full
    (1, 40, None, 1),      # a window of less than two tiles: not split
    (1, 1024, None, 32),   # 32 keys a split at least (64 without the window: 16 splits)
    (1, None, 2048, 64),   # a chunk shorter than the table alike (32 splits at 64 keys)
    (1, 8192, None, 64),   # a window longer than the table bounds nothing: 66 splits would give 4 programs an SM
])
def test_paged_decode_split_counts_bounded_span(rows, window, chunk, want):
    # gpt-oss's heads (64 queries over 8 key-value heads), block tables of 4096 positions (16-position blocks)
    q = torch.zeros(rows, 64, 64)
    k_cache = torch.zeros(1, 16, 8, 64)
    got = paged_decode_splits(q, k_cache, torch.zeros(rows, 4096 // 16, dtype=torch.int32), window, chunk)
    assert got == want


def test_bounded_span_never_splits_more_than_the_table():
    # a 6000-position window over a 6144-position table: 187 one-tile splits would pass the table's own 96 (64 once a
    # power of two), so the workspace sized for the table's span would not hold them
    q = torch.zeros(1, 8, 64)
    k_cache = torch.zeros(1, 16, 1, 64)
    tables = torch.zeros(1, 6144 // 16, dtype=torch.int32)
    assert paged_decode_splits(q, k_cache, tables, 6000) == paged_decode_splits(q, k_cache, tables) == 64


@pytest.mark.parametrize("rows, span, want", [
    (1, 65536, 64),    # Kimi-K2.5's 64 heads, 4 programs a split: at most 64 splits
    (4, 65536, 16),    # 16 programs a split: about 2 programs an SM of 132
    (1, 4096, 64),
    (128, 65536, 1),
    (1, 64, 1),
])
def test_mla_decode_split_counts(rows, span, want):
    assert mla_decode_splits(rows, 64, span, "cpu") == want


@pytest.mark.parametrize("rows, heads, want", [
    (132, 64, (16, 4)),     # 132 programs of 64 heads: no more than the 132 SMs CPU tensors count
    (133, 64, (64, 8)),
    (256, 64, (64, 8)),     # Kimi-K2.5 at batch 256
    (66, 128, (16, 4)),
    (67, 128, (64, 8)),     # DeepSeek-V3: two wide programs a row
    (1000, 32, (16, 4)),    # fewer heads than a wide program
])
def test_mla_decode_tiles(rows, heads, want):
    from epmoe.engine.mla_decode import mla_decode_tiles

    assert mla_decode_tiles(rows, heads, "cpu") == want
    assert mla_decode_tiles(rows, heads, "cpu", torch.float32) == (16, 4)   # float32 rows: always 16 heads
    if want[0] == 64:   # the wide programs alone outnumber the SMs: no split
        assert mla_decode_splits(rows, heads, 65536, "cpu") == 1


@pytest.mark.parametrize("args, match", [
    ((-1, 64, "cpu"), "batch"), ((4, 0, "cpu"), "heads"), ((2.5, 64, "cpu"), "batch"), ((4, True, "cpu"), "heads"),
    ((256, 64, "cpu", "float32"), "dtype must be one of"), ((256, 64, "cpu", torch.int8), "dtype must be one of"),
    ((256, 64, None), "device must be a torch.device or its name, got None"),
    ((256, 64, "nonsense"), "device must be a torch.device or its name, got 'nonsense'"),
])
def test_mla_decode_tiles_arguments_named(args, match):
    from epmoe.engine.mla_decode import mla_decode_tiles

    with pytest.raises(ValueError, match=f"mla_decode_tiles: {match}"):
        mla_decode_tiles(*args)


def test_mla_decode_tiles_names_cuda_without_a_gpu(monkeypatch):
    from epmoe.engine.mla_decode import mla_decode_tiles

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="mla_decode_tiles: device 'cuda', but CUDA is not available"):
        mla_decode_tiles(256, 64, "cuda")


@pytest.mark.parametrize("rows, heads, max_context, want", [
    (8, 64, 4096, (64, 8)),      # Kimi-K2.5: 8 rows x 1 group x 4096 keys reach WIDE_MIN_KEYS
    (8, 64, 4095, (16, 4)),
    (1, 64, 32768, (16, 4)),     # one 64-head group: the wide tile underfills the GPU at any context
    (1, 128, 16384, (64, 8)),    # DeepSeek-V3: one row is two 64-head groups
    (1, 128, 16383, (16, 4)),
    (64, 64, 512, (64, 8)),
    (64, 64, 511, (16, 4)),
    (8, 32, 1 << 20, (16, 4)),   # fewer heads than a wide program
    (8, 64, 0, (16, 4)),
])
def test_mla_decode_tiles_by_the_longest_context(rows, heads, max_context, want):
    from epmoe.engine.mla_decode import WIDE_MIN_KEYS, mla_decode_tiles, wide_tile_min_context

    assert WIDE_MIN_KEYS == 32768
    assert mla_decode_tiles(rows, heads, "cpu", max_context=max_context) == want
    assert mla_decode_tiles(rows, heads, "cpu", torch.float32, max_context=max_context) == (16, 4)
    least = wide_tile_min_context(rows, heads, "cpu")
    assert (least is not None and max_context >= least) == (want[0] == 64)
    # the tile sets the programs, and so the splits: more of them with the wide tile's fewer programs
    narrow = mla_decode_splits(rows, heads, 32768, "cpu")
    assert (mla_decode_splits(rows, heads, 32768, "cpu", max_context=max_context) > narrow) == (want[0] == 64)


@pytest.mark.parametrize("rows, heads, dtype, want", [
    (8, 64, torch.bfloat16, 4096), (2, 64, torch.float16, 16384), (1, 128, torch.bfloat16, 16384),
    (64, 128, torch.bfloat16, 256),
    (1, 64, torch.bfloat16, None),     # never wide
    (133, 64, torch.bfloat16, None),   # always wide (its programs outnumber the SMs)
    (8, 64, torch.float32, None), (8, 16, torch.bfloat16, None),
])
def test_wide_tile_min_context(rows, heads, dtype, want):
    from epmoe.engine.mla_decode import wide_tile_min_context

    assert wide_tile_min_context(rows, heads, "cpu", dtype) == want


@pytest.mark.parametrize("value", [-1, 2.5, True, "4096"])
def test_max_context_named(value):
    from epmoe.engine.mla_decode import mla_decode_tiles

    with pytest.raises(ValueError, match="mla_decode_tiles: max_context"):
        mla_decode_tiles(8, 64, "cpu", max_context=value)
    with pytest.raises(ValueError, match="mla_decode_splits: max_context"):
        mla_decode_splits(8, 64, 4096, "cpu", max_context=value)
    from epmoe.engine.mla_decode import mla_decode_attention

    q, cache = torch.zeros(1, 2, 24), torch.zeros(2, 4, 24)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^max_context must be an integer >= 0, got "):   # checked on CPU too
        mla_decode_attention(q, cache, tables, lens, 0.5, 16, max_context=value)
