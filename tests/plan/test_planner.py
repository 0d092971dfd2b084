"""Planner: every shipped MoE config plans; collective counts and memory against hand-worked values."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from epmoe.cli import main
from epmoe.plan import plot
from epmoe.plan.costs import MoEDims, expected_destination_ranks, expected_max_load, predict_moe_layer_time
from epmoe.plan.hardware import hardware_names, load_hardware
from epmoe.plan.planner import plan
from epmoe.plan.plot import plot_formats
from epmoe.plan.report import plan_to_dict, plot_plan, recommend
from epmoe.plan.request import PlanRequest
from epmoe.spec import DenseModelError, load_moe_spec

from ..conftest import CONFIGS

MOE_CONFIGS = sorted(p for p in CONFIGS.glob("*.json") if not p.name.startswith("eagle3"))
H200 = "h200-sxm"
ENGINE_ROWS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "engine_qwen3_gemv_peer_h200.json"


def _plan(name: str, gpus: int, **kw):
    spec = load_moe_spec(CONFIGS / f"{name}.config.json")
    return plan(PlanRequest(spec=spec, hardware=load_hardware(kw.pop("hardware", H200)), gpus=gpus, **kw))


def test_shipped_profiles_load():
    assert {"h200-sxm", "h100-sxm", "rtx-pro-6000"} <= set(hardware_names())
    for name in hardware_names():
        hw = load_hardware(name)
        assert hw.memory_bytes > 0 and hw.hbm_bytes_per_s > 0 and "bf16" in hw.matmul_flops_per_s
        assert hw.sources, f"{name} names no sources"


@pytest.mark.parametrize("path", MOE_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("hardware", ["h200-sxm", "rtx-pro-6000"])
def test_every_config_plans(path, hardware):
    spec = load_moe_spec(path)
    gpus = 8 if spec.num_experts >= 8 else spec.num_experts
    p = plan(PlanRequest(spec=spec, hardware=load_hardware(hardware), gpus=gpus, spec_tokens=3))
    assert p.strategies
    for sp in p.strategies:
        for st in sp.steps:
            assert st.total_ms > 0 and math.isfinite(st.total_ms)
            assert st.memory.total > st.memory.weights > 0
    assert recommend(p)


def test_kimi_k25_tp8_counts():
    # Kimi-K2.5: 61 decoder layers (layer 0 dense, 60 MoE), D 7168.
    p = _plan("kimi-k2.5", 8, batches=(1,))
    tp = p.strategy("TP8").steps[0]
    # TP: one all-reduce after attention and one after the MLP/MoE of every layer: 2 x 61 = 122.
    assert tp.count("all_reduce") == 122
    ar = next(c for c in tp.collectives if c.kind == "all_reduce")
    assert ar.bytes_per_call == 1 * 7168 * 2  # 1 token x D x 2 B (bf16) = 14336 B
    # EP with DP attention: dispatch + combine per MoE layer, 2 x 60 = 120 all-to-alls, nothing else.
    dp = p.strategy("EP8+DPattn").steps[0]
    assert dp.count("all_to_all") == 120 and dp.count("all_reduce") == 0
    # EP with TP attention: the dense layer keeps 2 all-reduces; every MoE layer reduce-scatters,
    # dispatches, combines and all-gathers (60 + 1 logits all-gather).
    tpa = p.strategy("EP8+TPattn").steps[0]
    assert (tpa.count("all_reduce"), tpa.count("reduce_scatter"), tpa.count("all_gather"), tpa.count("all_to_all")) == (
        2, 60, 61, 120)
    assert "TP8" in recommend(p).split(" ")[0]


def test_kimi_k25_verify_step_bytes():
    # S = 3 draft tokens: 4 positions per sequence; batch 2 -> 8 tokens x 7168 x 2 B = 114688 B per all-reduce.
    st = _plan("kimi-k2.5", 8, batches=(2,), spec_tokens=3).strategy("TP8").steps[0]
    assert st.tokens == 8
    assert next(c for c in st.collectives if c.kind == "all_reduce").bytes_per_call == 8 * 7168 * 2


def test_deepseek_v3_counts_and_memory():
    p = _plan("deepseek-v3", 8, batches=(64,), context=4096)
    # 61 layers (3 dense, 58 MoE): TP8 2 x 61 = 122 all-reduces; EP8+DPattn 2 x 58 = 116 all-to-alls.
    assert p.strategy("TP8").steps[0].count("all_reduce") == 122
    ep = p.strategy("EP8+DPattn").steps[0]
    assert ep.count("all_to_all") == 116
    # MLA cache: (kv_lora 512 + rope 64) x 2 B = 1152 B per token per layer, whole on every rank.
    # DP attention: 64 / 8 = 8 sequences per rank: 8 x 4096 x 61 x 1152 = 2,302,672,896 B.
    assert ep.memory.kv_cache == 8 * 4096 * 61 * 1152 == 2_302_672_896
    # TP attention replicates the latent cache: all 64 sequences on every rank, 8x as much.
    assert p.strategy("TP8").steps[0].memory.kv_cache == 64 * 4096 * 61 * 1152
    # Routed experts per rank under EP8: 58 layers x 32 experts x 3*7168*2048 (= 44,040,192) params
    # x (1 + 4/16384) B (FP8 with one fp32 scale per 128x128 block).
    assert ep.memory.expert_weights == pytest.approx(58 * 32 * 44_040_192 * (1 + 4 / 16384))
    # A token's 8 experts among 256 (32 per rank) land on 8 * (1 - prod_{i<8} (224-i)/(256-i)) = 5.25 ranks.
    miss = math.prod((224 - i) / (256 - i) for i in range(8))
    assert expected_destination_ranks(256, 8, 8) == pytest.approx(8 * (1 - miss))
    assert 5.2 < 8 * (1 - miss) < 5.3


def test_qwen3_30b_tp4_memory():
    p = _plan("qwen3-30b-a3b", 4, batches=(8,), context=1000)
    st = p.strategy("TP4").steps[0]
    # 48 layers, all MoE, D 2048: 2 x 48 = 96 all-reduces.
    assert st.count("all_reduce") == 96
    # Per rank, bf16: attention q+o 2 x 2048 x 32 x 128 = 16,777,216 / 4 = 4,194,304; k+v 2048 x 4 x 256 =
    # 2,097,152 split over 4 KV heads -> 1 head = 524,288; experts 128 x 3 x 2048 x 768 / 4 = 150,994,944;
    # router 2048 x 128 = 262,144; per layer 155,975,680, x 48 = 7,486,832,640; embedding 151,936 x 2048 =
    # 311,164,928 whole + LM head / 4 = 77,791,232 -> 7,875,788,800 params x 2 B = 15,751,577,600 B.
    assert st.memory.weights == pytest.approx(15_751_577_600)
    # KV: 1 KV head per rank x (128 + 128) x 2 B = 512 B per token per layer; 8 seqs x 1000 x 48 x 512.
    assert st.memory.kv_cache == 8 * 1000 * 48 * 512
    # Whole model (TP1) is the published 30.5B parameters: 48 x 623,116,288 + 2 x 311,164,928.
    one = _plan("qwen3-30b-a3b", 1, batches=(1,)).strategy("TP1").steps[0]
    assert one.memory.weights / 2 == pytest.approx(48 * 623_116_288 + 2 * 311_164_928)
    assert one.collectives == ()


def test_mixtral_8x7b():
    p = _plan("mixtral-8x7b", 8, batches=(8,))
    # 32 layers: TP8 64 all-reduces; EP8+DPattn 2 x 32 = 64 all-to-alls.
    assert p.strategy("TP8").steps[0].count("all_reduce") == 64
    ep = p.strategy("EP8+DPattn").steps[0]
    assert ep.count("all_to_all") == 64
    # 8 experts on 8 ranks: a token's 2 experts are on 2 ranks, 2 x 7/8 = 1.75 of them remote;
    # batch 8 on DP8 -> 1 token per rank: 1 x 1.75 x 4096 x 2 B = 14336 B sent per all-to-all.
    assert expected_destination_ranks(8, 2, 8) == pytest.approx(2.0)
    assert next(c for c in ep.collectives if c.kind == "all_to_all").bytes_per_call == pytest.approx(14336)
    # Whole model: 32 x (attention 41,943,040 + experts 8 x 176,160,768 + router 32,768) + 2 x 32000 x 4096
    # = 46,702,526,464 params (Mixtral's published 46.7B), bf16 -> x 2 B; TP2 halves all but the
    # replicated embedding (131,072,000) and router (32 x 32,768).
    tp2 = _plan("mixtral-8x7b", 2, batches=(1,)).strategy("TP2").steps[0]
    whole = 46_702_526_464
    replicated = 131_072_000 + 32 * 32_768
    assert tp2.memory.weights == pytest.approx(2 * ((whole - replicated) / 2 + replicated))


def test_config_that_cannot_fit_is_reported():
    # Kimi-K2 Instruct in FP8 is ~1.03 TB of weights: more than 8 x 141 GB x 0.9.
    p = _plan("kimi-k2-instruct", 8, batches=(1,))
    assert all(not sp.steps[0].memory.fits for sp in p.strategies)
    assert all(sp.steps[0].memory.over > 0 for sp in p.strategies)
    assert recommend(p).startswith("nothing fits")
    # Kimi-K2.5 at batch 256: TP replicates the MLA cache (256 x 4096 x 61 x 1152 B = 68.6 GiB) and overflows.
    big = _plan("kimi-k2.5", 8, batches=(256,)).strategy("TP8").steps[0]
    assert not big.memory.fits and big.memory.over > 0


def test_load_imbalance_model():
    # One bin holds everything; perfect balance at large loads tends to the mean; skew to mean / B.
    assert expected_max_load(100, 1) == 100
    assert expected_max_load(80_000, 8, 1.0) == pytest.approx(10_000, rel=0.02)
    assert expected_max_load(80_000, 8, 0.5) == pytest.approx(20_000, rel=0.02)
    assert 2.0 < expected_max_load(8, 8, 1.0) < 2.6  # 8 picks over 8 ranks: about 2.2 on the busiest


def test_predict_moe_layer_time_hand_worked():
    spec = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json")
    # Fixed figures so the arithmetic below does not move with the shipped profile.
    hw = dataclasses.replace(load_hardware(H200), hbm_bytes_per_s=4.25e12, matmul_flops_per_s={"bf16": 6.78e14},
                             moe_layer_fixed_us=27.0, moe_stream_matrix_overlap=0.5)
    # 4096 tokens x top-8 = 32768 rows over 128 experts; all hit (128 (1 - (15/16)^4096) = 128).
    # Weights 128 x 3 x 2048 x 768 x 2 B = 1,207,959,552 B; activations 32768 rows x (3 x 2048 + 2 x 768)
    # x 2 B = 503,316,480 B; together 1,711,276,032 B / 4.25 TB/s = 402.653 us. FLOPs 32768 x 2 x 4,718,592
    # = 309,237,645,312 / 678 TFLOP/s = 456.103 us. Half of the shorter (streaming) hidden under the matrix work:
    # 456.103 + 0.5 x 402.653 = 657.429 us, + 27 us fixed = 684.429 us.
    stream_ms = (1_207_959_552 + 503_316_480) / 4.25e12 * 1e3
    matrix_ms = 32768 * 2 * 4_718_592 / 6.78e14 * 1e3
    assert (stream_ms, matrix_ms) == (pytest.approx(0.402653, abs=1e-6), pytest.approx(0.456103, abs=1e-6))
    assert predict_moe_layer_time(spec, 4096, 128, hw, "bf16") == pytest.approx(0.684429, abs=1e-6)
    # DeepSeek-V3 EP8 shard, 1 token: 8/256 of its choices are local -> 1 row, 1 expert hit (32 x 8/256).
    # 3 x 7168 x 2048 x 2 B = 88,080,384 B + 1 x (3 x 7168 + 2 x 2048) x 2 B = 51,200 B -> 20.7368 us of
    # streaming; 2 x 44,040,192 FLOPs -> 0.1299 us of matrix work, half of it hidden: 20.8018 us + 27 us.
    shard = predict_moe_layer_time(MoEDims(7168, 2048, 256, 8), 1, 32, hw, "bf16")
    assert shard == pytest.approx(((88_080_384 + 51_200) / 4.25e12 + 0.5 * 2 * 44_040_192 / 6.78e14) * 1e3 + 0.027)
    assert shard == pytest.approx(0.0478018, abs=1e-7)
    with pytest.raises(ValueError, match="num_local_experts"):
        predict_moe_layer_time(spec, 1, 129, hw)


def test_plan_expert_term_is_predict_moe_layer_time():
    # epmoe plan prices routed experts with the function checked against the H200 measurements:
    # on one GPU (TP1) the step's expert time is L MoE layers x predict_moe_layer_time(all E local).
    spec = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json")
    hw = load_hardware(H200)
    p = plan(PlanRequest(spec=spec, hardware=hw, gpus=1, batches=(1, 8, 64, 256)))
    for st in p.strategy("TP1").steps:
        per_layer = predict_moe_layer_time(spec, st.tokens, spec.num_experts, hw, "bf16")
        assert st.expert_ms == pytest.approx(spec.num_moe_layers * per_layer, rel=1e-12)


def test_ep_busiest_rank_reads_more_expert_weights_at_batch_1():
    # DeepSeek-V3, batch 1: TP8 reads 1/8 of each of the token's 8 experts = 1 expert's bytes per rank.
    # EP8: the busiest rank receives expected_max_load(8 rows, 8 ranks, balancedness 0.8) = 2.49 rows and is
    # priced as 2.49 tokens over its 32 of 256 experts: 32 (1 - (1 - 8/256)^2.49) = 2.44 experts' bytes.
    p = _plan("deepseek-v3", 8, batches=(1,))
    hw = load_hardware(H200)
    fixed_ms = 58 * hw.moe_w8a16_layer_fixed_us * 1e-3  # its FP8 experts' fixed cost a layer
    tp = p.strategy("TP8").steps[0].expert_ms - fixed_ms
    ep = p.strategy("EP8+DPattn").steps[0].expert_ms - fixed_ms
    assert ep / tp == pytest.approx(2.44, rel=0.03)


def test_bad_inputs():
    spec = load_moe_spec(CONFIGS / "mixtral-8x7b.config.json")
    hw = load_hardware(H200)
    with pytest.raises(ValueError, match="hardware 'b200' is not known"):
        load_hardware("b200")
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        PlanRequest(spec=spec, hardware=hw, gpus=8, batches=(1, 0))
    with pytest.raises(ValueError, match=r"gpus \(16\) exceeds the expert slots.*--redundant 8"):
        PlanRequest(spec=spec, hardware=hw, gpus=16, nodes=2)
    with pytest.raises(ValueError, match="pass --nodes 2"):
        PlanRequest(spec=load_moe_spec(CONFIGS / "deepseek-v3.config.json"), hardware=hw, gpus=16)
    with pytest.raises(DenseModelError, match="no MoE layers"):
        load_moe_spec(CONFIGS / "eagle3-draft-deepseek-v3-specforge.config.json")
    # qwen1.5-MoE has 60 experts: EP8 is skipped with the redundancy that would make it work.
    p = _plan("qwen1.5-moe-a2.7b", 8, batches=(1,))
    assert any("--redundant 4" in why for why in p.skipped)
    planned = _plan("qwen1.5-moe-a2.7b", 8, batches=(1,), redundant=4).strategies
    assert any(sp.strategy.name == "EP8+DPattn" for sp in planned)


def test_cli_plan_json_plot_and_errors(tmp_path, capsys):
    cfg = str(CONFIGS / "kimi-k2.5.config.json")
    png = tmp_path / "plan.png"
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", H200, "--batch", "1,8,64,256", "--json",
                 "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    tp8 = next(s for s in doc["strategies"] if s["name"] == "TP8")
    assert sum(c["count"] for c in tp8["steps"][0]["collectives"] if c["kind"] == "all_reduce") == 122
    assert doc["recommendation"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", "nope"]) == 2
    assert "hardware 'nope' is not known" in capsys.readouterr().err
    draft = str(CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json")
    assert main(["plan", "--config", draft, "--gpus", "8", "--hardware", H200]) == 2
    assert "no MoE layers" in capsys.readouterr().err
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", H200, "--batch", "1"]) == 0
    assert "Recommendation" in capsys.readouterr().out


def test_plan_refuses_an_int4_group_size_the_loader_refuses(tmp_path, capsys):
    """Kimi-K2.5's config with INT4 groups of 48: plan refuses it with the message doctor (and the loader) give,
    and still prices it converted (``--weights int4``); doctor names the error once, not again as memory."""
    doc = json.loads((CONFIGS / "kimi-k2.5.config.json").read_text())
    doc["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 48
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(doc))
    refused = ("quantization_config weights.group_size (format 'int4_group48') is 48; the INT4 expert kernels take "
               "group sizes (32, 64, 128); epmoe run refuses to load these experts")
    assert main(["plan", "--config", str(cfg), "--gpus", "8", "--hardware", H200, "--batch", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"epmoe plan: error: {cfg}: routed experts: {refused}" in captured.err
    assert main(["plan", "--config", str(cfg), "--gpus", "8", "--hardware", H200, "--batch", "1",
                 "--weights", "int4"]) == 0
    assert "experts int4_group32" in capsys.readouterr().out
    assert main(["doctor", "--config", str(cfg), "--ep", "8", "--hardware", H200]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the target model: routed experts: {refused}; use a checkpoint in a served format "
                      "(README: supported weight formats)"]


def test_plan_counts_of_one_are_singular(capsys):
    """One node, one draft token per round: the titles say so in the singular."""
    cfg = str(CONFIGS / "kimi-k2.5.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", H200, "--batch", "1", "--spec-tokens", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(h200-sxm, 1 node), verify S=1" in out and "speculative decoding: 1 draft token per round" in out


def test_plan_dict_and_plot_roundtrip(tmp_path):
    p = _plan("olmoe-1b-7b-0924", 4, batches=(1, 16))
    doc = json.loads(json.dumps(plan_to_dict(p)))
    assert doc["gpus"] == 4 and len(doc["strategies"]) == len(p.strategies)
    plot_plan(p, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "config,gpus,extra,reasons",
    [
        ("deepseek-v3", 3, [], ["128 attention heads are not divisible by 3",
                                "256 expert slots are not divisible by 3; use --redundant 2"]),
        ("mixtral-8x7b", 3, [], ["32 attention heads are not divisible by 3",
                                 "8 expert slots are not divisible by 3; use --redundant 1"]),
        ("olmoe-1b-7b-0924", 7, [], ["16 attention heads are not divisible by 7",
                                     "64 expert slots are not divisible by 7; use --redundant 6"]),
        # the suggestion is the total to pass, counting the redundant slots already asked for
        ("deepseek-v3", 3, ["--redundant", "1"], ["257 expert slots are not divisible by 3; use --redundant 2"]),
    ],
)
def test_no_strategy_on_n_gpus_says_why(capsys, config, gpus, extra, reasons):
    cfg = str(CONFIGS / f"{config}.config.json")
    assert main(["plan", "--config", cfg, "--gpus", str(gpus), "--hardware", "h200-sxm", *extra]) == 2
    captured = capsys.readouterr()
    assert f"epmoe plan: error: no strategy can run {config}.config.json on {gpus} GPUs: " in captured.err
    assert "min()" not in captured.err and all(r in captured.err for r in reasons), captured.err
    assert captured.out == ""  # nothing printed before the error (no empty table)
    with pytest.raises(ValueError, match=f"no strategy can run {config}.config.json on {gpus} GPUs"):
        plan(PlanRequest(spec=load_moe_spec(cfg), hardware=load_hardware("h200-sxm"), gpus=gpus, batches=(1,)))


def test_redundant_suggestion_counts_the_slots_given():
    from epmoe.plan.planner import strategies_for

    # Mixtral: 8 experts + 1 redundant = 9 slots over 4 GPUs: TP2xEP2 needs 10 slots, EP4 needs 12
    _, skipped = strategies_for(load_moe_spec(CONFIGS / "mixtral-8x7b.config.json"), 4, redundant=1)
    assert "TP2xEP2: 9 expert slots are not divisible by EP 2; use --redundant 2" in skipped
    assert "EP4 with all-to-all: 9 expert slots are not divisible by 4; use --redundant 4" in skipped


def test_nodes_advice_on_hardware_without_an_inter_node_link(capsys):  # was "pass --nodes 2", then refused
    cfg = str(CONFIGS / "deepseek-v3.config.json")
    assert main(["plan", "--config", cfg, "--hardware", "rtx-pro-6000", "--gpus", "16"]) == 2
    assert ("error: --gpus (16) on 1 node(s) is 16 per node but rtx-pro-6000 has 8; it has no inter_node link, so at "
            "most 8 GPUs") in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--gpus", "8", "--mem-fraction", "2"], "error: --mem-fraction must lie in (0, 1], got 2.0"),
        (["--gpus", "8", "--spec-tokens", "-1"], "error: --spec-tokens must be an integer >= 0, got -1"),
        (["--gpus", "8", "--redundant", "-2"], "error: --redundant must be an integer >= 0, got -2"),
        (["--gpus", "8", "--context", "0"], "error: --context must be an integer >= 1, got 0"),
        (["--gpus", "0"], "error: --gpus must be an integer >= 1, got 0"),
        (["--gpus", "16"], "error: --gpus (16) on 1 node(s) is 16 per node but h200-sxm has 8; pass --nodes 2"),
        (["--gpus", "8", "--nodes", "3"], "error: --gpus (8) must be divisible by --nodes (3)"),
        # was "pass --nodes 2", which the line above refuses
        (["--gpus", "9"], "error: --gpus (9) on 1 node(s) is 9 per node but h200-sxm has 8; pass --nodes 3"),
        # was "they need --spec-tokens" when --spec-tokens was given
        (["--gpus", "8", "--spec-tokens", "0", "--accept-length", "2"], "error: --accept-length prices speculative "
         "decoding: it needs --spec-tokens of at least 1 (draft tokens verified per step), got 0"),
    ],
)
def test_cli_messages_name_the_flags(capsys, args, msg):
    cfg = str(CONFIGS / "deepseek-v3.config.json")
    assert main(["plan", "--config", cfg, "--hardware", "h200-sxm", *args]) == 2
    assert msg in capsys.readouterr().err


def test_weights_mxfp4_prices_experts_in_mxfp4():
    from epmoe.spec import load_moe_spec

    qwen = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json")
    req = PlanRequest(spec=qwen, hardware=load_hardware("h200-sxm"), gpus=2, batches=(1,), weights="mxfp4")
    assert req.expert_format == "mxfp4"
    step = plan(req).strategies[0].steps[0]
    slots = qwen.num_experts / 2  # TP2: each GPU holds half of every expert
    assert step.memory.expert_weights == pytest.approx(qwen.num_moe_layers * slots * qwen.expert_params() * 17 / 32)
    assert main(["plan", "--config", str(CONFIGS / "qwen3-30b-a3b.config.json"), "--gpus", "2", "--hardware",
                 "h200-sxm", "--weights", "mxfp4", "--batch", "1"]) == 0


def test_fp8_asked_for_experts_of_ragged_f_is_priced_in_bf16_and_said(capsys):
    # gpt-oss's F (2880) is not a multiple of 128: epmoe run would dequantize FP8 experts, so plan prices bf16
    cfg = str(CONFIGS / "gpt-oss-20b.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "2", "--hardware", "h100-sxm", "--weights", "fp8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "routed experts priced in bf16, as epmoe run serves them: FP8 dequantized on load: the expert " \
           "intermediate size F (2880) is not a multiple of 128" in out
    assert main(["plan", "--config", cfg, "--gpus", "2", "--hardware", "h100-sxm", "--weights", "fp8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["expert_format"] == "bf16" and "F (2880)" in doc["expert_format_note"]
    assert main(["plan", "--config", cfg, "--gpus", "2", "--hardware", "h100-sxm", "--json"]) == 0
    assert "expert_format_note" not in json.loads(capsys.readouterr().out)  # MXFP4 as published: no note


def test_weights_hint_only_smaller_formats(capsys):
    from epmoe.plan.costs import smaller_weight_choices, weights_hint

    assert smaller_weight_choices("bf16") == ["fp8", "int4"]
    assert weights_hint("fp8_block128") == "--weights int4"
    assert weights_hint("int4_group32") == "" and weights_hint("mxfp4") == ""
    # Kimi-K2-Instruct is stored in FP8 already: only int4 is smaller
    k2 = str(CONFIGS / "kimi-k2-instruct.config.json")
    assert main(["plan", "--config", k2, "--gpus", "2", "--hardware", "h200-sxm", "--batch", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "nothing fits" in out and "use --weights int4 or a shorter --context" in out and "fp8/int4" not in out
    # Kimi-K2.5 (INT4 experts): no --weights advice at all
    k25 = str(CONFIGS / "kimi-k2.5.config.json")
    assert main(["plan", "--config", k25, "--gpus", "1", "--hardware", "h200-sxm", "--batch", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "add GPUs or use a shorter --context" in out and "--weights" not in out


@pytest.mark.parametrize("flag,value,msg", [
    ("--batch", "1000000000000", "--batch must be at most 1048576, got 1000000000000"),
    ("--spec-tokens", "1000000000", "--spec-tokens must be at most 16, got 1000000000"),
    ("--spec-tokens", "17", "--spec-tokens must be at most 16, got 17"),  # priced 100 draft tokens: run takes 16
    ("--context", "999999999999", "--context must be at most 16777216, got 999999999999"),
    ("--redundant", "100000", "--redundant must be at most 896, got 100000"),  # 128 experts x (8 - 1) GPUs
])
def test_plan_refuses_absurd_sizes_at_once(capsys, flag, value, msg):
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm", flag, value]) == 2
    captured = capsys.readouterr()
    assert msg in captured.err and captured.out == ""


def test_expected_max_load_sums_only_the_window():
    # the window is exact for ordinary sizes: 8 picks over 8 ranks, by direct summation of P(max > k)
    from scipy.stats import binom

    direct = sum(1 - binom.cdf(k, 8, 1 / 8) ** 8 for k in range(8))
    assert expected_max_load(8, 8) == pytest.approx(direct, rel=1e-12)
    # billions of items: O(sqrt(n)) terms; the busiest of 8 bins sits a few standard deviations above the mean
    n = 2e9
    mean, sd = n / 8, math.sqrt(n / 8 * 7 / 8)
    assert mean + sd < expected_max_load(n, 8) < mean + 4 * sd


def test_plot_path_checked_before_planning_and_written_exactly(tmp_path, capsys):
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    base = ["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm", "--batch", "1"]
    assert main([*base, "--plot", str(tmp_path / "nodir" / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot" in captured.err and "does not exist" in captured.err and captured.out == ""
    assert main([*base, "--plot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main([*base, "--plot", str(tmp_path / "steps")]) == 0  # no suffix: written under exactly that name
    assert (tmp_path / "steps").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "steps.png").exists()


def test_a_plot_whose_write_fails_is_named_and_nothing_is_printed(tmp_path, capsys, monkeypatch):
    """A path the up-front check passes but the file system refuses (a full or read-only one) fails the command
    naming ``--plot``, before the plan is printed; the figure there before is left as it was and no partial file
    stays (the figure was saved straight onto the path: an old one was truncated, a new one left empty)."""
    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    path = tmp_path / "x.png"
    path.write_bytes(b"the old figure")
    monkeypatch.setattr(Path, "write_bytes", full)
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm", "--batch", "1",
                 "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.endswith(f"epmoe plan: error: --plot ({str(path)!r}) cannot be written: No space left on "
                                 f"device\n"), captured.err
    assert captured.out == ""
    assert path.read_bytes() == b"the old figure" and sorted(tmp_path.iterdir()) == [path]


def test_a_plot_or_placement_onto_a_device_or_pipe_is_refused(tmp_path, capsys):
    """``--plot`` or ``--out`` naming a device or a pipe: the atomic write's rename replaced it with a regular file
    (``balance --plot /dev/full`` turned the device into a PNG); now refused up front, naming the flag."""
    import os

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm", "--batch", "1",
                 "--plot", str(fifo)]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe plan: error: --plot ({str(fifo)!r}) is not a regular file (a "
                                            f"device, pipe or socket), which writing it would replace; expected a "
                                            f"figure file path (.png, .pdf, .svg, ...)\n")
    assert fifo.is_fifo()
    loads = tmp_path / "loads.json"
    loads.write_text('{"format": "epmoe.loads/1", "load": [[4, 3, 2, 1]]}')
    for flag in ("--out", "--plot"):
        target = tmp_path / f"pipe{flag[2:]}.png"
        os.mkfifo(target)
        out = ["--out", str(target)] if flag == "--out" else ["--out", str(tmp_path / "p.json"), "--plot", str(target)]
        assert main(["balance", "--loads", str(loads), "--ep", "2", *out]) == 2
        assert f"epmoe balance: error: {flag} ({str(target)!r}) is not a regular file" in capsys.readouterr().err
        assert target.is_fifo() and not (tmp_path / "p.json").exists()


def test_plot_suffix_picks_the_format_and_one_matplotlib_cannot_write_is_refused_before_planning(tmp_path, capsys):
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    base = ["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm", "--batch", "1"]
    known = ", ".join(f".{s}" for s in plot_formats())
    assert main([*base, "--plot", str(tmp_path / "x.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.err.endswith(f"epmoe plan: error: --plot ({str(tmp_path / 'x.txt')!r}): matplotlib writes no "
                                 f"'.txt' files; supported: {known} (no suffix: PNG)\n"), captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == []
    assert ".pdf" in known and ".svg" in known and ".txt" not in known
    assert main([*base, "--plot", str(tmp_path / "steps.PDF")]) == 0  # the suffix's format, case ignored
    assert (tmp_path / "steps.PDF").read_bytes()[:5] == b"%PDF-"
    assert main([*base, "--plot", str(tmp_path / "steps.svg")]) == 0
    assert b"<svg" in (tmp_path / "steps.svg").read_bytes()[:500]


def test_a_pgf_plot_needs_its_tex_system(tmp_path, monkeypatch):
    monkeypatch.setattr(plot.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"^plot \('.*x\.pgf'\): '\.pgf' needs xelatex \(matplotlib's "
                                         r"pgf\.texsystem\), which is not on PATH; supported: \.avif"):
        plot.check_plot_path("plot", tmp_path / "x.pgf")
    monkeypatch.setattr(plot.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert plot.check_plot_path("plot", tmp_path / "x.pgf") == (tmp_path / "x.pgf", "pgf")
    assert plot.check_plot_path("plot", tmp_path / "x") == (tmp_path / "x", "png")
    assert plot.check_plot_path("plot", tmp_path / "x.Svg") == (tmp_path / "x.Svg", "svg")


def test_batch_list_parsing(capsys):
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    base = ["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm", "--json"]
    assert main([*base, "--batch", "8,1,8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted({st["batch"] for sp in doc["strategies"] for st in sp["steps"]}) == [1, 8]
    assert all([st["batch"] for st in sp["steps"]] == [1, 8] for sp in doc["strategies"])
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage error
        main([*base, "--batch", "1,,2"])
    assert exit_info.value.code == 2
    assert "argument --batch: comma-separated integers expected, got '1,,2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--batch", "0,4"])
    assert "argument --batch: sizes must be >= 1, got '0,4'" in capsys.readouterr().err


def test_context_beyond_the_models_positions_is_said(capsys):
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    base = ["plan", "--config", cfg, "--gpus", "1", "--hardware", "h200-sxm", "--batch", "1", "--json"]
    assert main([*base, "--context", "40960"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().err
    assert main([*base, "--context", "40961"]) == 0
    assert ("epmoe plan: --context 40961 is above the model's max_position_embeddings 40960"
            in capsys.readouterr().err)


def test_recommendation_on_one_gpu_names_no_batch():
    # one GPU plans one strategy: the reason holds at every batch size, so it names none
    p = _plan("qwen3-30b-a3b", 1, batches=(1, 8))
    assert len(p.strategies) == 1
    assert recommend(p) == f"{p.strategies[0].strategy.name} at every batch size: it is the only strategy planned"


def test_recommendation_names_the_family_that_does_not_fit():
    # DeepSeek-V3 on 8 x H200 at batch 256: no all-reduce strategy fits; the reason says so and names
    # the fastest of them with its overshoot, not one strategy as if it were the only alternative.
    p = _plan("deepseek-v3", 8, batches=(256,))
    line = recommend(p)
    best = min((s for s in p.strategies if s.steps[0].memory.fits), key=lambda s: s.steps[0].total_ms)
    assert best.strategy.mode != "all_reduce"
    assert all(not s.steps[0].memory.fits for s in p.strategies if s.strategy.mode == "all_reduce")
    assert line.startswith(f"{best.strategy.name} at every batch size: at batch 256 no all-reduce strategy fits "
                           "(the fastest, ")


def test_engine_step_costs_add_per_step_layer_and_sequence():
    """The profile's engine_* terms add (step + layers x layer + sequences x seq) µs to every step, and the
    shipped H200 fit prices Qwen3-30B-A3B's steps within 25% of the engine rows it was fitted to (the plan uses
    the rows' own context)."""
    spec = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json")
    hw = load_hardware(H200)
    bare = dataclasses.replace(hw, engine_step_us=0.0, engine_layer_step_us=0.0, engine_seq_step_us=0.0)
    costed = dataclasses.replace(bare, engine_step_us=100.0, engine_layer_step_us=10.0, engine_seq_step_us=2.0)
    batches = (1, 64)
    for b, s0, s1 in zip(batches, plan(PlanRequest(spec, bare, gpus=1, batches=batches)).strategies[0].steps,
                         plan(PlanRequest(spec, costed, gpus=1, batches=batches)).strategies[0].steps):
        want = (100.0 + spec.num_layers * 10.0 + b * 2.0) / 1e3
        assert s0.engine_ms == 0.0 and s1.engine_ms == pytest.approx(want)
        assert s1.total_ms - s0.total_ms == pytest.approx(want)
    rows = json.loads(ENGINE_ROWS.read_text())["models"]["qwen3-30b-a3b"]["rows"]
    measured = {int(b): r["tpot_ms"] for b, r in rows.items()}
    ctx = int(rows["1"]["ctx"])
    steps = plan(PlanRequest(spec, hw, gpus=1, batches=tuple(measured), context=ctx)).strategies[0].steps
    assert len(steps) == 4 and all(s.engine_ms > 0 for s in steps)
    for s in steps:
        assert 0.75 <= measured[s.batch] / s.total_ms <= 1.25, (s.batch, measured[s.batch], s.total_ms)


