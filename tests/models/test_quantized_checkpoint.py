"""INT4 pack-quantized (Kimi-K2.5), MXFP4 (gpt-oss) and block-FP8 (DeepSeek-V3) checkpoints served with their
experts kept as stored.

The checkpoints are ``epmoe.models.tiny``'s ``kimi-k2.5-int4``, ``gpt-oss-mxfp4`` (transformers' own model, routed
experts quantized and packed by ``compressed-tensors``) and ``deepseek-v3-fp8``. The reference is transformers'
model loaded with ``from_pretrained`` from a twin checkpoint whose experts were dequantized by the formats' own code
(compressed-tensors' ``unpack_from_int32`` + ``dequantize``; transformers' ``convert_moe_packed_tensors``; FP8: each
value times its block's scale, in plain torch), so nothing of ours takes part in it.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from epmoe.comm import Comm
from epmoe.experts import BlockFP8ExpertWeights, Int4ExpertWeights, MXFP4ExpertWeights
from epmoe.layer import MoELayerOptions
from epmoe.placement import ExpertPlacement
from epmoe.runtime.launch import RankInfo, init_group, spawn

from ..hf_greedy import hf_greedy

FAMILIES = ("kimi-k2.5-int4", "gpt-oss-mxfp4", "deepseek-v3-fp8")
WEIGHT_TYPES = {"kimi-k2.5-int4": Int4ExpertWeights, "gpt-oss-mxfp4": MXFP4ExpertWeights,
                "deepseek-v3-fp8": BlockFP8ExpertWeights}
EXPERTS = {"kimi-k2.5-int4": 16, "gpt-oss-mxfp4": 8, "deepseek-v3-fp8": 16}
STORED_DTYPE = {"kimi-k2.5-int4": "torch.int32", "gpt-oss-mxfp4": "torch.uint8",
                "deepseek-v3-fp8": "torch.float8_e4m3fn"}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _dequantized_twin(src: Path, dst: Path) -> Path:
    """The same model with every packed tensor dequantized by the format's own package, unwrapped and
    unquantized, so that transformers' ``from_pretrained`` reads it."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if "text_config" in cfg:  # Kimi-K2.5: the language model alone, as DeepSeek-V3 (its architecture)
        cfg = {**cfg["text_config"], "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = _tensors(src)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
    out = {}
    for name, t in tensors.items():
        plain = name.removeprefix("language_model.")
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            q = unpack_from_int32(t, 4, torch.Size(tensors[base + "_shape"].tolist()))
            out[plain[: -len("_packed")]] = dequantize(q, tensors[base + "_scale"].float(), args=args)
        elif name + "_scale_inv" in tensors:  # block FP8: each value times its 128x128 block's scale
            scale = tensors[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[plain] = t.float() * scale[: t.shape[0], : t.shape[1]]
        elif name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[plain[: -len("_blocks")]] = convert_moe_packed_tensors(t, tensors[base + "_scales"],
                                                                        dtype=torch.float32).contiguous()
        elif not name.endswith(("_scale", "_shape", "_scales", "_scale_inv")):
            out[plain] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoints, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (the quantized checkpoint, its dequantized twin)."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for fam in FAMILIES:
        src = tiny_checkpoints(fam)
        out[fam] = (str(src), str(_dequantized_twin(src, root / f"{fam}-deq")))
    return out


def _check(directory: str, twin: str, comm: Comm, layout: str, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import load_ep_model
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(directory)
    placement = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, comm.size, comm.size, layout)
    dispatcher = "local" if comm.size == 1 else "all_to_all"
    ep = load_ep_model(directory, placement, comm, options=MoELayerOptions(dispatcher=dispatcher))
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(seed * 31 + comm.rank))
    with torch.no_grad():
        ours, theirs = ep.model(ids).logits, ref(ids).logits
    prompts = [ids[0].tolist(), ids[1, :4].tolist()]
    weights = ep.moe_layers[0].experts.weights()
    return {"rel_err": float((ours - theirs).norm() / theirs.norm()),
            "tokens_equal": hf_greedy(ep.model, prompts, 4, 258) == hf_greedy(ref, prompts, 4, 258),
            "weights": type(weights).__name__, "held": ep.expert_bytes / ep.full_expert_bytes,
            "dtypes": sorted({str(p.dtype) for p in ep.moe_layers[0].experts.parameters()})}


@pytest.mark.parametrize("family", FAMILIES)
def test_ep1_matches_transformers_on_dequantized_weights(ckpts, family):
    r = _check(*ckpts[family], Comm(None), "contiguous", seed=0)
    assert r["rel_err"] < 1e-5 and r["tokens_equal"], r
    assert r["weights"] == WEIGHT_TYPES[family].__name__
    assert STORED_DTYPE[family] in r["dtypes"]  # the experts stay as stored, not widened


def _rebalanced_equal(directory: str, comm: Comm) -> dict:
    """Load INT4 under one placement, move to another live, compare with a fresh load under the new one."""
    from epmoe.models.hf import load_ep_model
    from epmoe.runtime import rebalance

    old = ExpertPlacement.trivial(2, 16, comm.size, num_redundant=comm.size)
    new = ExpertPlacement.trivial(2, 16, comm.size, num_redundant=comm.size, layout="round_robin")
    options = MoELayerOptions(dispatcher="all_to_all")
    ep = load_ep_model(directory, old, comm, options=options)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5 + comm.rank))
    with torch.no_grad():
        before = ep.model(ids).logits
    result = rebalance.migrate(ep, new, epoch=1, timeout_s=20)
    fresh = load_ep_model(directory, new, comm, options=options)
    same = all(torch.equal(a, b) and a.dtype == b.dtype for la, lb in zip(ep.moe_layers, fresh.moe_layers)
               for a, b in zip(la.experts.parameters(), lb.experts.parameters()))
    with torch.no_grad():
        after, fresh_logits = ep.model(ids).logits, fresh.model(ids).logits
    return {"committed": result.committed, "received": result.copies_received, "bytes": result.bytes_received,
            "same_weights": same, "after_equals_fresh": torch.equal(after, fresh_logits),
            "rel_vs_before": float((after - before).norm() / before.norm())}


