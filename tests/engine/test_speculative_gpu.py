"""Speculative decoding on CUDA: the verify steps (B x (K + 1) rows) and the draft model's steps replay
their own CUDA graphs, and the greedy tokens equal the eager plain engine's in bfloat16."""

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams

from ..conftest import CONFIGS

pytestmark = pytest.mark.gpu

PROMPTS = ["abcabcabcabcabc", "the cat sat, the cat sat, the", "def f(x):", "M"]


def _engine(model: str, eager: bool, **spec) -> Engine:
    """Prompts run eagerly on both sides (``cuda_graph_max_tokens=0``, no piecewise graphs): the graph buckets are
    the decode and verify ones, and the prompt's keys are computed by the same kernels as the eager reference's."""
    return Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", expert_backend="triton", max_num_seqs=8,
                               cuda_graph_max_bs=8, cuda_graph_max_tokens=0, piecewise_cuda_graph_max_tokens=0,
                               enforce_eager=eager, **spec))


# Qwen3-MoE: its bf16 kernels give the same tokens for a sequence whatever rows share its step, so a verify step
# must reproduce plain decoding exactly. (Kimi's MLA decode and sigmoid router in bf16 do not: there a verify step
# and a plain step can round a near-tie apart; Kimi with an EAGLE-3 head is checked exactly in float32 on CPU, in
# test_speculative.py.)
@pytest.mark.parametrize("algo,family", [("ngram", "qwen3-moe"), ("draft", "qwen3-moe"), ("eagle3", "qwen3-moe")])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_graphs_equal_eager_plain_decoding(tiny_checkpoints, tmp_path, algo, family, k):
    from epmoe.models.tiny import build_tiny_eagle3_config

    model = str(tiny_checkpoints(family))
    draft = {"ngram": None, "draft": str(tiny_checkpoints("mixtral")),
             "eagle3": str(build_tiny_eagle3_config(tmp_path / "eagle3", CONFIGS / "eagle3-draft-qwen3-30b-a3b-"
                                                    "specforge.config.json", model))}[algo]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in _engine(model, True).generate(PROMPTS, params)]
    engine = _engine(model, False, speculative_algorithm=algo, speculative_draft_model=draft,
                     speculative_num_tokens=k)
    assert max(engine.runner.buckets) == 8 * (k + 1)  # the verify buckets
    if algo == "draft":
        assert all(g.graph is not None for g in engine.proposer.runner.graphs.values())
    got = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert got == want
    assert engine.stats["graph_steps"] > 0 and engine.spec_stats.verify_steps > 0
