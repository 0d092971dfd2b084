"""Doctor: one line per finding, exit code 1 on errors; target and draft placements; memory."""

from __future__ import annotations

import json
import re

import pytest

from epmoe.cli import main
from epmoe.doctor import DoctorConfig, diagnose, run_doctor
from epmoe.placement import ExpertPlacement
from epmoe.spec import load_moe_spec

from .conftest import CONFIGS

KIMI = str(CONFIGS / "kimi-k2.5.config.json")


def _errors(findings):
    return [f for f in findings if f.severity == "error"]


def test_good_setup_has_no_errors(tmp_path, capsys):
    # Kimi-K2.5: 60 MoE layers x 384 experts; 8 ranks x 48 slots.
    path = tmp_path / "kimi.json"
    ExpertPlacement.trivial(60, 384, 8).save(path)
    draft = str(CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json")
    findings = diagnose(DoctorConfig(model=KIMI, placement=str(path), draft=draft, ep=8, hardware="h200-sxm", batch=8))
    assert not _errors(findings), [f.line() for f in findings]
    lines = [f.line() for f in findings]
    assert any("gloo backend available" in line for line in lines)
    assert any("covers all 60 MoE layers" in line for line in lines)
    assert any("dense model" in line and "needs no placement" in line for line in lines)
    assert any("weights and caches fit" in line for line in lines)
    assert run_doctor(DoctorConfig(model=KIMI, placement=str(path), ep=8)) == 0
    assert "ok:" in capsys.readouterr().out


def test_placement_for_other_model_is_an_error(tmp_path):
    path = tmp_path / "dsv3.json"
    ExpertPlacement.trivial(58, 256, 8).save(path)  # DeepSeek-V3's 58 layers x 256 experts
    errors = _errors(diagnose(DoctorConfig(model=KIMI, placement=str(path), ep=8)))
    assert len(errors) == 1
    line = errors[0].line()
    assert "58 MoE layers" in line and "has 60" in line and "build a placement for 60 MoE layers x 384" in line


def test_moe_draft_without_placement_gets_its_own(tmp_path):
    # an MoE draft with the target's vocabulary (151936): Qwen1.5-MoE (60 experts) for Qwen3-30B-A3B (128)
    target = str(CONFIGS / "qwen3-30b-a3b.config.json")
    draft = str(CONFIGS / "qwen1.5-moe-a2.7b.config.json")
    findings = diagnose(DoctorConfig(model=target, draft=draft, ep=4))
    assert not _errors(findings), [f.line() for f in findings]
    assert any("the draft model qwen1.5-moe-a2.7b.config.json: no placement given; the trivial placement (15 experts "
               "per rank on 24 MoE layers)" in f.what for f in findings)
    assert any("gets a placement of its own, not the target's" in f.what for f in findings)
    errors = _errors(diagnose(DoctorConfig(model=target, draft=draft, ep=8)))  # 60 experts on 8 ranks
    assert [e.what for e in errors] == ["the draft model qwen1.5-moe-a2.7b.config.json: 60 experts are not divisible "
                                        "by EP size 8"]
    good = tmp_path / "draft.json"
    ExpertPlacement.trivial(24, 60, 4).save(good)
    assert not _errors(diagnose(DoctorConfig(model=target, draft=draft, draft_placement=str(good), ep=4)))
    wrong = tmp_path / "target.json"
    ExpertPlacement.trivial(48, 128, 4).save(wrong)  # the target's placement is refused for the draft
    (error,) = _errors(diagnose(DoctorConfig(model=target, draft=draft, draft_placement=str(wrong), ep=4)))
    assert "the draft model qwen1.5-moe-a2.7b.config.json" in error.what and "48 MoE layers" in error.what


def test_draft_identical_to_its_target_is_fine():
    """A DeepSeek-V3 draft with the target's own shape is placed on its own: no claim that shapes differ."""
    dsv3 = str(CONFIGS / "deepseek-v3.config.json")
    findings = diagnose(DoctorConfig(model=dsv3, draft=dsv3, ep=8))
    lines = [f.line() for f in findings]
    assert not _errors(findings), lines
    assert not any("differ" in line for line in lines)
    assert any("gets a placement of its own, not the target's (the same shape as the target's" in line
               for line in lines)


def test_standalone_draft_of_another_hidden_size_is_fine(tmp_path):
    """Only EAGLE-style heads read the target's hidden states: a Qwen3-0.6B-shaped dense draft serves
    Qwen3-235B-A22B (hidden 1024 against 4096); a vocabulary of its own is still refused."""
    target = str(CONFIGS / "qwen3-235b-a22b.config.json")
    small = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, max_position_embeddings=40960, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(small))
    findings = diagnose(DoctorConfig(model=target, draft=str(tmp_path / "config.json"), ep=8))
    assert not _errors(findings), [f.line() for f in findings]
    assert any("a standalone dense draft" in f.what and "needs no placement" in f.what for f in findings)
    (tmp_path / "config.json").write_text(json.dumps({**small, "vocab_size": 32000}))
    (error,) = _errors(diagnose(DoctorConfig(model=target, draft=str(tmp_path / "config.json"), ep=8)))
    assert "has vocab size 32000 but the target model" in error.what and "tokenizer" in error.fix


