"""Doctor: one line per finding, exit code 1 on errors; target and draft placements; memory."""

from __future__ import annotations

from epmoe.cli import main
from epmoe.doctor import DoctorConfig, diagnose, run_doctor
from epmoe.placement import ExpertPlacement

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


def test_moe_draft_without_placement_is_a_finding(tmp_path):
    draft = str(CONFIGS / "qwen3-30b-a3b.config.json")  # an MoE model used as draft
    errors = _errors(diagnose(DoctorConfig(model=KIMI, draft=draft, ep=8)))
    assert any("no placement of its own" in e.what and "--draft-placement" in e.fix for e in errors)
    good = tmp_path / "draft.json"
    ExpertPlacement.trivial(48, 128, 8).save(good)
    assert not _errors(diagnose(DoctorConfig(model=KIMI, draft=draft, draft_placement=str(good), ep=8)))


def test_indivisible_ep_dense_target_and_memory(capsys):
    mixtral = str(CONFIGS / "mixtral-8x7b.config.json")
    errors = _errors(diagnose(DoctorConfig(model=mixtral, ep=16)))
    assert any("8 experts are not divisible by EP size 16" in e.what for e in errors)
    dense = str(CONFIGS / "eagle3-draft-deepseek-v3-specforge.config.json")
    assert any("has no MoE layers" in e.what for e in _errors(diagnose(DoctorConfig(model=dense))))
    # Kimi-K2 Instruct FP8 (~1 TB) does not fit 8 x H200.
    k2 = str(CONFIGS / "kimi-k2-instruct.config.json")
    assert main(["doctor", "--config", k2, "--ep", "8", "--hardware", "h200-sxm"]) == 1
    out = capsys.readouterr().out
    assert "error: weights and caches need" in out and "GiB over" in out