def _worker(info: RankInfo, dirs: dict[str, tuple[str, str]]) -> dict:
    comm = Comm(init_group(info, "cpu"))
    layout = "contiguous" if comm.size == 2 else "round_robin"
    out = {(fam, layout): _check(*dirs[fam], comm, layout, seed=i) for i, fam in enumerate(FAMILIES)}
    if comm.size == 2:
        out["rebalance"] = _rebalanced_equal(dirs["kimi-k2.5-int4"][0], comm)
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [2, 4])
def test_multi_rank_matches_transformers_and_moves_int4_experts(ckpts, ep):
    from epmoe.experts.storage import ExpertStorage

    results = spawn(_worker, ep, (ckpts,))
    for rank, res in enumerate(results):
        for key, r in res.items():
            if key == "rebalance":
                continue
            assert r["rel_err"] < 1e-5 and r["tokens_equal"], (rank, key, r)
            assert r["weights"] == WEIGHT_TYPES[key[0]].__name__
            e = EXPERTS[key[0]]
            assert r["held"] == pytest.approx((e / ep + 1) / e), key  # only this rank's slots were read
    if ep == 2:
        per_expert = ExpertStorage.of("int4_group32", 32).bytes_per_expert(64, 32, dtype_bytes=4)
        for r in (res["rebalance"] for res in results):
            assert r["committed"] and r["received"] > 0
            assert r["bytes"] == r["received"] * per_expert  # packed words + scales, one message per copy
            assert r["same_weights"] and r["after_equals_fresh"], r
            assert r["rel_vs_before"] < 1e-6


def test_packing_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from epmoe.experts.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 40, 96), generator=g, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 40, 12)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(pack_to_int32(q, 4)), q)
    assert torch.equal(unpack_from_int32(packed, 4, q.shape), q)
    w = torch.randn(2, 24, 128, generator=g)
    p, s = quantize_int4(w, 32)
    deq = dequantize_int4(p, s, 32, torch.float32)
    assert torch.equal(deq, (unpack_from_int32(p, 4, w.shape).float().unflatten(-1, (-1, 32))
                             * s.unsqueeze(-1)).flatten(-2))
    assert 0.0 < float((deq - w).norm() / w.norm()) < 0.12  # really 4 bits, and close
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8))


