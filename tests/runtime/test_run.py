"""``epmoe run`` end to end (spawned ranks and torchrun), and its bad-input messages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from epmoe.cli import main
from epmoe.comm import Comm
from epmoe.layer import MoELayerOptions
from epmoe.models.hf import load_ep_model
from epmoe.placement import ExpertPlacement
from epmoe.runtime.launch import free_port


@pytest.fixture(scope="module")
def kimi(tiny_checkpoints):
    return tiny_checkpoints("kimi-k2.5")


def test_json_to_stdout_is_the_json_alone(kimi):
    """``--json`` without a file: stdout began with the rank's progress bar's empty line."""
    proc = subprocess.run([sys.executable, "-m", "epmoe.cli", "run", "--model", str(kimi), "--ep", "1",
                           "--max-new-tokens", "2", "--no-reference", "--json"], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, EPMOE_PDL="0"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("{") and json.loads(proc.stdout)["ep"] == 1, proc.stdout[:200]
    # an environment switch is named in the report (no effect on the CPU, but a GPU run would differ)
    assert json.loads(proc.stdout)["switched_off"] == [
        "EPMOE_PDL=0 turns off the Triton kernels' programmatic dependent launches (Hopper)"]


def test_nan_weights_fail_the_reference_check(tiny_checkpoints, tmp_path, capsys):
    """A NaN in a router weight made every token 0 here and in the reference, and the check said "YES, token for
    token"."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny_checkpoints("qwen3-moe"), bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.gate.weight"][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "report.json"
    assert main(["run", "--model", str(bad), "--max-new-tokens", "3", "--prompt", "hello", "--prompt", "abc",
                 "--json", str(out)]) == 1  # 1: the tokens do not match the reference
    report = json.loads(out.read_text())
    assert report["matches_reference"] is False and report["mismatches"] == [0, 1]
    assert report["reference_not_finite"] == [0, 0] and report["first_mismatch"] is None
    text = capsys.readouterr().out
    assert "NO: the reference's logits hold NaN or infinite values" in text and "YES" not in text


