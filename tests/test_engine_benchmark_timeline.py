"""benchmarks/engine.py's per-layer timeline (``layer_windows``, ``median_layer``) on a made-up kernel timeline: the
layers it cuts out, the starts, durations and gaps it reports (a programmatic dependent launch's negative gap
included) and their median."""

from __future__ import annotations

import pytest

from .benchmark_scripts import before_the_aborts, count_live_requests, load_benchmark, staggered_engine


def _spans(steps: int = 2, layers: int = 4):
    spans, t = [], 0.0
    for step in range(steps):
        for layer in range(layers):
            # the down kernel starts 1 us before the gate/up kernel ends (a dependent launch)
            for name, dur, gap in (("rms_norm_kernel", 2.0, 0.5), ("nvjet_qkv", 7.0, 0.5),
                                   ("paged_decode_kernel", 3.0 + step + layer, 0.5), ("gate_up", 4.0, 0.5),
                                   ("down", 5.0, -1.0)):
                t += gap
                spans.append((t, t + dur, name))
                t += dur
    return spans


def test_layer_windows_are_the_last_steps_whole_layers(monkeypatch):
    mod = load_benchmark("engine", monkeypatch)
    windows = mod.layer_windows(_spans(), steps=2)
    # step 1 (the last): layers 0..2, each from its attention launch to the next one's
    assert len(windows) == 3
    for layer, w in enumerate(windows):
        assert [k["kernel"] for k in w] == ["paged_decode_kernel", "gate_up", "down", "rms_norm_kernel", "nvjet_qkv"]
        assert w[0]["us"] == 3.0 + 1 + layer and w[0]["start_us"] == 0.0 and w[0]["gap_us"] == 0.5
        assert [k["gap_us"] for k in w[1:]] == [0.5, -1.0, 0.5, 0.5]
        assert w[1]["start_us"] == w[0]["us"] + 0.5
    assert mod.layer_windows(_spans()[:5], steps=1) == []  # one attention launch: no whole layer
    # a new graph begins at layer 2: layer 1 is followed by it and left out
    cut = mod.layer_windows(_spans(), steps=2, cuts=[2])
    assert [w[0]["us"] for w in cut] == [4.0, 6.0]


def test_median_layer_takes_the_common_kernel_sequence(monkeypatch):
    mod = load_benchmark("engine", monkeypatch)
    windows = mod.layer_windows(_spans(layers=5), steps=2)
    odd = [dict(k) for k in windows[0][:3]]  # a layer with fewer kernels is not in the median
    kernels, count = mod.median_layer(windows + [odd])
    assert count == 4
    assert [k["kernel"] for k in kernels] == ["paged_decode_kernel", "gate_up", "down", "rms_norm_kernel", "nvjet_qkv"]
    assert kernels[0]["us"] == (5.0 + 6.0) / 2  # attention of layers 0..3 of step 1: 4, 5, 6, 7 us
    assert kernels[2]["gap_us"] == -1.0
    assert mod.median_layer([]) == ([], 0)