def test_mxfp4_matches_transformers_and_compressed_tensors():
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from epmoe.experts.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    deq = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), deq)
    values = unpack_fp4_from_uint8(blocks.reshape(-1, 16), blocks.numel() // 16, 32, torch.float32)
    theirs = values.view(3, 40, 3, 32) * decompress_mx_scale(scales).float().unsqueeze(-1)
    assert torch.equal(theirs.flatten(-2), deq)
    assert 0.0 < float((deq - w).norm() / w.norm()) < 0.2
    # a tie between two E2M1 magnitudes goes to the smaller one (block scale 1: amax 4 to 7.99)
    ties = torch.tensor([0.25, 2.5, 5.0, -2.5, 1.25, 1.75, 0.75, 4.0] * 4)
    assert dequantize_mxfp4(*quantize_mxfp4(ties), torch.float32)[:8].tolist() == [0.0, 2.0, 4.0, -2.0, 1.0, 1.5,
                                                                                   0.5, 4.0]


def test_mxfp4_bad_tensors_are_named():
    from epmoe.experts.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(TypeError, match="MXFP4 blocks must be uint8, got torch.int8"):
        dequantize_mxfp4(blocks.to(torch.int8), scales)
    with pytest.raises(TypeError, match="MXFP4 scales must be uint8, got torch.int32"):
        dequantize_mxfp4(blocks, scales.int())
    with pytest.raises(ValueError, match=r"blocks \(16,\) and scales \(\) do not fit"):
        dequantize_mxfp4(torch.zeros(16, dtype=torch.uint8), torch.zeros((), dtype=torch.uint8))
    odd = torch.zeros(2, 65, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="w13_blocks has 65 rows; gate and up rows"):
        MXFP4ExpertWeights(odd, torch.zeros(2, 65, 2, dtype=torch.uint8), torch.zeros(2, 64, 1, 16, dtype=torch.uint8),
                           torch.zeros(2, 64, 1, dtype=torch.uint8))
    u8 = functools.partial(torch.zeros, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w13_blocks \(2, 64, 0, 16\) holds no weights"):
        MXFP4ExpertWeights(u8(2, 64, 0, 16), u8(2, 64, 0), u8(2, 0, 1, 16), u8(2, 0, 1))
    i32 = functools.partial(torch.zeros, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w13_packed \(2, 64, 0\) holds no weights"):  # INT4 likewise
        Int4ExpertWeights(i32(2, 64, 0), torch.zeros(2, 64, 0), i32(2, 0, 4), torch.zeros(2, 0, 1))
    good = (u8(2, 64, 2, 16), u8(2, 64, 2), u8(2, 64, 1, 16), u8(2, 64, 1))
    with pytest.raises(TypeError, match="b13 must be a floating-point tensor, got torch.int64"):
        MXFP4ExpertWeights(*good, torch.zeros(2, 64, dtype=torch.long))
    with pytest.raises(TypeError, match="b2 must be a floating-point tensor, got torch.int32"):
        MXFP4ExpertWeights(*good, torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.int32))
    # E8M0's NaN code dequantizes to NaN (OCP MX), its neighbour 254 to 2 ** 127; NaN input has no code
    one = torch.full((1, 16), 0x22, dtype=torch.uint8)  # every value 1.0
    deq = dequantize_mxfp4(one, torch.tensor([254], dtype=torch.uint8), torch.float32)
    assert bool((deq == 2.0 ** 127).all())
    assert bool(dequantize_mxfp4(one, torch.tensor([255], dtype=torch.uint8), torch.float32).isnan().all())
    w = torch.ones(2, 64)
    w[1, 40] = float("nan")
    w[0, 50] = float("-inf")
    with pytest.raises(ValueError, match=r"w holds 2 NaN or infinite values \(the first at \(0, 50\)\): MXFP4 has no "
                                         r"code for them"):
        quantize_mxfp4(w)
    with pytest.raises(ValueError, match="w must have at least one dimension"):
        quantize_mxfp4(torch.tensor(1.0))
    for bad, name in ((torch.ones(32, dtype=torch.complex64), "torch.complex64"), (torch.ones(32, dtype=torch.int32),
                      "torch.int32"), (torch.ones(32).numpy(), "ndarray")):
        with pytest.raises(TypeError, match=f"w must be a real floating-point tensor, got {name}"):
            quantize_mxfp4(bad)
    with pytest.raises(TypeError, match="MXFP4 values dequantize to a floating-point dtype, got torch.int32"):
        dequantize_mxfp4(one, torch.tensor([127], dtype=torch.uint8), torch.int32)
    with pytest.raises(TypeError, match="w13_blocks must be a torch.Tensor, got ndarray"):
        MXFP4ExpertWeights(good[0].numpy(), *good[1:])
    with pytest.raises(TypeError, match="b2 must be a torch.Tensor, got list"):
        MXFP4ExpertWeights(*good, None, [0.0] * 64)


def _broken(src: str, tmp: Path, edit) -> str:
    dst = tmp / "broken"
    shutil.copytree(src, dst)
    tensors = _tensors(dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(tensors, cfg)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


EXPERT = "language_model.model.layers.2.mlp.experts.5"


def _load_one_rank(directory: str):
    """``load_ep_model`` of ``directory`` on one rank (trivial placement, local dispatch)."""
    from epmoe.models.hf import load_ep_model
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(directory)
    return load_ep_model(directory, ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                         options=MoELayerOptions(dispatcher="local"))


def _drop_scale(t, cfg):
    del t[f"{EXPERT}.down_proj.weight_scale"]


def _group16(t, cfg):
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16


def _bad_shape(t, cfg):
    t[f"{EXPERT}.up_proj.weight_shape"] = torch.tensor([32, 96])


def _scale_group16(t, cfg):
    t[f"{EXPERT}.gate_proj.weight_scale"] = torch.ones(32, 4, dtype=torch.bfloat16)


def _asymmetric(t, cfg):
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False


def _no_shared_expert(t, cfg):  # the shared expert's tensors kept: was served without them, without a word
    cfg["text_config"]["n_shared_experts"] = 0


def _drop_mxfp4_scales(t, cfg):
    del t["model.layers.1.mlp.experts.down_proj_scales"]


def _packed_float(t, cfg):
    t[f"{EXPERT}.gate_proj.weight_packed"] = t[f"{EXPERT}.gate_proj.weight_packed"].float()


def _scale_int(t, cfg):
    t[f"{EXPERT}.gate_proj.weight_scale"] = t[f"{EXPERT}.gate_proj.weight_scale"].to(torch.int32)


def _group_string(t, cfg):
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = "32"


def _mxfp4_blocks_int8(t, cfg):
    t["model.layers.1.mlp.experts.down_proj_blocks"] = t["model.layers.1.mlp.experts.down_proj_blocks"].to(torch.int8)


def _mxfp4_blocks_cut(t, cfg):
    for suffix in ("_blocks", "_scales"):  # half the rows, blocks and scales agreeing with each other
        key = "model.layers.1.mlp.experts.gate_up_proj" + suffix
        t[key] = t[key][:, :32].contiguous()


def _mxfp4_blocks_of_8_bytes(t, cfg):  # was blamed on the scales, whose shape was the one expected
    key = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    t[key] = t[key][..., :8].contiguous()


def _drop_mxfp4_blocks(t, cfg):
    del t["model.layers.1.mlp.experts.gate_up_proj_blocks"]


# every checkpoint the loader refuses, doctor's up-front check (headers and config.json only) refuses the same way
REFUSED = [
    ("kimi-k2.5-int4", _drop_scale, rf"{EXPERT}.down_proj.weight_packed.*no '{EXPERT}.down_proj.weight_scale'"),
    ("kimi-k2.5-int4", _group16, r"group_size.*16.*group sizes \(32, 64, 128\)"),
    ("kimi-k2.5-int4", _bad_shape,
     rf"tensor '{EXPERT}.up_proj.weight_shape' holds \(32, 96\), expected \(32, 64\)"),
    ("kimi-k2.5-int4", _scale_group16, rf"{EXPERT}.gate_proj.weight_scale'.*per 16 inputs.*group_size 32"),
    ("kimi-k2.5-int4", _asymmetric, r"routed expert weight format 'compressed-tensors-int4-asymmetric' is not served"),
    ("kimi-k2.5-int4", _no_shared_expert, r"holds 6 tensors the model config.json describes has no place for, "
     r"the first 'model.layers.1.mlp.shared_experts.down_proj.weight' \(config.json makes it \(64, 0\), "
     r"the checkpoint holds \(64, 32\)"),
    ("kimi-k2.5-int4", _packed_float, rf"{EXPERT}.gate_proj.weight_packed' is F32, expected I32"),
    ("kimi-k2.5-int4", _scale_int, rf"{EXPERT}.gate_proj.weight_scale' is I32, expected a float dtype"),
    ("gpt-oss-mxfp4", _drop_mxfp4_scales, r"no 'model.layers.1.mlp.experts.down_proj_scales'"),
    ("gpt-oss-mxfp4", _mxfp4_blocks_int8, r"down_proj_blocks / .*down_proj_scales are I8 / U8, expected U8 / U8"),
    ("gpt-oss-mxfp4", _mxfp4_blocks_of_8_bytes, r"tensor 'model.layers.1.mlp.experts.gate_up_proj_blocks' has shape "
     r"\(8, 64, 2, 8\); its last dimension must be 16 \(the bytes of one block of 32 values\)"),
    ("gpt-oss-mxfp4", _mxfp4_blocks_cut, r"tensor 'model.layers.1.mlp.experts.gate_up_proj' \(stored as "
     r"'model.layers.1.mlp.experts.gate_up_proj_blocks' of shape \(8, 32, 2, 16\), read as \(8, 64, 32\)\), expected "
     r"\(8, 64, 64\)"),
]


@pytest.mark.parametrize("family,edit,match", REFUSED)
def test_bad_quantized_checkpoint_is_named(ckpts, tmp_path, family, edit, match):
    directory = _broken(ckpts[family][0], tmp_path, edit)
    with pytest.raises(ValueError, match=match.replace(".", "[.]").replace("[.]*", ".*")):
        _load_one_rank(directory)


def _other_packing(t, cfg):
    cfg["text_config"]["quantization_config"]["format"] = "marlin-24"


@pytest.mark.parametrize("edit, match", [
    (_asymmetric, r"config\.json: quantization_config\.config_groups\.group_0\.weights\.symmetric is false; 4-bit "
                  r"weights are read with symmetric true only$"),
    (_other_packing, r"config\.json: quantization_config\.format is \"marlin-24\"; 4-bit weights are read with format "
                     r"\"pack-quantized\" only$"),
])
def test_the_reader_refuses_an_int4_scheme_it_does_not_unpack(ckpts, tmp_path, edit, match):
    """Non-expert tensors are read through the checkpoint reader too: a 4-bit scheme it would unpack wrongly (zero
    points, another packing) is refused there by its field, as the spec names the experts unserved."""
    from epmoe.models.checkpoint import CheckpointReader

    with pytest.raises(ValueError, match=match):
        CheckpointReader(_broken(ckpts["kimi-k2.5-int4"][0], tmp_path, edit))


def _top_level_groups_string(t, cfg):  # the language model's own quantization_config is good
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": "x"}


def _only_the_wrapper_quantized(t, cfg):  # the language model names none: the wrapper's describes its weights
    cfg["quantization_config"] = cfg["text_config"]["quantization_config"]
    cfg["text_config"]["quantization_config"] = None


@pytest.mark.parametrize("edit, match", [
    (_group_string, r"config\.json: field 'text_config\.quantization_config\.config_groups\.group_0\.weights\."
                    r"group_size' must be a positive integer, got \"32\" \(a string\)$"),
    # was an AttributeError from the checkpoint reader, which read the top level's first
    (_top_level_groups_string, r"config\.json: field 'quantization_config\.config_groups' must be a JSON object, got "
                               r"\"x\" \(a string\)$"),
])
def test_bad_quantization_config_is_refused_where_the_spec_is_read(ckpts, tmp_path, edit, match):
    from epmoe.spec import load_moe_spec

    with pytest.raises(ValueError, match=match):
        load_moe_spec(_broken(ckpts["kimi-k2.5-int4"][0], tmp_path, edit))


def _scheme_nulls(t, cfg):  # null for compressed-tensors' defaults: int, symmetric, groups of the group_size
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        type=None, symmetric=None, strategy=None)


@pytest.mark.parametrize("edit", [_only_the_wrapper_quantized, _scheme_nulls])
def test_spec_and_reader_take_the_same_quantization_config(ckpts, tmp_path, edit):
    """Only the wrapper's quantization_config, or nulls for the scheme's defaults: the spec and the checkpoint reader
    both read INT4 in groups of 32 (the spec read bf16 from the language model's null and the reader refused the
    stored INT4 against it; the reader refused a null type the spec took for int)."""
    from epmoe.spec import load_moe_spec

    directory, twin = _broken(ckpts["kimi-k2.5-int4"][0], tmp_path, edit), ckpts["kimi-k2.5-int4"][1]
    assert load_moe_spec(directory).expert_weight_format == "int4_group32"
    r = _check(directory, twin, Comm(None), "contiguous", seed=0)
    assert r["rel_err"] < 1e-5 and r["tokens_equal"] and r["weights"] == "Int4ExpertWeights", r


def test_mxfp4_blocks_missing_beside_their_scales_is_named(ckpts, tmp_path):
    directory = _broken(ckpts["gpt-oss-mxfp4"][0], tmp_path, _drop_mxfp4_blocks)
    with pytest.raises(KeyError, match=r"no tensor 'model[.]layers[.]1[.]mlp[.]experts[.]gate_up_proj' \(it holds "
                                       r"'model[.]layers[.]1[.]mlp[.]experts[.]gate_up_proj_scales' without the tensor "
                                       r"they belong with\)"):
        _load_one_rank(directory)


def test_a_tensor_in_two_weights_files_is_refused(ckpts, tmp_path):
    # was read from whichever file came last: a copy left beside the weights went unnoticed
    from epmoe.models.checkpoint import CheckpointReader

    directory = tmp_path / "twice"
    shutil.copytree(ckpts["kimi-k2.5-int4"][0], directory)
    shutil.copy(directory / "model.safetensors", directory / "model-2.safetensors")
    with pytest.raises(ValueError, match=r"tensor '.+' is in both 'model-2\.safetensors' and 'model\.safetensors' "
                                         r"\(with no model\.safetensors\.index\.json to say which is read\)"):
        CheckpointReader(directory)


def test_an_index_naming_a_directory_says_so(ckpts, tmp_path):  # was "index names missing shard files ['sub']"
    from epmoe.models.checkpoint import CheckpointReader

    directory = tmp_path / "indexed"
    shutil.copytree(ckpts["kimi-k2.5-int4"][0], directory)
    (directory / "sub").mkdir()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "sub"}}))
    with pytest.raises(ValueError, match=r"index names shard file 'sub', which is not a file \(a directory or another "
                                         r"kind\)$"):
        CheckpointReader(directory)


