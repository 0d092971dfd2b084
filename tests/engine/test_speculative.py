"""Speculative decoding in one process: the n-gram proposer, the verification rule (greedy and the rejection
sampler's distribution), every algorithm's greedy output against plain decoding, seeded reruns, and the
drafts refused at construction."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.ngram import ngram_propose
from epmoe.engine.speculative import Proposal, verify

from ..conftest import CONFIGS

KIMI_EAGLE = CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json"
PROMPTS = ["abcabcabcabcab", "the cat sat, the cat sat, the", [5, 9, 5, 9, 5], [7]]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_checkpoints):
    """Draft directories: a dense Qwen3 (random weights), an EAGLE-3 head config for the Kimi target."""
    from epmoe.models.tiny import build_tiny_dense_checkpoint, build_tiny_eagle3_config

    root = tmp_path_factory.mktemp("drafts")
    return {
        "dense": str(build_tiny_dense_checkpoint(root / "qwen3-dense", seed=7)),
        "eagle3": str(build_tiny_eagle3_config(root / "eagle3", KIMI_EAGLE, tiny_checkpoints("kimi-k2.5"),
                                               aux_layer_ids=[0, 1, 2])),
    }


# ---- ngram ----------------------------------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_the_longest_then_latest_match():
    tokens = [4, 1, 2, 5, 0, 2, 6, 4, 1, 2]
    assert ngram_propose(tokens, 2, 1, 3) == [5, 0]  # [4, 1, 2] matches at 0
    assert ngram_propose(tokens, 2, 1, 1) == [6, 4]  # only [2]: its latest earlier occurrence, at 5
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 4) == [7, 5, 1]
    assert ngram_propose([7, 8, 7], 5, 1, 2) == [8, 7]  # the continuation runs up to the end
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_propose([1, 2, 1, 3, 1, 2], 3, 3, 3) == []  # [3, 1, 2] never occurs earlier
    assert ngram_propose([1, 2, 1, 3, 1, 2], 3, 2, 3) == [1, 3, 1]


# ---- verification -------------------------------------------------------------------------------------


def test_greedy_verification_keeps_the_matching_prefix_then_the_target_token():
    logits = torch.full((4, 6), -1.0)
    for row, tok in enumerate([3, 1, 4, 0]):
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0)
    assert verify(logits, Proposal((3, 1, 2)), greedy, None) == ([3, 1, 4], 2)
    assert verify(logits, Proposal((3, 1, 4)), greedy, None) == ([3, 1, 4, 0], 3)
    assert verify(logits, Proposal((5, 1, 4)), greedy, None) == ([3], 0)


def _target_law(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from epmoe.engine.sampling import probabilities

    p = probabilities(logits.unsqueeze(0), [params])[0]
    return p / p.sum()


@pytest.mark.parametrize("draft_kind", ["model", "one_hot"])
def test_rejection_sampling_yields_the_target_distribution(draft_kind):
    """Leviathan et al.'s rule: whatever the draft, the first emitted token follows the target's law (after
    temperature and top-k); a chi-square bound over 2000 seeded draws, and never a token top-k cuts."""
    gen = torch.Generator().manual_seed(0)
    v, n = 6, 2000
    target = torch.randn(2, v, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    q = torch.softmax(torch.randn(v, generator=gen) * 2.0, dim=0)  # a draft law far from the target's
    p = _target_law(target[0], params)
    counts = torch.zeros(v)
    accepted = 0
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen)) if draft_kind == "model" else int(q.argmax())
        probs = q.unsqueeze(0) if draft_kind == "model" else None
        tokens, m = verify(target, Proposal((d,), probs), params, gen)
        assert len(tokens) == m + 1
        counts[tokens[0]] += 1
        accepted += m
    expected = p * n
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"tokens cut by top-k were emitted: {counts.tolist()}"
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < 16.3, f"chi-square {chi2:.1f}: {counts.tolist()} vs {expected.tolist()}"  # 3 dof, p = 0.001
    assert 0 < accepted < n  # both branches of the rule ran


# ---- the engine -----------------------------------------------------------------------------------------


def _params(stop_token: int | None = None) -> list[SamplingParams]:
    out = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    out[1] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            stop_token_ids=(stop_token,) if stop_token is not None else ())
    out[3] = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # shorter than K: proposals capped
    return out


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    """Plain greedy tokens per family, with a stop token the second prompt meets mid-way."""
    out = {}
    for fam in ("qwen3-moe", "kimi-k2.5"):
        engine = Engine(EngineConfig(model=str(tiny_checkpoints(fam))))
        stop = engine.generate(PROMPTS, _params())[1].token_ids[6]
        out[fam] = [o.token_ids for o in engine.generate(PROMPTS, _params(stop))]
        out[fam + ":stop"] = stop
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("algo,family", [("ngram", "qwen3-moe"), ("draft", "qwen3-moe"), ("eagle3", "kimi-k2.5")])
def test_speculative_greedy_equals_plain_greedy(tiny_checkpoints, drafts, plain, algo, family, k):
    """Token for token, with random-weight drafts (the dense draft, the EAGLE-3 head on Kimi's architecture),
    a stop token met inside a run of accepted proposals, and a request shorter than K."""
    draft = {"ngram": None, "draft": drafts["dense"], "eagle3": drafts["eagle3"]}[algo]
    engine = Engine(EngineConfig(model=str(tiny_checkpoints(family)), speculative_algorithm=algo,
                                 speculative_draft_model=draft, speculative_num_tokens=k))
    outs = engine.generate(PROMPTS, _params(plain[family + ":stop"]))
    assert [o.token_ids for o in outs] == plain[family]
    assert outs[1].finish_reason == "stop"
    stats = engine.spec_stats
    assert stats.verify_steps > 0 and stats.draft_tokens >= stats.verify_steps
    assert max(len(o.token_ids) for o in outs) == 12
    if algo == "ngram":
        assert stats.accepted_tokens > 0  # the repetitive prompts are looked up
    assert sum(o.num_verify_steps for o in outs) == stats.verify_steps
    assert engine.allocator.num_free == engine.allocator.capacity


@pytest.mark.parametrize("family", ["gpt-oss", "llama4", "deepseek-v2"])
def test_verify_rows_on_other_attention_variants(tiny_checkpoints, family):
    """Sliding windows and sinks (gpt-oss), chunked attention (Llama-4), MLA with device-limited routing
    (DeepSeek-V2): each verify row attends within its own window, greedy output equals plain decoding."""
    model = str(tiny_checkpoints(family))
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    want = [o.token_ids for o in Engine(EngineConfig(model=model)).generate(PROMPTS[:3], params)]
    engine = Engine(EngineConfig(model=model, speculative_algorithm="ngram", speculative_num_tokens=4))
    assert [o.token_ids for o in engine.generate(PROMPTS[:3], params)] == want
    assert engine.spec_stats.verify_steps > 0


@pytest.mark.parametrize("family", ["qwen3-moe", "kimi-k2.5"])  # kimi: the draft's own MLA latent cache
def test_a_draft_equal_to_the_target_is_always_accepted(tiny_checkpoints, family):
    """The draft's KV cache follows the sequences exactly: the target as its own draft proposes what the
    target then picks, every time (greedy), and K + 1 tokens come per verify step."""
    model = str(tiny_checkpoints(family))
    engine = Engine(EngineConfig(model=model, speculative_algorithm="draft", speculative_draft_model=model,
                                 speculative_num_tokens=3))
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    engine.generate(PROMPTS[:3], params)
    stats = engine.spec_stats
    assert stats.acceptance_rate == 1.0
    assert stats.accepted_length == 4.0  # 12 tokens after the first: 3 verify steps of 4 per request


def test_eagle3_reads_the_outputs_of_the_configured_target_layers(tiny_checkpoints, drafts):
    """After a prefill the head holds the target's hidden states of every prompt position: the outputs of
    the decoder layers its config names, equal to transformers' own ``hidden_states`` (layers 0 and 1;
    transformers' last entry is after the final norm)."""
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import hf_config

    model = str(tiny_checkpoints("kimi-k2.5"))
    engine = Engine(EngineConfig(model=model, speculative_algorithm="eagle3", speculative_draft_model=drafts["eagle3"],
                                 speculative_num_tokens=2))
    assert engine.proposer.aux_layers == (0, 1, 2)
    ids = engine.encode(PROMPTS[1])
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4), request_id="r")
    engine.step()  # the whole prompt in one chunk
    first, feats = engine.proposer.pending["r"]
    ref = AutoModelForCausalLM.from_pretrained(model, config=hf_config(model)).eval()
    with torch.no_grad():
        hidden = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    d = ref.config.hidden_size
    assert first == 0 and feats.shape == (len(ids), 3 * d)
    for j in (0, 1):
        want = hidden[j + 1][0]
        assert float((feats[:, j * d:(j + 1) * d] - want).norm() / want.norm()) < 1e-5, j


