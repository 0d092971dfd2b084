"""The engine on CUDA: eager steps (paged attention, fused norms) equal transformers' greedy generate in
float32, and graph-replayed decode gives the eager path's tokens in bfloat16 (prompts run eagerly on both
sides: fed as graph rows they attend through another kernel, whose bf16 rounding may flip a near-tie of these
random weights; ``test_rowwise_prefill`` checks that path against the chunk's)."""

import pytest
import torch

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.packing import Feed

pytestmark = pytest.mark.gpu

PROMPTS = ["Expert parallelism places whole experts on ranks", "The quick brown fox", "def f(x):", "M"]


def _reference(model_dir, ids, n):
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import hf_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config(str(model_dir)),
                                                 dtype=torch.float32).cuda().eval()
    out = []
    for p in ids:
        x = torch.tensor([p], device="cuda")
        y = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(y[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("family", ["qwen3-moe", "kimi-k2.5", "gpt-oss", "llama4"])
def test_cuda_engine_matches_transformers(tiny_checkpoints, family):
    d = tiny_checkpoints(family)
    engine = Engine(EngineConfig(model=str(d), device="cuda", max_num_seqs=8, enforce_eager=True))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ref = _reference(d, [engine.encode(p) for p in PROMPTS], 12)
    assert [o.token_ids for o in outs] == ref
    assert engine.allocator.num_free == engine.allocator.capacity


@pytest.mark.parametrize("family,kind", [("qwen3-moe", "plain"), ("kimi-k2.5", "plain"), ("gpt-oss", "plain"),
                                         ("llama4", "plain"), ("kimi-k2.5-int4", "int4"), ("gpt-oss-mxfp4", "mxfp4"),
                                         ("deepseek-v3-fp8", "fp8")])
def test_graph_and_eager_agree_bf16(tiny_checkpoints, family, kind):
    # quantized routed experts stay as stored on the GPU, and their kernels replay inside the decode graphs
    d = tiny_checkpoints(family)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for eager in (False, True):
        engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                     max_num_seqs=8, cuda_graph_max_bs=8, cuda_graph_max_tokens=0,
                                     piecewise_cuda_graph_max_tokens=0, enforce_eager=eager))
        assert all(layer.experts.storage.kind == kind for layer in engine.ep_model.moe_layers)
        tokens.append([o.token_ids for o in engine.generate(PROMPTS, params)])
        assert (engine.stats["graph_steps"] > 0) != eager
    assert tokens[0] == tokens[1]


def test_segmented_graphs_give_the_same_tokens(tiny_checkpoints):
    """A captured step split into two graphs along its decoder layers (replayed in order) gives the one-graph
    step's tokens."""
    d = tiny_checkpoints("qwen3-moe")
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                 max_num_seqs=8, cuda_graph_max_bs=8))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert all(len(g.graph) == 1 for g in engine.runner.graphs.values())
    want = [o.token_ids for o in engine.generate(PROMPTS, params)]
    engine.runner.graph_segments = 2
    engine._capture()
    assert all(len(g.graph) == 2 for g in engine.runner.graphs.values())
    steps = engine.stats["graph_steps"]
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == want
    assert engine.stats["graph_steps"] > steps