@pytest.mark.parametrize("index,message", [
    ("not json", r" is not JSON \(Expecting value: line 1 column 1 \(char 0\)\)"),  # was the bare parser message
    ('{"metadata": {}}', r" has no object 'weight_map' \(tensor name -> shard file; its fields are \['metadata'\]\)"),
    ("[1, 2]", r" has no object 'weight_map' \(tensor name -> shard file; it holds a list\)"),  # was a TypeError
    ('{"weight_map": {"a": 3}}', r": field 'weight_map' names no shard file for tensor 'a' \(got 3\)"),
    ('{"weight_map": null}', r": field 'weight_map' must be an object \(tensor name -> shard file\), got null"),
    # was read from wherever the path led
    ('{"weight_map": {"a": "../model.safetensors"}}', r": field 'weight_map' names shard file '../model.safetensors' "
                                                      r"for tensor 'a', outside the checkpoint directory \(shards are "
                                                      r"named relative to it, without '..', as transformers reads "
                                                      r"them\)"),
    ('{"weight_map": {"a": "sub/../model.safetensors"}}', r": field 'weight_map' names shard file "
                                                          r"'sub/../model.safetensors' for tensor 'a', outside the "
                                                          r"checkpoint directory .*"),  # transformers refuses it
    ('{"weight_map": {"a": "model.safetensors/"}}', r": field 'weight_map' names shard file 'model.safetensors/' for "
                                                   r"tensor 'a', a directory's name \(ending in '/'\)"),
    ('{"weight_map": {"a": "/tmp/model.safetensors"}}', r": field 'weight_map' names shard file "
                                                        r"'/tmp/model.safetensors' for tensor 'a', outside the "
                                                        r"checkpoint directory .*"),
    # was the OS error alone ([Errno 36] File name too long)
    ('{"weight_map": {"a": "' + "x" * 300 + '.safetensors"}}',
     r": field 'weight_map' names shard file 'x{300}\.safetensors' for tensor 'a', which the file system cannot look "
     r"up: File name too long"),
    # a path through a file, a NUL byte (were "missing shard files")
    ('{"weight_map": {"a": "config.json/x.safetensors"}}',
     r": field 'weight_map' names shard file 'config.json/x\.safetensors' for tensor 'a', which the file system cannot "
     r"look up: Not a directory"),
    ('{"weight_map": {"a": "x\\u0000.safetensors"}}',
     r": field 'weight_map' names shard file 'x\\x00\.safetensors' for tensor 'a', which the file system cannot look "
     r"up: embedded null byte"),
])
def test_a_bad_index_is_named(ckpts, tmp_path, index, message):  # was "weight_map", or a TypeError's words
    from epmoe.models.checkpoint import CheckpointReader

    directory = tmp_path / "indexed"
    shutil.copytree(ckpts["kimi-k2.5-int4"][0], directory)
    (directory / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=rf"^checkpoint index '.*model\.safetensors\.index\.json'{message}$"):
        CheckpointReader(directory)


