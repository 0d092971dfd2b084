"""benchmarks/engine.py's one-layer timeline (``one_layer``) on a made-up kernel timeline: the layer it cuts out, the
starts, durations and gaps it reports (a programmatic dependent launch's negative gap included)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine.py"


def _one_layer(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the script imports its sibling ``timing``
    spec = importlib.util.spec_from_file_location("engine_benchmark", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.one_layer


def test_one_layer_is_the_middle_layer_of_the_last_step(monkeypatch):
    one_layer = _one_layer(monkeypatch)
    spans, t = [], 0.0
    for step in range(2):
        for layer in range(4):
            # the down kernel starts 1 us before the gate/up kernel ends (a dependent launch)
            for name, dur, gap in (("rms_norm_kernel", 2.0, 0.5), ("nvjet_qkv", 7.0, 0.5),
                                   ("paged_decode_kernel", 3.0 + step + layer, 0.5), ("gate_up", 4.0, 0.5),
                                   ("down", 5.0, -1.0)):
                t += gap
                spans.append((t, t + dur, name))
                t += dur
    layer = one_layer(spans, steps=2)
    # step 1 (the last), from its attention launch of layer 1 (of 0..3: the one before the middle) to the next one
    assert [k["kernel"] for k in layer] == ["paged_decode_kernel", "gate_up", "down", "rms_norm_kernel", "nvjet_qkv"]
    assert layer[0]["us"] == 3.0 + 1 + 1 and layer[0]["start_us"] == 0.0 and layer[0]["gap_us"] == 0.5
    assert [k["gap_us"] for k in layer[1:]] == [0.5, -1.0, 0.5, 0.5]
    assert layer[1]["start_us"] == layer[0]["us"] + 0.5
    assert one_layer(spans[:5], steps=1) == []  # one attention launch: no whole layer
    # a new graph begins at layer 2: layer 1 is followed by it, so the layer before (0) is taken
    cut = one_layer(spans, steps=2, cuts=[2])
    assert cut[0]["us"] == 3.0 + 1 + 0 and [k["kernel"] for k in cut] == [k["kernel"] for k in layer]
    assert one_layer(spans, steps=2, cuts=[3]) == layer  # layer 2 begins no graph
