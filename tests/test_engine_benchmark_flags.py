"""benchmarks/engine.py's flags (the speculation rows' ``--spec``, ``--device cpu``, and the decode rows'): a bad one is
an argparse error (exit 2) naming the flag and its value before any engine is built, not a traceback from deep inside
the run."""

from __future__ import annotations

import json
import os
import sys

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture
def script(monkeypatch):
    return load_benchmark("engine", monkeypatch)


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "--device cpu needs --spec-model DIR (a small checkpoint; and --eagle3-config, an EAGLE-3 "
                          "head's config.json for it): the default target is the full-size Qwen3-30B-A3B"),
    # the decode rows' flags were ignored: the speculation rows ran on the small checkpoint instead
    (["--device", "cpu", "--models", "gpt-oss-20b", "--spec-model", "{tmp}/ckpt"],
     "--device cpu runs only the speculation rows (on --spec-model, with an EAGLE-3 head for it: --eagle3-config); "
     "--models is for the decode rows and would be ignored"),
    (["--spec", "--expert-format", "mxfp4"], "--spec runs only the speculation rows (on --spec-model, with an EAGLE-3 "
                                             "head for it: --eagle3-config); --expert-format is for the decode rows "
                                             "and would be ignored"),
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
    # the window's requests would run past the context: it was refused only after the plain rows
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--spec-steps", "100000"],
     "--spec-steps 100000 with --spec-k up to 3 may generate 400012 tokens a request in a window (its 3 warm-up "
     "steps included), more than fit the speculation rows' context of 2048 tokens past a prompt of up to 128"),
    # a head for another model: it failed after the plain and n-gram rows
    (["--device", "cpu", "--spec-model", "{tmp}/small"],
     "--eagle3-config '{eagle}' has hidden_size 2048, --spec-model '{tmp}/small' 64: the EAGLE-3 head must be one "
     "for that model"),
    # the rows ran first, then the results folder failed with FileExistsError
    (["--device", "cpu", "--spec-model", "{tmp}/ckpt", "--eagle3-config", "{tmp}/ckpt/config.json", "--out",
      "{tmp}/ckpt/config.json"], "--out '{tmp}/ckpt/config.json' is a file; it names the folder the results are "
                                 "written to"),
])
def test_bad_speculation_flags_are_named_with_exit_2(script, tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text('{"hidden_size": 64, "vocab_size": 259}')
    eagle = os.path.relpath(script.CONFIGS / "eagle3-draft-qwen3-30b-a3b-specforge.config.json")  # the default
    built = []
    monkeypatch.setattr(script, "spec_rows", lambda *a: built.append(a))  # nothing may be built
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["engine.py", *out, *[a.format(tmp=tmp_path, eagle=eagle) for a in args]])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    assert f"engine.py: error: {message.format(tmp=tmp_path, eagle=eagle)}\n" in capsys.readouterr().err
    assert built == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--profile", "8", "--profile-steps", "-3"], "--profile-steps must be at least 1, got -3"),
    (["--context", "32768", "--steps", "300"],
     "--steps 300 (with the profile and routing steps: 304 a row) is more than fit the context limit past a "
     "32768-token prompt (256; the rest is for requests that decode while others are prefilled)"),
    (["--batches", "abc"], "--batches must be comma-separated integers, got 'abc'"),
    (["--batches", "1,,8"], "--batches must be comma-separated integers, got '1,,8'"),
    (["--batches", "0"], "--batches values must be integers >= 1, got '0'"),
    (["--batches", ""], "--batches must name at least one batch size"),
    (["--batches", "8,8"], "--batches repeats a value, got '8,8'"),
    (["--peer-batches", "8,-1"], "--peer-batches '8,-1': the batches must be distinct integers >= 1, at least one, "
                                 "got '8,-1'"),
    (["--peer-batches", ""], "--peer-batches '': the batches must be distinct integers >= 1, at least one, got ''"),
    (["--batches", "1,8", "--peer-batches", "static=1;eager=1,256"],
     "--peer-batches [256] are not among --batches '1,8' (the table compares the peer with the engine's rows)"),
    (["--peer", "static", "--peer-batches", "static=1,8;eager=64"],
     "--peer-batches 'static=1,8;eager=64': 'eager=64' is not MODE=BATCHES with MODE one of the --peer modes "
     "['static']"),
    (["--peer-batches", "static=1,x"], "--peer-batches 'static=1,x': static's batches must be comma-separated "
                                       "integers, got '1,x'"),
    (["--profile", "1, x"], "--profile must be comma-separated integers, got '1, x'"),
    (["--batches", "1,8", "--profile", "128"], "--profile [128] are not among --batches '1,8'"),
    (["--sequential-batches", "3"], "--sequential-batches [3] are not among --batches '1,8,64,256'"),
    (["--ttft", "abc"], "--ttft must be comma-separated integers, got 'abc'"),
    # the prompt would have been refused by the engine only after every decode row was measured
    (["--ttft", "1024,8192"], "--ttft [8192] leave no room in the engine's context of 8192 tokens (max_model_len: "
                              "8192, or --context 128 plus 512); each TTFT prompt must be shorter"),
    (["--context", "9000", "--ttft", "9511,9512"],
     "--ttft [9512] leave no room in the engine's context of 9512 tokens (max_model_len: 8192, or --context 9000 plus "
     "512); each TTFT prompt must be shorter"),
    (["--peer", "eagr"], "--peer takes eager and/or static (each once), or none, got 'eagr'"),
    (["--peer", "static,static"], "--peer takes eager and/or static (each once), or none, got 'static,static'"),
    (["--peer", "eager,none"], "--peer takes eager and/or static (each once), or none, got 'eager,none'"),
    (["--kimi-layers", "0"], "--kimi-layers must be at least 1, got 0"),
    (["--expert-format", "int4,nvfp4"], "--expert-format takes bf16, int4, mxfp4 or fp8 (comma-separated), got "
                                        "['nvfp4'] in 'int4,nvfp4'"),
    (["--env-variants", "EPMOE_PDL=0;FOO"], "--env-variants: 'FOO' in 'FOO' is not NAME=VALUE"),
    (["--env-variants", "=1"], "--env-variants: '=1' in '=1' is not NAME=VALUE"),
    # valid flags, no GPU: refused before anything is measured (it failed importing Triton for the ceilings)
    ([], "--device cuda (the default): no CUDA device here; the decode, TTFT, peer and speculation rows on CUDA "
         "need one (on CPU the speculation rows run: --device cpu --spec-model DIR)"),
])
def test_bad_decode_flags_are_named_with_exit_2(script, tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    measured = []
    monkeypatch.setattr(script, "measure_ceilings", lambda: measured.append(1))  # nothing may be measured or built
    monkeypatch.setattr(sys, "argv", ["engine.py", "--out", str(tmp_path / "out"), *args])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    assert f"engine.py: error: {message}\n" in capsys.readouterr().err
    assert measured == [] and not (tmp_path / "out").exists()


def test_decode_flags_unused_are_not_checked_and_unknown_models_are_named(script, tmp_path, monkeypatch, capsys):
    """``--profile-steps`` without ``--profile`` and ``--peer-batches`` with ``--peer none`` are not used, so not
    refused; a model without a config is named with the known ones."""
    monkeypatch.setattr(script, "measure_ceilings", lambda: (_ for _ in ()).throw(RuntimeError("measured")))
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["engine.py", "--out", str(tmp_path / "out"), "--profile-steps", "0", "--peer",
                                      "none", "--peer-batches", "", "--steps", "1000"])
    with pytest.raises(RuntimeError, match="measured"):  # past the checks: a 148-token prompt leaves 7788 steps
        script.main()
    monkeypatch.setattr(sys, "argv", ["engine.py", "--out", str(tmp_path / "out"), "--models", "qwen3-30b-a3b,nope"])
    with pytest.raises(SystemExit):
        script.main()
    err = capsys.readouterr().err
    assert "error: --models ['nope'] have no model config under" in err and "qwen3-30b-a3b" in err.split("known:")[1]
    assert "eagle3-draft" not in err  # the drafts' configs are not models the script builds
    # a draft's config is not taken as a model either
    monkeypatch.setattr(sys, "argv", ["engine.py", "--models", "eagle3-draft-qwen3-30b-a3b-specforge"])
    with pytest.raises(SystemExit):
        script.main()
    assert "have no model config under" in capsys.readouterr().err