def test_indivisible_ep_dense_target_and_memory(capsys):
    mixtral = str(CONFIGS / "mixtral-8x7b.config.json")
    errors = _errors(diagnose(DoctorConfig(model=mixtral, ep=16)))
    assert any("8 experts are not divisible by EP size 16" in e.what for e in errors)
    dense = str(CONFIGS / "eagle3-draft-deepseek-v3-specforge.config.json")
    (dense_error,) = _errors(diagnose(DoctorConfig(model=dense)))
    assert "is not an MoE model" in dense_error.what
    # said once, not twice (the spec's message already says it)
    assert dense_error.line().count("no experts to place") == 1 and dense_error.line().count("no MoE layers") == 1
    # Kimi-K2 Instruct FP8 (~1 TB) does not fit 8 x H200.
    k2 = str(CONFIGS / "kimi-k2-instruct.config.json")
    assert main(["doctor", "--config", k2, "--ep", "8", "--hardware", "h200-sxm"]) == 1
    out = capsys.readouterr().out
    assert "error: weights and caches need" in out and "GiB over" in out


DSV3 = str(CONFIGS / "deepseek-v3.config.json")


def test_ep_with_no_strategy_keeps_every_finding(capsys):
    # 256 experts over EP 3: no all-to-all strategy; the planner's empty choice must not replace the findings
    assert main(["doctor", "--config", DSV3, "--ep", "3", "--hardware", "h200-sxm"]) == 1
    captured = capsys.readouterr()
    assert "min()" not in captured.err and captured.err == ""
    assert "gloo backend available" in captured.out
    assert "error: the target model: 256 experts are not divisible by EP size 3" in captured.out
    assert "pass a placement with 2 redundant slot(s) per layer" in captured.out
    # no rank layout to size after the placement's error: no bytes per rank, no memory check
    assert "warning: expert bytes per rank and memory not checked: the placement is refused" in captured.out
    assert not [line for line in captured.out.splitlines() if line.startswith("ok:") and "per rank" in line]
    assert "weights and caches" not in captured.out


def test_ep_zero_is_an_error_and_nodes_advice_is_a_doctor_flag(capsys):
    assert main(["doctor", "--config", DSV3, "--ep", "0"]) == 2
    assert "epmoe doctor: error: --ep must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["doctor", "--config", DSV3, "--ep", "16", "--nodes", "3"]) == 2
    assert "epmoe doctor: error: --ep (16) must be divisible by --nodes (3)" in capsys.readouterr().err
    # 16 ranks on one 8-GPU node: the advice names --nodes, which doctor accepts
    assert main(["doctor", "--config", DSV3, "--ep", "16", "--hardware", "h200-sxm"]) == 1
    out = capsys.readouterr().out
    assert "error: EP size 16 on 1 node(s) is 16 GPUs per node but h200-sxm has 8" in out
    assert "pass --nodes 2 or a smaller --ep" in out
    assert main(["doctor", "--config", DSV3, "--ep", "16", "--nodes", "2", "--hardware", "h200-sxm"]) == 0
    assert "ok: weights and caches fit" in capsys.readouterr().out


