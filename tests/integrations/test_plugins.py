"""The SGLang and vLLM plug-ins and the DeepSeek drop-in, called with each signature generation on the real OLMoE
counts: placements at least as balanced as DeepSeek's, deterministic, in the caller's return shape."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from epmoe.balance import balance_deepseek, balancedness
from epmoe.compat import rebalance_experts
from epmoe.integrations import LayeredPlacement, read_load_dump, save_placement_as
from epmoe.integrations import sglang as sglang_plugin
from epmoe.integrations import vllm as vllm_plugin
from epmoe.loads import read_csv_loads
from epmoe.placement import ExpertPlacement

OLMOE = Path(__file__).resolve().parents[2] / "data" / "loads" / "olmoe_expert_counts.csv"
EP, SLOTS = 8, 80  # 64 experts + 16 redundant


@pytest.fixture(scope="module")
def olmoe() -> torch.Tensor:
    return read_csv_loads(OLMOE)[0]


def _check_tables(load: torch.Tensor, phy2log, log2phy, logcnt) -> ExpertPlacement:
    p = ExpertPlacement(phy2log, num_experts=load.shape[1], ep_size=EP)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert log2phy.shape == (load.shape[0], load.shape[1], SLOTS - load.shape[1] + 1)  # DeepSeek's width R + 1
    assert torch.equal(logcnt, p.logcnt) and torch.equal((log2phy >= 0).sum(-1), logcnt)
    slots = log2phy.clamp(min=0)
    assert torch.equal(torch.gather(phy2log, 1, slots.flatten(1)).view_as(slots)[log2phy >= 0],
                       torch.arange(load.shape[1]).expand_as(log2phy.transpose(1, 2)).transpose(1, 2)[log2phy >= 0])
    assert balancedness(load, p) >= balancedness(load, balance_deepseek(load, EP, SLOTS - load.shape[1]))
    return p


def test_deepseek_drop_in(olmoe):
    out = rebalance_experts(olmoe.float(), SLOTS, 1, 1, EP)
    p = _check_tables(olmoe, *out)
    assert all(torch.equal(a, b) for a, b in zip(out, rebalance_experts(olmoe.float(), SLOTS, 1, 1, EP)))
    assert balancedness(olmoe, p) > 0.999


@pytest.mark.parametrize("args, message", [
    ((SLOTS, 1, 0, EP), "num_nodes must be a positive integer, got 0"),  # were taken as one node
    ((SLOTS, -1, 1, EP), r"num_groups must be a non-negative integer or None \(0 and None: no groups\), got -1"),
])
def test_deepseek_drop_in_sizes_named(olmoe, args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(olmoe.float(), *args)
    with pytest.raises(ValueError, match=r"weight must hold real loads, got complex values \(torch\.complex64\)"):
        rebalance_experts(olmoe.to(torch.complex64), SLOTS, 1, 1, EP)
    with pytest.raises(ValueError, match=r"weight must hold real loads, got complex values \(complex128\)"):
        rebalance_experts(olmoe.to(torch.complex64).tolist(), SLOTS, 1, 1, EP)  # was an AttributeError


def test_sglang_signature_with_dense_rows(olmoe):
    tokens = torch.zeros(2, olmoe.shape[0] + 1, 64, dtype=torch.int32)  # [B, L_all, E], layer 0 dense
    tokens[0, 1:] = (olmoe / 2).floor().int()
    tokens[1, 1:] = olmoe.int() - tokens[0, 1:]
    for algorithm in ("deepseek", "deepseek_hierarchical"):
        phy2log, log2phy, logcnt = sglang_plugin.rebalance_experts(tokens, SLOTS, SLOTS // EP, 8, 1, algorithm)
        assert torch.equal(phy2log[0], torch.arange(SLOTS) % 64)  # the dense row stays trivial
        _check_tables(olmoe, phy2log[1:], log2phy[1:], logcnt[1:])
    sglang_plugin.check_signature(sglang_plugin.rebalance_experts)
    with pytest.raises(RuntimeError, match="takes \\(weight, num_replicas"):
        sglang_plugin.check_signature(rebalance_experts)


def test_vllm_generations(olmoe, tmp_path):
    plugin = vllm_plugin.VllmEplb()
    gen1 = plugin.entry_point(1)
    assert vllm_plugin.generation_of(inspect.signature(gen1)) == 1
    first = _check_tables(olmoe, *gen1(olmoe, SLOTS, 1, 1, EP))
    policy2, policy3 = plugin.entry_point(2), plugin.entry_point(3)
    assert vllm_plugin.generation_of(inspect.signature(policy2.rebalance_experts)) == 2
    assert vllm_plugin.generation_of(inspect.signature(policy3.rebalance_experts)) == 3
    _check_tables(olmoe, *policy2.rebalance_experts(olmoe, SLOTS, 1, 1, EP, None))
    # generation 3 passes the serving map: the rearrangement moves few copies and stays balanced
    drifted = olmoe.roll(1, dims=0)
    moved = policy3.rebalance_experts(drifted, SLOTS, 1, 1, EP, first.phy2log)
    scratch = policy3.rebalance_experts(drifted, SLOTS, 1, 1, EP)
    assert isinstance(moved, torch.Tensor) and moved.shape == (olmoe.shape[0], SLOTS)
    p_moved = ExpertPlacement(moved, num_experts=64, ep_size=EP)
    assert int((moved != first.phy2log).sum()) < int((scratch != first.phy2log).sum())
    assert balancedness(drifted, p_moved) >= balancedness(drifted, balance_deepseek(drifted, EP, 16))
    with pytest.raises(RuntimeError, match="does not know an EPLB entry point taking \\(tokens_per_expert"):
        vllm_plugin.generation_of(inspect.signature(sglang_plugin.rebalance_experts))


def test_vllm_dump_and_fixed_placement(olmoe, tmp_path, monkeypatch):
    fixed = ExpertPlacement.trivial(olmoe.shape[0], 64, EP, 16, layout="round_robin")
    path = tmp_path / "fixed.yaml"
    save_placement_as(LayeredPlacement(fixed, tuple(range(olmoe.shape[0])), None, "trtllm"), path)
    monkeypatch.setenv("EPMOE_EPLB_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("EPMOE_EPLB_PLACEMENT", str(path))
    policy = vllm_plugin.VllmEplb.from_env().entry_point(3)
    assert torch.equal(policy.rebalance_experts(olmoe, SLOTS, 1, 1, EP, None), fixed.phy2log)  # first: the file
    second = policy.rebalance_experts(olmoe, SLOTS, 1, 1, EP, fixed.phy2log)
    assert not torch.equal(second, fixed.phy2log)
    dumps = sorted(tmp_path.glob("epmoe_loads_*.json"))
    assert [p.name for p in dumps] == ["epmoe_loads_000000.json", "epmoe_loads_000001.json"]
    d = read_load_dump(dumps[1])
    assert d.format == "epmoe" and torch.equal(d.load, olmoe)
    bad = vllm_plugin.VllmEplb(placement_file=path).entry_point(3)
    with pytest.raises(ValueError, match="covers 15 layers x 80 slots of 64 experts, but vLLM rearranges 15 MoE "
                                         "layers x 88 slots"):
        bad.rebalance_experts(olmoe, 88, 1, 1, EP, None)


def test_plugins_do_nothing_without_epmoe_eplb(monkeypatch):
    monkeypatch.delenv("EPMOE_EPLB", raising=False)
    assert sglang_plugin.register() is None and vllm_plugin.register() is None