def test_expert_format_keeps_only_the_formats_it_names(script, tmp_path):
    """A model's ``quantization_config`` stays where ``--expert-format`` names the format it is published in; a model
    cut to fewer layers keeps as many ``layer_types`` (transformers refuses gpt-oss's config otherwise)."""
    import json

    assert {m: script.published_format(m) for m in ("kimi-k2.5", "gpt-oss-20b", "deepseek-v3", "qwen3-30b-a3b")} == {
        "kimi-k2.5": "int4", "gpt-oss-20b": "mxfp4", "deepseek-v3": "fp8", "qwen3-30b-a3b": "bf16"}
    kept = {}
    for fmt in ("bf16", "int4", "int4,mxfp4"):
        for model in ("kimi-k2.5", "gpt-oss-20b", "deepseek-v3"):
            cfg = json.loads((script.checkpoint(model, 2, tmp_path / fmt, fmt) / "config.json").read_text())
            text = cfg.get("text_config", cfg)
            assert text["num_hidden_layers"] == 2 and len(text.get("layer_types", "ab")) == 2  # gpt-oss's cut too
            kept[fmt, model] = "quantization_config" in cfg or "quantization_config" in text
    assert [k for k, v in kept.items() if v] == [("int4", "kimi-k2.5"), ("int4,mxfp4", "kimi-k2.5"),
                                                 ("int4,mxfp4", "gpt-oss-20b")]