def _edited_weights(src, dst, edit):
    """A copy of checkpoint ``src`` with its tensors (a name -> tensor dict) edited in place by ``edit``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _drop_tensor(src, dst, name):
    def drop(tensors):
        assert name in tensors, sorted(tensors)[:20]
        del tensors[name]

    return _edited_weights(src, dst, drop)


def test_checkpoint_missing_expert_tensor_is_named(tiny_checkpoints, tmp_path):
    good = tiny_checkpoints("olmoe")  # 16 experts, 2 MoE layers, per-expert tensors
    lines = [f.line() for f in diagnose(DoctorConfig(model=str(good), ep=2))]
    assert ("ok: the target model: checkpoint holds every tensor the loader reads, with the shapes config.json "
            "predicts (16 routed experts x 2 MoE layers, float32 weights)") in lines
    # unquantized experts named by the checkpoint's dtype (float32 here); sizes in the unit that fits (a tiny expert
    # is KiB, not "0.0 MiB")
    assert ("ok: the target model: routed experts float32, served in the compute dtype (counted in bf16; --dtype "
            "float32 doubles it): 12.0 KiB per expert, 192.0 KiB per rank (8 slots x 2 MoE layers)") in lines
    bad = _drop_tensor(good, tmp_path / "olmoe", "model.layers.1.mlp.experts.5.up_proj.weight")
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert error.what == ("the target model: checkpoint is missing a tensor of logical expert 5 of model.layers.1.mlp: "
                          f"checkpoint {bad} has no tensor 'model.layers.1.mlp.experts.5.up_proj.weight'")
    # fused experts (gpt-oss: gate_up_proj [E, D, 2F] per layer)
    fused = _drop_tensor(tiny_checkpoints("gpt-oss"), tmp_path / "gptoss", "model.layers.0.mlp.experts.down_proj")
    (error,) = _errors(diagnose(DoctorConfig(model=str(fused), ep=2)))
    assert ("checkpoint is missing a tensor of the fused experts of model.layers.0.mlp: checkpoint "
            f"{fused} has no tensor 'model.layers.0.mlp.experts.down_proj'") in error.what


def test_draft_for_another_target_is_an_error():
    qwen = str(CONFIGS / "qwen3-30b-a3b.config.json")
    dsv3_draft = str(CONFIGS / "eagle3-draft-deepseek-v3-specforge.config.json")
    errors = [e.what for e in _errors(diagnose(DoctorConfig(model=qwen, draft=dsv3_draft, ep=2)))]
    assert ("draft eagle3-draft-deepseek-v3-specforge.config.json has hidden size 7168 but the target model "
            "qwen3-30b-a3b.config.json has hidden size 2048") in errors
    assert ("draft eagle3-draft-deepseek-v3-specforge.config.json has vocab size 129280 but the target model "
            "qwen3-30b-a3b.config.json has vocab size 151936") in errors
    own = str(CONFIGS / "eagle3-draft-qwen3-30b-a3b-specforge.config.json")
    assert not _errors(diagnose(DoctorConfig(model=qwen, draft=own, ep=2)))


def test_draft_weights_count_in_memory():
    import re

    from epmoe.plan.draft import read_draft

    qwen = str(CONFIGS / "qwen3-30b-a3b.config.json")
    own = str(CONFIGS / "eagle3-draft-qwen3-30b-a3b-specforge.config.json")

    def fit_gib(cfg):
        (line,) = [f.line() for f in diagnose(cfg) if "weights and caches" in f.what]
        return float(re.search(r"fit: ([\d.]+) of", line).group(1)), line

    alone, _ = fit_gib(DoctorConfig(model=qwen, ep=2, hardware="h200-sxm", batch=8))
    with_draft, line = fit_gib(DoctorConfig(model=qwen, draft=own, ep=2, hardware="h200-sxm", batch=8))
    draft = read_draft(own)
    # EAGLE-3 draft: embedding 151936 x 2048, fc 3D x D, q/k/v over 2D, o, SwiGLU 3 D I, LM head 32000 x D; bf16
    d, heads, kv, hd = 2048, 32, 4, 128
    params = 151936 * d + (2 * d * (heads + 2 * kv) * hd + heads * hd * d) + 3 * d * 12288 + 3 * d * d + 32000 * d
    assert draft.weight_bytes == 2 * params
    assert with_draft - alone >= draft.weight_bytes / 2**30 - 0.1
    assert "draft eagle3-draft-qwen3-30b-a3b-specforge.config.json" in line


def test_counts_of_one_are_singular():
    """Mixtral-8x7B at EP 8: one expert, one slot per rank (no "1 slots")."""
    lines = [f.line() for f in diagnose(DoctorConfig(model=str(CONFIGS / "mixtral-8x7b.config.json"), ep=8))]
    assert ("ok: the target model: no placement given; the trivial placement (1 expert per rank on 32 MoE layers) "
            "will be used") in lines
    assert any(line.endswith("per rank (1 slot x 32 MoE layers)") for line in lines), lines


def test_weights_advice_only_smaller_formats(capsys):
    k2 = str(CONFIGS / "kimi-k2-instruct.config.json")  # FP8 experts already
    assert main(["doctor", "--config", k2, "--ep", "8", "--hardware", "h200-sxm"]) == 1
    out = capsys.readouterr().out
    assert "use more GPUs, --weights int4, a smaller batch" in out and "fp8/int4" not in out


def test_config_that_does_not_describe_the_weights(tiny_checkpoints, tmp_path, capsys):
    """config.json says 8 experts, the weights hold 16: doctor says so, and run names the tensor."""
    import shutil

    bad = tmp_path / "kimi8"
    shutil.copytree(tiny_checkpoints("kimi-k2.5"), bad)
    doc = json.loads((bad / "config.json").read_text())
    doc.get("text_config", doc)["n_routed_experts"] = 8
    (bad / "config.json").write_text(json.dumps(doc))
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert error.what == (f"the target model: checkpoint {bad}: tensor 'model.layers.1.mlp.gate.weight' has shape "
                          "(16, 64), expected (8, 64) from config.json (does config.json belong to these weights?)")
    assert main(["run", "--model", str(bad), "--ep", "1", "--no-reference", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "tensor 'model.layers.1.mlp.gate.weight' has shape (16, 64), expected (8, 64) from config.json" in err


def test_doctor_says_which_values_came_from_transformers_defaults(tmp_path):
    cfg = json.loads((CONFIGS / "qwen1.5-moe-a2.7b.config.json").read_text())
    del cfg["vocab_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    findings = diagnose(DoctorConfig(model=str(path), ep=4))
    assert not _errors(findings), [f.line() for f in findings]
    warned = [f.line() for f in findings if "defaults" in f.what]
    assert warned == ["warning: the target model: config.json has no vocab_size: took transformers' Qwen2MoeConfig "
                      "defaults vocab_size=151936; transformers builds the model with the same values, but a "
                      "config.json that lost fields may not describe these weights; check them against the model's "
                      "own config"]
    assert not [f for f in diagnose(DoctorConfig(model=KIMI, ep=8)) if "defaults" in f.what]


def _edited_copy(src, dst, config_edit):
    """A copy of checkpoint ``src`` with its config.json edited by ``config_edit(doc)``."""
    import shutil

    shutil.copytree(src, dst)
    doc = json.loads((dst / "config.json").read_text())
    config_edit(doc)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst


def _loader_refusal(directory) -> str:
    from epmoe.comm import Comm
    from epmoe.layer import MoELayerOptions
    from epmoe.models.hf import load_ep_model
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(directory)
    try:
        load_ep_model(str(directory), ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                      options=MoELayerOptions(dispatcher="local"))
    except (ValueError, KeyError) as exc:
        return exc.args[0] if isinstance(exc, KeyError) else str(exc)
    raise AssertionError(f"the loader accepted {directory}")


def test_doctor_refuses_what_the_loader_refuses(tiny_checkpoints, tmp_path, capsys):
    """An MXFP4 gpt-oss, a checkpoint missing q_proj, and an intermediate_size that disagrees with the tensors: the
    loader refuses each before reading weights, and doctor reports the loader's own message (exit code 1)."""
    cases = {
        "mxfp4": _edited_copy(tiny_checkpoints("gpt-oss"), tmp_path / "mxfp4",
                              lambda d: d.update(quantization_config={"quant_method": "mxfp4"})),
        "q_proj": _drop_tensor(tiny_checkpoints("qwen3-moe"), tmp_path / "noq",
                               "model.layers.0.self_attn.q_proj.weight"),
        "intermediate": _edited_copy(tiny_checkpoints("kimi-k2.5"), tmp_path / "inter",
                                     lambda d: d.get("text_config", d).update(intermediate_size=96)),
    }
    expected = {
        "q_proj": "checkpoint {} is missing tensor 'model.layers.0.self_attn.q_proj.weight'",
        "intermediate": "tensor 'model.layers.0.mlp.gate_proj.weight' has shape",
    }
    for name, directory in cases.items():
        refusal = _loader_refusal(directory)
        if name in expected:
            assert expected[name].format(directory) in refusal
        (error,) = _errors(diagnose(DoctorConfig(model=str(directory), ep=1)))
        assert error.what == f"the target model: {refusal}", name
        assert main(["doctor", "--model", str(directory)]) == 1
        assert refusal in capsys.readouterr().out


