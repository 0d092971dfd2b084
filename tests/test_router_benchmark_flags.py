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
    assert "--models: 'nope' is not a MoE model config of data/configs (known: deepseek-r1," in capsys.readouterr().err
    # an EAGLE-3 draft's config is in data/configs too, but no MoE layer to route
    monkeypatch.setattr(sys, "argv", ["router.py", "--models", "eagle3-draft-qwen3-30b-a3b-specforge"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2
    assert "'eagle3-draft-qwen3-30b-a3b-specforge' is not a MoE model config" in capsys.readouterr().err


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
