"""MLA over the latent KV cache (``engine.mla``) against transformers' own DeepSeek-V2/V3 attention, the CPU
decode reference against a naive computation, and the engine on MLA checkpoints (latent cache, greedy
tokens equal to transformers'). The families at EP 1, 2 and 4 run in ``test_engine_ranks``."""

from __future__ import annotations

import pytest
import torch

from epmoe.engine.attention import AttnBatch, PrefillChunk
from epmoe.engine.kv_cache import KVCache, KVLayout
from epmoe.engine.mla import MLAAttention, install_mla
from epmoe.engine.mla_decode import mla_decode_attention, mla_decode_reference, mla_decode_splits, mla_decode_triton

from ..hf_greedy import hf_greedy

_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, vocab_size=64,
              q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, intermediate_size=32,
              max_position_embeddings=256)
_YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    # DeepSeek-V3 / Kimi: q LoRA, interleaved rope (transformers' default)
    "v3": ("deepseek_v3", dict(rope_interleave=True, rope_scaling=None)),
    # q_proj without LoRA, rotate-half rope, yarn with mscale_all_dim (the softmax scale grows by mscale^2)
    "v3-yarn-no-qlora": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, rope_scaling=_YARN)),
    # DeepSeek-V2: complex rope
    "v2": ("deepseek_v2", dict(rope_scaling=None)),
}


