"""Speculative decoding priced per strategy: verify steps, drafts, their collectives, break-even and tokens/s, and
the server command lines that realise a plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from epmoe.cli import main
from epmoe.integrations.commands import chosen_strategy, server_command
from epmoe.plan.costs import ACT_BYTES
from epmoe.plan.draft import default_eagle3_draft, read_draft
from epmoe.plan.hardware import load_hardware
from epmoe.plan.planner import plan
from epmoe.plan.request import PlanRequest
from epmoe.plan.speculative import price_speculation
from epmoe.spec import load_moe_spec

from ..conftest import CONFIGS

KIMI = CONFIGS / "kimi-k2.5.config.json"


def _kimi(**kw) -> PlanRequest:
    return PlanRequest(spec=load_moe_spec(KIMI), hardware=load_hardware("rtx-pro-6000"), gpus=8, **kw)


def test_default_draft_is_the_published_kimi_eagle3_head():
    published = read_draft(str(CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json"))
    ours = default_eagle3_draft(load_moe_spec(KIMI))
    for field in ("weight_bytes", "step_params", "kv_bytes_per_token", "kv_heads", "num_layers", "head_vocab",
                  "hidden_size"):
        assert getattr(ours, field) == getattr(published, field), field
    # 1 layer: attention 2D x (64 + 2 * 64) heads x 128 + o 64 x 128 x D, MLP 3 D 18432, fc 3 D^2, head 32000 D
    d = 7168
    assert ours.step_params == 2 * d * 192 * 128 + 64 * 128 * d + 3 * d * 18432 + 3 * d * d + 32000 * d


def test_verify_step_grows_less_than_linearly_and_collectives_are_counted_per_strategy():
    base = _kimi(batches=(1,), spec_tokens=0)
    steps = {k: plan(dataclasses.replace(base, spec_tokens=k)) for k in (0, 1, 3, 7)}
    for name in ("TP8", "EP8+DPattn"):
        t = [steps[k].strategy(name).steps[0].total_ms for k in (0, 1, 3, 7)]
        assert t[0] < t[1] < t[2] < t[3]
        assert t[2] / t[0] < 2.0  # 4 positions per sequence cost well under 4 decode steps (memory-bound)
    sp = price_speculation(dataclasses.replace(base, spec_tokens=3), accept_length=2.5)
    tp, dp = sp.strategy("TP8").steps[0], sp.strategy("EP8+DPattn").steps[0]
    assert tp.verify.count("all_reduce") == tp.decode.count("all_reduce") == 2 * 61
    assert tp.verify.count("all_gather") == 1 and tp.verify.count("all_to_all") == 0
    ar = next(c for c in tp.verify.collectives if c.kind == "all_reduce")
    assert ar.bytes_per_call == 4 * 7168 * ACT_BYTES  # 1 sequence x 4 positions of D bf16
    assert dp.verify.count("all_to_all") == 2 * 60 and dp.verify.count("all_reduce") == 0
    # the EAGLE-3 head, 3 forwards: under TP 2 all-reduces (1 layer) + 1 logits all-gather each; under DP none
    assert [(c.kind, c.count) for c in tp.draft_collectives] == [("all_reduce", 6), ("all_gather", 3)]
    assert dp.draft_collectives == ()
    for st in (tp, dp):
        assert st.round_ms == pytest.approx(st.verify.total_ms + st.draft_ms)
        assert st.break_even == pytest.approx(st.round_ms / st.decode.total_ms)
        assert st.tokens_per_s == pytest.approx(2.5 * 1e3 / st.round_ms)
        assert st.plain_tokens_per_s == pytest.approx(1e3 / st.decode.total_ms)
        assert st.pays == (2.5 > st.break_even)
    # the DP-attention draft runs whole on each GPU, the TP one sliced over 8: the whole one reads 8x the weights
    assert dp.draft_ms > 4 * tp.draft_ms
    head = sp.draft  # its memory beside the target: weights (sliced under TP) and the KV cache of the context
    assert tp.draft_bytes == pytest.approx(head.weight_bytes / 8 + 4096 * head.kv_bytes_per_token / 8)
    assert dp.draft_bytes == pytest.approx(head.weight_bytes + 4096 * head.kv_bytes_per_token)
    assert tp.fits and not dp.fits and dp.over == pytest.approx(dp.verify.memory.over + dp.draft_bytes)


def test_moe_draft_is_priced_as_its_own_decode_step():
    target = PlanRequest(spec=load_moe_spec(CONFIGS / "qwen3-235b-a22b.config.json"),
                         hardware=load_hardware("h200-sxm"), gpus=8, batches=(1, 8), spec_tokens=2)
    draft = read_draft(str(CONFIGS / "qwen3-30b-a3b.config.json"))
    sp = price_speculation(target, draft)
    own = plan(dataclasses.replace(target, spec=draft.spec, spec_tokens=0))
    for s in sp.strategies:
        for i, st in enumerate(s.steps):
            assert st.draft_ms == pytest.approx(2 * own.strategy(s.strategy.name).steps[i].total_ms)
            assert st.accept_length is None and st.tokens_per_s is None and st.pays is None


def test_bad_speculation_requests():
    with pytest.raises(ValueError, match="spec_tokens must be at least 1"):
        price_speculation(_kimi(batches=(1,)))
    with pytest.raises(ValueError, match=r"accept_length must lie in \[1, spec_tokens \+ 1 = 4\]"):
        price_speculation(_kimi(batches=(1,), spec_tokens=3), accept_length=4.5)


def test_plan_cli_speculation_and_engine_commands(capsys):
    args = ["plan", "--config", str(KIMI), "--gpus", "8", "--hardware", "rtx-pro-6000", "--batch", "1",
            "--spec-tokens", "3", "--accept-length", "2"]
    assert main([*args, "--json", "--engine", "vllm"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tp = next(s for s in doc["speculation"]["strategies"] if s["name"] == "TP8")["steps"][0]
    assert tp["tokens_per_s"] == pytest.approx(2 * 1e3 / tp["round_ms"])
    assert tp["pays"] == (2 > tp["break_even_accept_length"])
    assert doc["command"]["argv"][:5] == ["vllm", "serve", "MODEL", "--tensor-parallel-size", "8"]
    assert main([*args, "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "Speculation under TP8 at batch 1:" in out and "Speculation under EP8+DPattn at batch 1:" in out
    assert "--speculative-algorithm EAGLE3" in out and "--speculative-num-draft-tokens 4" in out
    assert main(["plan", "--config", str(KIMI), "--gpus", "8", "--hardware", "rtx-pro-6000",
                 "--accept-length", "2"]) == 2
    err = capsys.readouterr().err
    assert "--accept-length prices speculative decoding: it needs --spec-tokens of at least 1" in err


def test_server_commands_for_expert_parallel_with_redundant_experts():
    req = PlanRequest(spec=load_moe_spec(CONFIGS / "kimi-k2.5.config.json"), hardware=load_hardware("h200-sxm"),
                      gpus=8, batches=(256,), redundant=32)
    p = plan(req)
    assert chosen_strategy(p)[0].name == "EP8+DPattn"  # INT4 experts, 32 redundant slots, batch 256
    sg = server_command("sglang", p, model="/models/Kimi-K2.5")
    assert sg.argv == ("python", "-m", "sglang.launch_server", "--model-path", "/models/Kimi-K2.5", "--tp-size",
                       "8", "--ep-size", "8", "--attn-dp-size", "8", "--moe-a2a-backend", "deepep",
                       "--ep-num-redundant-experts", "32", "--init-expert-location", "placement.pt")
    vl = server_command("vllm", p, model="/models/Kimi-K2.5")
    assert vl.text() == ("vllm serve /models/Kimi-K2.5 --tensor-parallel-size 1 --data-parallel-size 8 "
                         "--enable-expert-parallel --all2all-backend deepep_low_latency --enable-eplb --eplb-config "
                         "'{\"num_redundant_experts\": 32}'")
    with pytest.raises(ValueError, match="engine must be one of sglang, vllm"):
        server_command("trtllm", p)


def test_plan_refuses_an_eagle_head_trained_for_another_target(capsys):
    """As doctor does: an EAGLE-3 head reads the target's hidden states, so Qwen3-30B's head cannot draft for
    Kimi-K2.5 (hidden 2048 against 7168); Kimi's own head is priced."""
    args = ["plan", "--config", str(CONFIGS / "kimi-k2.5.config.json"), "--gpus", "8", "--hardware", "h200-sxm",
            "--spec-tokens", "3", "--batch", "1"]
    assert main(args + ["--draft", str(CONFIGS / "eagle3-draft-qwen3-30b-a3b-specforge.config.json")]) == 2
    err = capsys.readouterr().err
    assert "the draft has hidden size 2048 but the target kimi-k2.5.config.json has hidden size 7168" in err
    assert main(args + ["--draft", str(CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json")]) == 0


def test_engine_command_leaves_speculation_off_where_it_does_not_pay(capsys):
    """At accepted length 1 (every draft token rejected) speculation pays nowhere: the server command has no
    speculation flags and says why; at 2 (as above) it keeps them."""
    args = ["plan", "--config", str(KIMI), "--gpus", "8", "--hardware", "rtx-pro-6000", "--batch", "1",
            "--spec-tokens", "3", "--json"]
    for engine, flag in (("sglang", "--speculative-algorithm"), ("vllm", "--speculative-config")):
        assert main([*args, "--accept-length", "1", "--engine", engine]) == 0
        doc = json.loads(capsys.readouterr().out)
        chosen = doc["command"]["strategy"]
        steps = next(s for s in doc["speculation"]["strategies"] if s["name"] == chosen)["steps"]
        assert not any(st["pays"] for st in steps)
        assert flag not in doc["command"]["argv"]
        assert any(n.startswith(f"speculation left off: at accepted length 1 it pays at no planned batch under "
                                f"{chosen}") for n in doc["command"]["notes"])
        assert not any(n.startswith("DRAFT") for n in doc["command"]["notes"])
        assert main([*args, "--accept-length", "2", "--engine", engine]) == 0
        assert flag in json.loads(capsys.readouterr().out)["command"]["argv"]
