"""benchmarks/deployment.py end to end on CPU: two spawned gloo ranks, the built-in small Kimi checkpoint, few tokens.

The script is what runs on a machine with several GPUs when one is lent; this checks its CPU path and the values it
writes: greedy tokens equal under ep and tp and with or without speculation, every row measured with its
collectives, memory and the planner's prediction, speculation rows against plain ones, and the server's benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "deployment.py"
CONCURRENCY = (4,)
CHECK_TOKENS = 4


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("deployment")
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + paths)
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--concurrency",
           ",".join(map(str, CONCURRENCY)), "--steps", "2", "--profile-steps", "1", "--check-tokens",
           str(CHECK_TOKENS), "--serve-concurrency", "4", "--serve-prompts", "4"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    path = out / "deployment.json"
    assert proc.returncode == 0 and path.is_file(), \
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(path.read_text()), proc


def test_greedy_tokens_equal_under_ep_tp_and_speculation(result):
    doc, _ = result
    tokens = doc["checks"]["tokens"]
    assert sorted(tokens) == sorted(f"{p}/{m}" for p in ("ep", "tp") for m in ("plain", "ngram", "eagle3"))
    assert len(tokens["ep/plain"]) == doc["gpus"] == 2  # one prompt per rank
    assert all(len(t) == CHECK_TOKENS for t in tokens["ep/plain"])
    for key, toks in tokens.items():
        assert toks == tokens["ep/plain"], key
    assert doc["checks"]["tokens_equal"] is True


def test_every_row_has_measured_values_and_a_plan(result):
    doc, _ = result
    rows = doc["rows"]
    assert sorted((r["parallel"], r["mode"], r["concurrency"]) for r in rows) == sorted(
        (p, m, c) for p in ("ep", "tp") for m in ("plain", "ngram", "eagle3") for c in CONCURRENCY)
    for r in rows:
        assert r["step_ms"] > 0 and r["forward_ms"] > 0 and r["output_tokens_per_s"] > 0
        assert r["tokens_per_s_per_stream"] == pytest.approx(r["output_tokens_per_s"] / r["concurrency"])
        assert r["accepted_length"] >= 1
        assert len(r["memory_gib_per_rank"]) == 2 and min(r["memory_gib_per_rank"]) > 0
        assert r["plan_ratio"] > 0 and r["plan"]["strategy"] == ("EP2+DPattn" if r["parallel"] == "ep" else "TP2")
        calls = {k: v["calls_per_step"] for k, v in r["collectives"].items()}
        # ep: one all-to-all per dispatch and combine (and the eager dispatcher's count exchange) per MoE layer;
        # tp: the tokens gathered and the partial outputs summed per MoE layer
        moe_layers = 2
        if r["parallel"] == "ep":
            assert calls.get("all_to_all", 0) >= 2 * moe_layers and "all_reduce" not in calls
        else:
            assert calls.get("all_reduce", 0) >= moe_layers and "all_to_all" not in calls
        if r["mode"] == "plain":
            assert r["k"] == 0 and r["speedup_per_stream"] == 1.0
        else:
            assert r["k"] == 3 and r["speedup_per_stream"] > 0 and r["plan_tokens_ratio"] > 0
            assert r["accepted_length"] <= 4
    # ngram on repetitive prompts: some verify steps accept drafted tokens
    assert any(r["verify_steps"] > 0 and r["accepted_length"] > 1 for r in rows if r["mode"] == "ngram")
    assert set(doc["ep_over_tp"]) == {str(c) for c in CONCURRENCY}
    assert set(doc["plan"]["planned_faster"].values()) <= {"ep", "tp"}


def test_serve_under_bench_and_the_table(result):
    doc, proc = result
    serve = doc["serve"]
    rep = serve["report"]
    assert serve["exit_code"] == 0 and "--parallel ep --ep 2" in serve["command"]
    assert rep["completed"] == 4 and rep["failed"] == 0
    assert rep["ttft_ms"]["p99"] >= rep["ttft_ms"]["p50"] > 0 and rep["tpot_ms"]["p50"] > 0
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("serve --parallel ep --ep 2 at concurrency 4")
    assert any(line.startswith("par mode") for line in lines)