@pytest.mark.parametrize("model,rows_file,weights", [
    ("qwen3-30b-a3b", "engine_qwen3_rope_fold_h100.json", "bf16"),
    ("gpt-oss-20b", "engine_gptoss20b_mxfp4_router_h100.json", None),  # its MXFP4 experts, as published
])
def test_h100_engine_fit_prices_the_measured_steps(model, rows_file, weights):
    """The H100 profile's engine_* terms and W4A16 figures, fitted to the engine's steps measured on an H100, price
    them within 25% (the plan at the rows' own context)."""
    spec = load_moe_spec(CONFIGS / f"{model}.config.json")
    rows = json.loads(ENGINE_ROWS.with_name(rows_file).read_text())["models"][model]["rows"]
    measured = {int(b): r["tpot_ms"] for b, r in rows.items()}
    req = PlanRequest(spec, load_hardware("h100-sxm"), gpus=1, batches=tuple(measured),
                      context=int(rows["1"]["ctx"]), weights=weights)
    steps = plan(req).strategies[0].steps
    assert len(steps) == 4 and all(s.engine_ms > 0 for s in steps)
    for s in steps:
        assert 0.75 <= measured[s.batch] / s.total_ms <= 1.25, (s.batch, measured[s.batch], s.total_ms)


def test_the_table_adds_up_and_the_reason_names_the_engine_costs(capsys):
    """The plan table's step is its parts, the engine's own costs a column of their own; where those costs are what
    differs between the chosen strategy and the other family (sequences per rank: every one under TP, ``B/G`` under
    DP attention), the recommendation names them, not a part that is equal on both sides."""
    cfg = str(CONFIGS / "gpt-oss-20b.config.json")
    req = PlanRequest(load_moe_spec(cfg), load_hardware("h100-sxm"), gpus=8, batches=(256,))
    p = plan(req)
    for sp in p.strategies:
        st = sp.steps[0]
        assert st.total_ms == pytest.approx(st.attention_ms + st.expert_ms + st.comm_ms + st.engine_ms)
    by_name = {sp.strategy.name: sp.steps[0] for sp in p.strategies}
    tp, ep = by_name["TP8"], by_name["EP8+DPattn"]
    assert tp.engine_ms == pytest.approx(ep.engine_ms + 7 * 256 / 8 * req.hardware.engine_seq_step_us / 1e3)
    line = recommend(p)
    assert line.startswith("EP8+DPattn") and "the engine's own step costs" in line, line
    assert f"take {ep.engine_ms:.2f} ms against {by_name['TP1xEP8'].engine_ms:.2f} ms for TP1xEP8" in line, line
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", "h100-sxm", "--batch", "256"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "strategy" in line and "attn+dense" in line)
    assert "┃ engine ┃" in header and f"{tp.engine_ms:.2f}" in out


