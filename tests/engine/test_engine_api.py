"""The engine's request API on a tiny real checkpoint (CPU, float32): validation, abort, stops, seeds, limits."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = ["Hello world", "The quick brown fox", "abc", "zzz top"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("qwen3-moe"))


def config(model_dir: str, **kw) -> EngineConfig:
    opts = dict(model=model_dir, max_num_seqs=4, num_kv_blocks=41, block_size=4, max_model_len=32)
    opts.update(kw)
    return EngineConfig(**opts)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(config(model_dir))


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Greedy tokens of every prompt, served together."""
    outs = engine.generate(PROMPTS, GREEDY)
    for o in outs:  # 10 tokens, or EOS (kept) before
        assert (o.finish_reason, len(o.token_ids)) == ("length", 10) or \
            (o.finish_reason == "stop" and o.token_ids[-1] in engine.eos_ids), o
        assert not engine.eos_ids & set(o.token_ids[:-1])
    return {p: o.token_ids for p, o in zip(PROMPTS, outs)}


def drain(engine: Engine, limit: int = 200) -> dict:
    """Step until nothing is left; the last output of each request."""
    last = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError("the engine did not drain")


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.allocator.num_free == engine.allocator.capacity


def test_bad_requests_rejected_before_queueing(engine, model_dir, reference):
    ok = engine.add_request("abc", GREEDY, request_id="dup")
    cases = [
        (lambda: engine.add_request([5] * 32, GREEDY), "prompt of 32 tokens leaves no room in the context of "
                                                       "max_model_len 32"),
        (lambda: engine.add_request("", GREEDY), "prompt must not be empty"),
        (lambda: engine.add_request([], GREEDY), "prompt must have at least one token"),
        (lambda: engine.add_request([3, 259, 4], GREEDY), r"in \[0, 259\), got \[259\]"),
        (lambda: engine.add_request([-1], GREEDY), r"got \[-1\]"),
        (lambda: engine.add_request([True], GREEDY), r"got \[True\]"),
        (lambda: engine.add_request("abc", GREEDY, request_id="dup"), "request id 'dup' is already in use"),
        (lambda: engine.add_request("abc", SamplingParams(max_tokens=0)), "max_tokens must be an integer >= 1, got 0"),
        (lambda: engine.add_request("abc", SamplingParams(stop_token_ids=(5, 259, 1000))),
         r"stop_token_ids must be in \[0, 259\) \(the vocabulary\), got \[259, 1000\]"),
        (lambda: engine.add_request("abc", SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 3})),
         r"unknown sampling option\(s\) \['max_new_tokens'\]"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert [s.request_id for s in engine.scheduler.waiting] == ["dup"] and engine.scheduler.running == []
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        engine.add_request("abc", {"temperature": 0})
    with pytest.raises(TypeError, match="request_id must be a string, got int 5"):
        engine.add_request("abc", GREEDY, request_id=5)
    with pytest.raises(TypeError, match="request_id must be a string, got bytes b'dup'"):
        engine.abort(b"dup")
    assert [s.request_id for s in engine.scheduler.waiting] == ["dup"]
    # the engine keeps serving: the queued request and new ones give the reference tokens
    other = engine.add_request("Hello world", GREEDY)
    last = drain(engine)
    assert last[ok].token_ids == reference["abc"] and last[other].token_ids == reference["Hello world"]
    assert_idle(engine)


def test_an_aborted_id_is_in_use_until_its_abort_is_reported(engine, reference):
    # was: the next step reported ('a', abort) and ('a', running) side by side
    engine.add_request("abc", GREEDY, request_id="a")
    assert engine.abort("a").finish_reason == "abort"
    with pytest.raises(ValueError, match=r"request id 'a' is already in use \(its abort is reported by the next "
                                         r"step\(\)\)"):
        engine.add_request("abc", GREEDY, request_id="a")
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason) == ("a", "abort")
    # a finish still to be reported holds its id too (rebalance_now reads back the step in flight)
    engine.add_request("abc", SamplingParams(temperature=0, max_tokens=1), request_id="b")
    assert engine.step() == []  # its one token is still in flight (the overlap schedule)
    engine.rebalance_now()  # reads it back: b is finished, its report waits for the next step
    with pytest.raises(ValueError, match="request id 'b' is already in use"):
        engine.add_request("abc", GREEDY, request_id="b")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("b", "length")]
    engine.add_request("abc", GREEDY, request_id="b")
    drain(engine)
    engine.add_request("abc", GREEDY, request_id="a")  # free again once reported
    assert drain(engine)["a"].token_ids == reference["abc"]
    assert_idle(engine)