@pytest.mark.parametrize("algo", ["ngram", "draft", "eagle3"])
def test_seeded_sampling_with_speculation_repeats(tiny_checkpoints, drafts, algo):
    family = "kimi-k2.5" if algo == "eagle3" else "qwen3-moe"
    draft = {"ngram": None, "draft": drafts["dense"], "eagle3": drafts["eagle3"]}[algo]
    cfg = EngineConfig(model=str(tiny_checkpoints(family)), speculative_algorithm=algo,
                       speculative_draft_model=draft, speculative_num_tokens=3)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(PROMPTS))]
    first = [o.token_ids for o in Engine(cfg).generate(PROMPTS, params)]
    engine = Engine(cfg)
    again = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert first == again
    assert engine.spec_stats.verify_steps > 0
    other = [SamplingParams(temperature=0.9, top_p=0.95, seed=99 + i, max_tokens=10, ignore_eos=True)
             for i in range(len(PROMPTS))]
    assert [o.token_ids for o in engine.generate(PROMPTS, other)] != first


# ---- drafts refused at construction ----------------------------------------------------------------------


def test_moe_draft_without_placement_gets_its_own(tiny_checkpoints):
    """No placement given: the draft is placed by its own experts (8), never the target's (16)."""
    target, draft = str(tiny_checkpoints("qwen3-moe")), str(tiny_checkpoints("mixtral"))
    engine = Engine(EngineConfig(model=target, speculative_algorithm="draft", speculative_draft_model=draft,
                                 speculative_num_tokens=2))
    mine = engine.proposer.placement
    assert mine is not engine.placement
    assert (mine.num_experts, mine.num_layers) == (8, 2) and engine.placement.num_experts == 16
    assert "own trivial placement" in engine.proposer.describe() and draft in engine.proposer.describe()