def test_run_two_ranks_matches_reference(kimi, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["run", "--model", str(kimi), "--ep", "2", "--max-new-tokens", "4", "--redundant", "2",
                 "--prompt", "hello", "--prompt", "expert parallel", "--prompt", "abc", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["matches_reference"] is True and report["mismatches"] == []
    assert [len(r["prompts"]) for r in report["ranks"]] == [2, 1]
    # per step: 2 MoE layers x (counts + rows + results) all-to-alls, one all-gather agreeing on the batch
    # (plus the final round that agrees there is no more work)
    for r in report["ranks"]:
        steps = r["steps"]
        assert r["collectives"] == {"all_to_all": 6.0, "all_reduce": 0.0, "all_gather": (steps + 1) / steps}
        assert r["expert_mb"] == pytest.approx(r["full_expert_mb"] * 9 / 16)  # (16 + 2) / 2 of 16 experts
    assert 0 < report["balancedness"] <= 1
    assert "YES, token for token" in capsys.readouterr().out


def test_a_reference_that_does_not_fit_is_skipped_with_its_reason(kimi, tmp_path, capsys, monkeypatch):
    """The reference check loads the whole model on one device: on a model served only sharded it died of an
    out-of-memory error after the run, its report lost."""
    import epmoe.runtime.run as run_module
    from epmoe.plan.costs import model_params
    from epmoe.plan.request import format_bytes
    from epmoe.spec import load_moe_spec

    monkeypatch.setattr(run_module, "free_bytes", lambda device: 1000)
    need = format_bytes(model_params(load_moe_spec(kimi)) * 4)
    out = tmp_path / "report.json"
    assert main(["run", "--model", str(kimi), "--max-new-tokens", "2", "--prompt", "hello", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    reason = f"the unsharded transformers model needs about {need} in float32, and the host has 1000 B free"
    assert report["matches_reference"] is None and report["reference_skipped"] == reason
    assert report["reference_outputs"] == [] and len(report["outputs"]) == 1
    text = " ".join(re.sub("[│┃]", " ", capsys.readouterr().out).split())
    assert f"not checked: {reason} (--no-reference does not ask for it)" in text


def test_a_float32_judgement_that_does_not_fit_leaves_the_prompts_unweighed(kimi, tmp_path, capsys, monkeypatch):
    """In bfloat16 Kimi-K2.5's small checkpoint differs from transformers' bfloat16 run (a near-tie); where the
    float32 model, which would judge it, does not fit, the prompts stay differing and the verdict says why."""
    import epmoe.runtime.run as run_module
    from epmoe.plan.costs import model_params
    from epmoe.plan.request import format_bytes
    from epmoe.spec import load_moe_spec

    params = model_params(load_moe_spec(kimi))
    monkeypatch.setattr(run_module, "free_bytes", lambda device: 3 * params)  # bf16 fits, float32 does not
    out = tmp_path / "report.json"
    code = main(["run", "--model", str(kimi), "--dtype", "bfloat16", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["reference_skipped"] is None and report["float32_judged"] == [] and report["divergences"] == []
    assert report["float32_skipped"].startswith("the unsharded transformers model needs about ")
    assert report["float32_skipped"].endswith(f" in float32, and the host has {format_bytes(3 * params)} free")
    assert code == 1 and report["matches_reference"] is False and report["mismatches"]
    text = " ".join(re.sub("[│┃]", " ", capsys.readouterr().out).split())
    assert "not weighed against float32: the unsharded transformers model needs about" in text


def test_run_with_placement_file_and_idle_rank(kimi, tmp_path):
    placement = tmp_path / "pl.safetensors"
    ExpertPlacement.trivial(2, 16, 4, layout="round_robin").save(placement)
    out = tmp_path / "r.json"
    # 2 prompts over 4 ranks: ranks 2 and 3 have nothing to do and join with empty batches
    code = main(["run", "--model", str(kimi), "--ep", "4", "--placement", str(placement), "--max-new-tokens", "3",
                 "--no-enable-prefix-caching", "--prompt", "one", "--prompt", "two", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["matches_reference"] is True and report["prefix_cache"] is None
    idle = [r for r in report["ranks"] if not r["prompts"]]
    assert len(idle) == 2 and all(r["step_kinds"]["idle_steps"] == r["steps"] > 0 for r in idle)
    assert all(r["step_kinds"]["eager_steps"] == 0 for r in idle)


def test_run_under_torchrun_environment(kimi, tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "epmoe.cli", "run", "--model", str(kimi), "--max-new-tokens", "3",
             "--json", str(tmp_path / f"r{rank}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    report = json.loads((tmp_path / "r0.json").read_text())
    assert report["ep"] == 2 and report["matches_reference"] is True
    assert not (tmp_path / "r1.json").exists()  # only rank 0 reports


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ep", "32"], r"EP size \(32\) is larger than the number of slots \(16\)"),
        (["--ep", "2", "--redundant", "1"],
         r"num_slots \(17 = 16 experts \+ 1 redundant\) must be divisible by the EP group size \(2\)"),
        (["--ep", "0"], r"--ep must be an integer >= 1, got 0"),
        (["--max-new-tokens", "0"], r"--max-new-tokens must be at least 1, got 0"),
        (["--ep", "2", "--dispatcher", "local"], r"--dispatcher local serves EP size 1 only; EP size is 2"),
        (["--max-new-tokens", "300"], r"plus --max-new-tokens \(300\) is \d+ positions, past the model's "
                                      r"max_position_embeddings \(256\)"),
        (["--max-moves", "3"], r"--max-moves limits live rebalancing: give --eplb-interval with it"),
        (["--request-rate", "0"], r"--request-rate must be a positive number"),
        (["--num-kv-blocks", "1000000000"], r"--num-kv-blocks 1000000000 of --block-size 16 is 4291\.5 GiB of KV "
                                            r"cache a rank, and the 2 CPU rank\(s\) share the host's [\d.]+ GiB free"),
        (["--request-rate", "1e-300"], r"--request-rate 1e-300 spreads 2 prompts on a rank over 1e\+300 s, past the "
                                       r"86400 s \(one day\)"),
        (["--max-num-seqs", "0"], r"^epmoe run: error: --max-num-seqs must be a positive integer, got 0"),
        (["--num-kv-blocks", "3", "--block-size", "2", "--prompt", "x" * 40],
         r"the longest prompt with --max-new-tokens 8 needs 47 KV slots; --num-kv-blocks 3 of --block-size 2 hold 4"),
        (["--temperature", "-1"], r"temperature must be a finite number >= 0, got -1.0"),
        (["--max-num-seqs", "4", "--max-num-batched-tokens", "2"],
         r"--max-num-batched-tokens \(2\) must be at least --max-num-seqs \(4\)"),
    ],
)
def test_bad_options(kimi, capsys, args, message):
    assert main(["run", "--model", str(kimi), *args]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("args, message", [
    (["--ep", "2"], r"^epmoe run: error: --ep 2 on --device cuda starts one rank a GPU, and this machine has 1 "
                    r"visible GPU"),  # was rank 1's "CUDA error: invalid device ordinal" (an H100)
    (["--ep", "1", "--dtype", "float32", "--expert-backend", "triton"],
     r"^epmoe run: error: --expert-backend 'triton' computes on CUDA in bfloat16 or float16, got --dtype 'float32': "
     r"use --expert-backend 'reference'"),
])
def test_what_a_one_gpu_machine_cannot_run_is_named_before_any_rank_starts(kimi, capsys, monkeypatch, args, message):
    """Both failed inside a rank on an H100; ``--dtype float32`` without a backend was a rank's TypeError too (the
    default ``triton`` computes in bf16/fp16; the default is ``reference`` there now). No rank starts here: the
    machine has no GPU, and the checks run before any would."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["run", "--model", str(kimi), "--device", "cuda", *args]) == 2
    assert re.search(message, capsys.readouterr().err, re.M)


def test_float32_on_cuda_takes_the_reference_backend(kimi, monkeypatch):
    from epmoe.engine.config import command_engine_config, default_expert_backend
    from epmoe.runtime.run import RunConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_expert_backend("cuda", "float32") == "reference"
    assert default_expert_backend("cuda", "bfloat16") == default_expert_backend("cuda", "float16") == "triton"
    assert default_expert_backend("cpu", "bfloat16") == "reference"
    cfg = command_engine_config(RunConfig(model=str(kimi), device="cuda", dtype="float32"), str(kimi))
    assert cfg.expert_backend == "reference" and cfg.enforce_eager


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoints_half_dtype_on_cuda(kimi):
    """``--dtype`` was float32 unless given, so ``--device cuda`` ran float32: eager steps and (before) a rank's
    TypeError from the Triton kernels. ``auto`` is the default now, as vLLM's."""
    from dataclasses import replace

    from epmoe.engine.config import command_dtype
    from epmoe.runtime.run import RunConfig
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(str(kimi))
    assert RunConfig().dtype == "auto"
    assert command_dtype("auto", "cpu", replace(spec, checkpoint_dtype="bfloat16")) == "float32"
    for named, taken in (("bfloat16", "bfloat16"), ("float16", "float16"), ("half", "float16"),
                         ("float32", "bfloat16"), (None, "bfloat16")):
        assert command_dtype("auto", "cuda", replace(spec, checkpoint_dtype=named)) == taken, named
    assert command_dtype("float16", "cuda", replace(spec, checkpoint_dtype="bfloat16")) == "float16"
    assert command_dtype("bfloat16", "cpu", spec) == "bfloat16"
    with pytest.raises(ValueError, match=r"--dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\], "
                                         r"got 'float64'"):
        RunConfig(dtype="float64").validate()


def test_placement_file_with_default_placement_options(kimi, tmp_path, capsys):
    path = tmp_path / "pl.json"
    ExpertPlacement.trivial(2, 16, 2).save(path)
    assert main(["run", "--model", str(kimi), "--placement", str(path), "--redundant", "2"]) == 2
    assert (f"--redundant (2) shapes the default placement; --placement ('{path}') is a file that fixes its own slots: "
            f"leave it unset") in capsys.readouterr().err


def test_placement_missing_a_layer(kimi, tmp_path, capsys):
    bad = tmp_path / "one_layer.json"
    ExpertPlacement.trivial(1, 16, 2).save(bad)  # the model has 2 MoE layers
    assert main(["run", "--model", str(kimi), "--placement", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--placement {bad} with --ep 2: " in err and "placement covers 1 MoE layer but model" in err


def test_placement_with_expert_without_slot(kimi, tmp_path, capsys):
    bad = tmp_path / "hole.json"
    rows = [list(range(16)), list(range(15)) + [0]]
    bad.write_text(json.dumps({"ep_size": 2, "num_experts": 16, "phy2log": rows}))
    assert main(["run", "--model", str(kimi), "--placement", str(bad)]) == 2
    assert "layer 1: logical expert 15 has no physical slot" in capsys.readouterr().err


def test_placement_id_past_the_models_experts_is_named_out_of_range(kimi, tmp_path, capsys):
    """A file without num_experts was read as having max id + 1 experts ("100 experts were assumed; is 99 out of
    range?") although the model says 16."""
    bad = tmp_path / "oor.json"
    rows = [list(range(16)), list(range(15)) + [99]]
    bad.write_text(json.dumps({"ep_size": 2, "phy2log": rows}))
    assert main(["run", "--model", str(kimi), "--placement", str(bad)]) == 2
    assert (f"--placement {bad} with --ep 2: placement file '{bad}': phy2log[1, 15] = 99 is not a logical expert id "
            f"in [0, 16)") in capsys.readouterr().err


def test_placement_num_experts_past_the_models_is_named(kimi, tmp_path, capsys):
    """A file's num_experts of 32 on a model of 16 was reported as "logical expert 16 has no physical slot"."""
    bad = tmp_path / "ne32.json"
    bad.write_text(json.dumps({"ep_size": 2, "num_experts": 32, "phy2log": [list(range(16))] * 2}))
    assert main(["run", "--model", str(kimi), "--placement", str(bad)]) == 2
    assert (f"placement file '{bad}': field 'num_experts' is 32 but the model has 16 experts a layer (layer 0: "
            "logical expert 16 has no physical slot") in capsys.readouterr().err


def test_request_rate_span_under_torchrun_counts_its_world(kimi, monkeypatch, capsys):
    """Under torchrun the world size shares the prompts, not --ep (default 2): one rank's 4 prompts at 1.2e-5 a
    second span 2.5e5 s, which was let through."""
    from epmoe.runtime.launch import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(["run", "--model", str(kimi), "--request-rate", "1.2e-5", "--no-reference"]) == 2
    assert "--request-rate 1.2e-05 spreads 4 prompts on a rank over 250000 s" in capsys.readouterr().err


def test_missing_model_dir(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path / "nope")]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err
    assert main(["run", "--model", ""]) == 2  # an empty path is not the built-in default
    assert "--model '' is not a checkpoint directory" in capsys.readouterr().err
    assert main(["run", "--model", str(tmp_path)]) == 2  # a directory without config.json: named by its flag
    err = capsys.readouterr().err
    assert (f"--model '{tmp_path}' is not a checkpoint directory (a config.json, and its *.safetensors weights "
            "unless --load-format dummy)") in err


def test_dummy_weights_run_from_a_config_json_alone(kimi, tmp_path):
    """``--load-format dummy`` needs only ``config.json``, as the README says (``run`` asked the weights files whether
    transformers could read them, for a reference it would not run, and refused: "has no *.safetensors weights");
    the summary names the one reason the reference is not checked."""
    import json
    import shutil

    from epmoe.runtime.run import RunConfig, run_job

    shutil.copy(kimi / "config.json", tmp_path / "config.json")
    # without it, the weights are asked for, and the flag that does without them named
    with pytest.raises(ValueError, match=rf"^--model: checkpoint directory '{tmp_path}' has no \*\.safetensors "
                                         rf"weights \(--load-format dummy runs a config\.json alone\)$"):
        run_job(RunConfig(model=str(tmp_path)))
    out = tmp_path / "run.json"
    assert main(["run", "--model", str(tmp_path), "--load-format", "dummy", "--ep", "1", "--max-new-tokens", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["load_format"] == "dummy" and report["matches_reference"] is None
    assert report["reference_not_asked"] == "--load-format dummy: random weights"
    assert all(len(r["tokens"]) for r in report["ranks"])


def test_damaged_weights_file_refused_before_the_start(kimi, tmp_path, capsys):
    # a weights file cut short (an interrupted download): named, exit 2, no rank started, no traceback
    broken = tmp_path / "cut"
    broken.mkdir()
    for f in kimi.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    assert main(["run", "--model", str(broken), "--ep", "1"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {broken / 'model.safetensors'} cannot be read as safetensors" in err
    assert "damaged or incomplete" in err and "Traceback" not in err


def test_a_directory_named_as_weights_is_refused_in_the_words_it_is(kimi, tmp_path, capsys):
    # was "cannot be read as safetensors (No such --device (os error 19))": the OS's "device" taken for the flag
    odd = tmp_path / "odd"
    shutil.copytree(kimi, odd)
    (odd / "extra.safetensors").mkdir()
    assert main(["run", "--model", str(odd), "--ep", "1"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {odd / 'extra.safetensors'} is not a file" in err and "--device" not in err


def test_a_config_that_disagrees_with_the_weights_is_named_before_the_placement(kimi, tmp_path, capsys):
    # was "num_slots (15 = ...) must be divisible ...; 1 redundant slots would give 16": advice for the wrong cause
    odd = tmp_path / "odd"
    shutil.copytree(kimi, odd)
    cfg = json.loads((odd / "config.json").read_text())
    experts = cfg["n_routed_experts"]
    cfg["n_routed_experts"] = experts - 1
    (odd / "config.json").write_text(json.dumps(cfg))
    assert main(["run", "--model", str(odd), "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"tensor 'model\.layers\.\d+\.mlp\.gate\.weight' has shape \({experts}, \d+\), expected "
                     rf"\({experts - 1}, \d+\) from config\.json", err), err
    assert "redundant" not in err


def test_the_flag_names_leave_quoted_words_alone():
    from epmoe.cli import _flag_error

    exc = _flag_error(ValueError('file x cannot be read ("No such device (os error 19)"); device (cuda) must be'),
                      {"device": "--device"})
    assert str(exc) == 'file x cannot be read ("No such device (os error 19)"); --device (cuda) must be'
    # and the paths the user typed ("/data/my device (copy)" was "/data/my --device (copy)")
    exc = _flag_error(ValueError("checkpoint /data/my device (copy)/x is not a file; device (cuda) must be"),
                      {"device": "--device"}, ("/data/my device (copy)",))
    assert str(exc) == "checkpoint /data/my device (copy)/x is not a file; --device (cuda) must be"


def test_checkpoint_missing_one_expert(kimi, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in kimi.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in kimi.glob("*.safetensors"):
        tensors.update(load_file(f))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    placement = ExpertPlacement.trivial(2, 16, 1)
    with pytest.raises(KeyError, match=r"logical expert 5 of model\.layers\.2\.mlp.*experts\.5\.up_proj\.weight"):
        load_ep_model(str(broken), placement, Comm(None), options=MoELayerOptions(dispatcher="local"))


def test_moe_layer_without_placement_fails_at_construction(kimi):
    from epmoe.layer import MoELayer
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(kimi)
    with pytest.raises(TypeError, match="MoE layer 0 needs an ExpertPlacement, got NoneType"):
        MoELayer(spec, 0, None, Comm(None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement is for EP size 2 but the EP group has 1 ranks"):
        MoELayer(spec, 0, ExpertPlacement.trivial(2, 16, 2), Comm(None))
    with pytest.raises(KeyError, match=r"unknown dispatcher 'nccl_magic'; supported: \["):
        MoELayer(spec, 0, ExpertPlacement.trivial(2, 16, 1), Comm(None), MoELayerOptions(dispatcher="nccl_magic"))
    with pytest.raises(KeyError, match=r"unknown expert backend 'fast'"):
        MoELayer(spec, 0, ExpertPlacement.trivial(2, 16, 1), Comm(None),
                 MoELayerOptions(dispatcher="local", expert_backend="fast"))
    layer = MoELayer(spec, 1, ExpertPlacement.trivial(2, 16, 1), Comm(None), MoELayerOptions(dispatcher="local"))
    assert torch.equal(layer.local_experts,
                       torch.arange(16))


def test_run_staggered_arrivals_small_batches_and_kv_pool(kimi, tmp_path):
    out = tmp_path / "cb.json"
    prompts = ["hello there", "expert parallel", "abc", "mixture of experts", "x", "quick fox"]
    # arrivals 1 ms apart: staggered, yet each arrives before the one ahead of it can finish (a step takes longer),
    # so two sequences share the 7-block pool and one is preempted on any machine (at 50 a second a fast machine
    # finished each request before the next arrived)
    code = main(["run", "--model", str(kimi), "--ep", "2", "--max-new-tokens", "6", "--max-num-seqs", "2",
                 "--max-num-batched-tokens", "8", "--request-rate", "1000", "--num-kv-blocks", "7", "--block-size", "4",
                 "--json", str(out),
                 *[a for p in prompts for a in ("--prompt", p)]])
    report = json.loads(out.read_text())
    assert code == 0 and report["matches_reference"] is True
    assert sum(r["step_kinds"]["preemptions"] for r in report["ranks"]) > 0
    assert all(len(t) == 6 for t in report["reference_outputs"])


def test_run_prefix_caching_on_two_ranks(kimi, tmp_path):
    # one prompt at a time per rank: each rank's later prompts start after the blocks its earlier ones computed
    out = tmp_path / "pc.json"
    prompts = ["mixture of experts", "mixture of experts!", "mixture of experts?", "mixture of experts."]
    code = main(["run", "--model", str(kimi), "--ep", "2", "--max-new-tokens", "4", "--max-num-seqs", "1",
                 "--block-size", "4", "--enable-prefix-caching", "--json", str(out),
                 *[a for p in prompts for a in ("--prompt", p)]])
    report = json.loads(out.read_text())
    assert code == 0 and report["matches_reference"] is True
    assert [r["step_kinds"]["prefix_cache_hits"] for r in report["ranks"]] == [16, 16]  # 4 blocks of 4, once each
    queried = sum(r["step_kinds"]["prefix_cache_queries"] for r in report["ranks"])
    assert report["prefix_cache"] == {"queried_tokens": queried, "hit_tokens": 32} and queried >= 32


def test_run_seeded_sampling_repeats(kimi, tmp_path, capsys):
    """A seeded rerun repeats; the rerun asks for the triton backend on the CPU, which runs the reference (the same
    tokens), and the report says so once."""
    runs = []
    for name, backend in (("a", []), ("b", ["--expert-backend", "triton"])):
        out = tmp_path / f"{name}.json"
        assert main(["run", "--model", str(kimi), "--ep", "1", "--max-new-tokens", "6", "--temperature", "0.9",
                     "--top-p", "0.9", "--seed", "3", "--json", str(out), *backend]) == 0
        runs.append(json.loads(out.read_text()))
    assert runs[0]["outputs"] == runs[1]["outputs"]
    assert runs[0]["matches_reference"] is None  # sampling: no greedy reference
    # each prompt draws with its own seed (seed + its index, wrapped), not all with the same numbers
    from epmoe.runtime.run import RunConfig

    assert [RunConfig(seed=3).sampling(i).seed for i in range(3)] == [3, 4, 5]
    assert RunConfig(seed=2**63 - 1).sampling(1).seed == 0 and RunConfig().sampling(2).seed is None
    said = "triton: the reference on cpu (the Triton kernels take CUDA tensors only)"
    assert [r["expert_backend"] for r in runs] == ["reference", said]
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # table cells wrap: compare words only
    assert text.count("expert backend reference ") == 1 and text.count(f"expert backend {said} ") == 1


def test_corrupt_or_misplaced_cache(tmp_path, capsys):
    from epmoe.models.tiny import ensure_default_checkpoint

    built = ensure_default_checkpoint(tmp_path / "cache")
    assert ensure_default_checkpoint(tmp_path / "cache") == built  # cached: built once
    weights = next(built.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="is unreadable .* delete that directory and run again"):
        ensure_default_checkpoint(tmp_path / "cache")
    rebuilt = ensure_default_checkpoint(tmp_path / "cache2")
    (rebuilt / "config.json").write_text("{}")  # was "missing field 'model_type'" with no word of the cache
    with pytest.raises(ValueError, match=r"is unreadable \(ValueError: .*model_type.*\); delete that directory"):
        ensure_default_checkpoint(tmp_path / "cache2")
    cfg = json.loads((ensure_default_checkpoint(tmp_path / "cache3") / "config.json").read_text())
    cfg["n_routed_experts"] -= 1  # parses, but not these weights: was no word of the cache
    (tmp_path / "cache3" / next((tmp_path / "cache3").iterdir()).name / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"is unreadable \(ValueError: .*has shape .*\); delete that directory"):
        ensure_default_checkpoint(tmp_path / "cache3")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match=r"\(EPMOE_CACHE\) is a file: point EPMOE_CACHE at a directory"):
        ensure_default_checkpoint(not_a_dir)


def test_json_target_checked_before_the_run(tmp_path, capsys):
    # an existing directory as --json is refused before any model is read or built (the model path is bogus)
    assert main(["run", "--model", str(tmp_path / "no-model"), "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "is a directory" in err


def test_host_free_memory_is_read_defensively(tmp_path, monkeypatch):
    """A ``MemAvailable`` line without a number crashed the run after its generation (an ``IndexError``), ``abc``
    ended it as bad input, and a container's or batch job's memory limit was not read."""
    import epmoe.memory as memory_module

    meminfo, cgroups, root = tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "fs"
    monkeypatch.setattr(memory_module, "_MEMINFO", str(meminfo))
    monkeypatch.setattr(memory_module, "_SELF_CGROUP", str(cgroups))
    monkeypatch.setattr(memory_module, "_CGROUP_ROOT", str(root))
    for line, expected in [("MemAvailable:   2048 kB", 2 << 20), ("MemAvailable:", None),
                           ("MemAvailable: abc kB", None), ("MemAvailable: -5 kB", None), ("MemFree: 4 kB", None),
                           ("MemAvailable: \u00b2 kB", None)]:
        meminfo.write_text(f"MemTotal: 8192 kB\n{line}\n")
        assert memory_module._host_free_bytes() == expected, line
    meminfo.write_bytes(b"\xff\xfe")
    assert memory_module._host_free_bytes() is None
    meminfo.write_text("MemAvailable: 4096 kB\n")
    # cgroup v2: this process in /job/step, the limit on /job (an ancestor); the step has none
    cgroups.write_text("0::/job/step\n")
    job, step = root / "job", root / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text("1048576\n")
    assert memory_module._host_free_bytes() == 4 << 20  # no limit: the kernel's figure
    (job / "memory.max").write_text("3145728\n")
    (job / "memory.current").write_text("2097152\n")
    assert memory_module._host_free_bytes() == 1 << 20  # the job's limit less its usage, below the kernel's
    (job / "memory.stat").write_text("anon 1048576\ninactive_file 524288\nactive_file 524288\n")
    assert memory_module._host_free_bytes() == (1 << 20) + (1 << 19)  # its reclaimable page cache counted free
    (job / "memory.current").write_text("8388608\n")
    assert memory_module._host_free_bytes() == 0  # usage above the limit
    # cgroup v1: the memory controller's line
    cgroups.write_text("9:name=systemd:/\n5:cpu,memory:/job\n")
    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("3145728\n")
    (v1 / "memory.usage_in_bytes").write_text("2621440\n")
    (v1 / "memory.stat").write_text("inactive_file 0\ntotal_inactive_file 524288\n")
    assert memory_module._host_free_bytes() == 1 << 20
    cgroups.write_text("garbage\n")
    assert memory_module._host_free_bytes() == 4 << 20


def test_a_reference_loaded_through_the_host_is_priced_there_too(kimi, monkeypatch):
    import epmoe.runtime.run as run_module
    from epmoe.plan.costs import model_params
    from epmoe.plan.request import format_bytes
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(kimi)
    need = model_params(spec) * 2
    monkeypatch.setattr(run_module, "free_bytes", lambda device: 10 * need if device == "cuda" else need - 1)
    assert run_module.reference_room(spec, "bfloat16", "cuda") is None  # built on the device
    assert run_module.reference_room(spec, "bfloat16", "cuda", via_host=True) == (
        f"the unsharded transformers model needs about {format_bytes(need)} in bfloat16, and the host has "
        f"{format_bytes(need - 1)} free")
    monkeypatch.setattr(run_module, "free_bytes", lambda device: 2 * need - 1000)  # both round alike: in bytes
    assert format_bytes(2 * need) == format_bytes(2 * need - 1000)
    assert run_module.reference_room(spec, "float32", "cpu").endswith(f"needs about {2 * need} B in float32, and the "
                                                                      f"host has {2 * need - 1000} B free")
