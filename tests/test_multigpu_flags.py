"""benchmarks/multigpu.py's flags: a bad count is an argparse error (exit 2) naming the flag and its value, before
torchrun's ranks start (they failed inside a part: 'capacity must be a positive integer', 'no median for empty
data', a store timeout), and a 0 --max-bytes is not taken for "not given"."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("multigpu", monkeypatch)


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens must be comma-separated integers >= 1, got '0'"),
    (["--tokens", "1,0"], "--tokens must be comma-separated integers >= 1, got '1,0'"),
    (["--dispatch-tokens", "0"], "--dispatch-tokens must be comma-separated integers >= 1, got '0'"),
    (["--check-tokens", "0"], "--check-tokens must be at least 1, got 0"),
    (["--iters", "0"], "--iters must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--calib-iters", "0"], "--calib-iters must be at least 1, got 0"),
    (["--max-bytes", "0"], "--max-bytes must be at least 8, got 0"),
    (["--run-timeout", "0"], "--run-timeout must be at least 1, got 0"),
    (["--timeout", "0"], "--timeout must be at least 1, got 0"),
])
def test_bad_counts_are_named_with_exit_2(script, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        script.parse_args(["--device", "cpu", "--small", *args])
    assert exc.value.code == 2
    assert f": error: {message}\n" in capsys.readouterr().err


def test_good_values_pass(script):
    a = script.parse_args(["--device", "cpu", "--small", "--tokens", "1,4", "--warmup", "0", "--max-bytes", "4096"])
    assert (a.tokens, a.dispatch_tokens, a.warmup, a.max_bytes) == ([1, 4], [1, 64, 512], 0, 4096)
