"""Calibrate: two gloo processes on CPU write a profile that the planner accepts."""

from __future__ import annotations

import pytest

from epmoe.cli import main
from epmoe.plan.hardware import load_hardware, parse_hardware
from epmoe.runtime.calibrate import CalibrationConfig, build_profile, calibrate, message_sizes

from ..conftest import CONFIGS


def test_message_sizes():
    # 8 B rounded up to 4 B x 2 ranks = 8; doubling to 64 B.
    assert message_sizes(64, 2) == [8, 16, 32, 64]
    # with 3 ranks every size is a multiple of 12 B (float32 split evenly for all-to-all)
    assert all(s % 12 == 0 for s in message_sizes(1024, 3))


def test_bad_config():
    with pytest.raises(ValueError, match="nprocs must be >= 2"):
        CalibrationConfig(out="x.json", nprocs=1)
    with pytest.raises(ValueError, match="backend must be"):
        CalibrationConfig(out="x.json", backend="mpi")


@pytest.mark.multiprocess
def test_two_gloo_processes_write_a_profile_plan_accepts(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    doc = calibrate(CalibrationConfig(out=str(out), nprocs=2, backend="gloo", max_bytes=2**20, iters=2, name="cpu2"))
    link = doc["links"]["intra_node"]
    assert link["all_reduce_latency_us"] > 0 and link["all_to_all_busbw_bytes_per_s"] > 0
    assert [r["bytes"] for r in doc["measurements"]] == message_sizes(2**20, 2)
    hw = load_hardware(out)
    assert hw.name == "cpu2" and hw.gpus_per_node == 2 and hw.inter_node is None
    # the measured curves travel into the profile: the planner prices collectives on them
    # (as the envelope: each time the least at that size or a larger one)
    rows = doc["measurements"]
    for key, curve in (("all_to_all_ms", hw.intra_node.all_to_all_ms_by_bytes),
                       ("all_reduce_ms", hw.intra_node.all_reduce_ms_by_bytes)):
        assert curve == tuple((float(r["bytes"]), min(q[key] for q in rows[i:])) for i, r in enumerate(rows))
    cfg = str(CONFIGS / "olmoe-1b-7b-0924.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "2", "--hardware", str(out), "--batch", "1,8", "--json"]) == 0
    assert '"hardware": "cpu2"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--base", "a100"], "error: --base ('a100') is not a usable profile: hardware 'a100' is not known"),
        (["--out", "/nonexistent/dir/p.json"],
         "error: --out ('/nonexistent/dir/p.json') cannot be written: directory '/nonexistent/dir' does not exist"),
    ],
)
def test_base_and_out_checked_before_measuring(tmp_path, capsys, monkeypatch, args, msg):
    import epmoe.runtime.calibrate

    def spawn(*a, **k):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(epmoe.runtime.calibrate, "spawn", spawn)
    argv = ["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(tmp_path / "p.json"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    # an existing directory as --out
    assert main(["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(tmp_path)]) == 2
    assert f"error: --out ({str(tmp_path)!r}) is a directory" in capsys.readouterr().err


def _no_spawn(monkeypatch):
    import epmoe.runtime.calibrate

    def spawn(*a, **k):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(epmoe.runtime.calibrate, "spawn", spawn)


def test_bad_base_profile_refused_before_measuring(tmp_path, capsys, monkeypatch):
    import json
    from importlib import resources

    _no_spawn(monkeypatch)
    doc = json.loads(resources.files("epmoe.plan.hardware").joinpath("h200-sxm.json").read_text())
    doc["moe_layer_fixed_us"] = float("nan")
    base = tmp_path / "base.json"
    base.write_text(json.dumps(doc))
    out = tmp_path / "p.json"
    assert main(["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(out), "--base", str(base)]) == 2
    err = capsys.readouterr().err
    assert (f"error: --base ({str(base)!r}) is not a usable profile: {base}: field 'moe_layer_fixed_us' must be a "
            f"finite number >= 0, got nan") in err
    assert err.count("\n") == 1 and "Traceback" not in err and not out.exists()
    # a misspelt key in the base, too
    del doc["moe_layer_fixed_us"]
    doc["moe_layer_fixed"] = 11.1
    base.write_text(json.dumps(doc))
    assert main(["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(out), "--base", str(base)]) == 2
    assert f"{base}: unknown field 'moe_layer_fixed'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--max-bytes", "1000000000000"], "error: --max-bytes must be <= 1073741824 (1 GiB"),
        (["--max-bytes", "4096"], "error: --max-bytes must be >= 1048576 (1 MiB: the bus bandwidth is fitted on the "
                                  "largest buffer, and smaller ones measure only latency), got 4096"),
        (["--iters", "0"], "error: --iters must be >= 1, got 0"),
        (["--name", ""], "name must be a non-empty string, got ''"),
        (["--name", "  "], "name must be a non-empty string, got '  '"),
    ],
)
def test_bad_sizes_and_name_refused(tmp_path, capsys, monkeypatch, args, msg):
    _no_spawn(monkeypatch)
    argv = ["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(tmp_path / "p.json"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_max_bytes_limit_accepted():
    assert CalibrationConfig(out="x.json", max_bytes=1024**3).max_bytes == 1024**3
    with pytest.raises(ValueError, match=r"^max_bytes must be <= 1073741824 \(1 GiB.*got 1073741825$"):
        CalibrationConfig(out="x.json", max_bytes=1024**3 + 1)


@pytest.mark.parametrize("cpus,nprocs,limit", [(2, 1000, 8), (2, 9, 8), (64, 65, 64), (None, 5, 4)])
def test_gloo_nprocs_bounded_by_64_and_4_per_cpu(tmp_path, capsys, monkeypatch, cpus, nprocs, limit):
    import os

    _no_spawn(monkeypatch)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    argv = ["calibrate", "--nprocs", str(nprocs), "--backend", "gloo", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: --nprocs ({nprocs}) exceeds {limit}, the most gloo processes on this machine" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    CalibrationConfig(out="x.json", nprocs=limit, backend="gloo").check_nprocs("gloo")  # the bound itself is fine


def test_nccl_nprocs_bounded_by_visible_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    CalibrationConfig(out="x.json", nprocs=2).check_nprocs("nccl")
    with pytest.raises(ValueError, match=r"^nprocs \(3\) exceeds the 2 visible GPUs$"):
        CalibrationConfig(out="x.json", nprocs=3).check_nprocs("nccl")


def test_latency_is_the_fastest_small_size_and_bandwidth_the_largest():
    from epmoe.runtime.calibrate import fit_link

    rows = [{"bytes": 8, "t": 0.297}, {"bytes": 16, "t": 0.130}, {"bytes": 32, "t": 0.120},
            {"bytes": 4096, "t": 0.125}, {"bytes": 8192, "t": 0.050}, {"bytes": 1 << 20, "t": 1.120}]
    lat_us, bw = fit_link(rows, "t", 1.0)
    assert lat_us == pytest.approx(120.0)  # not 297 (the first size) nor 50 (8 KiB is above 4 KiB)
    assert bw == pytest.approx((1 << 20) / 1.0e-3)
    assert fit_link([{"bytes": 8192, "t": 0.2}, {"bytes": 16384, "t": 0.3}], "t", 1.0)[0] == pytest.approx(200.0)


def test_collectives_warmed_up_before_timing(monkeypatch):
    """Slow first calls (connection set-up) are not timed, even with one timed call per size."""
    import time

    import torch
    import torch.distributed as dist

    from epmoe.runtime.calibrate import WARMUP_ROUNDS, measure_collectives

    calls = {"all_reduce": 0, "all_to_all": 0}

    def slow_at_first(kind):
        calls[kind] += 1
        if calls[kind] <= WARMUP_ROUNDS:
            time.sleep(0.05)

    def all_reduce(t, op=None, group=None):
        if op is None:  # the MAX over ranks of the timing itself is not a measured call
            slow_at_first("all_reduce")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_to_all_single", lambda y, x, group=None: slow_at_first("all_to_all"))
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    rows = measure_collectives([8, 16], 1, torch.device("cpu"))
    assert all(r["all_reduce_ms"] < 25 and r["all_to_all_ms"] < 25 for r in rows), rows
    assert calls == {"all_reduce": WARMUP_ROUNDS + 2 * 3, "all_to_all": WARMUP_ROUNDS + 2 * 3}


def test_cli_names_the_name_and_iters_flags(tmp_path, capsys):
    from epmoe.cli import main

    out = tmp_path / "c.json"
    assert main(["calibrate", "--nprocs", "2", "--name", "", "--out", str(out)]) == 2
    assert "--name must be a non-empty string, got ''" in capsys.readouterr().err
    assert main(["calibrate", "--nprocs", "2", "--iters", "100000", "--out", str(out)]) == 2
    assert "--iters must be at most 1000" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("base", ["h200-sxm", "h100-sxm"])
def test_base_expert_kernel_figures_carried(base):
    rows = [{"bytes": b, "all_reduce_ms": 0.01 + b / 1e8, "all_to_all_ms": 0.02 + b / 1e8} for b in (1024, 2**20)]
    facts = {"bf16_flops_per_s": 5e14, "memory_bytes": 8e10, "hbm_bytes_per_s": 3e12}
    doc = build_profile(rows, facts, 2, 1, "nccl", "GPU", CalibrationConfig(out="x.json", base=base))
    ref = load_hardware(base)
    hw = parse_hardware(doc)
    for field in ("moe_w4a16_layer_fixed_us", "moe_w4a16_stream_efficiency", "moe_mxfp4_layer_fixed_us",
                  "moe_mxfp4_stream_efficiency", "mla_decode_read_efficiency"):
        assert getattr(hw, field) == getattr(ref, field), field
    # the H200 profile has MXFP4 figures of its own, the H100 one prices MXFP4 on its W4A16 figures
    assert (ref.moe_mxfp4_stream_efficiency is None) == (base == "h100-sxm")
