"""benchmarks/engine.py's per-layer timeline (``layer_windows``, ``median_layer``) on a made-up kernel timeline: the
layers it cuts out, the starts, durations and gaps it reports (a programmatic dependent launch's negative gap
included) and their median."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark


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
    """The floor prices the experts the step touched where measured; ``floor_uniform_ms`` the uniform-routing count."""
    from types import SimpleNamespace

    import torch

    mod = load_benchmark("engine", monkeypatch)
    engine = SimpleNamespace(spec=SimpleNamespace(num_experts=128, top_k=8, num_moe_layers=2),
                             kv=SimpleNamespace(layout=SimpleNamespace(bytes_per_token=lambda dtype: 0)),
                             config=SimpleNamespace(torch_dtype=torch.bfloat16))
    wb = {"dense": 0, "expert": 10**6, "embed_row": 0}
    ceil = {"copy_bytes_per_s": 10**9, "bf16_flop_per_s": 10**18}
    measured = mod.decode_floor(engine, wb, 64, 100.0, ceil, touched=50.0)
    uniform = 128 * (1 - (1 - 8 / 128) ** 64)
    assert measured["floor_ms"] == 2 * 50 * 10**6 / 10**9 * 1e3
    assert measured["floor_uniform_ms"] == 2 * uniform * 10**6 / 10**9 * 1e3
    assert mod.decode_floor(engine, wb, 64, 100.0, ceil)["floor_ms"] == measured["floor_uniform_ms"]


def test_experts_touched_needs_a_step(monkeypatch):
    mod = load_benchmark("engine", monkeypatch)
    with pytest.raises(ValueError, match="experts_touched: steps must be at least 1, got 0"):
        mod.experts_touched(object(), 0)
