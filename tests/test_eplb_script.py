"""benchmarks/eplb.py's --exact-time: a negative or NaN budget is an argparse error (exit 2) naming the flag, before
any work (it silently skipped the exact solve)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "eplb.py"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("eplb_benchmark", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("value, shown", [("-1", "-1.0"), ("nan", "nan")])
def test_a_bad_exact_time_is_named_with_exit_2(script, tmp_path, capsys, monkeypatch, value, shown):
    monkeypatch.setattr(script, "read_csv_loads", lambda *a: pytest.fail("work started"))
    with pytest.raises(SystemExit) as exc:
        script.main(["--exact-time", value, "--out", str(tmp_path / "eplb.json")])
    assert exc.value.code == 2
    assert (f"error: --exact-time must be a number of seconds >= 0 (0: no exact solve), got {shown}\n"
            in capsys.readouterr().err)
    assert not (tmp_path / "eplb.json").exists()