def test_peer_batches_per_mode(script):
    modes = ["eager", "static"]
    assert script.peer_batch_lists("1,8", modes) == {"eager": [1, 8], "static": [1, 8]}
    assert script.peer_batch_lists("static=1,8; eager=64,256", modes) == {"static": [1, 8], "eager": [64, 256]}
    assert script.peer_batch_lists("eager=64", modes) == {"eager": [64]}  # static is not timed
    assert script.peer_batch_lists("", []) == {}
    with pytest.raises(ValueError, match="static is given batches twice"):
        script.peer_batch_lists("static=1;static=8", modes)
    with pytest.raises(ValueError, match="'1,8' is not MODE=BATCHES"):
        script.peer_batch_lists("static=4;1,8", modes)


def test_result_files_are_named_by_the_whole_gpu_name(monkeypatch):
    timing = load_benchmark("timing", monkeypatch)
    assert timing.gpu_file_name("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert timing.gpu_file_name("NVIDIA H100 PCIe") == "h100-pcie"  # another memory bandwidth: another file
    assert timing.gpu_file_name("NVIDIA H200") == "h200"
    assert timing.gpu_file_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb") == "h100-80gb-hbm3-mig-1g.10gb"
    assert timing.gpu_file_name("Tesla V100-SXM2-16GB") == "v100-sxm2-16gb"
    assert timing.gpu_file_name("AMD Instinct MI250X / MI250") == "instinct-mi250x-mi250"
    assert timing.gpu_file_name("NVIDIA") == "nvidia" and timing.gpu_file_name("") == "gpu"


def test_replan_ttft_refits_the_shipped_prefill_term(script, tmp_path, monkeypatch, capsys):
    """``--replan-ttft``, no GPU: the shipped rows file re-priced with this commit's planner fits each profile's
    ``engine_prefill_layer_us`` to the value the profile ships (within 1 us), the fitted rows within 30% of the
    plan; a rows file naming a model its results file lacks is an argparse error naming it."""
    from epmoe.plan.hardware import load_hardware

    rows = os.path.join(os.path.dirname(script.__file__), "results", "ttft_fit_rows.json")
    monkeypatch.setattr(sys, "argv", ["engine.py", "--replan-ttft", rows, "--out", str(tmp_path)])
    script.main()
    result = json.loads((tmp_path / "ttft_replan.json").read_text())
    for profile, fit in result["fits"].items():
        assert abs(fit["engine_prefill_layer_us"] - load_hardware(profile).engine_prefill_layer_us) < 1.0, profile
        assert all(1 / 1.3 <= r <= 1.3 for r in fit["ratios_after"]), (profile, fit["ratios_after"])
    assert {r["model"] for r in result["rows"]} == {"qwen3-30b-a3b", "deepseek-v3", "kimi-k2.5", "gpt-oss-20b"}
    assert "engine_prefill_layer_us" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"results": "engine_qwen3_final_h200.json", "model": "gpt-oss-20b", "layers": None,
                                "expert_format": "bf16", "profile": "h200-sxm"}]))
    monkeypatch.setattr(sys, "argv", ["engine.py", "--replan-ttft", str(bad), "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    assert "engine_qwen3_final_h200.json has no TTFT rows of 'gpt-oss-20b'" in capsys.readouterr().err


def test_prefill_floor_counts_expert_parameters_and_window_pairs(script, tmp_path):
    """A prompt's floors, hand-worked for gpt-oss-20b (24 layers, 12 of them a 128-token window; 32 experts, top 4;
    64 heads of 64): the experts' FLOPs from their parameters (``3 D F``), not their packed MXFP4 bytes."""
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(str(script.checkpoint("gpt-oss-20b", None, tmp_path, "mxfp4")))
    wb = {"dense": 2e9, "expert": 13e6, "expert_params": 3 * 2880 * 2880}
    flop_ms, read_ms = script.prefill_floor(spec, wb, 4096, {"bf16_flop_per_s": 1e15, "copy_bytes_per_s": 3e12})
    # parameters a token: 1e9 dense + 24 x 4 x 24,883,200 = 3,388,787,200; x 2 x 4096 = 27,760,944,742,400 FLOPs;
    # pairs: 12 x 4096 x 4097 / 2 + 12 x (128 x 129 / 2 + 3968 x 128) = 100,687,872 + 6,193,920 = 106,881,792, at
    # 2 x 64 x (64 + 64) = 16384 FLOPs each: 1,751,151,280,128; over 1e15 FLOP/s: 29.512096022528 ms
    assert flop_ms == pytest.approx(29.512096022528, rel=1e-12)
    # 4096 tokens touch all 32 experts of each of the 24 layers: 2e9 + 24 x 32 x 13e6 = 11.984e9 B over 3e12 B/s
    assert read_ms == pytest.approx(11.984e9 / 3e12 * 1e3, rel=1e-9)
    # one token: its 4 experts a layer; no pairs but its own (1 x 2 / 2 = 1 a layer)
    flop_1, read_1 = script.prefill_floor(spec, wb, 1, {"bf16_flop_per_s": 1e15, "copy_bytes_per_s": 3e12})
    assert flop_1 == pytest.approx((2 * 3388787200 + 24 * 16384) / 1e12, rel=1e-12)
    assert read_1 == pytest.approx((2e9 + 24 * 4 * 13e6) / 3e12 * 1e3, rel=1e-12)