def test_experts_touched_counts_each_steps_distinct_slots(monkeypatch, tmp_path):
    """``experts_touched`` reads the engine's own load counts: one request routes one token a step, so each MoE
    layer gives exactly top-k distinct experts a step; four requests more than that and at most 4 top-k."""
    from epmoe.engine import Engine, EngineConfig, SamplingParams
    from epmoe.models.tiny import build_tiny_checkpoint

    mod = load_benchmark("engine", monkeypatch)
    engine = Engine(EngineConfig(model=str(build_tiny_checkpoint("qwen3-moe", tmp_path / "q")), device="cpu"))
    k, e = engine.spec.top_k, engine.spec.num_experts
    for n, low, high in ((1, k, k), (4, k + 0.25, min(e, 4 * k))):
        for i in range(n):
            engine.add_request(list(range(3 + i, 9 + i)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prompts
        touched = mod.experts_touched(engine, 3)
        assert low <= touched <= high
        while engine.has_unfinished():
            engine.step()


def test_decode_floor_reads_the_measured_experts(monkeypatch):
    """The floor prices the experts the step touched where measured; ``floor_uniform_ms`` the uniform-routing count;
    the FLOPs count an expert's weights, not its bytes (packed INT4 or MXFP4 experts hold about 4 weights in 2
    bytes)."""
    from types import SimpleNamespace

    import torch

    mod = load_benchmark("engine", monkeypatch)
    engine = SimpleNamespace(spec=SimpleNamespace(num_experts=128, top_k=8, num_moe_layers=2),
                             kv=SimpleNamespace(layout=SimpleNamespace(bytes_per_token=lambda dtype: 0)),
                             config=SimpleNamespace(torch_dtype=torch.bfloat16))
    wb = {"dense": 0, "expert": 10**6, "embed_row": 0, "expert_params": 3 * 10**6}
    ceil = {"copy_bytes_per_s": 10**9, "bf16_flop_per_s": 10**18}
    measured = mod.decode_floor(engine, wb, 64, 100.0, ceil, touched=50.0)
    uniform = 128 * (1 - (1 - 8 / 128) ** 64)
    assert measured["floor_ms"] == 2 * 50 * 10**6 / 10**9 * 1e3
    assert measured["floor_uniform_ms"] == 2 * uniform * 10**6 / 10**9 * 1e3
    assert mod.decode_floor(engine, wb, 64, 100.0, ceil)["floor_ms"] == measured["floor_uniform_ms"]
    assert measured["floor_flops"] == 2 * (2 * 8 * 3 * 10**6) * 64


def test_experts_touched_needs_a_step(monkeypatch):
    mod = load_benchmark("engine", monkeypatch)
    with pytest.raises(ValueError, match="experts_touched: steps must be at least 1, got 0"):
        mod.experts_touched(object(), 0)


def test_time_decode_measures_the_whole_batch(monkeypatch, tmp_path):
    """Every measured step of a decode row runs all ``bs`` requests, also those that started decoding while the
    others were prefilled; the requests are aborted at the end and their KV blocks returned."""
    import torch

    mod = load_benchmark("engine", monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    engine = staggered_engine(tmp_path)
    seen = count_live_requests(monkeypatch, engine)
    row = mod.time_decode(engine, 4, steps=3, vocab=engine.spec.vocab_size, prompt=12)
    # the prompts took several steps (16 tokens a step), then the 3 timed and ROUTING_STEPS routing steps ran all 4
    # requests; then the aborts were reported
    seen = before_the_aborts(seen)
    measured = 3 + mod.ROUTING_STEPS
    assert len(seen) >= measured + 3 and seen[-measured:] == [4] * measured
    assert row["experts_touched_measured"] > engine.spec.top_k
    spread = row["step_spread_ms"]
    assert 0 < spread["min"] <= spread["median"] <= spread["max"] <= 3 * row["tpot_ms"]
    assert not engine.has_unfinished() and not engine._seqs
    assert engine.allocator.num_free == engine.allocator.capacity


@pytest.mark.parametrize("config, message", [
    # the context limit leaves 8 tokens past the 12-token prompt: the first requests finish during the routing steps
    ({"max_model_len": 20}, r"batch 4: of 4 requests [1-4] finished and 0 were preempted before the routing steps "
                            r"ended, so the steps ran fewer; each may generate 8 tokens"),
    # 12 blocks of 16 positions: 4 requests of 12 prompt tokens growing to 80 cannot all stay
    ({"max_model_len": 80, "num_kv_blocks": 12}, r"batch 4: of 4 requests 0 finished and [1-9]\d* were preempted"),
])
def test_time_decode_refuses_a_shrinking_batch(monkeypatch, tmp_path, config, message):
    """A row whose batch shrinks during the measured steps (requests finished at the context limit, or preempted
    for KV blocks) is refused, not measured on fewer requests; its requests are aborted all the same."""
    import torch

    mod = load_benchmark("engine", monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    engine = staggered_engine(tmp_path, **config)
    steps = 60 if "num_kv_blocks" in config else 3
    with pytest.raises(RuntimeError, match=message):
        mod.time_decode(engine, 4, steps=steps, vocab=engine.spec.vocab_size, prompt=12)
    assert not engine.has_unfinished() and not engine._seqs
    assert engine.allocator.num_free == engine.allocator.capacity


def _spec_engine(tmp_path, **config):
    """A tiny engine with n-gram speculation (3 tokens) whose four prompts take several steps (16 tokens a step)."""
    return staggered_engine(tmp_path, speculative_algorithm="ngram", speculative_num_tokens=3, **config)


def test_spec_window_measures_the_whole_batch(monkeypatch, tmp_path):
    """Every timed step of a speculation window runs all ``bs`` requests, though the first decode (up to 4 tokens a
    step) while the last are prefilled; the requests are aborted at the end and their KV blocks returned."""
    mod = load_benchmark("engine", monkeypatch)
    engine = _spec_engine(tmp_path)
    assert mod.decode_room(engine, mod.SPEC_PROMPTS[0]) == engine.max_model_len - len(
        engine.encode(mod.SPEC_PROMPTS[0]))
    seen = count_live_requests(monkeypatch, engine)
    row = mod.spec_window(engine, 4, steps=5, device="cpu")
    seen = before_the_aborts(seen)
    assert seen[-(5 + 3):] == [4] * (5 + 3)   # the 3 warm-up and 5 timed steps
    assert row["verify_steps"] == 4 * 5 and row["accepted_length"] >= 1.0   # one verification a request a step
    assert not engine.has_unfinished() and not engine._seqs
    assert engine.allocator.num_free == engine.allocator.capacity


def test_spec_window_refuses_a_shrinking_batch(monkeypatch, tmp_path):
    """With the context limit a few tokens past the longest prompt, the first requests finish inside the window: it
    is refused, not measured on fewer requests, and its requests are aborted all the same."""
    mod = load_benchmark("engine", monkeypatch)
    longest = max(len(p.encode()) for p in mod.SPEC_PROMPTS)   # the tiny tokenizer is byte-level
    engine = _spec_engine(tmp_path, max_model_len=longest + 24)
    with pytest.raises(RuntimeError, match=r"speculative window, batch 4: of 4 requests [1-4] finished and 0 were "
                                           r"preempted before the timed steps ended"):
        mod.spec_window(engine, 4, steps=20, device="cpu")
    assert not engine.has_unfinished() and not engine._seqs
    assert engine.allocator.num_free == engine.allocator.capacity


def test_decode_room_stays_within_the_kv_pool(monkeypatch, tmp_path):
    """Where the KV pool is smaller than the context limit, the room is what the pool holds past the prompt, and a
    request asking for it is accepted."""
    from epmoe.engine import SamplingParams

    mod = load_benchmark("engine", monkeypatch)
    engine = staggered_engine(tmp_path, max_model_len=256, num_kv_blocks=8)
    pool = engine.allocator.capacity * engine.config.block_size
    assert pool < 256
    room = mod.decode_room(engine, [1] * 12)
    assert room == pool - 12 + 1
    engine.check_request([1] * 12, SamplingParams(max_tokens=room))
    with pytest.raises(ValueError, match="KV pool"):
        engine.check_request([1] * 12, SamplingParams(max_tokens=room + 1))


def test_step_spread(monkeypatch):
    """A window's step times as median, min and max; an empty window has none."""
    mod = load_benchmark("engine", monkeypatch)
    assert mod.step_spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert mod.step_spread([]) == {}
