"""Cost-model formulas, and the expert-compute model against the stored H200 measurements.

The measurement test is a regression test of the model against ``benchmarks/results/moe_layer_h200.json``
(written by ``benchmarks/moe_layer.py`` on one H200); nothing is timed here. When that file is replaced by
a new run, ``python benchmarks/planner_vs_h200.py`` prints the table and re-fits the stream/matrix overlap and
the fixed per-layer cost.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from epmoe.plan.costs import (
    ACT_BYTES,
    MoEDims,
    collective_ms,
    compute_dtype,
    dispatch_layout_ms,
    expected_distinct_experts,
    expert_activation_bytes,
    expert_layer_ms,
    predict_moe_layer_time,
)
from epmoe.plan.hardware import load_hardware, parse_hardware

from ..conftest import CONFIGS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "moe_layer_h200.json"
# benchmarks/planner_vs_h200.py --int4-results: the INT4 rows' measured times (the path the backend takes).
INT4_RESULTS = RESULTS.with_name("planner_vs_h200_int4.json")
# ... --hardware h100-sxm --int4-results of the MXFP4 rows measured on an H100.
MXFP4_RESULTS = RESULTS.with_name("planner_vs_h100_mxfp4.json")
MXFP4_H200_RESULTS = RESULTS.with_name("planner_vs_h200_mxfp4.json")
# benchmarks/moe_layer.py's cases: Qwen3-30B-A3B layer (128 of 128 experts local), DeepSeek-V3 EP8 shard (32 of 256).
CASES = {"qwen3": (MoEDims(2048, 768, 128, 8), 128), "dsv3": (MoEDims(7168, 2048, 256, 8), 32)}


def test_expected_distinct_experts_hand_worked():
    # Qwen3 (E 128, K 8), 8 tokens: a given expert is missed by one token with probability 120/128 = 15/16,
    # by all 8 with (15/16)^8 = 0.596719..., so 128 x (1 - 0.596719) = 51.620 experts are hit.
    assert (15 / 16) ** 8 == pytest.approx(0.5967194, abs=1e-7)
    assert expected_distinct_experts(8, 128, 8) == pytest.approx(51.620, abs=1e-3)
    # One token hits exactly K; no tokens hit none; many tokens hit all.
    assert expected_distinct_experts(1, 128, 8) == pytest.approx(8.0)
    assert expected_distinct_experts(0, 128, 8) == 0.0
    assert expected_distinct_experts(4096, 128, 8) == pytest.approx(128.0)
    # DeepSeek-V3 EP8 shard, 32 of 256 experts: one token -> 32 x 8/256 = 1; 32 tokens -> 32 (1 - (31/32)^32)
    # = 32 x (1 - 0.362055) = 20.414.
    assert expected_distinct_experts(1, 256, 8, 32) == pytest.approx(1.0)
    assert expected_distinct_experts(32, 256, 8, 32) == pytest.approx(20.414, abs=1e-3)
    # K = E: every expert is hit by every token.
    assert expected_distinct_experts(1, 8, 8) == 8.0


def test_expected_distinct_experts_matches_sampling():
    # 4000 draws of 8 tokens each choosing 8 distinct experts of 128 without replacement.
    rng = np.random.default_rng(0)
    hits = [len(np.unique(np.concatenate([rng.choice(128, 8, replace=False) for _ in range(8)])))
            for _ in range(4000)]
    assert np.mean(hits) == pytest.approx(expected_distinct_experts(8, 128, 8), abs=0.3)


def test_expected_distinct_experts_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        expected_distinct_experts(1, 8, 9)
    with pytest.raises(ValueError, match="num_tokens"):
        expected_distinct_experts(-1, 8, 2)
    with pytest.raises(ValueError, match="num_local"):
        expected_distinct_experts(1, 8, 2, 9)
    with pytest.raises(ValueError, match="num_experts"):
        expected_distinct_experts(1, 0, 1)


def test_expert_activation_bytes_hand_worked():
    # Qwen3 layer, 64 rows: 64 x (3 x 2048 + 2 x 768) x 2 B = 64 x 7680 x 2 = 983,040 B; TP4 slices F only.
    assert expert_activation_bytes(MoEDims(2048, 768, 128, 8), 64) == 983_040
    assert expert_activation_bytes(MoEDims(2048, 768, 128, 8), 64, tp=4) == 64 * (3 * 2048 + 2 * 192) * 2


def test_expert_layer_ms_hand_worked_overlap_0_and_1():
    # D 1024, F 512, 4 experts hit, 100 rows, expert TP 2, bf16 on 1 TB/s and 100 TFLOP/s, 10 us fixed.
    # Weights 4 x 3 x 1024 x 512 x 2 B / 2 = 6,291,456 B; activations 100 x (3 x 1024 + 2 x 512 / 2) x 2 B
    # = 716,800 B; stream 7,008,256 B / 1 TB/s = 7.008256 us. Matrix 100 x 2 x 1,572,864 / 2 = 157,286,400
    # FLOPs / 100 TFLOP/s = 1.572864 us.
    dims = MoEDims(1024, 512, 16, 2)
    base = dataclasses.replace(load_hardware("h200-sxm"), hbm_bytes_per_s=1e12, matmul_flops_per_s={"bf16": 1e14},
                               moe_layer_fixed_us=10.0)

    def us(rows: float, overlap: float) -> float:
        hw = dataclasses.replace(base, moe_stream_matrix_overlap=overlap)
        return expert_layer_ms(dims, rows, 4, 2, hw, "bf16") * 1e3

    # overlap 0: added, 7.008256 + 1.572864 + 10 = 18.58112 us; overlap 1: the longer only, 17.008256 us;
    # overlap 0.25: 7.008256 + 0.75 x 1.572864 + 10 = 18.187904 us.
    assert us(100, 0.0) == pytest.approx(18.58112, abs=1e-9)
    assert us(100, 1.0) == pytest.approx(17.008256, abs=1e-9)
    assert us(100, 0.25) == pytest.approx(18.187904, abs=1e-9)
    # 2000 rows, matrix-bound: activations 2000 x 3584 x 2 B = 14,336,000 B -> stream 20.627456 us; matrix
    # 3,145,728,000 FLOPs -> 31.45728 us. Overlap 0: 62.084736 us; overlap 1: 41.45728 us.
    assert us(2000, 0.0) == pytest.approx(62.084736, abs=1e-9)
    assert us(2000, 1.0) == pytest.approx(41.45728, abs=1e-9)


def _h200_doc() -> dict:
    return json.loads(resources.files("epmoe.plan.hardware").joinpath("h200-sxm.json").read_text())


@pytest.mark.parametrize("value", [1.5, -0.1, "0.5", True, None, float("nan")])
def test_profile_overlap_outside_0_1_or_not_a_number_refused(value):
    doc = _h200_doc()
    doc["moe_stream_matrix_overlap"] = value
    with pytest.raises(ValueError, match=r"field 'moe_stream_matrix_overlap' must be a number in \[0, 1\], got "):
        parse_hardware(doc, "bad.json")


def test_profile_overlap_absent_means_0_and_bounds_accepted():
    doc = _h200_doc()
    del doc["moe_stream_matrix_overlap"]
    assert parse_hardware(doc).moe_stream_matrix_overlap == 0.0
    for value in (0, 1, 0.527):
        doc["moe_stream_matrix_overlap"] = value
        assert parse_hardware(doc).moe_stream_matrix_overlap == value


def test_model_within_25_percent_of_h200_measurements():
    results = json.loads(RESULTS.read_text())
    hw = load_hardware("h200-sxm")
    assert results["rows"], f"{RESULTS} holds no rows"
    off = []
    for row in results["rows"]:
        dims, local = CASES[row["case"]]
        predicted_us = predict_moe_layer_time(dims, row["tokens"], local, hw, "bf16") * 1e3
        ratio = predicted_us / row["ours_us"]
        if not 0.75 <= ratio <= 1.25:
            off.append(f"{row['case']} T={row['tokens']}: measured {row['ours_us']:.1f} us, "
                       f"predicted {predicted_us:.1f} us ({ratio:.2f}x)")
    assert not off, ("expert-compute model off by more than 25% (re-fit with benchmarks/planner_vs_h200.py): "
                     + "; ".join(off))


def test_expert_layer_ms_int4_figures_hand_worked():
    # the same layer as above with INT4 group-32 weights (0.5625 B a parameter): weights 4 x 1,572,864 x 0.5625 / 2
    # = 1,769,472 B + activations 716,800 B = 2,486,272 B at 0.5 x 1 TB/s = 4.972544 us; matrix 157,286,400 FLOPs
    # at the w4a16 rate of 50 TFLOP/s = 3.145728 us; overlap 0 and the INT4 fixed cost 30 us: 38.118272 us
    dims = MoEDims(1024, 512, 16, 2)
    hw = dataclasses.replace(load_hardware("h200-sxm"), hbm_bytes_per_s=1e12, moe_layer_fixed_us=10.0,
                             matmul_flops_per_s={"bf16": 1e14, "w4a16": 5e13}, moe_stream_matrix_overlap=0.0,
                             moe_w4a16_layer_fixed_us=30.0, moe_w4a16_stream_efficiency=0.5)
    assert compute_dtype("int4_group32") == "w4a16"
    assert expert_layer_ms(dims, 100, 4, 2, hw, "int4_group32") * 1e3 == pytest.approx(38.118272, abs=1e-9)
    # a profile without the INT4 figures: the bf16 rate, the full bandwidth and the bf16 fixed cost:
    # 2,486,272 B / 1 TB/s = 2.486272 us + 1.572864 us + 10 us
    plain = dataclasses.replace(hw, matmul_flops_per_s={"bf16": 1e14}, moe_w4a16_layer_fixed_us=None,
                                moe_w4a16_stream_efficiency=1.0)
    assert expert_layer_ms(dims, 100, 4, 2, plain, "int4_group32") * 1e3 == pytest.approx(14.059136, abs=1e-9)


def test_expert_layer_ms_mxfp4_priced_on_packed_bytes():
    # D 1024, F 512, 4 experts hit, expert TP 1, MXFP4 (0.53125 B a parameter), priced with the W4A16 kernels'
    # figures as INT4: 1 TB/s at a stream efficiency of 0.5, w4a16 50 TFLOP/s, overlap 0, 30 us fixed. 16 rows:
    # weights 4 x 1,572,864 x 0.53125 = 3,342,336 B + activations 16 x (3 x 1024 + 2 x 512) x 2 = 131,072 B ->
    # 6.946816 us; matrix 16 x 2 x 1,572,864 = 50,331,648 FLOPs -> 1.00663296 us; 37.95344896 us. 300 rows:
    # activations 2,457,600 B -> 11.599872 us; matrix 18.874368 us; 60.47424 us.
    dims = MoEDims(1024, 512, 16, 2)
    hw = dataclasses.replace(load_hardware("h200-sxm"), hbm_bytes_per_s=1e12, moe_layer_fixed_us=10.0,
                             matmul_flops_per_s={"bf16": 1e14, "w4a16": 5e13}, moe_stream_matrix_overlap=0.0,
                             moe_w4a16_layer_fixed_us=30.0, moe_w4a16_stream_efficiency=0.5,
                             moe_mxfp4_layer_fixed_us=None, moe_mxfp4_stream_efficiency=None)
    assert compute_dtype("mxfp4") == "w4a16"
    assert expert_layer_ms(dims, 16, 4, 1, hw, "mxfp4") * 1e3 == pytest.approx(37.95344896, abs=1e-9)
    assert expert_layer_ms(dims, 300, 4, 1, hw, "mxfp4") * 1e3 == pytest.approx(60.47424, abs=1e-9)
    # MXFP4's own figures, where the profile has them, replace the W4A16 ones for MXFP4 and only for it: at 0.25
    # of the bandwidth and 20 us fixed, 16 rows stream 3,473,408 B in 13.893632 us, the matrix's 1.00663296 us add
    # at overlap 0: 34.90026496 us
    own = dataclasses.replace(hw, moe_mxfp4_layer_fixed_us=20.0, moe_mxfp4_stream_efficiency=0.25)
    assert expert_layer_ms(dims, 16, 4, 1, own, "mxfp4") * 1e3 == pytest.approx(34.90026496, abs=1e-9)
    assert expert_layer_ms(dims, 16, 4, 1, own, "int4_group32") == expert_layer_ms(dims, 16, 4, 1, hw,
                                                                                    "int4_group32")
    # one of the two given: the other is the W4A16 figure (0.5 of the bandwidth, 20 us: 6.946816 + 1.00663296 + 20)
    half = dataclasses.replace(hw, moe_mxfp4_layer_fixed_us=20.0)
    assert expert_layer_ms(dims, 16, 4, 1, half, "mxfp4") * 1e3 == pytest.approx(27.95344896, abs=1e-9)


def test_mxfp4_model_within_25_percent_of_h200_measurements():
    # the H200 profile's moe_mxfp4_* figures fitted to gpt-oss-20b's MXFP4 layer measured on an H200
    # (benchmarks/planner_vs_h200.py --int4-results moe_layer_mxfp4_h200_fit_rows.json)
    doc = json.loads(MXFP4_H200_RESULTS.read_text())
    hw = load_hardware("h200-sxm")
    assert (hw.moe_mxfp4_stream_efficiency, hw.moe_mxfp4_layer_fixed_us) == (0.5, 14.8)
    assert [row["tokens"] for row in doc["rows"]] == [1, 2, 8]
    for row in doc["rows"]:
        predicted_us = predict_moe_layer_time(MoEDims(2880, 2880, 32, 4), row["tokens"], 32, hw, "mxfp4") * 1e3
        assert 0.75 <= predicted_us / row["measured_us"] <= 1.25, (row, predicted_us)


def test_mxfp4_model_within_25_percent_of_h100_measurements():
    # the H100 profile's W4A16 figures fitted to the gpt-oss MXFP4 layers measured on an H100
    # (benchmarks/planner_vs_h200.py --hardware h100-sxm --int4-results moe_layer_mxfp4_h100_fit_rows.json)
    doc = json.loads(MXFP4_RESULTS.read_text())
    hw = load_hardware("h100-sxm")
    assert len(doc["rows"]) == 17, f"{MXFP4_RESULTS} holds {len(doc['rows'])} rows"
    off = []
    for row in doc["rows"]:
        experts = {"gptoss_mxfp4": 128, "gptoss20b_mxfp4": 32}[row["case"]]
        predicted_us = predict_moe_layer_time(MoEDims(2880, 2880, experts, 4), row["tokens"], experts, hw,
                                              "mxfp4") * 1e3
        if not 0.75 <= predicted_us / row["measured_us"] <= 1.25:
            off.append(f"{row['case']} T={row['tokens']}: measured {row['measured_us']:.1f} us, predicted "
                       f"{predicted_us:.1f} us")
    assert not off, ("MXFP4 expert model off by more than 25% (re-fit with benchmarks/planner_vs_h200.py "
                     "--hardware h100-sxm --int4-results): " + "; ".join(off))


@pytest.mark.parametrize("field", ["moe_w4a16_stream_efficiency", "moe_mxfp4_stream_efficiency",
                                   "mla_decode_read_efficiency"])
@pytest.mark.parametrize("value", [0, 1.01, 1.5, -0.1, "0.5", True, None])
def test_profile_efficiency_outside_0_1_refused(field, value):
    doc = _h200_doc()
    doc[field] = value
    with pytest.raises(ValueError, match=rf"bad.json: field '{field}' must be a number in \(0, 1\], got "):
        parse_hardware(doc, "bad.json")
    del doc[field]
    assert getattr(parse_hardware(doc), field) == (None if field == "moe_mxfp4_stream_efficiency" else 1.0)


def test_profile_efficiency_defaults():
    doc = _h200_doc()
    del doc["moe_w4a16_stream_efficiency"], doc["moe_w4a16_layer_fixed_us"]
    hw = parse_hardware(doc)
    assert (hw.moe_w4a16_stream_efficiency, hw.moe_w4a16_layer_fixed_us) == (1.0, None)
    assert load_hardware("h200-sxm").mla_decode_read_efficiency == 0.74


def test_int4_model_within_25_percent_of_h200_measurements():
    doc = json.loads(INT4_RESULTS.read_text())
    hw = load_hardware("h200-sxm")
    assert len(doc["rows"]) == 8, f"{INT4_RESULTS} holds {len(doc['rows'])} rows"
    kimi = MoEDims(7168, 2048, 384, 8)
    off = []
    for row in doc["rows"]:
        local = {"kimi_int4": 48, "kimi_full_int4": 384}[row["case"]]
        predicted_us = predict_moe_layer_time(kimi, row["tokens"], local, hw, "int4") * 1e3
        if not 0.75 <= predicted_us / row["measured_us"] <= 1.25:
            off.append(f"{row['case']} T={row['tokens']}: measured {row['measured_us']:.1f} us, predicted "
                       f"{predicted_us:.1f} us")
    assert not off, ("INT4 expert model off by more than 25% (re-fit with benchmarks/planner_vs_h200.py "
                     "--int4-results): " + "; ".join(off))


def test_collective_ms_reads_a_measured_curve():
    link = load_hardware("h200-sxm").intra_node
    curved = dataclasses.replace(link, all_reduce_ms_by_bytes=((1024.0, 0.010), (4096.0, 0.040)),
                                 all_to_all_ms_by_bytes=((2048.0, 0.020), (8192.0, 0.080)))
    # all-reduce of a 2048 B buffer: halfway in log2 between 1024 and 4096 -> sqrt(0.010 * 0.040) = 0.020 ms
    assert collective_ms("all_reduce", 2048, 2, curved) == pytest.approx(0.020)
    assert collective_ms("all_reduce", 100, 2, curved) == pytest.approx(0.010)  # flat below the first point
    # beyond the last point: the last time plus the extra bus bytes at the link's bandwidth
    extra = 2 * (2 - 1) / 2 * (8192 - 4096) / link.all_reduce_busbw_bytes_per_s * 1e3
    assert collective_ms("all_reduce", 8192, 2, curved) == pytest.approx(0.040 + extra)
    # all-to-all: 2048 B sent to the other of 2 ranks is a 4096 B buffer -> sqrt(0.020 * 0.080) = 0.040 ms
    assert collective_ms("all_to_all", 2048, 2, curved) == pytest.approx(0.040)
    # reduce-scatter moves half an all-reduce's bytes: the all-reduce curve at half the buffer
    assert collective_ms("reduce_scatter", 4096, 2, curved) == pytest.approx(0.020)
    # without a curve: the latency + bandwidth line
    assert collective_ms("all_to_all", 2048, 2, link) == pytest.approx(
        link.all_to_all_latency_us * 1e-3 + 2048 / link.all_to_all_busbw_bytes_per_s * 1e3)


def test_dispatch_layout_ms_hand_worked():
    # 100 tokens reaching 1.5 ranks each: pack reads and writes 150 rows, combine reads 150 and writes 100
    ms = dispatch_layout_ms(150, 100, 7168, 4e12, 9.4)
    assert ms == pytest.approx(9.4e-3 + (3 * 150 + 100) * 7168 * ACT_BYTES / 4e12 * 1e3)


@pytest.mark.parametrize("name,billions", [
    # the published totals: DeepSeek-V3 671B (its MTP layer aside), Kimi-K2 1.03T, Qwen3-30B-A3B 30.5B,
    # Mixtral-8x7B 46.7B, gpt-oss-20b 20.9B
    ("deepseek-v3", 671.0), ("kimi-k2-instruct", 1026.4), ("qwen3-30b-a3b", 30.5), ("mixtral-8x7b", 46.7),
    ("gpt-oss-20b", 20.9),
])
def test_model_params_of_published_models(name, billions):
    from epmoe.plan.costs import model_params
    from epmoe.spec import load_moe_spec

    assert model_params(load_moe_spec(CONFIGS / f"{name}.config.json")) / 1e9 == pytest.approx(billions, abs=0.05)


def test_model_params_counts_a_tied_lm_head_once(tmp_path):
    # the same model with the LM head tied to the embedding holds one vocab x hidden table fewer
    import json

    from epmoe.plan.costs import model_params
    from epmoe.spec import load_moe_spec

    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
    untied = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tied = load_moe_spec(tmp_path / "config.json")
    assert not untied.tie_word_embeddings and tied.tie_word_embeddings
    assert model_params(untied) - model_params(tied) == 151936 * 2048 == untied.vocab_size * untied.hidden_size
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": "yes"}))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_moe_spec(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": None}))  # transformers refuses it
    with pytest.raises(ValueError, match="field 'tie_word_embeddings' is null in config.json; give true or false"):
        load_moe_spec(tmp_path / "config.json")
    # a composite config's model class decides which level ties (Kimi-K2.5: the top level): both tables counted
    kimi = json.loads((CONFIGS / "kimi-k2.5.config.json").read_text())
    kimi["text_config"]["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    assert not load_moe_spec(tmp_path / "config.json").tie_word_embeddings