def test_a_weight_stored_as_integers_is_named(tiny_checkpoints, tmp_path):
    """An int32 expert weight was copied into the float expert as numbers; now the loader and doctor refuse it with
    the tensor and its dtype. INT4 checkpoints' int32 ``weight_packed`` tensors stay accepted."""
    import torch

    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    bad = _edited_weights(tiny_checkpoints("olmoe"), tmp_path / "olmoe",
                          lambda tensors: tensors.update({name: tensors[name].to(torch.int32)}))
    refusal = _loader_refusal(bad)
    assert refusal == (f"checkpoint {bad}: tensor '{name}' of logical expert 5 of model.layers.1.mlp is I32, expected "
                       "a float dtype (BF16, F16, F32, F64, F8_E4M3, F8_E5M2)")
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert error.what == f"the target model: {refusal}"
    assert not _errors(diagnose(DoctorConfig(model=str(tiny_checkpoints("kimi-k2.5-int4")), ep=2)))


@pytest.mark.parametrize("edit, message", [
    (lambda d: _set_config(d, eos_token_id=999), r"config\.json': eos_token_id 999 is outside the model's vocabulary "
                                                 r"\[0, 259\)"),
    (lambda d: _set_config(d, eos_token_id=-1), r"config\.json': eos_token_id must be a token id \(an integer >= 0\) "
                                                r"or a list of them, got -1"),
    (lambda d: (d / "generation_config.json").write_text("{"), r"generation_config\.json' cannot be read"),
])
def test_stop_ids_run_refuses_are_doctor_errors(tiny_checkpoints, tmp_path, edit, message):
    """Were "ok" in doctor; run refused them from inside its ranks."""
    import shutil

    bad = tmp_path / "olmoe"
    shutil.copytree(tiny_checkpoints("olmoe"), bad)
    edit(bad)
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert re.search(message, error.what), error.what


