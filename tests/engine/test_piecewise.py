"""Piecewise graphs (``engine.piecewise``) on CPU: the bucket sizes, the cuts' staging, and the engine's piecewise
path (static padded rows, attention run on the real batch between the pieces) against transformers."""

from __future__ import annotations

import pytest
import torch

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.piecewise import Pieces, piece_buckets

from ..hf_greedy import hf_greedy


def test_piece_buckets():
    assert piece_buckets(1, 8192) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584,
                                      4096, 5120, 6144, 7168, 8192]
    assert piece_buckets(1, 3000) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3000]
    assert piece_buckets(1, 16) == [16]
    assert piece_buckets(200, 600) == [256, 512, 600]
    assert piece_buckets(1, 0) == []


def test_cut_stages_inputs_and_runs_on_the_real_rows():
    pieces = Pieces(max_rows=8)
    calls = []

    def attention(batch, q):
        calls.append((batch, q.shape[0]))
        return q.sum(dim=-1, keepdim=True).expand(q.shape[0], 3) * batch

    q = torch.arange(24, dtype=torch.float32).view(6, 2, 2)
    pieces.record(None)  # recording: staged, not run
    out = pieces.cut(attention, (3,), torch.float32, q.view(6, 4))
    cuts = pieces.stop()
    assert calls == [] and len(cuts) == 1 and out.shape == (6, 3)
    assert torch.equal(out, torch.zeros(6, 3))
    assert torch.equal(cuts[0].inputs[0], q.view(6, 4))
    cuts[0].run(10.0, 4)  # the real batch has 4 of the 6 rows: only those are computed and written
    assert calls == [(10.0, 4)]
    assert torch.equal(out[:4], q.view(6, 4)[:4].sum(-1, keepdim=True).expand(4, 3) * 10)
    assert torch.equal(out[4:], torch.zeros(2, 3))
    pieces.set_batch(2.0, 2)  # running: the cut runs at once, in the same shared buffers
    again = pieces.cut(attention, (3,), torch.float32, q.view(6, 4)[:5] + 1)
    assert again.data_ptr() == out.data_ptr() and calls[-1] == (2.0, 2)
    assert torch.equal(again[:2], (q.view(6, 4)[:2] + 1).sum(-1, keepdim=True).expand(2, 3) * 2)
    with pytest.raises(ValueError, match="a piecewise forward of 9 rows; the staging buffers hold 8"):
        pieces.cut(attention, (3,), torch.float32, torch.zeros(9, 4))


@pytest.mark.parametrize("family", ["gpt-oss", "llama4", "qwen3-moe"])
def test_piecewise_engine_equals_transformers(tiny_checkpoints, family):
    """Prompts of 1 to 23 tokens in chunks of up to 16 rows (with decodes beside them), none row-wise: every step
    with a prompt chunk is piecewise; greedy tokens equal transformers' in float32."""
    from transformers import AutoModelForCausalLM

    d = str(tiny_checkpoints(family))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (23, 5, 1, 12)]
    engine = Engine(EngineConfig(model=d, max_num_seqs=3, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
                                 static_decode_on_cpu=True, cuda_graph_max_bs=2, cuda_graph_max_tokens=0))
    assert engine.runner.piece_buckets == [16] and engine.kv_report()["piecewise_buckets"] == [16]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(ref, [p], 6, 258)[0] for p in prompts]
    assert engine.stats["piecewise_steps"] > 0 and engine.stats["eager_steps"] == 0
    assert engine.allocator.num_free == engine.allocator.capacity


def test_piecewise_off_runs_prompts_eagerly(tiny_checkpoints):
    d = str(tiny_checkpoints("qwen3-moe"))
    engine = Engine(EngineConfig(model=d, max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=32,
                                 static_decode_on_cpu=True, cuda_graph_max_bs=2, cuda_graph_max_tokens=0,
                                 piecewise_cuda_graph_max_tokens=0))
    assert engine.runner.piece_buckets == []
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.stats["piecewise_steps"] == 0 and engine.stats["eager_steps"] > 0


def test_bad_piecewise_option_named(tiny_checkpoints):
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens must be a non-negative integer, got -1"):
        EngineConfig(model=str(tiny_checkpoints("qwen3-moe")), piecewise_cuda_graph_max_tokens=-1)


def test_piecewise_buckets_stop_at_the_token_budget_with_speculation(tiny_checkpoints):
    """Proposed tokens take their share of the token budget (the scheduler's lookahead slots), so with speculative
    decoding too the piecewise buckets stop at ``max_num_batched_tokens`` (no bucket of verify rows past it) and
    every step holding verify rows and prompt chunks fits them; greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM

    d = str(tiny_checkpoints("qwen3-moe"))
    gen = torch.Generator().manual_seed(8)
    rep = torch.randint(0, 256, (3,), generator=gen).tolist()
    prompts = [rep * 5, torch.randint(0, 256, (14,), generator=gen).tolist(), rep * 3, rep[:2] * 6]
    engine = Engine(EngineConfig(model=d, max_num_seqs=3, max_num_batched_tokens=12, block_size=4, num_kv_blocks=64,
                                 static_decode_on_cpu=True, cuda_graph_max_bs=2, cuda_graph_max_tokens=0,
                                 speculative_algorithm="ngram", speculative_num_tokens=3))
    assert engine.runner.piece_buckets == [12]
    mixed = []
    run = engine.runner.run

    def spy(plan, bucket=None, drafts=None, piece=None, **kw):
        mixed.append(piece is not None and bool(plan.prefills) and any(drafts or ()))
        return run(plan, bucket, drafts, piece, **kw)

    engine.runner.run = spy
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(ref, [p], 8, 258)[0] for p in prompts]
    assert any(mixed), "no piecewise step carried verify rows next to a prompt chunk"
    assert engine.stats["eager_steps"] == 0 and engine.spec_stats.accepted_tokens > 0


def test_padding_rows_of_static_steps_reach_no_expert(tiny_checkpoints):
    """Decode buckets of 1, 2 and 4 rows and a piecewise bucket of 16, most steps padded: the first MoE layer's
    experts see
    exactly the fed tokens' pairs (every prompt token and every generated token but the last, ``K`` pairs each)."""
    d = str(tiny_checkpoints("qwen3-moe"))
    engine = Engine(EngineConfig(model=d, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
                                 static_decode_on_cpu=True, cuda_graph_max_bs=4, cuda_graph_max_tokens=0))
    layer = engine.ep_model.moe_layers[0]
    inner, seen = layer.expert_backend, []

    def recording(x, slots, *args, **kw):
        seen.append((x.shape[0], int((slots >= 0).sum())))
        return inner(x, slots, *args, **kw)

    layer.expert_backend = recording
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7]]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    k = engine.ep_model.spec.top_k
    assert sum(live for _, live in seen) == k * (sum(len(p) for p in prompts) + 3 * 4)
    assert any(rows * k > live for rows, live in seen)  # padded steps ran
    assert engine.stats["piecewise_steps"] > 0 and engine.stats["graph_steps"] > 0