def test_a_loop_of_links_in_the_index_is_named(ckpts, tmp_path):
    # Path.is_file() reads a loop as no file: it was "index names missing shard files"
    from epmoe.models.checkpoint import CheckpointReader

    directory = tmp_path / "indexed"
    shutil.copytree(ckpts["kimi-k2.5-int4"][0], directory)
    (directory / "a.safetensors").symlink_to("b.safetensors")
    (directory / "b.safetensors").symlink_to("a.safetensors")
    (directory / "model.safetensors.index.json").write_text('{"weight_map": {"t": "a.safetensors"}}')
    with pytest.raises(ValueError, match=r"field 'weight_map' names shard file 'a\.safetensors' for tensor 't', which "
                                         r"the file system cannot look up: Too many levels of symbolic links$"):
        CheckpointReader(directory)


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_named(ckpts, tmp_path):
    # was a SafetensorError traceback from the first read of that tensor ("File does not contain tensor ...")
    from safetensors.torch import load_file, save_file

    from epmoe.models.checkpoint import CheckpointReader

    directory = tmp_path / "indexed"
    shutil.copytree(ckpts["kimi-k2.5-int4"][0], directory)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, directory / file, metadata={"format": "pt"})
    weight_map = {k: file for file, part in halves.items() for k in part}
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert len(CheckpointReader(directory).weight_map) == len(names)  # the split itself reads
    weight_map[names[0]] = "b.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"^checkpoint index '.*model\.safetensors\.index\.json': field 'weight_map' "
                                         rf"puts tensor '{re.escape(names[0])}' in shard file 'b.safetensors', "
                                         rf"which does not hold it$"):
        CheckpointReader(directory)
    from epmoe.models.hf import check_checkpoint

    packed = next(k for k in names if k.endswith(".weight_packed"))
    unlisted = {k: f for k, f in weight_map.items() if k != packed}
    unlisted[names[0]] = "a.safetensors"
    index.write_text(json.dumps({"weight_map": unlisted}))  # was "missing tensor", with no word of the shard
    with pytest.raises(KeyError, match=rf"has no tensor '{re.escape(packed.removeprefix('language_model.')[:-7])}' "
                                       rf"\(shard file '{weight_map[packed]}' holds '{re.escape(packed)}', but "
                                       rf"model\.safetensors\.index\.json does not list it\)"):
        check_checkpoint(directory)
    weight_map[names[0]] = "a.safetensors"  # a second copy in another shard: transformers would read the last
    save_file({k: tensors[k] for k in [*halves["b.safetensors"], names[0]]}, directory / "b.safetensors",
              metadata={"format": "pt"})
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(names[0])}' is in both 'a.safetensors' \(where the "
                                         rf"index puts it\) and 'b.safetensors'$"):
        CheckpointReader(directory)


