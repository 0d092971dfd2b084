"""The overlap schedule (CPU, float32): a step's tokens are read back one step later, and nothing else changes."""

from __future__ import annotations

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.kv_cache import BlockAllocator
from epmoe.engine.request import PENDING_TOKEN, Sequence, SequenceStatus
from epmoe.engine.scheduler import Scheduler

PROMPTS = ["Hello world", "The quick brown fox jumps", "abc", "zzz top", "one two three four five six"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("qwen3-moe"))


def _engine(model_dir: str, overlap: bool, **kw) -> Engine:
    opts = dict(model=model_dir, max_num_seqs=3, num_kv_blocks=13, block_size=4, max_model_len=32,
                max_num_batched_tokens=16, disable_overlap_schedule=not overlap)
    opts.update(kw)
    return Engine(EngineConfig(**opts))


def _serve(engine: Engine, params: list[SamplingParams], abort_after: int | None = None) -> dict[str, tuple]:
    """Every prompt through the step API (request ``r2`` aborted after ``abort_after`` steps); per request its
    final (tokens, reason, preemptions), and every reported token in report order."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(p, sp, request_id=f"r{i}")
    final, streamed = {}, {f"r{i}": [] for i in range(len(PROMPTS))}
    for step in range(300):
        if abort_after is not None and step == abort_after:
            engine.abort("r2")
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = (out.token_ids, out.finish_reason, out.num_preemptions)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.capacity
    for rid, (tokens, _, _) in final.items():
        assert streamed[rid] == tokens, rid  # the streamed tokens add up to the final ones
    return final


def test_overlap_gives_the_sequential_schedule_tokens(model_dir):
    """Greedy with a stop token, seeded sampling, several max_tokens, a pool so small that requests are preempted,
    and an abort: the same tokens, reasons and preemptions with and without the overlap schedule."""
    ref = _engine(model_dir, overlap=False)
    greedy = ref.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    stop = greedy[3]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]),
              SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=9),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    want = _serve(ref, params, abort_after=6)
    got = _serve(_engine(model_dir, overlap=True), params, abort_after=6)
    assert want["r0"][0] == greedy[: greedy.index(stop) + 1] and want["r0"][1] == "stop"
    assert len(want["r3"][0]) == 1
    for run in (want, got):  # the schedules differ (a stopped request holds its blocks a step longer)
        assert sum(r[2] for r in run.values()) > 0, "the pool was meant to force a preemption"
        assert run["r2"][1] == "abort"
    (whole,) = ref.generate(PROMPTS[2:3], params[2])
    assert got["r2"][0] == whole.token_ids[: len(got["r2"][0])]  # cut where the abort came
    assert {r: v[:2] for r, v in got.items() if r != "r2"} == {r: v[:2] for r, v in want.items() if r != "r2"}


def test_tokens_are_reported_one_step_later(model_dir):
    engine = _engine(model_dir, overlap=True)
    sequential = _engine(model_dir, overlap=False)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    for e in (engine, sequential):
        e.add_request("Hello world", greedy, request_id="a")
    assert [o.new_token_ids for o in sequential.step()] == [[sequential._seqs["a"].output_token_ids[0]]]
    assert engine.step() == []  # the prompt's step: its token is still on the device
    seq = engine._seqs["a"]
    assert seq.output_token_ids == [PENDING_TOKEN] and seq.num_pending == 1
    (first,) = engine.step()  # the first token comes back while the second step runs
    assert first.token_ids == sequential._seqs["a"].output_token_ids[:1] and not first.finished
    assert seq.output_token_ids[1:] == [PENDING_TOKEN]
    outs = [o for _ in range(4) for o in engine.step()]
    assert [o.finished for o in outs] == [False, True] and outs[-1].finish_reason == "length"
    assert outs[-1].token_ids == [o.new_token_ids[0] for o in [first] + outs]
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.capacity


def test_pending_last_token_is_not_fed_again():
    """A sequence whose token on the device is its last by max_tokens or by the context is not scheduled."""
    alloc = BlockAllocator(9)
    sched = Scheduler(alloc, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=8)

    def running(rid: str, prompt: int, max_tokens: int) -> Sequence:
        seq = Sequence(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), arrival=len(rid))
        seq.output_token_ids = [7, PENDING_TOKEN]
        seq.num_pending, seq.device_row = 1, 0
        seq.num_computed = seq.num_tokens - 1
        seq.block_table = alloc.allocate(-(-seq.num_computed // 4))
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        return seq

    at_max = running("at-max", 3, max_tokens=2)
    at_context = running("at-ctx", 6, max_tokens=5)  # 6 + 2 tokens: the context of 8 is full
    going = running("going", 3, max_tokens=3)
    waiting = Sequence("new", [1, 2, 3], SamplingParams(max_tokens=4), arrival=9)
    sched.max_num_seqs = 2  # the two ending sequences no longer count: the new one is admitted
    sched.add(waiting)
    free = alloc.num_free
    plan = sched.schedule()
    assert [c.seq for c in plan.decodes] == [going] and [c.seq for c in plan.prefills] == [waiting]
    assert [c.start for c in plan.decodes] == [going.num_tokens - 1]
    assert at_max.block_table == [] and at_context.block_table == []  # freed at once: never fed again
    assert alloc.num_free == free + 1 + 2 - 1 - 1  # their 3 blocks back; one more for going, one for new
    assert sched.running == [at_max, at_context, going, waiting]  # kept until the engine reads the token back
    assert not plan.preempted


def test_pending_token_waits_for_a_block_instead_of_preempting():
    """A sequence whose token is still on the device (maybe a stop) needing a block none is free for skips the
    step; the one after it decodes and nobody is preempted."""
    alloc = BlockAllocator(4)  # 3 usable blocks
    sched = Scheduler(alloc, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    first = Sequence("first", [1, 2, 3], SamplingParams(max_tokens=8), arrival=0)
    first.output_token_ids, first.num_pending, first.device_row = [5, PENDING_TOKEN], 1, 0
    first.num_computed = 4  # position 4 needs a second block
    second = Sequence("second", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8), arrival=1)
    second.output_token_ids = [7]
    second.num_computed = 6  # position 6: inside its second block
    for seq, blocks in ((first, 1), (second, 2)):
        seq.block_table = alloc.allocate(blocks)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    assert alloc.num_free == 0
    plan = sched.schedule()
    assert [c.seq for c in plan.decodes] == [second] and not plan.preempted
    assert sched.running == [first, second] and len(first.block_table) == 1
    first.output_token_ids[-1], first.num_pending = 9, 0  # read back, not a stop: now it preempts as usual
    plan = sched.schedule()
    assert plan.preempted == (second,) and [c.seq for c in plan.decodes] == [first]


def test_overlap_can_be_turned_off_and_back_on_only(model_dir):
    on = _engine(model_dir, overlap=True, num_kv_blocks=9)
    on.overlap = False
    on.add_request("abc", SamplingParams(temperature=0, max_tokens=2), request_id="a")
    assert [o.new_token_ids for o in on.step()] != []  # read back at once
    on.overlap = True
    while on.has_unfinished():
        on.step()
    off = _engine(model_dir, overlap=False, num_kv_blocks=9)
    with pytest.raises(ValueError, match="only be turned back on"):
        off.overlap = True
    assert off.overlap is False
