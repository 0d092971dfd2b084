"""The continuous-batching scheduler alone: hand-made sequences, steps simulated as ``verify_step.advance`` does."""

from __future__ import annotations

import pytest

from epmoe.engine.kv_cache import BlockAllocator
from epmoe.engine.request import Sequence, SequenceStatus
from epmoe.engine.sampling import SamplingParams
from epmoe.engine.scheduler import Scheduler

BS = 4


def make(arrival: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(f"r{arrival}", list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                    arrival=arrival)


def sched(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks), BS, max_num_seqs, max_num_batched_tokens)


def advance(s: Scheduler, plan, token: int = 7) -> list[Sequence]:
    """What the engine does after running ``plan``: computed counts, one token per sampling chunk, finishes."""
    for c in plan.chunks:
        c.seq.num_computed = c.start + c.num_tokens
    done = []
    for c in plan.sampling:
        c.seq.output_token_ids.append(token)
        if len(c.seq.output_token_ids) >= c.seq.params.max_tokens:
            s.finish(c.seq, "length")
            done.append(c.seq)
    return done


def check_blocks(s: Scheduler) -> None:
    """Every running sequence holds exactly the blocks its computed tokens need, none shared; waiting ones none."""
    held = [b for q in s.running for b in q.block_table]
    assert len(held) == len(set(held)) and 0 not in held
    assert s.allocator.num_free + len(held) == s.allocator.capacity
    for q in s.waiting:
        assert q.block_table == [] and q.status is SequenceStatus.WAITING


def run_to_end(s: Scheduler, limit: int = 500) -> list:
    plans = []
    for _ in range(limit):
        if not s.has_unfinished():
            return plans
        plan = s.schedule()
        check_blocks(s)
        plans.append(plan)
        advance(s, plan)
    raise AssertionError("the scheduler did not drain")


def test_constructor_validation():
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        Scheduler(BlockAllocator(4), 0, 1, 1)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got True"):
        Scheduler(BlockAllocator(4), 4, True, 8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must be at least max_num_seqs \(4\)"):
        Scheduler(BlockAllocator(4), 4, 4, 3)


def test_chunked_prefill_under_token_budget():
    s = sched(max_num_batched_tokens=8)
    a, b = make(0, 13), make(1, 3)
    s.add(a)
    s.add(b)
    p1 = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in p1.chunks] == [("r0", 0, 8)]
    assert p1.num_tokens == 8 and p1.sampling == [] and p1.sampling_rows == []
    assert len(a.block_table) == 2 and b.status is SequenceStatus.WAITING  # budget spent: b not admitted
    advance(s, p1)
    p2 = s.schedule()  # a's last 5 prompt tokens, then b's whole prompt... but only 3 of budget left
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in p2.chunks] == [("r0", 8, 5), ("r1", 0, 3)]
    assert p2.decodes == () and p2.sampling_rows == [4, 7]
    assert len(a.block_table) == 4 and len(b.block_table) == 1
    advance(s, p2)
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    p3 = s.schedule()  # both decode now
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in p3.decodes] == [("r0", 13, 1), ("r1", 3, 1)]
    assert p3.prefills == () and p3.sampling_rows == [0, 1]
    advance(s, p3)
    run_to_end(s)
    assert s.allocator.num_free == s.allocator.capacity


def test_decodes_packed_first_and_sampling_rows():
    s = sched(max_num_batched_tokens=64)
    a = make(0, 5)
    s.add(a)
    advance(s, s.schedule())  # a prefilled, has one output token
    b = make(1, 6)
    s.add(b)
    plan = s.schedule()
    assert [c.seq.request_id for c in plan.decodes] == ["r0"]
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.prefills] == [("r1", 0, 6)]
    assert [c.seq.request_id for c in plan.chunks] == ["r0", "r1"]
    assert plan.sampling_rows == [0, 6] and [c.seq for c in plan.sampling] == [a, b]
    advance(s, plan)
    run_to_end(s)
    assert s.allocator.num_free == s.allocator.capacity


def test_one_token_chunk_that_does_not_sample_is_not_a_decode():
    # 3 decodes + 1 token of budget left: the new prompt gets a 1-token chunk that does not sample. It must
    # not be a decode row (graph-replayed decode steps return one logits row per decode row).
    s = sched(max_num_seqs=4, max_num_batched_tokens=4)
    old = [make(i, 1) for i in range(3)]
    for q in old:
        s.add(q)
    advance(s, s.schedule())
    new = make(3, 5)
    s.add(new)
    plan = s.schedule()
    assert [c.seq for c in plan.decodes] == old
    assert [(c.seq, c.start, c.num_tokens) for c in plan.prefills] == [(new, 0, 1)]
    assert plan.sampling_rows == [0, 1, 2] and len(plan.sampling) == len(plan.decodes)
    advance(s, plan)
    run_to_end(s)
    assert s.allocator.num_free == s.allocator.capacity


