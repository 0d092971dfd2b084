"""benchmarks/serve.py's flags: an --out that is a file, an unknown --model-config (or one given with --device cpu)
and --device cuda without a CUDA device are argparse errors (exit 2) naming the flag, before the server or any
checkpoint is started (they were FileExistsError / FileNotFoundError / CUDA assertion tracebacks, or ignored)."""

from __future__ import annotations

import sys

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("serve", monkeypatch)


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu", "--out", "{tmp}/file"],
     "--out '{tmp}/file' is a file; it names the folder the results are written to"),
    (["--device", "cuda", "--model-config", "bogus", "--out", "{tmp}/out"],
     "--model-config 'bogus' is not in {configs}; known: deepseek-r1, deepseek-v2-lite, deepseek-v3, "),
    (["--out", "{tmp}/out"],
     "--device cuda (the default): no CUDA device here; on CPU the built-in small checkpoint runs: --device cpu"),
    # was ignored: the built-in checkpoint ran and the run exited 0
    (["--device", "cpu", "--model-config", "deepseek-v3", "--out", "{tmp}/out"],
     "--model-config 'deepseek-v3' is for --device cuda; on CPU the built-in small checkpoint runs and the flag "
     "would be ignored"),
])
def test_bad_flags_are_named_with_exit_2(script, tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    monkeypatch.setattr(script, "ensure_default_checkpoint", lambda: pytest.fail("work started"))
    monkeypatch.setattr(script, "free_port", lambda: pytest.fail("work started"))
    monkeypatch.setattr(sys, "argv", ["serve.py", *[a.format(tmp=tmp_path) for a in args]])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    assert f"serve.py: error: {message.format(tmp=tmp_path, configs=script.CONFIGS)}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