def test_an_index_transformers_cannot_read_is_named_before_the_run(tiny_checkpoints, tmp_path, capsys):
    # was "epmoe run: error: metadata" (transformers' KeyError) after the run had generated
    from safetensors import safe_open

    from epmoe.cli import main
    from epmoe.models.checkpoint import check_index_for_transformers

    directory = tmp_path / "indexed"
    shutil.copytree(tiny_checkpoints("qwen3-moe"), directory)
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = list(f.keys())
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    assert main(["run", "--model", str(directory), "--max-new-tokens", "2"]) == 2
    assert (f"checkpoint index '{index}' has no object 'metadata', which transformers' from_pretrained reads for the "
            f"reference check (--no-reference runs without it)") in " ".join(capsys.readouterr().err.split())
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}))
    assert check_index_for_transformers(directory) is None  # with its metadata: nothing to refuse


@pytest.mark.parametrize("value", [float("nan"), 3e38])  # 3e38 is finite, but 8 times it is not a float32
def test_int4_scale_that_is_no_weight_is_refused_on_load(ckpts, tmp_path, value):
    # was served: NaN logits (or zeros), and the reference built from the same weights "matched"

    def bad_scale(t, cfg):
        t[f"{EXPERT}.gate_proj.weight_scale"][2, 1] = value

    directory = _broken(ckpts["kimi-k2.5-int4"][0], tmp_path, bad_scale)
    with pytest.raises(ValueError, match=rf"tensor '{EXPERT}[.]gate_proj[.]weight_scale' \(times the largest 4-bit "
                                         rf"value, 8\) holds 1 NaN or infinite value, the first at \(2, 1\): not a "
                                         rf"weight"):
        _load_one_rank(directory)