def test_loading_an_moe_model_without_placement_names_it(tiny_checkpoints):
    from epmoe.comm import Comm
    from epmoe.models.hf import load_ep_model

    draft = str(tiny_checkpoints("mixtral"))
    with pytest.raises(TypeError, match=f"checkpoint {draft}: its MoE layers need an ExpertPlacement"):
        load_ep_model(draft, None, Comm(None))


def test_draft_whose_experts_do_not_match_its_placement_is_refused(tiny_checkpoints, tmp_path):
    from epmoe.placement import ExpertPlacement

    target, draft = str(tiny_checkpoints("qwen3-moe")), str(tiny_checkpoints("mixtral"))
    wrong = tmp_path / "target-placement.json"
    ExpertPlacement.trivial(2, 16, 1).save(wrong)  # the target's shape: 16 experts, the draft has 8
    with pytest.raises(ValueError, match=rf"draft model {draft} .*placement holds 16 logical experts per layer "
                                         rf"but draft model {draft} has 8"):
        Engine(EngineConfig(model=target, speculative_algorithm="draft", speculative_draft_model=draft,
                            speculative_draft_placement=str(wrong)))


@pytest.mark.parametrize("name, fmt", [("draft.pt", "sglang"), ("draft.yaml", "trtllm")])
def test_draft_placement_of_sglang_or_tensorrt_llm_is_read(tiny_checkpoints, tmp_path, name, fmt):
    """--speculative-draft-placement takes SGLang's and TensorRT-LLM's files, as doctor's --draft-placement does (it
    read every file as epmoe's JSON)."""
    from epmoe.integrations.placements import LayeredPlacement, save_placement_as
    from epmoe.placement import ExpertPlacement
    from epmoe.spec import load_moe_spec

    target, draft = str(tiny_checkpoints("qwen3-moe")), str(tiny_checkpoints("mixtral"))
    spec = load_moe_spec(draft)
    p = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1, 1)
    save_placement_as(LayeredPlacement(p, spec.moe_layers, spec.num_layers, fmt), tmp_path / name, fmt)
    engine = Engine(EngineConfig(model=target, speculative_algorithm="draft", speculative_draft_model=draft,
                                 speculative_num_tokens=2, speculative_draft_placement=str(tmp_path / name)))
    assert torch.equal(engine.proposer.placement.phy2log, p.phy2log)
    assert engine.proposer.placement.num_redundant == 1


