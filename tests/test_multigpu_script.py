"""benchmarks/multigpu.py end to end on CPU: two gloo ranks under torchrun, tiny sizes, every part.

The script is what runs on a multi-GPU machine when one is lent; this checks its CPU path and the
values it writes: the EP and TP layers equal the single-rank layer, the collectives each forward
issues, the exact bytes the fixed-capacity dispatcher moves, the calibrated profile, the ``epmoe run``
child job against transformers, and the planner's predictions beside the measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epmoe.plan.hardware import load_hardware
from epmoe.runtime.calibrate import LATENCY_MAX_BYTES, message_sizes

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "multigpu.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("multigpu")
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + paths)
    env["EPMOE_CACHE"] = str(out / "cache")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--device", "cpu", "--small", "--out", str(out), "--tokens", "1,4", "--dispatch-tokens", "1,32",
           "--iters", "3", "--warmup", "1", "--calib-iters", "2", "--timeout", "120", "--run-timeout", "120"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    doc_path = out / "multigpu.json"
    assert doc_path.is_file(), f"no JSON written; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(doc_path.read_text()), proc, out


def test_every_part_runs_and_the_table_is_printed(result):
    doc, proc, _ = result
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ok = {p: s["ok"] for p, s in doc["parts"].items()}
    assert ok == {"calibrate": True, "layer": True, "run": True, "plan": True}
    assert doc["ok"] is True and doc["world_size"] == 2
    assert "result: OK" in proc.stdout and "T/rank" in proc.stdout


def test_calibration_rows_and_profile(result):
    doc, _, out = result
    calib = doc["calibrate"]
    assert [r["bytes"] for r in calib["rows"]] == message_sizes(64 * 1024, 2)
    assert all(r["all_reduce_ms"] > 0 and r["all_to_all_ms"] > 0 for r in calib["rows"])
    hw = load_hardware(out / "profile.json")
    assert hw.gpus_per_node == 2 and "gloo over 2 ranks" in hw.intra_node.kind
    # latency: the fastest of the sizes up to LATENCY_MAX_BYTES (not the first size, which may carry set-up costs)
    small = [r["all_to_all_ms"] for r in calib["rows"] if r["bytes"] <= LATENCY_MAX_BYTES]
    assert hw.intra_node.all_to_all_latency_us == pytest.approx(min(small) * 1e3)


def test_layers_equal_the_single_rank_layer_with_their_collectives(result):
    doc, _, _ = result
    layer = doc["layer"]
    assert layer["dtype"] == "float32" and layer["spec"]["experts"] == 32 and layer["spec"]["top_k"] == 8
    checks = layer["checks"]
    for name in ("ep_all_to_all", "ep_fixed_eager", "tp"):
        assert 0 < checks[name]["rel_err"] < 1e-5, (name, checks[name])
    # one forward: counts + rows + back for all_to_all, rows + back for fixed capacity, one all-reduce for TP
    assert checks["ep_all_to_all"]["calls"] == {"all_to_all": 3, "all_reduce": 0, "all_gather": 0}
    assert checks["ep_fixed_eager"]["calls"] == {"all_to_all": 2, "all_reduce": 0, "all_gather": 0}
    assert checks["tp"]["calls"] == {"all_to_all": 0, "all_reduce": 1, "all_gather": 0}


def test_fixed_capacity_moves_exactly_its_buffers(result):
    doc, _, _ = result
    layer = doc["layer"]
    d, k = layer["spec"]["hidden"], layer["spec"]["top_k"]
    rows = layer["rows"] + layer["dispatch_rows"]
    assert [r["tokens_per_rank"] for r in rows] == [1, 4, 1, 32]
    for r in rows:
        t = r["tokens_per_rank"]
        # G = 2, capacity T: T rows to the other rank each way; dispatch rows carry slots, weights, max count
        assert r["disp_fixed_bytes_sent"] == t * (d * 4 + (2 * k + 1) * 4) + t * d * 4
        assert r["disp_fixed_calls"] == 2 and r["disp_all_to_all_calls"] == 3
        assert 0 < r["disp_all_to_all_bytes_sent"] <= r["disp_fixed_bytes_sent"] + 16
        assert r["disp_fixed_us"] > 0 and r["disp_fixed_busbw_gbs"] > 0
    for r in layer["rows"]:
        assert min(r["ep_all_to_all_us"], r["ep_fixed_us"], r["tp_us"], r["tp_all_reduce_us"]) > 0
        assert r["tp_all_reduce_bytes"] == 2 * r["tokens_per_rank"] * d * 4


def test_epmoe_run_matches_transformers(result):
    doc, _, out = result
    run = doc["run"]
    assert run["matches_reference"] is True and run["graphs"] is False  # CPU: eager steps
    assert run["collectives_per_step"]["all_to_all"] == 3 * 2  # 2 MoE layers of the tiny Qwen3-MoE
    assert json.loads((out / "run.json").read_text())["ep"] == 2


def test_plan_predictions_beside_measurements(result):
    doc, _, _ = result
    plan = doc["plan"]
    assert plan["hardware"] == "calibrated-2x-cpu" and "EP2+DPattn" in plan["strategies"]
    for r in plan["rows"]:
        assert r["ep_pred_dispatch_combine_us"] > 0 and r["tp_pred_all_reduce_us"] > 0
        assert r["ep_pred_a2a_calls_per_layer"] == 2
        assert r["ep_disp_fixed_meas_over_pred"] > 0 and r["tp_all_reduce_meas_over_pred"] > 0


def test_replan_of_the_2x_h200_run_predicts_its_communication_within_25_percent(tmp_path):
    """The planner's collective and dispatch model against the measured 2x H200 run (no GPU needed)."""
    saved = REPO / "benchmarks" / "results" / "multigpu_h200x2.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "multigpu.py"), "--replan", str(saved),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "multigpu.json").read_text())["plan"]
    rows = [r for r in plan["rows"] if r.get("ep_disp_fixed_meas_over_pred")]
    assert [r["tokens_per_rank"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for r in rows:
        assert 0.75 <= r["ep_disp_fixed_meas_over_pred"] <= 1.25, r
        assert 0.75 <= r["tp_all_reduce_meas_over_pred"] <= 1.25, r
    assert load_hardware(tmp_path / "profile.json").intra_node.all_to_all_ms_by_bytes
