"""Penalties, logit bias and min-p (CPU, float32): the adjustment against a plain per-token implementation, and
greedy decoding through the engine (overlap and sequential schedules) against transformers' forward with the
same adjustment applied step by step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.sampling import TokenCounts, adjust_logits, probabilities

PROMPTS = [[11, 42, 7, 99, 3], [200, 5, 5, 17], [64, 65, 66, 67, 68, 69]]


def _adjusted(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row adjusted token by token, as the module docstring states it."""
    x = row.clone().float()
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(x.numel()):
        n = output.count(t)
        if n or t in prompt:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return x


def test_adjust_logits_equals_the_per_token_rule():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=gen)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4),
              SamplingParams(logit_bias={3: 5.0, 29: -100}),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.8, presence_penalty=1.0, logit_bias=[(0, 2.5)])]
    counts = TokenCounts(30, torch.device("cpu"), rows=1)  # grows on the second row
    first, second = counts.open([1, 2, 2], [5, 5, 17]), counts.open([7], [])
    counts.count([first], torch.tensor([17]))  # a token sampled since (the overlap schedule's, still on the device)
    out = adjust_logits(logits, params, counts, [first, None, None, second])
    assert out is not logits and counts.output.shape == (2, 30)
    want = [_adjusted(logits[0], params[0], [1, 2, 2], [5, 5, 17, 17]), _adjusted(logits[1], params[1], [], []),
            logits[2], _adjusted(logits[3], params[3], [7], [])]
    torch.testing.assert_close(out, torch.stack(want))
    # a closed row is zeroed and reused
    counts.close(first)
    assert counts.open([], []) == first and not counts.in_prompt[first].any() and not counts.output[first].any()
    assert adjust_logits(logits, [SamplingParams()] * 4) is logits
    with pytest.raises(ValueError, match="a penalized row needs its row of TokenCounts"):
        adjust_logits(logits, params)
    with pytest.raises(ValueError, match="a penalized row needs its row of TokenCounts"):
        adjust_logits(logits, params, counts, [None, None, None, second])
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 30\), got \[30\]"):
        adjust_logits(logits, [SamplingParams(logit_bias={30: 1.0})], None)


def test_min_p_keeps_tokens_at_least_min_p_of_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    kept = probabilities(probs.log(), [SamplingParams(min_p=0.2)])
    torch.testing.assert_close(kept, torch.tensor([[0.5, 0.3, 0.12, 0.0]]))
    torch.testing.assert_close(probabilities(probs.log(), [SamplingParams(min_p=0.0)]), probs)


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
    ("presence_penalty", 3, r"presence_penalty must be in \[-2, 2\], got 3"),
    ("frequency_penalty", float("nan"), r"frequency_penalty must be in \[-2, 2\], got nan"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0, got 0"),
    ("logit_bias", {-1: 1.0}, r"logit_bias keys must be token ids \(integers >= 0\), got -1"),
    ("logit_bias", {5: 101}, r"logit_bias values must be in \[-100, 100\], got 101 for token 5"),
    ("logit_bias", "5:1", "logit_bias must map token ids to numbers, got '5:1'"),
    ("logit_bias", {1: 2.0, "a": 1}, r"logit_bias keys must be token ids \(integers >= 0\), got 'a'"),
])
def test_bad_values_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("qwen3-moe"))


def _reference_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    ids = list(prompt)
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(_adjusted(logits, p, prompt, ids[len(prompt):]).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_with_penalties_equals_transformers_with_the_same_rule(model_dir, overlap):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=model_dir, max_num_seqs=4, num_kv_blocks=40, block_size=4, max_model_len=32,
                                 disable_overlap_schedule=not overlap))
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5,
                             frequency_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=2.0,
                             logit_bias={100: 3.0}),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={42: 100})]
    outs = engine.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert out.token_ids == _reference_greedy(model, prompt, p)
    assert outs[2].token_ids == [42] * 8
    plain = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert plain.token_ids != outs[0].token_ids  # the penalties changed the output
    assert engine.allocator.num_free == engine.allocator.capacity


def test_penalties_with_speculative_decoding_refused_by_name(model_dir):
    engine = Engine(EngineConfig(model=model_dir, max_num_seqs=2, num_kv_blocks=20, block_size=4, max_model_len=32,
                                 speculative_algorithm="ngram"))
    with pytest.raises(ValueError, match="frequency_penalty is not served with speculative decoding"):
        engine.add_request([1, 2, 3], SamplingParams(frequency_penalty=0.5))
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 259\)"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={259: 1.0}))
    assert not engine.has_unfinished()


def test_banned_tokens_and_extreme_penalties_stay_finite():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    out = adjust_logits(logits, [SamplingParams()] * 3, None, banned=[(4, 7), None, (0,)])
    assert torch.isinf(out[0, [4, 7]]).all() and torch.isinf(out[2, 0]) and torch.equal(out[1], logits[1])
    want = logits.clone()
    want[0, [4, 7]] = want[2, 0] = float("-inf")
    torch.testing.assert_close(out, want)
    tiny = SamplingParams(repetition_penalty=1e-300)  # its quotient is past float32's range: clamped, never NaN
    counts = TokenCounts(30, torch.device("cpu"))
    out = adjust_logits(logits[:1], [tiny], counts, [counts.open([1, 2, 3], [])])
    assert torch.isfinite(out).all() and out[0, [1, 2, 3]].abs().max() <= 1e30
    with pytest.raises(ValueError, match=r"banned token ids must be in \[0, 30\), got \[30\]"):
        adjust_logits(logits, [SamplingParams()] * 3, None, banned=[(30,), None, None])


@pytest.mark.parametrize("speculative", [False, True])
def test_min_tokens_bans_eos_until_reached(model_dir, speculative):
    kw = {"speculative_algorithm": "ngram", "speculative_num_tokens": 2} if speculative else {}
    engine = Engine(EngineConfig(model=model_dir, max_num_seqs=4, num_kv_blocks=40, block_size=4, max_model_len=32,
                                 **kw))
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    stop = greedy[0].token_ids[0]  # a stop token the plain run emits first
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, min_tokens=6, stop_token_ids=[stop]))
    for out, plain in zip(outs, greedy):
        assert len(out.token_ids) >= 6
        assert not ({stop} | engine.eos_ids) & set(out.token_ids[:5])
        if stop not in plain.token_ids[:6] and not engine.eos_ids & set(plain.token_ids[:6]):
            assert out.token_ids[:6] == plain.token_ids[:6]  # nothing banned was in the way
    assert outs[0].token_ids[0] != stop
