"""Log-probabilities of generated tokens (CPU, float32): the model's own log-softmax at each position, through the
overlap schedule, the sequential one and speculative steps, checked against transformers' forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.logprobs import logprob_entries, token_logprobs
from epmoe.engine.sampling import MAX_LOGPROBS

PROMPTS = [[11, 42, 7, 99, 3], [200, 5, 5, 17], [64, 65, 66, 67, 68, 69]]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("qwen3-moe"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir: str, **kw) -> Engine:
    opts = dict(model=model_dir, max_num_seqs=4, num_kv_blocks=40, block_size=4, max_model_len=32)
    opts.update(kw)
    return Engine(EngineConfig(**opts))


def _reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), V]`` the model's log-softmax at the position that chose each output token."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def test_token_logprobs_are_the_log_softmax_and_its_top_k():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens = torch.tensor([4, 0, 49])
    rows = token_logprobs(logits, tokens, 5)
    chosen, values, ids = rows.chosen, rows.top_values, rows.top_ids
    want = torch.log_softmax(logits.float(), dim=-1)
    assert chosen.dtype == torch.float32 and values.shape == (3, 5) and ids.dtype == torch.int64
    torch.testing.assert_close(chosen, want[torch.arange(3), tokens])
    torch.testing.assert_close(values, want.sort(dim=-1, descending=True).values[:, :5])
    torch.testing.assert_close(want.gather(1, ids), values)
    assert rows.rank.tolist() == [int((w > c).sum()) + 1 for w, c in zip(want, chosen)]
    entries = logprob_entries(tokens.tolist(), rows, [2, 0, 5])
    assert [len(e.top) for e in entries] == [2, 0, 5] and [e.token_id for e in entries] == [4, 0, 49]
    assert entries[2].top[0] == (ids[2, 0].item(), values[2, 0].item())
    assert [e.rank for e in entries] == rows.rank.tolist()
    top = token_logprobs(logits, ids[:, 0], 0)
    assert top.rank.tolist() == [1, 1, 1] and top.top_values.shape == (3, 0) and top.top_ids.shape == (3, 0)
    with pytest.raises(ValueError, match=r"k must be in \[0, 50\], got 51"):
        token_logprobs(logits, tokens, 51)
    with pytest.raises(ValueError, match=r"3 logits rows but tokens of shape \(2,\)"):
        token_logprobs(logits, tokens[:2], 1)


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5])
def test_bad_logprobs_named(value):
    with pytest.raises(ValueError, match=rf"logprobs must be an integer in \[0, {MAX_LOGPROBS}\] or None, got"):
        SamplingParams(logprobs=value)


@pytest.mark.parametrize("mode", ["overlap", "sequential", "ngram"])
def test_generated_tokens_carry_the_models_logprobs(model_dir, reference, mode):
    kw = {"overlap": {}, "sequential": {"disable_overlap_schedule": True},
          "ngram": {"speculative_algorithm": "ngram", "speculative_num_tokens": 2}}[mode]
    engine = _engine(model_dir, **kw)
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=0),
              SamplingParams(temperature=0, max_tokens=5)]
    outs = engine.generate(PROMPTS, params)
    assert outs[2].logprobs is None
    for prompt, out, p in zip(PROMPTS[:2], outs[:2], params[:2]):
        assert [e.token_id for e in out.logprobs] == out.token_ids
        want = _reference_logprobs(reference, prompt, out.token_ids)
        got = torch.tensor([e.logprob for e in out.logprobs])
        torch.testing.assert_close(got, want[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)],
                                   atol=1e-4, rtol=0)
        for e, row in zip(out.logprobs, want):
            assert len(e.top) == p.logprobs
            if p.logprobs:
                top = row.topk(p.logprobs)
                assert [i for i, _ in e.top] == top.indices.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top.values, atol=1e-4, rtol=0)
                assert e.top[0] == (e.token_id, e.logprob) and e.rank == 1  # greedy: the most likely
    if mode == "ngram":  # a proposal was accepted: a verify step emitted two tokens from consecutive rows
        assert engine.spec_stats.accepted_tokens > 0
    assert engine.allocator.num_free == engine.allocator.capacity


def _reference_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]``: row ``j`` the model's log-softmax predicting prompt token ``j + 1``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("mode", ["overlap", "sequential", "ngram"])
def test_prompt_logprobs_through_chunked_prefill_and_preemption(model_dir, reference, mode):
    kw = {"overlap": {}, "sequential": {"disable_overlap_schedule": True},
          "ngram": {"speculative_algorithm": "ngram", "speculative_num_tokens": 2}}[mode]
    # 5-token chunks cut every prompt; a 9-block pool holds two of these sequences, not three: one is preempted
    engine = _engine(model_dir, max_num_batched_tokens=5, num_kv_blocks=9, **kw)
    prompts = [PROMPTS[2] + [1, 2, 3, 4, 5, 6], PROMPTS[0] + PROMPTS[1], PROMPTS[1] * 3]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = engine.generate(prompts, params)
    plain = _engine(model_dir).generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # the extra logits rows change nothing
    assert outs[2].prompt_logprobs is None
    for prompt, out, p in zip(prompts, outs, params):
        if p.prompt_logprobs is None:
            continue
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        assert [e.token_id for e in entries[1:]] == prompt[1:]
        want = _reference_prompt_logprobs(reference, prompt)
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries[1:]]),
                                   want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)
        for e, row in zip(entries[1:], want):
            assert [i for i, _ in e.top] == row.topk(p.prompt_logprobs).indices.tolist()
            assert e.rank == int((row > row[e.token_id] + 1e-4).sum()) + 1  # no near-ties in these rows
    if mode != "ngram":
        assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force a preemption"
    assert engine.allocator.num_free == engine.allocator.capacity