def test_plan_says_which_values_came_from_transformers_defaults(capsys):
    """The trimmed GLM-4.7 config has no routing group fields: plan prints the values transformers filled in."""
    glm = str(CONFIGS / "glm-4.7-fp8.config.json")
    assert main(["plan", "--config", glm, "--gpus", "8", "--hardware", H200, "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert ("config.json has no hidden_act, n_group, topk_group, norm_topk_prob: took transformers' Glm4MoeConfig "
            "defaults hidden_act='silu', n_group=1, topk_group=1, norm_topk_prob=True") in " ".join(out.split())
    assert main(["plan", "--config", glm, "--gpus", "8", "--hardware", H200, "--batch", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config_defaults"] == {"class": "Glm4MoeConfig", "fields": {"hidden_act": "silu", "n_group": 1,
                                                                          "topk_group": 1, "norm_topk_prob": True}}
    assert main(["plan", "--config", str(CONFIGS / "glm-4.5.config.json"), "--gpus", "8", "--hardware", H200,
                 "--batch", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config_defaults"]["fields"] == {"n_group": 1, "topk_group": 1,
                                                                                "norm_topk_prob": True}


def test_mla_latent_read_once_per_head_block():
    """An MLA step's attention pays its latent cache ``ceil(H / tp / 16)`` times at ``mla_decode_read_efficiency``
    of the bandwidth (the engine's decode kernel reads each row once per 16 heads); grouped-query attention once."""
    from epmoe.plan.costs import kv_read_passes

    dsv3, qwen = (load_moe_spec(CONFIGS / f"{n}.config.json") for n in ("deepseek-v3", "qwen3-30b-a3b"))
    assert [kv_read_passes(dsv3, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    assert kv_read_passes(load_moe_spec(CONFIGS / "kimi-k2.5.config.json"), 1) == 4
    assert kv_read_passes(qwen, 1) == 1
    hw = load_hardware("h200-sxm")
    eff = hw.mla_decode_read_efficiency
    assert 0 < eff < 1

    def attention_ms(spec, context, h):
        req = PlanRequest(spec=spec, hardware=h, gpus=1, batches=(8,), context=context)
        return plan(req).strategy("TP1").steps[0].attention_ms

    # 8 sequences x 4096 more positions x 61 layers x 1152 B, read 8 / eff times instead of once
    extra = 8 * 4096 * 61 * 1152 * (8 / eff) / hw.hbm_bytes_per_s * 1e3
    assert attention_ms(dsv3, 8192, hw) - attention_ms(dsv3, 4096, hw) == pytest.approx(extra, rel=1e-9)
    once = dataclasses.replace(hw, mla_decode_read_efficiency=1.0)
    assert attention_ms(dsv3, 8192, once) - attention_ms(dsv3, 4096, once) == pytest.approx(extra * eff, rel=1e-9)
    # grouped-query attention: the efficiency does not apply
    assert attention_ms(qwen, 8192, hw) == attention_ms(qwen, 8192, once)


def test_mxfp4_is_priced_packed_above_the_decode_kernels():
    """gpt-oss's MXFP4 experts are read packed at every batch: one more token past the decode kernels' 64 (token, k)
    pairs (16 tokens at top-4) adds a token's share of the step, not a widening of the experts to bf16."""
    cfg = str(CONFIGS / "gpt-oss-20b.config.json")
    req = PlanRequest(load_moe_spec(cfg), load_hardware(H200), gpus=1, batches=(16, 17))
    sixteen, seventeen = plan(req).strategies[0].steps
    assert sixteen.total_ms < seventeen.total_ms < 1.1 * sixteen.total_ms


def test_windowed_layers_read_only_their_window():
    """gpt-oss's 12 sliding-window layers read 128 cached positions a decode step, not the whole context: at batch 1
    (attention bound by its bytes) the step is cheaper than with every layer full by those layers' KV bytes past
    the window; at a context inside the window the two plans agree."""
    spec = load_moe_spec(CONFIGS / "gpt-oss-20b.config.json")
    full = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, layer_spans=()))
    hw = load_hardware(H200)

    def attention(s, context):
        return plan(PlanRequest(s, hw, gpus=1, batches=(1,), context=context)).strategies[0].steps[0].attention_ms

    kv = 2 * spec.attention.num_kv_heads * spec.attention.head_dim * 2  # bytes a position and layer
    assert attention(spec, 32768) == pytest.approx(
        attention(full, 32768) - 12 * (32768 - 128) * kv / hw.hbm_bytes_per_s * 1e3, rel=1e-9)
    assert attention(spec, 100) == pytest.approx(attention(full, 100), rel=1e-12)


def test_prefill_prices_the_causal_pairs_and_one_row_of_logits():
    """A prompt's prefill (``PlanRequest.input_lens``): on one GPU the attention part is the roofline of the
    projections over the prompt's rows and of the scores over its causal pairs (a window's pairs for gpt-oss's
    sliding layers), plus one row of logits; the step's parts add up; the engine part is the step term and a prefill
    term a layer."""
    from epmoe.plan.costs import attention_params, causal_pairs, prefill_score_flops, roofline_ms

    assert causal_pairs(4, 10) == 10 and causal_pairs(4, 4) == 10 and causal_pairs(5, 2) == 3 + 3 * 2
    hw = load_hardware(H200)
    spec = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json")
    p = plan(PlanRequest(spec, hw, gpus=1, batches=(1,), input_lens=(1024, 4096)))
    short, long = p.strategies[0].prefills
    assert (short.batch, short.tokens, long.tokens) == (1, 1024, 4096)
    w = attention_params(spec).per_rank(1, spec.attention.num_kv_heads)
    rate, bw = hw.flops_per_s("bf16"), hw.hbm_bytes_per_s
    lm = roofline_ms(spec.vocab_size * spec.hidden_size * 2, 2 * spec.vocab_size * spec.hidden_size, bw, rate)
    router = spec.hidden_size * spec.num_experts
    side = roofline_ms(router * 2, 2 * router * 4096, bw, rate)
    attn = roofline_ms(w * 2, 2 * w * 4096 + causal_pairs(4096, 4096) * prefill_score_flops(spec), bw, rate)
    assert math.isclose(long.attention_ms, spec.num_layers * (attn + side) + lm, rel_tol=1e-9)
    assert math.isclose(long.total_ms, long.attention_ms + long.expert_ms + long.comm_ms + long.engine_ms)
    assert math.isclose(long.engine_ms, (hw.engine_step_us + spec.num_layers * hw.engine_prefill_layer_us) / 1e3)
    assert hw.engine_prefill_layer_us > 0 and long.attention_ms > 4 * short.attention_ms  # the pairs grow as n^2
    # gpt-oss: half its layers attend a 128-token window; their pairs grow linearly with the prompt
    oss = load_moe_spec(CONFIGS / "gpt-oss-20b.config.json")
    assert dict((s, n) for n, s in oss.attention.attended_positions(4096, oss.num_layers)) == {4096: 12, 128: 12}
    assert causal_pairs(4096, 128) < causal_pairs(4096, 4096) / 15


def test_prefill_under_dp_attention_puts_the_prompt_on_one_rank():
    """One prompt under DP attention: its rank computes all of its attention (slower than TP attention's share) and
    sends all of its rows to the experts; TP over 8 GPUs all-reduces the prompt's rows twice a layer."""
    p = _plan("deepseek-v3", 8, batches=(1,), input_lens=(4096,))
    by_name = {sp.strategy.name: sp.prefills[0] for sp in p.strategies}
    tp, dp = by_name["TP8"], by_name["EP8+DPattn"]
    assert dp.attention_ms > 4 * tp.attention_ms
    # EP with TP attention: each rank's shared expert and router see its reduce-scattered eighth of the prompt
    assert 0.9 * tp.attention_ms < by_name["EP8+TPattn"].attention_ms < 1.1 * tp.attention_ms
    assert all(st.memory.fits for st in by_name.values())
    assert tp.count("all_reduce") == 2 * 61 and dp.count("all_to_all") == 2 * 58
    spec = load_moe_spec(CONFIGS / "deepseek-v3.config.json")
    assert [c.bytes_per_call for c in tp.collectives if c.kind == "all_reduce"] == [4096 * spec.hidden_size * 2]


@pytest.mark.parametrize("model,rows_file,weights,profile", [
    ("qwen3-30b-a3b", "engine_qwen3_final_h200.json", "bf16", H200),
    ("qwen3-30b-a3b", "engine_qwen3_peers_h100.json", "bf16", "h100-sxm"),
    ("gpt-oss-20b", "engine_gptoss20b_sink_causal_blocks_h100.json", None, "h100-sxm"),
])
def test_prefill_fit_prices_the_measured_ttft(model, rows_file, weights, profile):
    """The profiles' engine_prefill_layer_us, fitted to the engine's measured times to first token
    (``benchmarks/engine.py --replan-ttft``), price them within 30%."""
    spec = load_moe_spec(CONFIGS / f"{model}.config.json")
    ttft = json.loads(ENGINE_ROWS.with_name(rows_file).read_text())["models"][model]["ttft"]
    lens = tuple(int(n) for n in ttft)
    req = PlanRequest(spec, load_hardware(profile), gpus=1, batches=(1,), weights=weights, input_lens=lens)
    for st in plan(req).strategies[0].prefills:
        measured = ttft[str(st.tokens)]["ms"]
        assert 1 / 1.3 <= measured / st.total_ms <= 1.3, (st.tokens, measured, st.total_ms)


def test_cli_plan_input_len(capsys):
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "2", "--hardware", H200, "--batch", "1", "--input-len",
                 "4096,1024", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["input_lens"] == [1024, 4096]
    for s in doc["strategies"]:
        assert [r["input_len"] for r in s["prefills"]] == [1024, 4096]
        assert all(r["ttft_ms"] > r["expert_ms"] > 0 and r["fits"] is True for r in s["prefills"])
    assert main(["plan", "--config", cfg, "--gpus", "1", "--hardware", H200, "--batch", "1", "--input-len",
                 "1024"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens" in out and "TTFT" in out
    # printed to a pipe (no terminal width), the widest table keeps its last column
    assert main(["plan", "--config", str(CONFIGS / "kimi-k2.5.config.json"), "--gpus", "8", "--hardware", H200]) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if "strategy" in line and "collectives" in line]
    assert header and "expert GiB" in header[0] and "fits" in header[0]
    with pytest.raises(SystemExit):
        main(["plan", "--config", cfg, "--gpus", "1", "--hardware", H200, "--input-len", "0"])
    assert "argument --input-len: sizes must be >= 1, got '0'" in capsys.readouterr().err
    assert main(["plan", "--config", cfg, "--gpus", "1", "--hardware", H200, "--context", "2048", "--input-len",
                 "4096"]) == 2
    assert ("--input-len 4096 is longer than the --context (2048 KV-cache tokens a sequence)"
            in capsys.readouterr().err)


def test_plan_default_context_stays_within_the_model(tiny_checkpoints, capsys):
    """Without ``--context`` the plan prices the model's ``max_position_embeddings`` where it is below 4096 (no
    warning); an explicit longer one is priced as asked, with the warning."""
    tiny = str(tiny_checkpoints("gpt-oss"))
    limit = load_moe_spec(tiny).max_position_embeddings
    assert limit < 4096
    base = ["plan", "--config", tiny, "--gpus", "1", "--hardware", H200, "--batch", "1", "--json"]
    assert main(base) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["context"] == limit and "max_position_embeddings" not in captured.err
    assert main([*base, "--context", "4096"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["context"] == 4096
    assert f"--context 4096 is above the model's max_position_embeddings {limit}" in captured.err
