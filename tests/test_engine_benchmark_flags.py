"""benchmarks/engine.py's speculation-row flags (``--spec``, ``--device cpu``): a bad one is an argparse error (exit
2) naming the flag and its value before any engine is built, not a traceback from deep inside the run."""

from __future__ import annotations

import sys

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("engine", monkeypatch)


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "--device cpu needs --spec-model DIR (a small checkpoint): the default target is the "
                          "full-size Qwen3-30B-A3B"),
    (["--device", "cpu", "--spec-model", "{tmp}/missing"],
     "--spec-model '{tmp}/missing' is not a checkpoint directory (no config.json)"),
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--eagle3-config", "{tmp}/missing.json"],
     "--eagle3-config '{tmp}/missing.json' is not a file"),
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--spec-batches", "1,0"],
     "--spec-batches values must be integers >= 1, got '1,0'"),
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--spec-batches", "x"],
     "--spec-batches must be comma-separated integers, got 'x'"),
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--spec-k", "0"],
     "--spec-k values must be integers >= 1 and <= 16, got '0'"),
    (["--spec", "--spec-k", "17"], "--spec-k values must be integers >= 1 and <= 16, got '17'"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--spec-steps", "0"], "--spec-steps must be at least 1, got 0"),
    # the rows ran first, then the results folder failed with FileExistsError
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--eagle3-config", "{tmp}/ckpt/config.json", "--out",
      "{tmp}/ckpt/config.json"], "--out '{tmp}/ckpt/config.json' is a file; it names the folder the results are "
                                 "written to"),
])
def test_bad_speculation_flags_are_named_with_exit_2(script, tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    built = []
    monkeypatch.setattr(script, "spec_rows", lambda *a: built.append(a))  # nothing may be built
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["engine.py", *out, *[a.format(tmp=tmp_path) for a in args]])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    assert f"engine.py: error: {message.format(tmp=tmp_path)}\n" in capsys.readouterr().err
    assert built == [] and not (tmp_path / "out").exists()