def test_mxfp4_nan_scale_is_refused_on_load(ckpts, tmp_path):
    # E8M0's NaN code in one block scale of expert 1 (a value only the data shows: doctor reads headers, the loader
    # the scales of its slots)

    def nan_scale(t, cfg):
        t["model.layers.1.mlp.experts.down_proj_scales"][1, 3, 0] = 255

    directory = _broken(ckpts["gpt-oss-mxfp4"][0], tmp_path, nan_scale)
    with pytest.raises(ValueError, match=r"tensor 'model[.]layers[.]1[.]mlp[.]experts[.]down_proj_scales' \(expert 1\) "
                                         r"holds 1 scale of 255, E8M0's NaN code, the first at \(3, 0\)"):
        _load_one_rank(directory)

    def huge_scale(t, cfg):  # 2 ** 126: a code of 4 or 6 gives a value past float32's largest
        t["model.layers.0.mlp.experts.gate_up_proj_scales"][0, 5, 1] = 253

    directory = _broken(ckpts["gpt-oss-mxfp4"][0], tmp_path / "huge", huge_scale)
    with pytest.raises(ValueError, match=r"gate_up_proj_scales' \(expert 0\) holds 1 scale above 252 \(whose blocks' "
                                         r"values, up to 6 x 2 \*\* \(s - 127\), overflow bf16 and float32\), the "
                                         r"first at \(5, 1\) \(253\)"):
        _load_one_rank(directory)