def test_drafts_that_cannot_serve_the_target_are_refused(tiny_checkpoints, drafts, tmp_path):
    target = str(tiny_checkpoints("qwen3-moe"))
    with pytest.raises(ValueError, match=f"draft model {drafts['dense']} is dense: it has no experts to place"):
        Engine(EngineConfig(model=target, speculative_algorithm="draft", speculative_draft_model=drafts["dense"],
                            speculative_draft_placement=str(tmp_path / "any.json")))
    other = tmp_path / "other-vocab"
    shutil.copytree(drafts["dense"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(ValueError, match=f"draft model {other} has vocab_size 300 but the target model {target} "
                                         f"has 259"):
        Engine(EngineConfig(model=target, speculative_algorithm="draft", speculative_draft_model=str(other)))
    wide = tmp_path / "eagle-wide"
    shutil.copytree(drafts["eagle3"], wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    kimi = str(tiny_checkpoints("kimi-k2.5"))
    with pytest.raises(ValueError, match=f"EAGLE-3 draft {wide} has hidden_size 128 but the target model {kimi} "
                                         f"has 64"):
        Engine(EngineConfig(model=kimi, speculative_algorithm="eagle3", speculative_draft_model=str(wide)))


@pytest.mark.parametrize("options,message", [
    (dict(speculative_algorithm="medusa"), "speculative_algorithm must be one of"),
    (dict(speculative_algorithm="ngram", speculative_num_tokens=0), "speculative_num_tokens must be an integer in"),
    (dict(speculative_num_tokens=3), "speculative_num_tokens configures speculative decoding"),
    (dict(speculative_algorithm="draft"), "speculative_algorithm 'draft' needs its draft: set speculative_draft_model"),
    (dict(speculative_algorithm="eagle3", speculative_draft_model="/nonexistent"),
     "speculative_draft_model '/nonexistent' is not a directory with a config.json"),
    (dict(speculative_algorithm="ngram", prompt_lookup_min=5), r"prompt_lookup_min \(5\) exceeds prompt_lookup_max"),
])
def test_bad_speculative_options_are_named(tiny_checkpoints, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_checkpoints("qwen3-moe")), **options)


def test_run_names_the_speculative_flags(tiny_checkpoints):
    from epmoe.runtime.run import RunConfig, run_job

    with pytest.raises(ValueError, match="--speculative-num-tokens must be an integer in"):
        run_job(RunConfig(model=str(tiny_checkpoints("qwen3-moe")), ep=1, speculative_algorithm="ngram",
                          speculative_num_tokens=17))
