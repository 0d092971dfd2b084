"""benchmarks/deployment.py's flags: a bad value is an argparse error (exit 2) naming the flag and the value, and a
value given is used, never taken for "not given" (``--steps 0`` ran the default 4 steps)."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("deployment", monkeypatch)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "--gpus must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--profile-steps", "0"], "--profile-steps must be at least 1, got 0"),
    (["--check-tokens", "-2"], "--check-tokens must be at least 1, got -2"),
    (["--spec-k", "0"], "--spec-k must be at least 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be at least 1, got 0"),
    (["--serve-concurrency", "0"], "--serve-concurrency must be at least 1, got 0"),
    (["--serve-prompts", "0"], "--serve-prompts must be at least 1, got 0"),
    (["--layers", "-1"], "--layers must be at least 0 (0: as many as fit), got -1"),
    (["--concurrency", "0"], "--concurrency must be comma-separated integers >= 1, got '0'"),
    (["--concurrency", "1,x"], "--concurrency must be comma-separated integers >= 1, got '1,x'"),
    (["--eagle3-config", "/nonexistent/eagle3.json"], "--eagle3-config '/nonexistent/eagle3.json' is not a file"),
])
def test_bad_flags_are_named_with_exit_2(script, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        script.parse_args(["--device", "cpu", *args])
    assert exc.value.code == 2
    assert f"error: {message}\n" in capsys.readouterr().err


def test_cpu_defaults_and_given_values(script):
    a = script.parse_args(["--device", "cpu"])
    assert (a.gpus, a.concurrency, a.steps, a.profile_steps, a.check_tokens) == (2, [1, 4], 4, 2, 6)
    a = script.parse_args(["--device", "cpu", "--gpus", "3", "--concurrency", "2,8", "--steps", "1",
                           "--profile-steps", "1", "--check-tokens", "1"])
    assert (a.gpus, a.concurrency, a.steps, a.profile_steps, a.check_tokens) == (3, [2, 8], 1, 1, 1)
