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
    # each of these was accepted and failed later (or ran something else than asked)
    (["--spec-k", "99"], "--spec-k must be at most 16 (the engine's speculative_num_tokens), got 99"),
    (["--skip-serve", "--skip-engine"], "--skip-serve and --skip-engine together leave nothing to run"),
    (["--concurrency", "1,,4"], "--concurrency must be comma-separated integers >= 1, got '1,,4'"),
    (["--concurrency", "4,4"], "--concurrency repeats a value, got '4,4'"),
    (["--modes", ""], "--modes must start with plain and name each of ('plain', 'ngram', 'eagle3') at most once, "
                      "got ''"),
    (["--modes", "plain,plain"], "--modes must start with plain and name each of ('plain', 'ngram', 'eagle3') at "
                                 "most once, got 'plain,plain'"),
    (["--parallel", ","], "--parallel must name each of ('ep', 'tp') at most once (at least one), got ','"),
    (["--parallel", "ep,ep"], "--parallel must name each of ('ep', 'tp') at most once (at least one), got 'ep,ep'"),
    (["--profile", "1"], "unrecognized arguments: --profile 1"),   # not taken for --profile-steps
    # a traceback from the ranks before (the placement's slots per rank), and a stale one from the loader check
    (["--gpus", "3"], "--gpus 3: the model's 16 routed experts do not divide evenly among 3 ranks (expert and "
                      "tensor parallelism place the same number on each)"),
    (["--expert-format", "int4"], "--expert-format int4: the CPU run uses the built-in small checkpoint, whose "
                                  "routed experts are bf16; INT4 experts are timed with --device cuda"),
])
def test_bad_flags_are_named_with_exit_2(script, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        script.parse_args(["--device", "cpu", *args])
    assert exc.value.code == 2
    assert f"error: {message}\n" in capsys.readouterr().err


def test_cpu_defaults_and_given_values(script):
    a = script.parse_args(["--device", "cpu"])
    assert (a.gpus, a.concurrency, a.steps, a.profile_steps, a.check_tokens) == (2, [1, 4], 4, 2, 6)
    a = script.parse_args(["--device", "cpu", "--gpus", "4", "--concurrency", "2,8", "--steps", "1",
                           "--profile-steps", "1", "--check-tokens", "1"])
    assert (a.gpus, a.concurrency, a.steps, a.profile_steps, a.check_tokens) == (4, [2, 8], 1, 1, 1)


@pytest.mark.parametrize("args, gpus, message", [
    ([], 0, "--device cuda (the default): no CUDA device here; use --device cpu without one"),
    (["--gpus", "8"], 0, "--device cuda (the default): no CUDA device here; use --device cpu without one"),
    (["--gpus", "8"], 4, "--gpus 8: this machine has 4 GPU(s)"),
    (["--gpus", "5"], 8, "--gpus 5: the model's 384 routed experts do not divide evenly among 5 ranks (expert and "
                         "tensor parallelism place the same number on each)"),
    (["--steps", "600"], 8, "--steps 600 and --profile-steps 4 (with --spec-k 3: up to 2556 tokens of context a "
                            "request, a 128-token allowance for the prompt included) do not fit --max-model-len 2048"),
])
def test_cuda_flags_checked_against_the_machine(script, monkeypatch, capsys, args, gpus, message):
    """On CUDA the machine is checked before any rank is spawned (without a GPU the ranks died on
    ``_cuda_setDevice``), and the timed steps against the context limit (a window ran past it)."""
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(script.torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit) as exc:
        script.parse_args(args)
    assert exc.value.code == 2
    assert f"error: {message}\n" in capsys.readouterr().err