@pytest.mark.parametrize("edit, message", [
    (lambda d: _set_json(d / "generation_config.json", temperature=-1),
     "generation_config.json: temperature: temperature must be a finite number >= 0, got -1"),
    (lambda d: _set_json(d / "generation_config.json", top_p="0.9"), "top_p must be in (0, 1], got '0.9'"),
    (lambda d: _set_json(d / "generation_config.json", max_new_tokens=0), "max_tokens must be"),
    (lambda d: (d / "tokenizer.json").write_text("{"), "tokenizer.json' cannot be read"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1]"),
     "tokenizer_config.json' must hold a JSON object, got list"),
])
def test_generation_config_and_tokenizer_run_and_serve_refuse_are_doctor_errors(tmp_path, edit, message):
    """Were "ok" in doctor while serve refused the sampling defaults at start and run the rest (the last with
    "AttributeError: 'list' object has no attribute 'get'", naming no file)."""
    import shutil

    from epmoe.models.tiny import ensure_default_checkpoint

    bad = tmp_path / "ckpt"
    shutil.copytree(ensure_default_checkpoint(), bad)
    assert not _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    if not (bad / "generation_config.json").exists():
        (bad / "generation_config.json").write_text("{}")
    edit(bad)
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert message in error.what, error.what


GOOD_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize("template, warned", [
    ("{% for %}", "does not compile: "),
    ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),  # parses, does not compile
    (5, "does not compile: it is not text: 5"),
    ([{"name": "default", "template": GOOD_TEMPLATE}, {"name": "tool_use", "template": "{% if %}"}],
     "chat template 'tool_use' does not compile"),
    # transformers' own Jinja extensions compile: no warning
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}", None),
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", None),
    ([{"name": "default", "template": GOOD_TEMPLATE}, {"name": "tool_use", "template": GOOD_TEMPLATE}], None),
])
def test_a_chat_template_that_does_not_compile_is_a_doctor_warning(tmp_path, template, warned):
    """serve starts with it and answers every chat that uses it with a 400; doctor said ok. The check is serve's own
    (transformers' Jinja environment), and a named template is named."""
    import shutil

    from epmoe.models.tiny import ensure_default_checkpoint

    bad = tmp_path / "ckpt"
    shutil.copytree(ensure_default_checkpoint(), bad)
    _set_json(bad / "tokenizer_config.json", chat_template=template)
    findings = diagnose(DoctorConfig(model=str(bad), ep=2))
    assert not _errors(findings)
    found = [f for f in findings if "chat template" in f.what]
    if warned is None:
        assert not found, found
    else:
        (warning,) = found
        assert warning.severity == "warning" and warned in warning.what, warning.what