def test_max_num_seqs_and_arrival_order():
    s = sched(max_num_seqs=2)
    seqs = [make(i, 3, max_tokens=2 + i) for i in range(5)]
    for q in seqs:
        s.add(q)
    admitted: list[str] = []
    for plan in run_to_end(s):
        assert len({c.seq.request_id for c in plan.chunks}) <= 2
        admitted += [c.seq.request_id for c in plan.chunks if c.start == 0]
        assert len(s.running) <= 2
    assert admitted == [f"r{i}" for i in range(5)]
    assert all(q.finish_reason == "length" and len(q.output_token_ids) == q.params.max_tokens for q in seqs)
    assert s.allocator.num_free == s.allocator.capacity


def test_recompute_preemption_of_latest_admitted():
    # 6 usable blocks of 4 tokens; three 6-token prompts take 2 blocks each, then decoding needs more.
    s = sched(num_blocks=7, max_num_batched_tokens=64)
    a, b, c = make(0, 6, 8), make(1, 6, 8), make(2, 6, 8)
    late = make(3, 2, 2)
    for q in (a, b, c):
        s.add(q)
    p = s.schedule()
    assert [q.request_id for q in s.running] == ["r0", "r1", "r2"] and s.allocator.num_free == 0
    advance(s, p)  # each has 7 tokens, 6 computed: the decode of token 7 fits in block 2
    s.add(late)
    p = s.schedule()
    assert [ch.seq for ch in p.decodes] == [a, b, c] and p.preempted == () and late.status is SequenceStatus.WAITING
    advance(s, p)  # 8 tokens each, 7 computed
    advance(s, s.schedule())  # token 8 still in block 2; now 9 tokens, 8 computed: block 3 needed
    p = s.schedule()
    assert p.preempted == (c,)
    assert c.num_computed == 0 and c.block_table == [] and c.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and list(s.waiting) == [c, late]  # arrival order
    assert [ch.seq for ch in p.decodes] == [a, b] and p.prefills == ()  # c's 2 blocks went to a and b
    assert len(a.block_table) == len(b.block_table) == 3 and s.allocator.num_free == 0
    check_blocks(s)
    advance(s, p)
    plans = run_to_end(s)
    assert all(q.finish_reason == "length" and len(q.output_token_ids) == 8 for q in (a, b, c))
    assert late.output_token_ids == [7, 7]
    # the preempted sequence is recomputed from all its tokens, generated ones included, in one chunk
    recompute = [ch for pl in plans for ch in pl.chunks if ch.seq is c and ch.start == 0]
    assert recompute and recompute[0].num_tokens == 6 + 3
    assert s.allocator.num_free == s.allocator.capacity


def test_preempting_itself_when_earlier_sequences_hold_the_pool():
    # a (admitted first) holds 2 blocks; b holds 1 block and needs a second one with none free: b is the latest
    # admitted, so b itself is preempted, not a.
    s = sched(num_blocks=4, max_num_batched_tokens=64)
    a, b = make(0, 8, 1), make(1, 4, 3)
    s.add(a)
    s.add(b)
    p = s.schedule()
    assert s.allocator.num_free == 0 and p.preempted == ()
    a.num_computed, b.num_computed = 7, 4  # pretend a is still prefilling, b is decoding token 5
    a.output_token_ids, b.output_token_ids = [], [9]
    p = s.schedule()
    assert p.preempted == (b,) and [ch.seq for ch in p.chunks] == [a]
    assert b.num_computed == 0 and b.block_table == [] and list(s.waiting) == [b]
    advance(s, p)
    run_to_end(s)
    assert s.allocator.num_free == s.allocator.capacity


def test_sequence_too_long_for_the_pool_finishes_with_length():
    s = sched(num_blocks=3, max_num_batched_tokens=64)  # 2 blocks = 8 tokens
    big = make(0, 9)
    small = make(1, 3, 2)
    s.add(big)
    s.add(small)
    p = s.schedule()
    assert p.finished == (big,) and big.finish_reason == "length" and big.block_table == []
    assert [ch.seq for ch in p.chunks] == [small]
    advance(s, p)
    # a sequence that grows past the pool while alone is finished with length too
    grow = make(2, 6, 10)
    s.add(grow)
    plans = run_to_end(s)
    assert small.finish_reason == "length" and small.output_token_ids == [7, 7]
    assert grow.finish_reason == "length" and grow.num_tokens == 9 and grow in [q for pl in plans for q in pl.finished]
    assert s.allocator.num_free == s.allocator.capacity


def test_finish_and_abort_free_blocks():
    s = sched()
    a, b, c = make(0, 9), make(1, 5), make(2, 3)
    for q in (a, b):
        s.add(q)
    advance(s, s.schedule())
    s.add(c)
    assert s.allocator.num_free == s.allocator.capacity - 3 - 2
    s.finish(a, "abort")
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort" and a.block_table == []
    assert a not in s.running and s.allocator.num_free == s.allocator.capacity - 2
    s.finish(c, "abort")  # still waiting
    assert c not in s.waiting and c.finished
    p = s.schedule()
    assert [ch.seq for ch in p.chunks] == [b]
    s.finish(b, "abort")
    assert not s.has_unfinished() and s.allocator.num_free == s.allocator.capacity


