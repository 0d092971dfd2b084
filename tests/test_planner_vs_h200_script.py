"""benchmarks/planner_vs_h200.py's flags: a bad one is an argparse error (exit 2) naming the flag and its value,
before any work, not a traceback."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from .benchmark_scripts import load_benchmark

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("planner_vs_h200", monkeypatch)


@pytest.mark.parametrize("args, message", [
    (["--results", "{tmp}/missing.json"], "--results '{tmp}/missing.json' cannot be read as JSON: [Errno 2]"),
    (["--results", "{tmp}/text.json"], "--results '{tmp}/text.json' cannot be read as JSON: Expecting value"),
    (["--results", "{tmp}/loads.json"],
     "--results '{tmp}/loads.json' holds no 'rows' list: not a results JSON of benchmarks/moe_layer.py"),
    (["--results", "{tmp}/rows.json", "--ceilings", "run"],
     "--ceilings run needs the run's 'ceilings' in --results '{tmp}/rows.json', which has none"),
    (["--hardware", "nope"], "--hardware 'nope': hardware 'nope' is not known; shipped profiles: h100-sxm, h200-sxm"),
    (["--out", "{tmp}/missing/out.json"], "--out '{tmp}/missing/out.json': folder '{tmp}/missing' does not exist"),
    (["--int4-results", "{tmp}/missing.json"], "--int4-results '{tmp}/missing.json' cannot be read as JSON"),
    (["--int4-results", "{tmp}/loads.json"], "--int4-results '{tmp}/loads.json' holds no 'int4_rows' or "
     "'mxfp4_rows' list: not a results JSON of benchmarks/moe_layer.py"),
    (["--int4-results", "{tmp}/rows.json"], "--int4-results '{tmp}/rows.json' holds no 'int4_rows' or 'mxfp4_rows' "
     "list: not a results JSON of benchmarks/moe_layer.py (its 'rows' are a bf16 run's: --results takes them)"),
    (["--out", "{tmp}"], "--out '{tmp}' is a folder; it names the JSON file to write"),
    (["--fp8-results", "{tmp}/rows.json"], "--fp8-results '{tmp}/rows.json': holds no row with an 'fp8_us'"),
    (["--fp8-results", "{tmp}/fp8nan.json"], "--fp8-results '{tmp}/fp8nan.json': rows[0] has fp8_us nan; expected a "
     "positive finite number of us"),
    (["--fp8-results", "{tmp}/rows.json", "--int4-results", "{tmp}/rows.json"],
     "--int4-results and --fp8-results each choose a mode: give one"),
])
def test_bad_flags_are_named_with_exit_2(script, tmp_path, capsys, args, message):
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "loads.json").write_text(json.dumps({"load": [[1, 2]]}))
    (tmp_path / "rows.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "fp8nan.json").write_text(json.dumps({"rows": [{"case": "dsv3", "tokens": 1, "fp8_us": float("nan")}]}))
    out = ["--out", str(tmp_path / "out.json")] if "--out" not in args else []
    with pytest.raises(SystemExit) as exc:
        script.main([a.format(tmp=tmp_path) for a in args] + out)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f": error: {message.format(tmp=tmp_path)}" in err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="Triton installed: the INT4 mode runs")
def test_int4_results_without_triton_says_so(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(["--int4-results", str(REPO / "benchmarks/results/moe_layer_int4_mma16_h200.json"),
                     "--out", str(tmp_path / "out.json")])
    assert exc.value.code == 2
    assert (": error: --int4-results takes each row's time from the INT4 path the backend picks, "
            "which imports Triton; Triton is not installed here") in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_the_default_run_still_writes_its_table(script, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert script.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["hardware"] == "h200-sxm" and len(doc["rows"]) == 16
    assert f"wrote {out}" in capsys.readouterr().out


def test_mxfp4_rows_are_compared_and_fitted_without_triton(script, tmp_path, capsys):
    # the MXFP4 rows' measured time is the backend's in the run (no path to recompute): no Triton needed
    out = tmp_path / "out.json"
    results = REPO / "benchmarks/results/moe_layer_mxfp4_h100_fit_rows.json"
    assert script.main(["--int4-results", str(results), "--hardware", "h100-sxm", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["hardware"] == "h100-sxm" and len(doc["rows"]) == 17 and doc["all_within_target"]
    assert (doc["fitted_stream_efficiency"], doc["fitted_w4a16_flops_per_s"]) == (0.61, 338e12)
    first = doc["rows"][0]
    assert (first["case"], first["tokens"], first["measured_us"]) == (
        "gptoss20b_mxfp4", 1, json.loads(results.read_text())["mxfp4_rows"][0]["mxfp4_us"])
    printed = capsys.readouterr().out
    assert "17/17 rows within 25%" in printed
    # the H100 profile has no MXFP4 figures of its own: its W4A16 figures price (and are fitted to) these rows
    assert "moe_w4a16_stream_efficiency, moe_w4a16_layer_fixed_us" in printed and "grid's bound" not in printed
    # MXFP4 rows alone are held against, and fitted as, the profile's moe_mxfp4_* figures where it has them
    h200 = REPO / "benchmarks/results/moe_layer_mxfp4_h200_fit_rows.json"
    assert script.main(["--int4-results", str(h200), "--hardware", "h200-sxm", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["moe_mxfp4_stream_efficiency"], doc["moe_mxfp4_layer_fixed_us"]) == (0.5, 14.8)
    assert doc["fitted_stream_efficiency"] == 0.5 and doc["fitted_fixed_us"] == pytest.approx(14.8, abs=0.05)
    assert [r["tokens"] for r in doc["rows"]] == [1, 2, 8] and doc["all_within_target"]
    printed = capsys.readouterr().out
    assert "moe_mxfp4_stream_efficiency, moe_mxfp4_layer_fixed_us" in printed
    assert "these rows do not determine the rate" in printed


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows.clear(), "holds no INT4 or MXFP4 row to compare"),
    (lambda rows: rows[2].update(mxfp4_us=float("nan")), "mxfp4_rows[2] has mxfp4_us nan; expected a positive finite"),
    (lambda rows: rows[2].update(mxfp4_us="fast"), "mxfp4_rows[2] has mxfp4_us 'fast'; expected a positive finite"),
    (lambda rows: rows[2].update(mxfp4_us=-1.0), "mxfp4_rows[2] has mxfp4_us -1.0; expected a positive finite"),
    (lambda rows: rows[2].pop("mxfp4_us"), "mxfp4_rows[2] has no 'mxfp4_us' (the backend's time)"),
    (lambda rows: rows[0].update(tokens=-3), "mxfp4_rows[0] has tokens -3; expected a positive integer"),
    (lambda rows: rows[1].update(case="x"), "mxfp4_rows[1] has case 'x'; known: gptoss_mxfp4, gptoss20b_mxfp4"),
])
def test_bad_mxfp4_rows_are_named_with_exit_2(script, tmp_path, capsys, edit, message):
    doc = json.loads((REPO / "benchmarks/results/moe_layer_mxfp4_mma_h100.json").read_text())
    edit(doc["mxfp4_rows"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as exc:
        script.main(["--int4-results", str(bad), "--hardware", "h100-sxm", "--out", str(tmp_path / "out.json")])
    assert exc.value.code == 2
    assert f": error: --int4-results '{bad}': {message}" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_fp8_rows_are_compared_and_fitted(script, tmp_path, capsys):
    # the block-FP8 rows of the bf16 run (fp8_us, the dsv3 shard) against the h200-sxm profile's W8A16 figures,
    # which were fitted to them: the fit reproduces them and every row is within the target
    out = tmp_path / "out.json"
    assert script.main(["--fp8-results", str(REPO / "benchmarks/results/moe_layer_h200.json"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 8 and doc["all_within_target"]
    assert (doc["fitted_stream_efficiency"], doc["fitted_w8a16_flops_per_s"]) == (0.61, 288e12)
    assert doc["fitted_fixed_us"] == pytest.approx(doc["moe_w8a16_layer_fixed_us"], abs=0.05)
    assert doc["rows"][0]["measured_us"] == pytest.approx(36.1, abs=0.05)
    assert "8/8 rows within 25%" in capsys.readouterr().out
