"""Block-FP8 checkpoints in DeepSeek-V3's published format (float8_e4m3fn + ``_scale_inv`` 128x128 block scales),
Kimi-K2's ``model_type: kimi_k2`` and Kimi-K2.5's ``text_config`` wrapper with ``language_model.`` tensors.

The FP8 checkpoint is written from a small DeepSeek-V3 one (hidden 192, expert F 160: two blocks per dimension,
the last one ragged); a twin written with the dequantized float32 tensors is the comparison. With F 160 the gate and
up rows of an expert's ``w13`` would share a scale block, so its routed experts are dequantized on load; a second
pair with F 256 (hidden still ragged) keeps them as stored, float8_e4m3fn with their block scales.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from epmoe.cli import main
from epmoe.comm import Comm
from epmoe.experts.fp8 import quantize_block_fp8
from epmoe.layer import MoELayerOptions
from epmoe.models.checkpoint import CheckpointReader
from epmoe.models.hf import load_ep_model, load_full_model
from epmoe.placement import ExpertPlacement

SIZES = dict(hidden_size=192, moe_intermediate_size=160, intermediate_size=320)
SIZES_128 = dict(hidden_size=192, moe_intermediate_size=256, intermediate_size=320)  # F: whole 128-row blocks
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
SKIP = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _copy_meta(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def _edit_config(directory: Path, **fields) -> dict:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(fields)
    (directory / "config.json").write_text(json.dumps(cfg))
    return cfg


def _build(root: Path, sizes: dict, family: str = "deepseek-v3") -> dict[str, Path]:
    """``fp8``: quantized, in DeepSeek's format; ``deq``: the same dequantized values written as float32."""
    from epmoe.models.tiny import build_tiny_checkpoint

    base = build_tiny_checkpoint(family, root / "base", seed=3, overrides=sizes)
    fp8, deq = root / "fp8", root / "deq"
    _copy_meta(base, fp8)
    _copy_meta(base, deq)
    quantized, dequantized = {}, {}
    for name, w in _tensors(base).items():
        if w.dim() == 2 and name.endswith(".weight") and not name.endswith(SKIP):
            q, s = quantize_block_fp8(w[None])
            quantized[name], quantized[name + "_scale_inv"] = q[0], s[0]
            scale = s[0].repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            dequantized[name] = q[0].float() * scale
        else:
            quantized[name] = dequantized[name] = w
    assert any(t.dtype == torch.float8_e4m3fn and t.shape[1] % 128 and t.shape[1] > 128 for t in quantized.values())
    save_file(quantized, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, deq / "model.safetensors", metadata={"format": "pt"})
    _edit_config(fp8, quantization_config=FP8_CONFIG)
    return {"base": base, "fp8": fp8, "deq": deq}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return _build(tmp_path_factory.mktemp("fp8"), SIZES)


@pytest.fixture(scope="module")
def ckpts128(tmp_path_factory) -> dict[str, Path]:
    return _build(tmp_path_factory.mktemp("fp8_128"), SIZES_128)


def _logits(directory: Path, ids: torch.Tensor, load_format: str = "auto") -> torch.Tensor:
    return _logits_and_model(directory, ids, load_format)[0]