def test_lookahead_reserves_room_for_proposals_within_limits():
    """Speculative decoding: a decoding sequence gets budget and blocks for K proposed tokens, capped by its
    max_tokens and the context, and none (rather than a preemption) when the blocks are short."""
    s = Scheduler(BlockAllocator(64), BS, 8, 64, lookahead=3, max_model_len=12)
    a, b, c = make(0, 5, max_tokens=10), make(1, 5, max_tokens=2), make(2, 8, max_tokens=10)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert all(ch.lookahead == 0 for ch in plan.chunks)  # prefills propose nothing
    advance(s, plan)
    plan = s.schedule()
    ahead = {ch.seq.request_id: ch.lookahead for ch in plan.decodes}
    # a: 3; b: one more token at most (max_tokens 2, one out): no proposal; c: 9 tokens, context 12: 3
    assert ahead == {"r0": 3, "r1": 0, "r2": 3}
    assert len(a.block_table) == 3  # positions 0..8 (5 prompt + 1 + 3 proposals): 3 blocks of 4
    advance(s, plan)  # c: 10 tokens; the context (12) leaves room for 2 proposals
    assert {ch.seq.request_id: ch.lookahead for ch in s.schedule().decodes} == {"r0": 3, "r2": 2}
    tight = Scheduler(BlockAllocator(3), BS, 8, 64, lookahead=3, max_model_len=64)  # 2 usable blocks
    d = make(3, 7, max_tokens=10)
    tight.add(d)
    advance(tight, tight.schedule())  # 8 tokens in the 2 blocks: proposals would need a third
    plan = tight.schedule()
    assert [(ch.seq, ch.lookahead) for ch in plan.decodes] == [(d, 0)] and not plan.preempted


def _rows(plan) -> int:
    return sum(c.num_tokens + c.lookahead for c in plan.chunks)


def test_short_prompts_are_cut_to_fill_the_largest_graph_step():
    """Four decodes running; three 10-token prompts arrive. Graph steps hold 16 rows and prompts ending
    within 16 tokens: the first prompt fits whole, the second is cut to the 2 rows left, the third waits;
    the next step finishes the second (8 rows) and starts the third as far as the 16 rows go."""
    s = Scheduler(BlockAllocator(64), BS, 8, 64, graph_tokens=16, graph_rows=16)
    running = [make(i, 3, max_tokens=10) for i in range(4)]
    for q in running:
        s.add(q)
    advance(s, s.schedule())  # the four prompts: 12 rows
    for i in range(4, 7):
        s.add(make(i, 10))
    plan = s.schedule()
    assert [c.num_tokens for c in plan.decodes] == [1, 1, 1, 1]
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.prefills] == [("r4", 0, 10), ("r5", 0, 2)]
    assert _rows(plan) == 16 and [q.request_id for q in s.waiting] == ["r6"]
    check_blocks(s)
    advance(s, plan)
    plan = s.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.prefills] == [("r5", 2, 8), ("r6", 0, 3)]
    assert _rows(plan) == 16
    assert len(run_to_end(s)) > 0 and not s.has_unfinished()


def test_decodes_filling_the_largest_graph_step_do_not_hold_prompts_back():
    """Graph steps hold 8 rows, up to 32 sequences may run. Eight 3-token prompts join a bucket at a time and
    become 8 decodes that fill it; four more short prompts then go in at once (an eager step) instead of waiting
    for a decode to finish, and all twelve run together."""
    s = Scheduler(BlockAllocator(256), BS, 32, 64, graph_tokens=8, graph_rows=8)
    for i in range(8):
        s.add(make(i, 3, max_tokens=20))
    plan = s.schedule()
    while plan.prefills:
        assert _rows(plan) == 8  # the burst fills graph steps
        advance(s, plan)
        plan = s.schedule()
    assert len(s.running) == 8 and not s.waiting
    assert _rows(plan) == 8 and len(plan.decodes) == 8  # decodes alone fill the bucket
    advance(s, plan)
    for i in range(8, 12):
        s.add(make(i, 3, max_tokens=20))
    plan = s.schedule()
    assert len(plan.decodes) == 8 and [(c.seq.request_id, c.num_tokens) for c in plan.prefills] == [
        ("r8", 3), ("r9", 3), ("r10", 3), ("r11", 3)]
    assert len(s.running) == 12 and not s.waiting
    check_blocks(s)
    assert len(run_to_end(s)) > 0 and not s.has_unfinished()


def test_a_prompt_too_long_for_a_graph_step_makes_it_eager_and_nothing_is_cut():
    s = Scheduler(BlockAllocator(64), BS, 8, 64, graph_tokens=16, graph_rows=16)
    s.add(make(0, 3, max_tokens=10))
    advance(s, s.schedule())
    for i, n in ((1, 20), (2, 10), (3, 10)):  # 20 > graph_tokens: this step runs eagerly anyway
        s.add(make(i, n))
    plan = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.prefills] == [("r1", 20), ("r2", 10), ("r3", 10)]


def test_without_graph_steps_prompts_are_not_cut():
    s = Scheduler(BlockAllocator(64), BS, 8, 64)
    for i in range(3):
        s.add(make(i, 10))
    assert [c.num_tokens for c in s.schedule().prefills] == [10, 10, 10]
