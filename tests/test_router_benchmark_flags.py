"""``benchmarks/router.py``'s flags, checked before any GPU work."""

import sys

import pytest

from .benchmark_scripts import load_benchmark


def test_router_benchmark_refuses_an_unknown_model_by_name(monkeypatch, capsys):
    mod = load_benchmark("router", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["router.py", "--models", "qwen3-30b-a3b,nope"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2
    assert "--models: 'nope' is not a config of data/configs" in capsys.readouterr().err


def test_router_benchmark_takes_gpt_oss_by_default(monkeypatch, capsys):
    mod = load_benchmark("router", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["router.py"])
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    assert mod.main() == 2  # the flags passed; no CUDA device here
    assert "needs a CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["router.py", "--help"])
    with pytest.raises(SystemExit):
        mod.main()
    assert "deepseek-v3,qwen3-30b-a3b,gpt-oss-20b" in capsys.readouterr().out