def _logits_and_model(directory: Path, ids: torch.Tensor, load_format: str = "auto"):
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(str(directory))
    placement = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1)
    ep = load_ep_model(str(directory), placement, Comm(None), options=MoELayerOptions(dispatcher="local"),
                       load_format=load_format)
    with torch.no_grad():
        return ep.model(ids).logits, ep


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_reader_dequantizes_and_hides_scales(ckpts):
    reader = CheckpointReader(ckpts["fp8"])
    assert reader.has_fp8 and not any(k.endswith("_scale_inv") for k in reader.keys())
    deq = _tensors(ckpts["deq"])
    name = "model.layers.1.mlp.experts.7.gate_proj.weight"  # [160, 192]: ragged in both dimensions
    assert torch.equal(reader.get(name), deq[name])
    assert reader.get(name, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(reader.get(name, index=150), deq[name][150])  # one row, its block's scales


def test_ep1_fp8_matches_dequantized_checkpoint(ckpts):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    ours = _logits(ckpts["fp8"], ids)
    assert _rel(ours, _logits(ckpts["deq"], ids)) < 1e-6
    assert _rel(ours, _logits(ckpts["base"], ids)) > 1e-6  # the weights really went through FP8
    ref = AutoModelForCausalLM.from_pretrained(ckpts["deq"], dtype=torch.float32).eval()
    full = load_full_model(str(ckpts["fp8"]))  # the reference `epmoe run` uses for FP8 checkpoints
    with torch.no_grad():
        theirs = ref(ids).logits
        assert _rel(full(ids).logits, theirs) < 1e-6
    assert _rel(ours, theirs) < 1e-5


def test_fp8_experts_served_as_stored_where_f_is_whole_blocks(ckpts, ckpts128):
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    ours, ep = _logits_and_model(ckpts128["fp8"], ids)
    experts = ep.moe_layers[0].experts
    assert experts.storage.kind == "fp8"
    assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
    # w13 [S, 2F, D]: gate then up rows, each F = 256 rows two whole blocks; D = 192 ragged
    assert tuple(experts.w13.shape) == (16, 512, 192) and tuple(experts.w13_scale.shape) == (16, 4, 2)
    assert tuple(experts.w2_scale.shape) == (16, 2, 2) and experts.w13_scale.dtype == torch.float32
    stored = _tensors(ckpts128["fp8"])
    block = "model.layers.1.mlp.experts.5"
    assert torch.equal(experts.w13[5, 256:].view(torch.uint8), stored[f"{block}.up_proj.weight"].view(torch.uint8))
    assert torch.equal(experts.w13_scale[5, 2:], stored[f"{block}.up_proj.weight_scale_inv"])
    assert _rel(ours, _logits(ckpts128["deq"], ids)) < 1e-6
    # F 160: gate and up rows would share a scale block, so the experts are dequantized on load
    plain = _logits_and_model(ckpts["fp8"], ids)[1].moe_layers[0].experts
    assert plain.storage.kind == "plain" and plain.w13.dtype == torch.float32


@pytest.mark.parametrize("family,sizes", [("qwen3-moe", SIZES_128),
                                          ("mixtral", dict(hidden_size=192, intermediate_size=256))])  # Mixtral's F
def test_fp8_experts_as_stored_in_other_families(tmp_path, family, sizes):
    # Qwen3's published FP8 checkpoints use DeepSeek's format; Mixtral's per-expert w1/w3/w2 names read the same way
    pair = _build(tmp_path, sizes, family)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    ours, ep = _logits_and_model(pair["fp8"], ids)
    assert ep.moe_layers[0].experts.w13.dtype == torch.float8_e4m3fn
    assert _rel(ours, _logits(pair["deq"], ids)) < 1e-6


def test_fp8_dummy_weights_stay_fp8(ckpts128, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(ckpts128["fp8"] / "config.json", only_config / "config.json")
    logits, ep = _logits_and_model(only_config, torch.tensor([[1, 2, 3]]), load_format="dummy")
    experts = ep.moe_layers[0].experts
    values = experts.w13.float()
    assert experts.w13.dtype == torch.float8_e4m3fn and values.std().item() == pytest.approx(4.2, rel=0.1)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_doctor_and_plan_say_how_fp8_experts_are_served(ckpts, ckpts128):
    from epmoe.doctor import check_expert_storage
    from epmoe.experts.storage import held_as
    from epmoe.plan.costs import compute_dtype
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.request import PlanRequest
    from epmoe.spec import load_moe_spec

    spec128, spec160 = load_moe_spec(str(ckpts128["fp8"])), load_moe_spec(str(ckpts["fp8"]))
    (ok,) = check_expert_storage(spec128, 2, 0)
    # one expert: 3 * 192 * 256 FP8 bytes + (4 + 2 + 2 * 2) float32 block scales
    assert "served as stored: FP8 values + float32 128x128 block scales: 144.0 KiB per expert" in ok.what, ok.what
    (deq,) = check_expert_storage(spec160, 2, 0)
    assert "the expert intermediate size F (160) is not a multiple of 128" in deq.what, deq.what
    h200 = load_hardware("h200-sxm")
    assert PlanRequest(spec=spec128, hardware=h200, gpus=2, batches=(1,)).expert_format == "fp8_block128"
    assert PlanRequest(spec=spec160, hardware=h200, gpus=2, batches=(1,)).expert_format == "bf16"
    assert PlanRequest(spec=spec128, hardware=h200, gpus=2, batches=(1,)).dense_format == "bf16"
    assert compute_dtype("fp8_block128") == "w8a16"  # the kernels widen FP8 to bf16 in registers
    # and epmoe run's summary
    f128, f160 = ("fp8_block128", spec128.moe_intermediate_size), ("fp8_block128", spec160.moe_intermediate_size)
    assert held_as(*f128, "ep", "bfloat16") == "fp8 (block 128) as stored"
    assert held_as(*f128, "tp", "float32") == "float32 (fp8 (block 128) dequantized on load: --parallel tp)"
    assert held_as(*f160, "ep", "float32") == (
        "float32 (FP8 dequantized on load: the expert intermediate size F (160) is not a multiple of 128, so the gate "
        "and up rows would share a scale block)")


@pytest.mark.parametrize("edit,match", [
    ("bf16_expert", r"experts[.]3[.]down_proj[.]weight' is BF16 of shape \(192, 256\); block-FP8 routed experts"),
    ("scale_shape", r"experts[.]3[.]down_proj[.]weight_scale_inv' is F32 of shape \(1, 2\), expected a float of "
                    r"shape \(2, 2\)"),
])
def test_bad_fp8_expert_tensors_are_named(ckpts128, tmp_path, edit, match):
    broken = tmp_path / "broken"
    _copy_meta(ckpts128["fp8"], broken)
    tensors = _tensors(ckpts128["fp8"])
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    if edit == "bf16_expert":
        tensors[name] = tensors[name].float().bfloat16()
    else:
        tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:1]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        load_ep_model(str(broken), ExpertPlacement.trivial(2, 16, 1), Comm(None),
                      options=MoELayerOptions(dispatcher="local"))


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    _copy_meta(src, dst)
    tensors = _tensors(src)
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _load(directory: Path):
    return load_ep_model(str(directory), ExpertPlacement.trivial(2, 16, 1), Comm(None),
                         options=MoELayerOptions(dispatcher="local"))


@pytest.mark.parametrize("which,edit,match", [
    # served as stored (F 256): a NaN scale, an infinite one, a NaN value (e4m3fn's 0x7f)
    ("128", lambda t: t["model.layers.1.mlp.experts.4.up_proj.weight_scale_inv"].__setitem__((1, 0), float("nan")),
     r"up_proj[.]weight_scale_inv' \(block scales, times the largest FP8 value 448\) holds 1 NaN or infinite value, "
     r"the first at \(1, 0\)"),
    ("128", lambda t: t["model.layers.1.mlp.experts.4.up_proj.weight_scale_inv"].__setitem__((0, 1), float("inf")),
     r"the first at \(0, 1\)"),
    ("128", lambda t: t["model.layers.2.mlp.experts.0.down_proj.weight"].view(torch.uint8).__setitem__((3, 5), 0x7F),
     r"experts[.]0[.]down_proj[.]weight' holds 1 NaN or infinite value, the first at \(3, 5\)"),
    # dequantized on load (F 160): a NaN scale of an expert (a whole 128x128 block), of an attention weight
    ("160", lambda t: t["model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"].__setitem__((0, 0), float("nan")),
     r"experts[.]2[.]gate_proj[.]weight' dequantized with its '.*_scale_inv' holds 16384 NaN or infinite values"),
    ("160", lambda t: t["model.layers.0.self_attn.o_proj.weight_scale_inv"].__setitem__((0, 0), float("inf")),
     r"o_proj[.]weight' dequantized with its"),
])
def test_fp8_nan_and_infinity_are_refused_on_load(ckpts, ckpts128, tmp_path, which, edit, match):
    src = (ckpts128 if which == "128" else ckpts)["fp8"]
    with pytest.raises(ValueError, match=match):
        _load(_broken_copy(src, tmp_path / "bad", edit))


def test_doctor_refuses_a_float8_tensor_without_scales_as_run_does(ckpts128, tmp_path):
    from epmoe.models.hf import check_checkpoint

    name = "model.layers.1.mlp.shared_experts.up_proj.weight"  # not a routed expert: dequantized on load
    bad = _broken_copy(ckpts128["fp8"], tmp_path / "bad", lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}' is float8_e4m3fn but has no"):
        check_checkpoint(str(bad))  # what doctor calls, without reading a weight
    cut = _broken_copy(ckpts128["fp8"], tmp_path / "blocks", lambda t: None)
    _edit_config(cut, quantization_config={**FP8_CONFIG, "weight_block_size": [64, 128]})
    with pytest.raises(ValueError, match=r"_scale_inv' is F32 of shape \(\d+, \d+\), expected a float of shape "
                                         r".* in 64x128 blocks"):
        check_checkpoint(str(cut))


@pytest.mark.parametrize("size, shown", [([True, 128], "[true, 128]"), ([128.0, 128.0], "[128.0, 128.0]"),
                                         ([128], "[128]"), ("128", '"128"')])
def test_bad_fp8_block_size_is_one_error(ckpts128, tmp_path, size, shown):
    """The value as config.json writes it (was Python's: ``[True, 128]``, ``'128'``)."""
    from epmoe.spec import load_moe_spec

    bad = _broken_copy(ckpts128["fp8"], tmp_path / "bad", lambda t: None)
    _edit_config(bad, quantization_config={**FP8_CONFIG, "weight_block_size": size})
    with pytest.raises(ValueError, match=r"config[.]json: quantization_config[.]weight_block_size must be two positive "
                                         r"integers, got " + re.escape(shown) + "$"):
        load_moe_spec(str(bad))


def test_fp8_without_block_size_is_128_blocks_served_as_stored(ckpts128, tmp_path):
    plain = _broken_copy(ckpts128["fp8"], tmp_path / "noblock", lambda t: None)
    _edit_config(plain, quantization_config={k: v for k, v in FP8_CONFIG.items() if k != "weight_block_size"})
    ep = _load(plain)
    assert ep.moe_layers[0].experts.w13.dtype == torch.float8_e4m3fn


def _run(model: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    code = main(["run", "--model", str(model), "--ep", "2", "--max-new-tokens", "4", "--prompt", "fp8 experts",
                 "--prompt", "block scales", "--prompt", "abc", "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_run_fp8_two_ranks_matches_reference(ckpts, tmp_path):
    report = _run(ckpts["fp8"], tmp_path)
    assert report["matches_reference"] is True and report["mismatches"] == []


@pytest.mark.multiprocess
def test_run_fp8_as_stored_two_ranks_with_live_rebalancing(ckpts128, tmp_path):
    # the FP8 values and their block scales move together between ranks (as bytes), and the tokens stay the reference's
    report = _run(ckpts128["fp8"], tmp_path, "--redundant", "2", "--eplb-interval", "2", "--max-new-tokens", "8")
    assert report["matches_reference"] is True and report["mismatches"] == []
    assert report["expert_storage"] == "fp8 (block 128) as stored"
    assert any(e["committed"] and e["copies_moved"] > 0 for e in report["ranks"][0]["rebalances"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["fp8", "deq"])  # deq: the reference is transformers' from_pretrained(config=)
def test_run_kimi_k2(ckpts, tmp_path, source):
    kimi = tmp_path / "kimi"
    shutil.copytree(ckpts[source], kimi)
    _edit_config(kimi, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    report = _run(kimi, tmp_path)
    assert report["model_type"] == "kimi_k2"
    assert report["matches_reference"] is True


def test_kimi_k25_wrapper_with_language_model_prefix(ckpts, tmp_path):
    wrapped = tmp_path / "k25"
    _copy_meta(ckpts["fp8"], wrapped)
    text = json.loads((ckpts["fp8"] / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    (wrapped / "config.json").write_text(json.dumps({
        "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}, "text_config": text,
        "vision_config": {"vt_hidden_size": 8},
    }))
    tensors = {f"language_model.{k}": v for k, v in _tensors(ckpts["fp8"]).items()}
    tensors["vision_tower.patch_embed.weight"] = torch.randn(8, 8)
    save_file(tensors, wrapped / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    assert _rel(_logits(wrapped, ids), _logits(ckpts["deq"], ids)) < 1e-6
    with torch.no_grad():
        assert _rel(load_full_model(str(wrapped))(ids).logits, _logits(ckpts["deq"], ids)) < 1e-6


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_a_proj.weight",
                                  "model.layers.2.mlp.experts.9.down_proj.weight"])
def test_float8_tensor_without_scale_is_named(ckpts, tmp_path, name):
    broken = tmp_path / "broken"
    _copy_meta(ckpts["fp8"], broken)
    tensors = _tensors(ckpts["fp8"])
    del tensors[name + "_scale_inv"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*float8_e4m3fn.*no .*_scale_inv"):
        load_ep_model(str(broken), ExpertPlacement.trivial(2, 16, 1), Comm(None),
                      options=MoELayerOptions(dispatcher="local"))


def _per_block_reference(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``q [..., N, K]`` times its block's scale, one block at a time."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[..., rows, cols] = q[..., rows, cols].float() * scale[..., i, j, None, None]
    return out


def _random_fp8(*shape: int, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 40).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("block", [(64, 128), (128, 64), (32, 96), (128, 128)])
def test_dequantize_non_square_blocks_against_per_block_reference(block):
    """Ragged ``[3, 150, 200]`` in ``bn x bk`` blocks: each block multiplied by its own scale."""
    from epmoe.models.checkpoint import dequantize_blockwise

    bn, bk = block
    q = _random_fp8(3, 150, 200, seed=bn + bk)
    scale = torch.rand(3, -(-150 // bn), -(-200 // bk), generator=torch.Generator().manual_seed(7)) + 0.1
    got = dequantize_blockwise(q, scale, block)
    assert got.dtype == torch.float32
    assert torch.equal(got, _per_block_reference(q, scale, bn, bk))
    assert torch.equal(dequantize_blockwise(q[1], scale[1], block), got[1])


def test_reader_dequantizes_64x128_blocks(tmp_path):
    """A checkpoint with ``weight_block_size [64, 128]``: whole tensors, one expert of a fused tensor and one row
    each read with their own blocks' scales."""
    q2, s2 = _random_fp8(150, 200, seed=1), torch.rand(3, 2, generator=torch.Generator().manual_seed(2)) + 0.1
    q3, s3 = _random_fp8(4, 150, 200, seed=3), torch.rand(4, 3, 2, generator=torch.Generator().manual_seed(4)) + 0.1
    save_file({"w.weight": q2, "w.weight_scale_inv": s2, "e.gate_up_proj": q3, "e.gate_up_proj_scale_inv": s3},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**FP8_CONFIG,
                                                                              "weight_block_size": [64, 128]}}))
    reader = CheckpointReader(tmp_path)
    assert reader.block_size == (64, 128)
    want2, want3 = _per_block_reference(q2, s2, 64, 128), _per_block_reference(q3, s3, 64, 128)
    assert torch.equal(reader.get("w.weight"), want2)
    assert torch.equal(reader.get("e.gate_up_proj"), want3)
    assert torch.equal(reader.get("e.gate_up_proj", index=2), want3[2])
    for row in (0, 63, 64, 100, 149):  # rows of the first, second and ragged third row block
        assert torch.equal(reader.get("w.weight", index=row), want2[row]), row