@pytest.mark.parametrize("family,edit,match", REFUSED)
def test_doctor_refuses_what_the_loader_refuses(ckpts, tmp_path, family, edit, match):
    from epmoe.doctor import DoctorConfig, diagnose

    bad = _broken(ckpts[family][0], tmp_path, edit)
    errors = [f for f in diagnose(DoctorConfig(model=bad, ep=2)) if f.severity == "error"]
    pattern = match.replace(".", "[.]").replace("[.]*", ".*")
    assert any(re.search(pattern, e.what) for e in errors), errors


def test_doctor_and_plan_report_the_expert_format_and_bytes(ckpts, tmp_path):
    from epmoe.doctor import DoctorConfig, check_expert_storage, diagnose
    from epmoe.plan.costs import bytes_per_param
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest
    from epmoe.spec import load_moe_spec

    lines = [f.line() for f in diagnose(DoctorConfig(model=ckpts["kimi-k2.5-int4"][0], ep=2))]
    assert any("routed experts int4_group32, served packed: INT4 values + bf16 scales" in ln and "8 slots x 2 MoE" in ln
               for ln in lines), lines
    kimi = load_moe_spec("data/configs/kimi-k2.5.config.json")
    (finding,) = check_expert_storage(kimi, 8, 0)
    assert "23.6 MiB per expert, 66.4 GiB per rank (48 slots x 60 MoE layers)" in finding.what  # 24.8 MB, 71.3 GB
    bad = load_moe_spec(_broken(ckpts["kimi-k2.5-int4"][0], tmp_path, _group16))
    (err,) = check_expert_storage(bad, 2, 0)
    assert err.severity == "error" and "group sizes (32, 64, 128)" in err.what
    req = PlanRequest(spec=kimi, hardware=load_hardware("h200-sxm"), gpus=8, batches=(1,))
    steps = [sp.steps[0] for sp in plan(req).strategies if sp.strategy.name.startswith("EP8")]
    per_expert = 3 * 7168 * 2048 * bytes_per_param("int4_group32")
    assert steps and all(st.memory.expert_weights == pytest.approx(60 * 48 * per_expert) for st in steps)


def test_dummy_weights_stay_packed(ckpts):
    from epmoe.models.hf import load_ep_model

    ep = load_ep_model(ckpts["kimi-k2.5-int4"][0], ExpertPlacement.trivial(2, 16, 1), Comm(None),
                       options=MoELayerOptions(dispatcher="local"), load_format="dummy")
    experts = ep.moe_layers[0].experts
    assert experts.w13_packed.dtype == torch.int32 and experts.w13_packed.unique().numel() > 100  # random words
    # the values q = nibble - 8 are symmetric about 0 (plain random bits would give -8..7, mean -1/2: every
    # expert output would share an all-ones component and all tokens would drift to the same experts)
    words = torch.cat([experts.w13_packed.flatten(), experts.w2_packed.flatten()])
    q = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)]).double() - 8
    assert q.min() == -7 and q.max() == 7
    assert abs(q.mean().item()) < 4 * q.std().item() / q.numel() ** 0.5
    with torch.no_grad():
        logits = ep.model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.multiprocess
def test_epmoe_run_on_the_int4_checkpoint(ckpts, tmp_path):
    from epmoe.cli import main

    out = tmp_path / "report.json"
    assert main(["run", "--model", ckpts["kimi-k2.5-int4"][0], "--ep", "2", "--max-new-tokens", "4",
                 "--prompt", "int4 experts", "--prompt", "packed", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["matches_reference"] is True and report["mismatches"] == []


def test_a_pipe_as_index_or_tokenizer_file_is_refused(ckpts, tmp_path):
    """A pipe as model.safetensors.index.json was taken for no index; as tokenizer_config.json it blocked epmoe run
    forever (transformers' read of it)."""
    import os

    from epmoe.engine.tokenizer import load_tokenizer
    from epmoe.models.checkpoint import CheckpointReader

    directory = tmp_path / "piped"
    shutil.copytree(ckpts["kimi-k2.5-int4"][0], directory)
    os.mkfifo(directory / "model.safetensors.index.json")
    with pytest.raises(ValueError, match=r"^checkpoint index '.*model\.safetensors\.index\.json' is not a regular "
                                         r"file$"):
        CheckpointReader(directory)
    (directory / "model.safetensors.index.json").unlink()
    (directory / "tokenizer_config.json").unlink(missing_ok=True)
    os.mkfifo(directory / "tokenizer_config.json")
    with pytest.raises(ValueError, match=r"^tokenizer file '.*tokenizer_config\.json' is not a regular file$"):
        load_tokenizer(str(directory))
