"""Calibrate: two gloo processes on CPU write a profile that the planner accepts."""

from __future__ import annotations

import pytest

from epmoe.calibrate import CalibrationConfig, calibrate, message_sizes
from epmoe.cli import main
from epmoe.hardware import load_hardware

from .conftest import CONFIGS


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


def test_two_gloo_processes_write_a_profile_plan_accepts(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    doc = calibrate(CalibrationConfig(out=str(out), nprocs=2, backend="gloo", max_bytes=4096, iters=2, name="cpu2"))
    link = doc["links"]["intra_node"]
    assert link["all_reduce_latency_us"] > 0 and link["all_to_all_busbw_bytes_per_s"] > 0
    assert [r["bytes"] for r in doc["measurements"]] == message_sizes(4096, 2)
    hw = load_hardware(out)
    assert hw.name == "cpu2" and hw.gpus_per_node == 2 and hw.inter_node is None
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
    import torch.multiprocessing

    def spawn(*a, **k):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    argv = ["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(tmp_path / "p.json"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    # an existing directory as --out
    assert main(["calibrate", "--nprocs", "2", "--backend", "gloo", "--out", str(tmp_path)]) == 2
    assert f"error: --out ({str(tmp_path)!r}) is a directory" in capsys.readouterr().err
