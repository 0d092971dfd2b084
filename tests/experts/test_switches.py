"""The environment's off switches: read in one place, named when one is off."""

from __future__ import annotations

import pytest

from epmoe.experts.switches import SWITCHES, enabled, switched_off


def test_every_switch_is_on_unless_its_variable_is_0(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert all(enabled(name) for name in SWITCHES) and switched_off() == []
    monkeypatch.setenv("EPMOE_GEMV", "0")
    monkeypatch.setenv("EPMOE_SHARED_OVERLAP", "1")  # anything but 0 keeps the path
    monkeypatch.setenv("EPMOE_FOLD_NORM", "0")
    assert [n for n in SWITCHES if not enabled(n)] == ["EPMOE_GEMV", "EPMOE_FOLD_NORM"]
    assert switched_off() == ["EPMOE_GEMV=0 turns off the Triton matrix-vector kernel of the projections at a few rows",
                              "EPMOE_FOLD_NORM=0 turns off the norms folded into the kernels after them at one row"]


def test_a_switch_value_other_than_0_or_1_is_refused_before_anything_runs(monkeypatch, capsys):
    """EPMOE_PDL=false read as on, with no word."""
    from epmoe.cli import main
    from epmoe.experts.switches import check_switches

    monkeypatch.setenv("EPMOE_PDL", "false")
    with pytest.raises(ValueError, match=r"environment variable EPMOE_PDL='false': epmoe's switches take 0 \(turns off "
                                         r"the Triton kernels' programmatic dependent launches \(Hopper\)\) or 1"):
        check_switches()
    for command in ("run", "serve"):
        assert main([command, "--port", "0"] if command == "serve" else [command]) == 2
        assert "error: environment variable EPMOE_PDL='false'" in capsys.readouterr().err


def test_an_unknown_switch_is_a_key_error_listing_the_known():
    with pytest.raises(KeyError, match=r"'EPMOE_GEMM' is not one of epmoe's switches \['EPMOE_FOLD_NORM', "):
        enabled("EPMOE_GEMM")


def test_the_server_start_log_names_a_switch_that_is_off(monkeypatch, caplog):
    import logging

    from epmoe.models.tiny import ensure_default_checkpoint
    from epmoe.server.config import ServeConfig
    from epmoe.server.core import EngineInfo
    from epmoe.server.serve import _startup_log

    model_dir = str(ensure_default_checkpoint())
    kv = {"blocks": 15, "block_size": 16, "tokens": 240, "bytes": 1 << 20, "max_concurrency": 1, "context": 240,
          "graph_buckets": [], "piecewise_buckets": [], "prefix_caching": True}
    info = EngineInfo(max_model_len=240, vocab_size=259, ranks=1, parallel="ep", kv=kv)
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="epmoe.serve"):
        _startup_log(ServeConfig(), model_dir, "m", info, "http://127.0.0.1:1")
    assert "switched off" not in caplog.text
    monkeypatch.setenv("EPMOE_PDL", "0")
    with caplog.at_level(logging.INFO, logger="epmoe.serve"):
        _startup_log(ServeConfig(), model_dir, "m", info, "http://127.0.0.1:1")
    assert ("fast paths switched off by the environment: EPMOE_PDL=0 turns off the Triton kernels' programmatic "
            "dependent launches (Hopper)") in caplog.text