@pytest.mark.parametrize("family", ["qwen3-moe", "kimi-k2.5", "gpt-oss", "llama4"])
def test_piecewise_graphs_match_the_eager_step_bf16(tiny_checkpoints, family):
    """The same steps eagerly and as piecewise graph replays (``engine.piecewise``): a 70-token prompt alone, then a
    decode row beside the next 30-token chunk of another prompt (attention over a cached prefix), then a step of
    one row: the same logits up to bf16 rounding (the padded steps may take other expert kernels and tile shapes), the
    graphs replaying with fewer rows than their bucket; then a short generation runs through the engine."""
    d = tiny_checkpoints(family)
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                 max_num_seqs=8, cuda_graph_max_bs=8, max_num_batched_tokens=256))
    runner = engine.runner
    assert runner.piece_buckets == [64, 128, 256]
    assert all(len(g.graph) == len(g.cuts) + 1 == len(engine.ep_model.model.model.layers) + 1
               for g in runner.piece_graphs.values())
    bs = engine.config.block_size
    gen = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, 250, (n,), generator=gen).tolist() for n in (71, 60))
    ta, tb = engine.allocator.allocate(-(-72 // bs)), engine.allocator.allocate(-(-60 // bs))
    steps = [[Feed(a[:70], 0, ta, False, 1)],
             [Feed(a[70:71], 70, ta, True, 1), Feed(b[:30], 0, tb, False, 0)],
             [Feed(b[30:60], 30, tb, False, 1)],
             [Feed(a[70:71], 70, ta, True, 1)]]
    for feeds in steps:
        rows = sum(len(f.token_ids) for f in feeds)
        eager = runner.execute(feeds).logits
        piece = runner.execute(feeds, piece=runner.piece_bucket_for(rows)).logits
        assert piece.shape == eager.shape == (sum(f.sample for f in feeds), eager.shape[1])
        assert ((piece - eager).norm() / eager.norm()).item() < 0.03
    engine.allocator.free(ta)
    engine.allocator.free(tb)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs) and engine.stats["eager_steps"] == 0


def test_piecewise_buckets_reuse_the_warm_up_memory(tiny_checkpoints):
    """Every bucket's warm-up and capture runs on one side stream, so the blocks the largest bucket's warm-up left
    cached serve the smaller buckets: capturing all ten buckets up to 2048 tokens reserves less than one more
    2 MiB segment per bucket over capturing the largest alone (a stream per bucket reserved new segments for each,
    and a capture cannot hand cached blocks back: a large model ran out of memory that way)."""
    import gc

    d = tiny_checkpoints("qwen3-moe")
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                 max_num_seqs=4, cuda_graph_max_bs=4, max_num_batched_tokens=2048,
                                 cuda_graph_max_tokens=0, piecewise_cuda_graph_max_tokens=0))
    activate, deactivate = engine._ep_static_hooks()
    runner = engine.runner
    sizes = [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]

    def reserved_after(buckets: list[int]) -> int:
        runner.piece_graphs, runner.pieces = {}, None
        runner._pool = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        runner.capture_pieces(buckets, activate, deactivate)
        return torch.cuda.memory_reserved() - base

    largest = reserved_after([2048])
    every = reserved_after(sizes)
    assert every - largest < (len(sizes) - 1) * 2 * 2**20, (largest, every)
    # the buckets replay: a 100-token prompt runs as a piecewise step
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert len(engine.generate([list(range(3, 103))], params)[0].token_ids) == 2
    assert engine.stats["piecewise_steps"] == 1


def test_graphs_survive_the_allocator_releasing_memory(tiny_checkpoints):
    """The decode graphs' split-K scratch lives as long as the graphs: after the caching allocator returns every
    free block to the driver (as it does under memory pressure), replays still give the same tokens."""
    import gc

    d = tiny_checkpoints("qwen3-moe")
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                 max_num_seqs=8, cuda_graph_max_bs=8))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(PROMPTS, params)]
    gc.collect()
    torch.cuda.empty_cache()
    steps = engine.stats["graph_steps"]
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == want
    torch.cuda.synchronize()
    assert engine.stats["graph_steps"] > steps


def _graphs_then_eager(model_dir: str, params: list[SamplingParams]) -> list[list]:
    """The first prompts' outputs in bfloat16 with graph-replayed decode, then with eager steps only."""
    outs = []
    for eager in (False, True):
        engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", expert_backend="triton",
                                     max_num_seqs=8, cuda_graph_max_bs=8, cuda_graph_max_tokens=0,
                                     piecewise_cuda_graph_max_tokens=0, enforce_eager=eager))
        outs.append(engine.generate(PROMPTS[:len(params)], params))
        assert (engine.stats["graph_steps"] > 0) != eager
    return outs