def test_kv_report_context_named(engine):  # was a ZeroDivisionError
    for bad in (-5, 0, 2.5):
        with pytest.raises(ValueError, match=f"context must be a positive integer of tokens, got {bad}"):
            engine.kv_report(context=bad)
    assert engine.kv_report(context=8)["max_concurrency"] == engine.allocator.capacity // 2  # blocks of 4 tokens
    with pytest.raises(ValueError, match=r"context \(33\) is past max_model_len \(32\): no sequence is that long"):
        engine.kv_report(context=33)


@pytest.mark.parametrize("times, message", [
    ([float("inf")], r"arrival_times must be finite non-negative seconds, got \[inf\]"),  # was: generate never ended
    ([-1.0], r"arrival_times must be finite non-negative seconds, got \[-1\.0\]"),
    (["x"], r"arrival_times must be numbers of seconds, got \['x'\]"),
    (["0.01"], r"arrival_times must be numbers of seconds, got \['0\.01'\]"),  # was taken as 0.01
    ([10 ** 400], r"arrival_times must be finite non-negative seconds"),  # was an OverflowError
])
def test_bad_arrival_times_named(engine, times, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(["abc"], GREEDY, arrival_times=times)
    assert_idle(engine)


def test_request_longer_than_the_pool(model_dir):
    """A request whose prompt plus max_tokens cannot fit in the whole pool is refused, not cut short."""
    small = Engine(config(model_dir, num_kv_blocks=5))  # 4 blocks of 4 = 16 tokens
    with pytest.raises(ValueError, match=r"prompt of 16 tokens with max_tokens 10 needs 25 KV slots; the KV pool "
                                         r"holds 16 tokens \(4 blocks of 4\)"):
        small.add_request([7] * 16, GREEDY)
    with pytest.raises(ValueError, match=r"prompt of 12 tokens with max_tokens 10 needs 21 KV slots"):
        small.generate([[7] * 12], SamplingParams(temperature=0, max_tokens=10))
    with pytest.raises(ValueError, match=r"prompt of 17 tokens needs as many KV slots; the KV pool holds 16 tokens "
                                         r"\(4 blocks of 4\): give the cache more blocks"):
        small.add_request([7] * 17, SamplingParams(max_tokens=1))
    assert not small.has_unfinished()
    # 12 + 5 - 1 = 16 slots: the last sampled token needs none, so it fits exactly
    (out,) = small.generate([[7] * 12], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert small.allocator.num_free == small.allocator.capacity


def test_context_limit_finishes_with_length(engine):
    (out,) = engine.generate([[7] * 28], SamplingParams(temperature=0, max_tokens=10))
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 28
    assert_idle(engine)


@pytest.mark.parametrize("field, value, message", [
    ("dtype", "float64", "dtype must be one of"),
    ("device", "tpu", "device must be 'cpu' or 'cuda', got 'tpu'"),
    ("max_num_seqs", 0, "max_num_seqs must be a positive integer, got 0"),
    ("block_size", -4, "block_size must be a positive integer, got -4"),
    ("max_num_batched_tokens", 2, r"max_num_batched_tokens \(2\) must be at least max_num_seqs \(4\)"),
    ("max_model_len", 0, "max_model_len must be a positive integer, got 0"),
    ("num_kv_blocks", 1, "num_kv_blocks must be an integer >= 2 .*got 1"),
    ("num_kv_blocks", 8.0, "num_kv_blocks must be an integer >= 2 .*got 8.0"),
    ("mem_fraction_static", 1.5, r"mem_fraction_static must be in \(0, 1\), got 1.5"),
    ("redundant", -1, "redundant must be a non-negative integer, got -1"),
    ("layout", "spiral", "layout must be 'contiguous' or 'round_robin', got 'spiral'"),
    ("expert_backend", "magic", "expert_backend 'magic' is not one of"),
    ("dispatcher", "fixed_capacity", "dispatcher 'fixed_capacity' is what graph-replayed"),
    ("dispatcher", "nccl_magic", r"dispatcher 'nccl_magic' is not one of \['all_to_all', 'local'\]"),
    ("load_format", "pt", "load_format must be 'auto' or 'dummy', got 'pt'"),
    ("seed", "7", "seed must be an integer in \\[0, 2\\*\\*63\\), got '7'"),
    ("enforce_eager", "yes", "enforce_eager must be true or false, got 'yes'"),
    ("static_decode_on_cpu", 1, "static_decode_on_cpu must be true or false, got 1"),
    ("max_num_seqs", 10**20, "max_num_seqs must be at most 65536, got 100000000000000000000"),
    ("cuda_graph_max_bs", 1 << 17, "cuda_graph_max_bs must be at most 65536, got 131072"),
    ("max_num_batched_tokens", 1 << 21, "max_num_batched_tokens must be at most 1048576, got 2097152"),
    ("eplb_interval", -1, "eplb_interval must be a non-negative integer, got -1"),
])
def test_bad_engine_config_named(model_dir, field, value, message):
    with pytest.raises(ValueError, match=message):
        config(model_dir, **{field: value})


def test_triton_in_float32_on_cuda_is_refused_by_the_config(model_dir, monkeypatch):
    """The Triton kernels compute in bf16/fp16: a rank used to fail with the kernels' TypeError at its first step."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"^expert_backend 'triton' computes on CUDA in bfloat16 or float16, got dtype "
                                         r"'float32': use expert_backend 'reference'"):
        config(model_dir, device="cuda", dtype="float32", expert_backend="triton", enforce_eager=True)
    assert config(model_dir, device="cuda", dtype="float32", enforce_eager=True).expert_backend == "reference"
    assert config(model_dir, device="cpu", dtype="float32", expert_backend="triton").expert_backend == "triton"


@pytest.mark.parametrize("field, value, message", [
    ("dtype", ["float32"], r"dtype must be a string, got list \['float32'\]"),  # was "unhashable type: 'list'"
    ("expert_backend", ["reference"], r"expert_backend must be a string, got list \['reference'\]"),
    ("model", 123, "model must be a string, got int 123"),  # was "expected str, bytes or os.PathLike object"
    ("dispatcher", 5, "dispatcher must be a string or None, got int 5"),
])
def test_a_text_option_of_another_type_is_named(model_dir, field, value, message):
    with pytest.raises(TypeError, match=message):
        config(model_dir, **{field: value})


def test_a_comm_of_another_type_is_named(model_dir):  # was "'int' object has no attribute 'size'"
    with pytest.raises(TypeError, match=r"comm must be an epmoe\.comm\.Comm \(Comm\(group\) wraps a process group\) "
                                        r"or None, got int"):
        Engine(config(model_dir), 5)


def test_bad_engine_config_model_and_context(model_dir, tmp_path):
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        config(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a checkpoint directory"):  # a directory without config.json
        config(str(tmp_path))
    with pytest.raises(ValueError, match=r"eplb_max_moves must be a non-negative integer, got True"):
        config(model_dir, eplb_interval=2, eplb_max_moves=True)
    with pytest.raises(ValueError, match=r"max_model_len \(300\) is past the model's max_position_embeddings \(256\)"):
        Engine(config(model_dir, max_model_len=300))
    with pytest.raises(TypeError, match="Engine needs an EngineConfig, got dict"):
        Engine(dataclasses.asdict(config(model_dir)))


def test_the_context_is_max_position_embeddings_as_the_spec_reads_it(model_dir, tmp_path):
    """Without max_model_len the context is config.json's max_position_embeddings, transformers' default when absent
    (it was a hard-coded 4096, for 0 too), and a value that is no context is refused by name (a negative one was
    taken)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    def context(name, edit):
        directory = tmp_path / name
        directory.mkdir()
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        edit(cfg)
        (directory / "config.json").write_text(json.dumps(cfg))
        engine = Engine(EngineConfig(model=str(directory), load_format="dummy", num_kv_blocks=8, block_size=4))
        return engine.max_model_len

    assert context("given", lambda cfg: None) == 256
    assert context("absent", lambda cfg: cfg.pop("max_position_embeddings")) == \
        AutoConfig.for_model("qwen3_moe").max_position_embeddings
    for value in (0, -4):
        with pytest.raises(ValueError, match=rf"config\.json: field 'max_position_embeddings' must be an integer in "
                                             rf"\[1, 16777216\], got {value}$"):
            context(f"bad{value}", lambda cfg: cfg.update(max_position_embeddings=value))


def test_max_model_len_is_checked_against_the_parsed_context(model_dir, tmp_path):
    """max_model_len is checked against the context the spec reads, transformers' default where config.json has no
    max_position_embeddings (it was checked against the file's raw field only, so any length passed then)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.pop("max_position_embeddings")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    default = AutoConfig.for_model("qwen3_moe").max_position_embeddings
    assert EngineConfig(model=str(tmp_path), load_format="dummy", max_model_len=default).max_model_len == default
    with pytest.raises(ValueError, match=rf"max_model_len \({default + 1}\) is past the model's "
                                         rf"max_position_embeddings \({default}\)"):
        EngineConfig(model=str(tmp_path), load_format="dummy", max_model_len=default + 1)


def test_abort_mid_generation(engine, reference):
    ids = {p: engine.add_request(p, GREEDY) for p in PROMPTS}
    victim = ids["The quick brown fox"]
    last = {}
    for _ in range(10):
        for out in engine.step():
            last[out.request_id] = out
        if victim in last and len(last[victim].token_ids) >= 3:  # tokens come back a step late (overlap)
            break
    assert len(last[victim].token_ids) == 3 and not last[victim].finished
    assert engine.scheduler.running[1].request_id == victim
    held = len(engine.scheduler.running[1].block_table)
    assert held > 0
    free = engine.allocator.num_free
    out = engine.abort(victim)
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert out.token_ids == reference["The quick brown fox"][:3]
    assert engine.allocator.num_free == free + held
    assert victim not in [s.request_id for s in engine.scheduler.running]
    assert engine.abort(victim) is None and engine.abort("nobody") is None
    reported = engine.step()
    assert [o.finish_reason for o in reported if o.request_id == victim] == ["abort"]
    last.update({o.request_id: o for o in reported})
    more = drain(engine)
    assert victim not in more  # reported once
    last.update(more)
    for p in PROMPTS:
        if ids[p] != victim:
            assert last[ids[p]].finished and last[ids[p]].token_ids == reference[p], p
    assert_idle(engine)


def test_made_up_ids_never_take_a_live_callers_id(engine, reference):
    """An id the engine makes up (``req-N``) skips ids a caller chose that look like it, so each live request keeps
    its own id and can be aborted by it."""
    n = int(engine.add_request("abc", GREEDY).removeprefix("req-"))  # every request counts, ours too: the next
    ours = [f"req-{n + 3}", f"req-{n + 4}-1"]  # two made-up ids would be req-{n + 3} and req-{n + 4}
    for rid in ours:
        assert engine.add_request("Hello world", GREEDY, request_id=rid) == rid
    made = [engine.add_request("abc", GREEDY), engine.add_request("abc", GREEDY)]
    assert made == [f"req-{n + 3}-1", f"req-{n + 4}"]
    assert engine.abort(ours[0]).request_id == ours[0]
    last = drain(engine)
    assert last[ours[0]].finish_reason == "abort" and last[ours[1]].token_ids == reference["Hello world"]
    assert all(last[rid].token_ids == reference["abc"] for rid in made)
    assert_idle(engine)


def _first_new(tokens: list[int], printable: bool = False, recurs: bool = False) -> int:
    """Index of the first token past the first that did not occur before it (a printable ASCII byte; one that
    occurs again later)."""
    for k in range(1, len(tokens)):
        if tokens[k] not in tokens[:k] and (not printable or 33 <= tokens[k] < 127) and \
                (not recurs or tokens[k] in tokens[k + 1:]):
            return k
    raise AssertionError(f"no usable token in {tokens}")


def test_stop_token_ids_eos_and_min_tokens(engine, reference):
    ref = reference["Hello world"]
    k = _first_new(ref, recurs=True)
    (out,) = engine.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[k]]))
    assert out.finish_reason == "stop" and out.token_ids == ref[: k + 1]  # the stop token is kept
    # min_tokens (vLLM's): the stop token cannot be generated before min_tokens tokens are out, so position k takes
    # the next most likely token
    (plain,) = engine.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=k + 1, logprobs=2))
    assert [t for t, _ in plain.logprobs[k].top][0] == ref[k]
    second = plain.logprobs[k].top[1][0]
    (out,) = engine.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=10, min_tokens=k + 2,
                                                             stop_token_ids=[ref[k]]))
    assert out.token_ids[: k + 1] == ref[:k] + [second] and ref[k] not in out.token_ids[: k + 2]
    assert out.finish_reason == "length" or out.token_ids[-1] in {ref[k], *engine.eos_ids}
    # EOS ends a request unless ignore_eos
    eos = [p for p in PROMPTS if reference[p][-1] in engine.eos_ids]
    assert eos, "no prompt reaches EOS greedily"
    (out,) = engine.generate(eos[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert out.token_ids[: len(reference[eos[0]])] == reference[eos[0]]
    assert_idle(engine)


def test_stop_string(engine, reference):
    for prompt in PROMPTS:
        ref = reference[prompt]
        try:
            k = _first_new(ref, printable=True)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError(f"no printable byte in the greedy outputs {reference}")
    stop = chr(ref[k])
    ref_text = engine.tokenizer.decode(ref, skip_special_tokens=True)
    assert stop in ref_text
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=[stop, "\x00never"]))
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: k + 1]
    assert out.text == ref_text[: ref_text.index(stop)] and stop not in out.text
    # vLLM's: a stop string ends nothing before min_tokens (k + 1 tokens here: the match is inside them)
    (late,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=[stop], min_tokens=k + 1))
    assert late.token_ids[: k + 1] == ref[: k + 1] and len(late.token_ids) > k + 1 or late.finish_reason == "length"
    # a stop token ends the generation and stays in the tokens, not in the text (vLLM's)
    (tok,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[k]]))
    assert tok.token_ids == ref[: k + 1] and tok.finish_reason == "stop"
    assert tok.text == engine.tokenizer.decode(ref[:k], skip_special_tokens=True) and stop not in tok.text
    assert_idle(engine)


def test_max_tokens(engine, reference):
    outs = engine.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=1),
                                         SamplingParams(temperature=0, max_tokens=4)])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == reference[PROMPTS[0]][:1] and outs[1].token_ids == reference[PROMPTS[1]][:4]
    assert_idle(engine)


def test_seeded_sampling_reproducible(engine, model_dir):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=8)

    first = [o.token_ids for o in engine.generate(PROMPTS, params(7))]
    fresh = Engine(config(model_dir, seed=123))  # another engine, another default generator
    assert [o.token_ids for o in fresh.generate(PROMPTS, params(7))] == first
    assert [o.token_ids for o in fresh.generate(PROMPTS[::-1], params(7))] == first[::-1]
    other = [o.token_ids for o in fresh.generate(PROMPTS, params(8))]
    assert any(a != b for a, b in zip(first, other))
    assert all(len(t) == 8 for t in first + other)
    assert fresh.allocator.num_free == fresh.allocator.capacity
    assert_idle(engine)


def test_eos_ids_of_generation_config_stop_generation(model_dir, reference, tmp_path):
    # Qwen3 lists <|endoftext|> beside <|im_end|> in generation_config.json only: the engine stops on both
    tokens = reference[PROMPTS[1]]
    d = tmp_path / "ckpt"
    shutil.copytree(model_dir, d)
    (d / "generation_config.json").write_text(f'{{"eos_token_id": [{tokens[2]}, 258]}}')
    engine = Engine(config(str(d)))
    assert {tokens[2], 258} <= engine.eos_ids
    (out,) = engine.generate([PROMPTS[1]], GREEDY)
    assert out.token_ids == tokens[: tokens.index(tokens[2]) + 1] and out.finish_reason == "stop"
    (d / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json' cannot be read"):
        Engine(config(str(d)))
    other = tmp_path / "gen"  # --generation-config DIR: its EOS ids instead of the checkpoint's
    other.mkdir()
    (other / "generation_config.json").write_text('{"eos_token_id": [77]}')
    (d / "generation_config.json").write_text('{"eos_token_id": [78]}')
    eos = Engine(config(str(d), generation_config=str(other))).eos_ids
    assert 77 in eos and 78 not in eos
    with pytest.raises(ValueError, match="generation_config must be a directory holding a generation_config.json"):
        config(str(d), generation_config=str(tmp_path / "none"))
    for bad in ("-1", "[5, -1]", '"119"', "true"):
        (d / "generation_config.json").write_text(f'{{"eos_token_id": {bad}}}')
        with pytest.raises(ValueError, match=r"generation_config.json': eos_token_id must be a token id \(an integer "
                                             r">= 0\) or a list of them, got"):
            Engine(config(str(d)))
    (d / "generation_config.json").write_text('{"eos_token_id": [5, 259]}')  # the tiny vocabulary: 259 tokens
    with pytest.raises(ValueError, match=r"generation_config.json': eos_token_id 259 is outside the model's "
                                         r"vocabulary \[0, 259\) \(got \[5, 259\]\)"):
        Engine(config(str(d)))


def test_a_failed_step_leaves_the_engine_serving(model_dir, reference, monkeypatch):
    # a step that raises (here the sampler, at the fourth call) ends generate with the error; its requests are
    # aborted and their blocks freed, and the next call serves as if nothing had happened
    import epmoe.engine.overlap as overlap_module

    engine = Engine(config(model_dir))
    real, calls = overlap_module.sample, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("sampler failed")
        return real(*args, **kw)

    monkeypatch.setattr(overlap_module, "sample", failing)
    with pytest.raises(RuntimeError, match="sampler failed"):
        engine.generate(PROMPTS, GREEDY)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS]
    assert_idle(engine)


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_a_periodic_rebalance_reads_every_step_of_its_interval(model_dir, interval, monkeypatch):
    """The window a rebalance of ``eplb_interval`` reads holds the routing of each step since the one before: the
    recorder advances after the rebalance (it used to advance first and clear the interval's oldest step, so an
    interval of 1 read nothing and skipped every time)."""
    engine = Engine(config(model_dir, eplb_interval=interval))
    per_step, read = [], []
    add, rebalance = engine.loads.add, engine.eplb.rebalance

    def counted(counts):
        per_step.append(int(counts.sum()))
        add(counts)

    def reading(step, load=None, max_moves=None):
        read.append((step, int(engine.recorder.logical_load(engine.ep_model.placement).sum())))
        return rebalance(step, load, max_moves)

    monkeypatch.setattr(engine.loads, "add", counted)
    monkeypatch.setattr(engine.eplb, "rebalance", reading)
    engine.generate(PROMPTS, GREEDY)
    assert len(read) == len(per_step) // interval > 0 and all(per_step)
    assert read == [(s, sum(per_step[s - interval:s])) for s in range(interval, len(per_step) + 1, interval)]
    assert not any(e.skipped and "no tokens" in e.skipped for e in engine.eplb.events)


def test_the_load_window_of_a_long_eplb_interval_is_bounded(model_dir):
    """The recorder keeps a row of counts per step of its window: an interval past ``EPLB_WINDOW_STEPS`` rebalances
    from the loads of its last that many steps instead of holding a row per step of the interval (an interval of
    1e11 steps had asked for terabytes)."""
    from epmoe.engine.config import EPLB_WINDOW_STEPS

    assert Engine(config(model_dir, eplb_interval=3)).recorder.window == 3
    assert Engine(config(model_dir, eplb_interval=10**11)).recorder.window == EPLB_WINDOW_STEPS
