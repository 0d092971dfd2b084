"""benchmarks/eplb.py's --exact-time: a negative or NaN budget is an argparse error (exit 2) naming the flag, before
any work (it silently skipped the exact solve)."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("eplb", monkeypatch)


@pytest.mark.parametrize("value, shown", [("-1", "-1.0"), ("nan", "nan")])
def test_a_bad_exact_time_is_named_with_exit_2(script, tmp_path, capsys, monkeypatch, value, shown):
    monkeypatch.setattr(script, "read_csv_loads", lambda *a: pytest.fail("work started"))
    with pytest.raises(SystemExit) as exc:
        script.main(["--exact-time", value, "--out", str(tmp_path / "eplb.json")])
    assert exc.value.code == 2
    assert (f"error: --exact-time must be a number of seconds >= 0 (0: no exact solve), got {shown}\n"
            in capsys.readouterr().err)
    assert not (tmp_path / "eplb.json").exists()
