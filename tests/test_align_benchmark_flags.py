"""``benchmarks/align.py``'s flags: a bad value is named by argparse before the device is looked at, and the script
loads without Triton (it imports the kernels only to time them)."""

import sys

import pytest

from .benchmark_scripts import load_benchmark


@pytest.mark.parametrize("argv,message", [
    (["--pairs", "a,b"], "argument --pairs: --pairs takes comma-separated integers, got 'a,b'"),
    (["--pairs", "3000000000"], "argument --pairs: --pairs takes integers from 0 to 1048576, got 3000000000"),
    (["--slots", "0"], "argument --slots: --slots takes integers from 1 to 2048, got 0"),
    (["--slots", "4096"], "argument --slots: --slots takes integers from 1 to 2048, got 4096"),
    (["--block-m", "12"], "argument --block-m: --block-m takes a multiple of 8 from 8 to 256 (last blocks round up to "
                          "8 rows), got '12'"),
    (["--block-m", "1e3"], "got '1e3'"),
])
def test_a_bad_flag_is_named_before_the_device(monkeypatch, capsys, argv, message):
    monkeypatch.setitem(sys.modules, "triton", None)  # importing it would fail: the flags must not need it
    align = load_benchmark("align", monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        align.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_good_flags_reach_the_device_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    align = load_benchmark("align", monkeypatch)
    with pytest.raises(SystemExit, match="benchmarks/align.py times CUDA kernels: no CUDA device"):
        align.main(["--pairs", "8, 64", "--slots", "48", "--block-m", "16"])