def _set_json(path, **fields):
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def test_stop_ids_of_a_config_file_are_checked(tmp_path):
    """``doctor --config FILE`` checked no eos_token_id; a bad one is now an error there too, given as JSON writes
    it, and the real config's ids are fine."""
    assert not [f for f in diagnose(DoctorConfig(model=DSV3, ep=16, nodes=2)) if "eos_token_id" in f.what]
    cfg = json.loads((CONFIGS / "deepseek-v3.config.json").read_text())
    vocab = cfg["vocab_size"]
    bad = tmp_path / "config.json"
    for value, message in ((True, "eos_token_id must be a token id (an integer >= 0) or a list of them, got true"),
                           ([1, vocab], f"eos_token_id {vocab} is outside the model's vocabulary [0, {vocab}) "
                                        f"(got [1, {vocab}])")):
        bad.write_text(json.dumps(dict(cfg, eos_token_id=value)))
        (error,) = [f for f in _errors(diagnose(DoctorConfig(model=str(bad), ep=16, nodes=2)))
                    if "eos_token_id" in f.what]
        assert error.what == f"the target model: {str(bad)!r}: {message}"


def _set_config(directory, **fields):
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(fields)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_layers_past_num_hidden_layers_are_named(tiny_checkpoints, tmp_path):
    """config.json says 2 layers, the weights hold 3: the third layer's tensors have no place in the model (they were
    left unread); refused with their count and the first named. A multi-token-prediction layer past the decoder
    layers (it holds an ``eh_proj``: DeepSeek-V3, GLM-4.5) is left unread, as transformers does."""
    import torch
    from safetensors import safe_open

    good = tiny_checkpoints("kimi-k2.5")
    with safe_open(str(good / "model.safetensors"), "pt") as f:
        third = [k for k in f.keys() if k.startswith("model.layers.2.")]
    bad = _edited_copy(good, tmp_path / "less", lambda d: d.get("text_config", d).update(num_hidden_layers=2))
    refusal = _loader_refusal(bad)
    assert refusal == (f"checkpoint {bad} holds {len(third)} tensors the model config.json describes has no place "
                       "for, the first 'model.layers.2.input_layernorm.weight' (num_hidden_layers 2; does config.json "
                       "belong to these weights?)")
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert error.what == f"the target model: {refusal}"

    def add_layer_3(with_eh_proj):
        def edit(tensors):
            tensors.update({f"model.layers.3.{norm}.weight": torch.ones(64) for norm in ("enorm", "hnorm")})
            if with_eh_proj:
                tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)

        return edit

    mtp = _edited_weights(good, tmp_path / "mtp", add_layer_3(True))
    assert not _errors(diagnose(DoctorConfig(model=str(mtp), ep=2)))
    stray = _edited_weights(good, tmp_path / "stray", add_layer_3(False))
    (error,) = _errors(diagnose(DoctorConfig(model=str(stray), ep=2)))
    assert "holds 2 tensors the model config.json describes has no place for, the first " \
           "'model.layers.3.enorm.weight' (num_hidden_layers 3; does config.json" in error.what


