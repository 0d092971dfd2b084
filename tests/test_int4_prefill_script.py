"""benchmarks/int4_prefill.py on CPU: it imports and parses its arguments (it times only on a GPU), and the floors it
prints beside each row are ``moe_layer.py``'s: the INT4 weight read and the FLOPs over the measured ceilings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from epmoe.experts.storage import ExpertStorage

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def test_help_on_cpu():
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "int4_prefill.py"), "--help"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--sizes" in done.stdout and "kimi_full_int4" in done.stdout


def test_floors_are_the_packed_bytes_and_the_projections_flops(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from moe_layer import INT4_CASES, INT4_GROUP, flop_floor_us, int4_expert_bytes, int4_read_floor_us

    case = INT4_CASES["kimi_int4"]
    d, f = case["d"], case["f"]
    # the bytes the loader keeps of one expert (values and scales), as doctor counts them
    assert int4_expert_bytes(case) == ExpertStorage.of(f"int4_group{INT4_GROUP}").bytes_per_expert(d, f) == 24772608
    ceil = {"copy_bytes_per_s": 4.0e12, "bf16_flop_per_s": 8.0e14}
    assert abs(int4_read_floor_us(case, 48, ceil) - 48 * 24772608 / 4.0e12 * 1e6) < 1e-9
    pairs = 4096
    projections = 2 * pairs * d * (2 * f) + 2 * pairs * f * d  # gate and up [D -> 2F], then down [F -> D]
    assert abs(flop_floor_us(case, pairs, ceil) - projections / 8.0e14 * 1e6) < 1e-9