def test_logprobs_and_penalties_through_graphs_equal_the_eager_steps(tiny_checkpoints):
    """Log-probabilities (copied to pinned host memory while the next step runs) and penalties (their token counts
    kept on the device, counted as each token is sampled) through graph-replayed decode in bfloat16: the eager
    steps' tokens and values (the CPU tests check both against transformers in float32)."""
    d = str(tiny_checkpoints("qwen3-moe"))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.4,
                             frequency_penalty=0.7, presence_penalty=0.3, logit_bias={7: 2.0}, logprobs=0),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    outs = _graphs_then_eager(d, params)
    for graph, eager in zip(*outs):
        assert graph.token_ids == eager.token_ids
        if eager.logprobs is None:
            assert graph.logprobs is None
            continue
        assert [e.token_id for e in graph.logprobs] == graph.token_ids
        # one bf16 rounding of a logit apart at most (the graph's and the eager step's kernels may differ)
        torch.testing.assert_close(torch.tensor([e.logprob for e in graph.logprobs]),
                                   torch.tensor([e.logprob for e in eager.logprobs]), atol=0.05, rtol=0)
        assert [[i for i, _ in e.top] for e in graph.logprobs] == [[i for i, _ in e.top] for e in eager.logprobs]


def test_structured_outputs_through_graphs_equal_the_eager_steps():
    """Constrained requests (the bitmask applied on the device to the graph's logits, the last step read back early
    under the overlap schedule) beside a free one: the eager steps' tokens; each output holds to its constraint."""
    import json
    import re

    from epmoe.models.tiny import ensure_default_checkpoint

    d = str(ensure_default_checkpoint())  # the built-in checkpoint has a tokenizer (structured outputs need one)
    schema = {"type": "object", "required": ["id"], "additionalProperties": False,
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}}}
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": schema,
                                                                               "disable_any_whitespace": True}),
              SamplingParams(temperature=0.8, seed=2, max_tokens=24, structured_outputs={"regex": r"[a-f]{4}"}),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    outs = _graphs_then_eager(d, params)
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    obj, code, free = outs[0]
    assert 0 <= json.loads(obj.text)["id"] <= 999 and re.fullmatch(r"[a-f]{4}", code.text)
    assert len(free.token_ids) == 12


@pytest.mark.parametrize("family", ["qwen3-moe", "kimi-k2.5", "gpt-oss"])
def test_a_one_row_step_folds_its_norms(tiny_checkpoints, family, monkeypatch):
    """A decode step of one row hands the input norms to the q/k/v projection (``RopeAttention``, Qwen3-MoE) and
    the post-attention norms to the MoE layers' routers (every family here; gpt-oss's through its tuple-returning
    block, with a gate bias and chosen-logit routing): the step's logits equal those of the
    same step with the folding off (``EPMOE_FOLD_NORM=0``) up to bf16 rounding, eagerly and replayed in its graph."""
    from collections import Counter

    import epmoe.engine.rope_attention as rope_attention
    from epmoe.routing import Router

    d = tiny_checkpoints(family)
    engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                 max_num_seqs=8, cuda_graph_max_bs=8))
    runner = engine.runner
    calls = Counter()
    route_folded, after_norm = Router.route_folded, rope_attention.linear_after_norm

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(Router, "route_folded", count("router", route_folded))
    monkeypatch.setattr(rope_attention, "linear_after_norm", count("qkv", after_norm))
    a = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    table = engine.allocator.allocate(-(-22 // engine.config.block_size))
    runner.execute([Feed(a[:20], 0, table, False, 1)])
    step = [Feed(a[20:21], 20, table, True, 1)]
    folded = runner.execute(step).logits
    layers = engine.ep_model.model.config.num_hidden_layers
    assert calls["router"] == engine.ep_model.spec.num_moe_layers
    assert calls["qkv"] == (layers - 1 if family in ("qwen3-moe", "gpt-oss") else 0)
    graphed = runner.execute(step, bucket=runner.bucket_for(1)).logits
    monkeypatch.setenv("EPMOE_FOLD_NORM", "0")
    plain = runner.execute(step).logits
    assert calls["router"] == engine.ep_model.spec.num_moe_layers  # no more folds
    for got in (folded, graphed):
        assert ((got.float() - plain.float()).norm() / plain.float().norm()).item() < 0.01
    engine.allocator.free(table)