def test_a_field_transformers_refuses_is_a_config_error(tiny_checkpoints, tmp_path):
    """A field epmoe does not read but transformers' config class refuses: named with config.json and the value (it
    was a safetensors-like 'cannot be read ... re-download the checkpoint')."""
    bad = _edited_copy(tiny_checkpoints("kimi-k2.5"), tmp_path / "tie",
                       lambda d: d.get("text_config", d).update(use_cache="yes"))
    (error,) = _errors(diagnose(DoctorConfig(model=str(bad), ep=2)))
    assert error.what.startswith(f"the target model: {bad / 'config.json'}: transformers cannot build the model's "
                                 "config from it: StrictDataclassFieldValidationError: Validation error for field "
                                 "'use_cache':")
    assert "(value: 'yes')" in error.what and "re-download" not in error.line()


def test_memory_check_context_stays_within_the_model(tiny_checkpoints, capsys):
    # without --context the memory check prices the model's max_position_embeddings where it is below 4096 (the
    # small checkpoint's 256); a --context past it is priced as asked, with a warning that names both
    tiny = str(tiny_checkpoints("gpt-oss"))
    limit = load_moe_spec(tiny).max_position_embeddings
    assert limit < 4096
    assert main(["doctor", "--model", tiny, "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert f"context {limit})" in out and "above the model's max_position_embeddings" not in out
    assert main(["doctor", "--model", tiny, "--hardware", "h100-sxm", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert f"warning: --context 4096 is above the model's max_position_embeddings {limit}" in out
    assert "context 4096)" in out
    # without --hardware the warning still comes; a context past any model's is a bad argument (exit 2)
    assert main(["doctor", "--model", tiny, "--context", "4096"]) == 0
    assert "warning: --context 4096 is above the model's max_position_embeddings" in capsys.readouterr().out
    assert main(["doctor", "--model", tiny, "--context", "100000000"]) == 2
    assert "--context must be at most 16777216, got 100000000" in capsys.readouterr().err
    # so is a batch past any plan's, with or without --hardware (it was a finding with one, let through without)
    for hw in ([], ["--hardware", "h200-sxm"]):
        assert main(["doctor", "--model", tiny, *hw, "--batch", "99999999999"]) == 2
        assert "--batch must be at most 1048576, got 99999999999" in capsys.readouterr().err
    # and an EP size past plan's --gpus bound (it was a finding advising 99999999983 redundant slots)
    assert main(["doctor", "--model", tiny, "--ep", "99999999999"]) == 2
    assert "--ep must be at most 65536, got 99999999999" in capsys.readouterr().err
    # DeepSeek-V3's 163840 positions: the default stays at 4096
    assert main(["doctor", "--config", DSV3, "--ep", "8", "--hardware", "h200-sxm"]) == 0
    assert "context 4096)" in capsys.readouterr().out


def test_a_path_to_no_config_is_a_bad_argument(tmp_path, capsys):
    """``doctor --model DIR`` on a directory without config.json exited 1, as a finding about a model; a path that
    holds no config is a bad argument (2), named by the flag typed, in plan's words (``spec.check_config_path``: doctor
    said "is neither a config.json nor a directory holding one" for a missing path and a directory alike)."""
    expected = "(expected a model directory holding config.json, or a config file)\n"
    assert main(["doctor", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe doctor: error: --model {str(tmp_path)!r} is a directory without a "
                                            f"config.json file {expected}")
    missing = tmp_path / "nope" / "config.json"
    assert main(["doctor", "--config", str(missing)]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe doctor: error: --config {str(missing)!r} does not exist {expected}")
    assert main(["doctor", "--config", str(CONFIGS / "qwen3-30b-a3b.config.json"), "--draft", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe doctor: error: --draft {str(tmp_path)!r} is a directory without "
                                            f"a config.json file {expected}")
    assert main(["doctor", "--model", ""]) == 2  # was "expected str, bytes or os.PathLike object, not NoneType"
    assert capsys.readouterr().err.endswith(f"epmoe doctor: error: --model is empty {expected}")
    assert main(["doctor", "--config", "/dev/null"]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe doctor: error: --config '/dev/null' is neither a file nor a "
                                            f"directory {expected}")
    # a config that is there but wrong stays a finding (exit 1)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert main(["doctor", "--model", str(tmp_path)]) == 1
    assert "error: the target model cannot be read" in capsys.readouterr().out
