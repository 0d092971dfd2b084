"""Prefix caching (CPU, float32): the allocator's cache of full blocks, and the engine's outputs with it equal to
those without it, through shared prefixes, repeats, chunked prefill, preemption and both schedules."""

from __future__ import annotations

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.kv_cache import BlockAllocator, block_key

SYSTEM = [7, 3, 250, 19, 19, 88, 41, 5, 6, 100, 200, 31, 64, 9]  # 14 tokens: three full blocks of 4 shared
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], SYSTEM + [60, 61, 62, 63, 64], [9, 9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_allocator_caches_registered_blocks_until_they_are_needed():
    a = BlockAllocator(6)  # blocks 1..5
    k1 = block_key(None, [1, 2])
    k2 = block_key(k1, [3, 4])
    assert k2 != block_key(block_key(None, [1, 9]), [3, 4])  # the same tokens after another prefix
    b = a.allocate(3)
    a.register(b[0], k1)
    a.register(b[1], k2)
    a.register(b[2], k1)  # the key is cached already: the first block stays its copy
    assert a.cached([k1, k2, block_key(k2, [5, 6])]) == b[:2] and a.num_cached == 2
    a.acquire(b[:2])  # a second holder
    a.free(b)
    assert a.num_free == 3 and a.cached([k1, k2]) == b[:2]  # still held once
    a.free(b[:2])
    assert a.num_free == 5 and a.num_revived(b[:2]) == 2  # free, and findable
    a.acquire(b[:1])
    assert a.num_free == 4 and a.num_revived(b[:2]) == 1
    a.free(b[:1])
    got = a.allocate(4)  # the never-cached blocks first, then the least recently freed cached one
    assert got[:3] == [4, 5, b[2]] and got[3] == b[1] and a.cached([k1, k2]) == [b[0]]
    assert a.num_cached == 1
    with pytest.raises(ValueError, match=r"block ids \[\d\] are not in the prefix cache"):
        a.acquire([got[0]])
    with pytest.raises(ValueError, match="is not allocated: only a held block can be cached"):
        a.register(b[0], k2)
    a.free(got)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(got[:1])


def _engine(model_dir: str, caching: bool, **kw) -> Engine:
    opts = dict(model=model_dir, max_num_seqs=4, num_kv_blocks=40, block_size=4, max_model_len=40,
                max_num_batched_tokens=12, enable_prefix_caching=caching)
    opts.update(kw)
    return Engine(EngineConfig(**opts))


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("qwen3-moe"))


@pytest.fixture(scope="module")
def plain(model_dir) -> list[list[int]]:
    return [o.token_ids for o in _engine(model_dir, False).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("overlap", [True, False])
def test_cached_prefixes_give_the_same_tokens(model_dir, plain, overlap):
    engine = _engine(model_dir, True, disable_overlap_schedule=not overlap)
    (first,) = engine.generate(PROMPTS[:1], GREEDY)  # computes the shared blocks
    assert first.token_ids == plain[0] and engine.scheduler.prefix_hits == 0 and first.num_cached_tokens == 0
    outs = engine.generate(PROMPTS, GREEDY)  # the others start after SYSTEM's three blocks; the first after its four
    assert [o.token_ids for o in outs] == plain
    s = engine.scheduler
    assert s.prefix_hits == 4 * 4 + 3 * 4 * 2 and s.prefix_queries == len(PROMPTS[0]) + sum(map(len, PROMPTS))
    assert [o.num_cached_tokens for o in outs] == [4 * 4, 3 * 4, 3 * 4, 0]  # each request's own hits
    again = engine.generate(PROMPTS, GREEDY)  # every prompt and its 5 fed outputs are cached now
    assert [o.token_ids for o in again] == plain
    assert engine.allocator.num_free == engine.allocator.capacity and engine.allocator.num_cached > 0


def test_preempted_sequences_find_their_blocks_again(model_dir, plain):
    # 9 blocks of 4: two sequences of 23 tokens do not fit together; the preempted one restarts from the cache
    engine = _engine(model_dir, True, num_kv_blocks=10)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_preemptions for o in outs) > 0 and engine.scheduler.prefix_hits > 0
    assert engine.allocator.num_free == engine.allocator.capacity


def test_a_preempted_request_reports_the_cached_tokens_of_its_first_admission(model_dir):
    # two prompts sharing no block on a fresh engine: neither is served from the cache when first admitted; the
    # second, preempted, finds its own blocks again when readmitted (the scheduler's hits), which its
    # num_cached_tokens does not count
    prompts = [list(range(11, 24)), list(range(200, 187, -1))]
    engine = _engine(model_dir, True, num_kv_blocks=10, max_num_seqs=2)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.num_preemptions > 0 for o in outs] == [False, True] and engine.scheduler.prefix_hits > 0
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_prompt_logprobs_requests_compute_their_whole_prompt(model_dir, plain):
    engine = _engine(model_dir, True)
    engine.generate(PROMPTS[:1], GREEDY)
    hits = engine.scheduler.prefix_hits
    (out,) = engine.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          prompt_logprobs=1))
    assert engine.scheduler.prefix_hits == hits and out.token_ids == plain[1]
    assert len(out.prompt_logprobs) == len(PROMPTS[1]) and out.prompt_logprobs[0] is None


def test_prefix_caching_with_ngram_speculation_and_not_with_a_draft_model(model_dir, plain):
    engine = _engine(model_dir, True, speculative_algorithm="ngram", speculative_num_tokens=2)
    engine.generate(PROMPTS[:1], GREEDY)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain and engine.scheduler.prefix_hits > 0
    with pytest.raises(ValueError, match="enable_prefix_caching does not combine with speculative_algorithm"):
        EngineConfig(model=model_dir, enable_prefix_caching=True, speculative_algorithm="draft",
                     speculative_draft_model=model_dir)
    with pytest.raises(ValueError, match="enable_prefix_caching must be true, false or None .*, got 1"):
        EngineConfig(model=model_dir, enable_prefix_caching=1)
    # the default (None): on, as vLLM's, except with a draft model; an explicit false holds
    assert EngineConfig(model=model_dir).prefix_caching is True
    assert EngineConfig(model=model_dir, speculative_algorithm="ngram").prefix_caching is True
    assert EngineConfig(model=model_dir, speculative_algorithm="draft", speculative_draft_model=model_dir,
                        ).prefix_caching is False
    assert EngineConfig(model=model_dir, enable_prefix_caching=False).prefix_caching is False