def _model(variant: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = VARIANTS[variant]
    config = AutoConfig.for_model(model_type, **{**_SMALL, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _reference(attn, rotary, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention module over the whole sequence ``x [n, D]`` (causal): ``[n, D]``."""
    n = x.shape[0]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out, _ = attn(hidden_states=x[None], position_embeddings=rotary(x[None], pos), attention_mask=mask)
    return out[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mla_attention_equals_transformers(variant):
    """Two sequences through chunked prefill and absorbed decode over the latent cache, one step mixing a
    decode row with a prefill chunk, against transformers' module on each whole sequence (float32)."""
    model = _model(variant)
    attn = model.model.layers[0].self_attn
    rotary = model.model.rotary_emb
    mla = MLAAttention(attn)
    if variant == "v3-yarn-no-qlora":
        assert mla.scaling == pytest.approx((16 ** -0.5) * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    cfg = model.config
    layout = KVLayout.from_config(cfg)
    assert layout.latent and layout.k_head_dim == 16 + 8
    kv = KVCache(layout, num_blocks=10, block_size=4, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(11, 64, generator=gen), torch.randn(6, 64, generator=gen)
    blocks = {"a": [3, 1, 7], "b": [5, 2]}  # not in order: the block tables matter
    x = {"a": xa, "b": xb}

    def slots(seq: str, positions: list[int]) -> torch.Tensor:
        return torch.tensor([blocks[seq][p // 4] * 4 + p % 4 for p in positions])

    def step(decodes: list[tuple[str, int]], prefills: list[tuple[str, int, int]]) -> torch.Tensor:
        rows, positions, slot, chunks = [], [], [], []
        for seq, p in decodes:
            rows.append(x[seq][p])
            positions.append(p)
            slot.append(slots(seq, [p]))
        r = len(decodes)
        for seq, start, n in prefills:
            rows.extend(x[seq][start:start + n])
            positions.extend(range(start, start + n))
            slot.append(slots(seq, list(range(start, start + n))))
            chunks.append(PrefillChunk(r, n, start, slots(seq, list(range(start + n)))))
            r += n
        tables = torch.zeros(len(decodes), 3, dtype=torch.int32)
        for i, (seq, _) in enumerate(decodes):
            tables[i, : len(blocks[seq])] = torch.tensor(blocks[seq])
        ctx = torch.tensor([p + 1 for _, p in decodes], dtype=torch.int32)
        batch = AttnBatch(kv, torch.cat(slot), len(decodes), tables, ctx, tuple(chunks))
        hidden = torch.stack(rows)[None]
        with torch.no_grad():
            out, none = mla(hidden, position_embeddings=rotary(hidden, torch.tensor(positions)[None]),
                            epmoe_batch=batch)
        assert none is None
        return out[0]

    got_a = [step([], [("a", 0, 5)]), step([], [("a", 5, 4)]),            # chunked prefill of a
             step([("a", 9)], [("b", 0, 6)])]                               # a decodes while b prefills
    got_a.append(step([("a", 10)], [])[:1])
    got_b = got_a[2][1:]
    got_a[2] = got_a[2][:1]
    with torch.no_grad():
        want_a, want_b = _reference(attn, rotary, xa), _reference(attn, rotary, xb)
    for got, want in ((torch.cat(got_a), want_a), (got_b, want_b)):
        assert got.shape == want.shape
        assert (got - want).norm() / want.norm() < 1e-5, (variant, (got - want).abs().max())
    # the cache holds the latent entries only: c_kv (normalised) and the rotated key of a's first token
    compressed = attn.kv_a_proj_with_mqa(xa[:1])
    with torch.no_grad():
        c0 = attn.kv_a_layernorm(compressed[:, :16])
    assert torch.allclose(kv.k[0][3, 0, :16], c0[0], atol=1e-6)


def test_install_mla_replaces_every_layer_once():
    model = _model("v3")
    assert install_mla(model) == 1 and isinstance(model.model.layers[0].self_attn, MLAAttention)
    assert install_mla(model) == 1  # idempotent
    before = model.model.layers[0].self_attn.kv_b_proj
    assert before.weight.data_ptr() == model.model.layers[0].self_attn.kv_b_proj.weight.data_ptr()
    with pytest.raises(ValueError, match="needs the engine's epmoe_batch"):
        model.model.layers[0].self_attn(torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="is not an MLA attention module"):
        MLAAttention(torch.nn.Linear(2, 2))


def _naive(q, cache, tables, ctx, scale, dv):
    """Per row: softmax over the context's entries, average of their first dv values (float64)."""
    b, h, dk = q.shape
    bs = cache.shape[1]
    out = torch.zeros(b, h, dv, dtype=torch.float64)
    for i in range(b):
        n = int(ctx[i])
        if n == 0:
            continue
        pos = torch.arange(n)
        entries = cache[tables[i, pos // bs].long(), pos % bs].double()
        probs = torch.softmax(q[i].double() @ entries.T * scale, dim=-1)
        out[i] = probs @ entries[:, :dv]
    return out


def _case(seed: int, ctx: list[int], h: int, dv: int, dr: int, bs: int, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    mb = max(1, -(-max(ctx) // bs))
    nb = len(ctx) * mb + 1
    cache = torch.randn(nb, bs, dv + dr, generator=gen).to(dtype)
    tables = (torch.randperm(nb - 1, generator=gen)[: len(ctx) * mb] + 1).reshape(len(ctx), mb).to(torch.int32)
    q = torch.randn(len(ctx), h, dv + dr, generator=gen).to(dtype)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    return q.to(device), cache.to(device), tables.to(device), ctx_t.to(device)


def test_decode_reference_equals_naive():
    q, cache, tables, ctx = _case(0, [7, 0, 1, 33], h=5, dv=16, dr=8, bs=4)
    got = mla_decode_reference(q, cache, tables, ctx, 0.3, 16)
    want = _naive(q, cache, tables, ctx, 0.3, 16)
    assert got.shape == (4, 5, 16) and got.dtype == torch.float32
    assert (got.double() - want).norm() / want.norm() < 1e-6
    assert torch.equal(got[1], torch.zeros(5, 16))  # padding row
    out = torch.full((4, 5, 16), float("nan"))
    assert mla_decode_attention(q, cache, tables, ctx, 0.3, 16, out=out) is out and torch.equal(out, got)


@pytest.mark.parametrize("bad, match", [
    (dict(v_head_dim=24), r"v_head_dim \(kv_lora_rank\) must be an int in \[1, Dk = 24\)"),
    (dict(cache_dim=20), "cache must be \\[NB, BS, Dk\\] with q's Dk 24"),
    (dict(ctx_dtype=torch.int64), "context_lens must be int32"),
    (dict(out_shape=(2, 5, 24)), r"out must be None or a \[B, H, Dv\] = \[2, 5, 16\] tensor"),
    (dict(scale=float("nan")), "scale must be a finite real number"),
])
def test_decode_bad_inputs_named(bad, match):
    q, cache, tables, ctx = _case(1, [3, 5], h=5, dv=16, dr=8, bs=4)
    if "cache_dim" in bad:
        cache = cache[..., : bad["cache_dim"]].contiguous()
    if "ctx_dtype" in bad:
        ctx = ctx.to(bad["ctx_dtype"])
    out = torch.empty(bad["out_shape"]) if "out_shape" in bad else None
    with pytest.raises(ValueError, match=match):
        mla_decode_attention(q, cache, tables, ctx, bad.get("scale", 0.5), bad.get("v_head_dim", 16), out=out)


@pytest.mark.parametrize("change, match", [
    (lambda t, c: (t, torch.stack([c, c], 1)[:, 0]), "context_lens must be contiguous, got stride 2"),
    (lambda t, c: (t, torch.tensor([3, 9], dtype=torch.int32)), r"context_lens holds 9; .* 0\.\.8"),
    (lambda t, c: (t, torch.tensor([-2, 5], dtype=torch.int32)), "context_lens holds -2"),
    (lambda t, c: (torch.full_like(t, 5), c), r"block_tables holds block id 5; the cache has blocks 0\.\.4"),
    (lambda t, c: (torch.full_like(t, -1), c), "block_tables holds block id -1"),
])
def test_decode_bad_tables_named(change, match):
    q, cache, tables, ctx = _case(2, [3, 5], h=5, dv=16, dr=8, bs=4)
    assert tables.shape == (2, 2) and cache.shape[0] == 5
    tables, ctx = change(tables, ctx)
    with pytest.raises(ValueError, match=match):
        mla_decode_attention(q, cache, tables, ctx, 0.5, 16)


@pytest.mark.parametrize("args, match", [
    ((-1, 64, 4096), "batch must be an integer >= 0, got -1"),
    ((True, 64, 4096), "batch must be an integer >= 0, got True"),
    ((2, 0, 4096), "heads must be an integer >= 1, got 0"),
    ((2, 64, 4096.0), "max_positions must be an integer >= 1, got 4096.0"),
])
def test_decode_split_count_arguments_named(args, match):
    with pytest.raises(ValueError, match=f"mla_decode_splits: {match}"):
        mla_decode_splits(*args, "cpu")
    assert mla_decode_splits(0, 64, 4096, "cpu") >= 1


def test_decode_split_count_and_workspace_checked_before_triton_is_needed():
    q, cache, tables, ctx = _case(3, [3, 5], h=5, dv=16, dr=8, bs=4)
    for splits in (3, 0, True):
        with pytest.raises(ValueError, match=f"splits must be a power of two >= 1, got {splits!r}"):
            mla_decode_triton(q, cache, tables, ctx, 0.5, 16, splits=splits)
    for ws, got in (("junk", "str"), (torch.zeros(4), r"torch.float32 \(4,\) on cpu")):
        with pytest.raises(ValueError, match=f"workspace must be a 1-D float32 tensor .* got {got}"):
            mla_decode_triton(q, cache, tables, ctx, 0.5, 16, splits=2, workspace=ws)


def test_engine_latent_cache_equals_transformers(tiny_checkpoints, tmp_path):
    """The engine on an MLA checkpoint without q LoRA, rotate-half rope and yarn (the tiny families cover q
    LoRA and interleaved rope): latent KV bytes, greedy tokens equal to transformers' through chunked
    prefill, a preemption and the static decode buckets (the CUDA-graph path, run eagerly on CPU)."""
    from transformers import AutoModelForCausalLM

    from epmoe.engine import Engine, EngineConfig, SamplingParams
    from epmoe.models.tiny import build_tiny_checkpoint

    d = build_tiny_checkpoint("kimi-k2.5", tmp_path / "kimi", overrides=dict(
        q_lora_rank=None, rope_interleave=False, rope_scaling=_YARN))
    engine = Engine(EngineConfig(model=str(d), max_num_seqs=3, max_num_batched_tokens=8, block_size=4,
                                 num_kv_blocks=9, static_decode_on_cpu=True, cuda_graph_max_bs=2))
    report = engine.kv_report()
    assert report["kind"] == "latent" and report["bytes_per_token_layer"] == (16 + 8) * 4
    assert engine.kv.nbytes == 3 * 9 * 4 * (16 + 8) * 4
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (13, 1, 6)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(ref, [p], 8, 258)[0] for p in prompts]
    assert engine.stats["preemptions"] > 0 and engine.stats["graph_steps"] > 0
    assert engine.allocator.num_free == engine.allocator.capacity


def test_long_context_buckets_replay_their_own_static_step(tmp_path, monkeypatch):
    """A bucket whose MLA decode tile the longest context changes (``mla_decode.wide_tile_min_context``) gets a
    second static step, replayed for steps whose longest context reaches the threshold (here lowered to 32 keys:
    two rows from 16 positions on; one row of 64 heads never changes tile); the tokens equal those of the same
    engine with the threshold as shipped, which these contexts never reach."""
    from epmoe.engine import Engine, EngineConfig, SamplingParams, mla_decode
    from epmoe.models.tiny import build_tiny_checkpoint

    d = build_tiny_checkpoint("kimi-k2.5", tmp_path / "kimi64", overrides=dict(num_attention_heads=64))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens, stats, longs = [], [], []
    for least_keys in (32, mla_decode.WIDE_MIN_KEYS):
        monkeypatch.setattr(mla_decode, "WIDE_MIN_KEYS", least_keys)
        engine = Engine(EngineConfig(model=str(d), dtype="bfloat16", max_num_seqs=2, static_decode_on_cpu=True,
                                     cuda_graph_max_bs=2))
        tokens.append([o.token_ids for o in engine.generate(prompts, params)])
        stats.append(dict(engine.stats))
        longs.append({b: g.min_context for b, g in engine.runner.long_graphs.items()})
    assert 1 not in longs[0] and longs[0][2] == 16 and longs[0][4] == 8   # prompt rows fill the larger buckets
    assert longs[1] == {128: 256}   # 128 rows x 256 positions = WIDE_MIN_KEYS, never reached here
    assert tokens[0] == tokens[1]
    assert 0 < stats[0]["long_context_graph_steps"] < stats[0]["graph_steps"] == stats[1]["graph_steps"]
    assert stats[1]["long_context_graph_steps"] == 0


def _long_context_worker(info, directory: str, least_keys: int) -> dict:
    from epmoe.comm import Comm
    from epmoe.engine import Engine, EngineConfig, SamplingParams, mla_decode
    from epmoe.runtime.launch import init_group

    mla_decode.WIDE_MIN_KEYS = least_keys
    comm = Comm(init_group(info, "cpu"))
    try:
        gen = torch.Generator().manual_seed(7 + comm.rank)
        length = 2 if comm.rank == 0 else 20   # rank 0's contexts stay below 16 positions, rank 1's reach it
        prompts = [torch.randint(0, 256, (length,), generator=gen).tolist() for _ in range(2)]
        engine = Engine(EngineConfig(model=directory, dtype="bfloat16", max_num_seqs=2, static_decode_on_cpu=True,
                                     cuda_graph_max_bs=2), comm)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        return {"tokens": [o.token_ids for o in outs], "stats": dict(engine.stats), "steps": engine.num_steps,
                "longs": {b: g.min_context for b, g in engine.runner.long_graphs.items()}}
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_ranks_agree_on_the_long_context_graph(tmp_path):
    """Two EP ranks replay a bucket's long-context graph in the same steps (its longest context is agreed with the
    step's other values), although only rank 1's own contexts reach the threshold (lowered to 32 keys: 16 positions
    at two rows); the tokens equal those of the threshold as shipped (no long graphs)."""
    from epmoe.engine import mla_decode
    from epmoe.models.tiny import build_tiny_checkpoint
    from epmoe.runtime.launch import spawn

    d = str(build_tiny_checkpoint("kimi-k2.5", tmp_path / "kimi64", overrides=dict(num_attention_heads=64)))
    low = spawn(_long_context_worker, 2, (d, 32))
    shipped = spawn(_long_context_worker, 2, (d, mla_decode.WIDE_MIN_KEYS))
    assert low[0]["longs"][2] == 16 and 2 not in shipped[0]["longs"]
    assert low[0]["steps"] == low[1]["steps"]
    longs = [r["stats"]["long_context_graph_steps"] for r in low]
    assert longs[0] == longs[1] > 0
    assert all(r["stats"]["long_context_graph_steps"] == 0 for r in shipped)
    assert [r["tokens"] for r in low] == [r["tokens"] for r in shipped]
