"""The engine on CUDA: eager steps (paged attention, fused norms) equal transformers' greedy generate in
float32, and graph-replayed decode gives the eager path's tokens in bfloat16 (prompts run eagerly on both
sides: fed as graph rows they attend through another kernel, whose bf16 rounding may flip a near-tie of these
random weights; ``test_rowwise_prefill`` checks that path against the chunk's)."""

import pytest
import torch

from epmoe.engine import Engine, EngineConfig, SamplingParams

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


@pytest.mark.parametrize("family", ["qwen3-moe", "kimi-k2.5", "gpt-oss", "llama4"])
def test_graph_and_eager_agree_bf16(tiny_checkpoints, family):
    d = tiny_checkpoints(family)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for eager in (False, True):
        engine = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", expert_backend="triton",
                                     max_num_seqs=8, cuda_graph_max_bs=8, cuda_graph_max_tokens=0,
                                     enforce_eager=eager))
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
