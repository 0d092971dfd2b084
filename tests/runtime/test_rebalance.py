"""Live rebalancing: weights move between gloo ranks mid-generation with identical output; a rank that
fails during the move leaves the old placement serving on every rank."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.layer import MoELayerOptions
from epmoe.placement import ExpertPlacement
from epmoe.runtime import rebalance
from epmoe.runtime.launch import RankInfo, init_group, spawn
from epmoe.runtime.run import RunConfig, run_job

from ..hf_greedy import hf_greedy


@pytest.mark.multiprocess
def test_rebalance_mid_generation_keeps_tokens(tiny_checkpoints):
    report = run_job(RunConfig(model=str(tiny_checkpoints("kimi-k2.5")), ep=2, redundant=2, max_new_tokens=7,
                               eplb_interval=2))
    events = report.ranks[0].rebalances
    assert [e["step"] for e in events] == [2, 4, 6]
    assert any(e["committed"] and e["copies_moved"] > 0 for e in events)
    assert all(e["balancedness_after"] >= e["balancedness_before"] - 0.02 for e in events)
    assert report.ranks[1].rebalances == events  # every rank took the same decisions
    assert report.matches_reference is True


def _snapshot(ep) -> list[torch.Tensor]:
    return [p.detach().clone() for layer in ep.moe_layers for p in layer.experts.parameters()]


def _failing_on_call(original, fail_call: int):
    """``original`` that raises on its ``fail_call``-th call (0-based) of one ``migrate``, i.e. on that MoE layer."""
    calls = []

    def maybe_fail(*args, **kwargs):
        calls.append(None)
        if len(calls) - 1 == fail_call:
            raise RuntimeError("simulated failure")
        return original(*args, **kwargs)

    return maybe_fail


def _worker(info: RankInfo, directory: str, fail_rank: int, where: str) -> dict:
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import load_ep_model

    comm = Comm(init_group(info, "cpu"))
    old = ExpertPlacement.trivial(2, 16, 2, num_redundant=2)
    ep = load_ep_model(directory, old, comm)
    new = ExpertPlacement.trivial(2, 16, 2, num_redundant=2, layout="round_robin")
    before = _snapshot(ep)
    original = getattr(rebalance, where)
    # fail on the first MoE layer, then on the second (the first layer is then fully staged and transferred)
    failures = []
    for fail_layer in range(len(ep.moe_layers)):
        if comm.rank == fail_rank:
            setattr(rebalance, where, _failing_on_call(original, fail_layer))
        failed = rebalance.migrate(ep, new, epoch=1 + fail_layer, timeout_s=20)
        setattr(rebalance, where, original)
        failures.append({
            "result": failed,
            "kept": ep.placement is old and all(layer.placement is old for layer in ep.moe_layers),
            "held": [layer.local_experts.tolist() for layer in ep.moe_layers],
            "same_weights": all(torch.equal(a, b) for a, b in zip(before, _snapshot(ep))),
        })
    prompts = [[72, 101, 108, 108, 111 + comm.rank]]
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    want = hf_greedy(ref, prompts, 5, 258)
    after_failure = hf_greedy(ep.model, prompts, 5, 258)
    # the same move without the fault commits, and serving stays exact
    ok = rebalance.migrate(ep, new, epoch=len(failures) + 1, timeout_s=20)
    after_commit = hf_greedy(ep.model, prompts, 5, 258)
    held = [layer.local_experts.tolist() for layer in ep.moe_layers]
    torch.distributed.destroy_process_group()
    return {"failures": failures, "want": want, "after_failure": after_failure, "ok": ok,
            "after_commit": after_commit, "held": held, "old_held": old.local_experts(comm.rank).tolist(),
            "expected_held": new.local_experts(comm.rank).tolist()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["_unpack", "_stage_layer"])
def test_failed_move_keeps_old_placement(tiny_checkpoints, where):
    """A failure on MoE layer 0, then one on layer 1 (after layer 0 was staged): every layer keeps the old
    placement and weights, on every rank."""
    results = spawn(_worker, 2, (str(tiny_checkpoints("kimi-k2.5")), 1, where))
    for r in results:
        assert len(r["failures"]) == 2
        for fail_layer, f in enumerate(r["failures"]):
            assert f["result"].committed is False
            assert "the old placement keeps serving" in f["result"].error
            assert f"MoE layer {fail_layer}" in f["result"].error
            assert f["kept"] and f["same_weights"]
            assert f["held"] == r["old_held"]
        assert r["after_failure"] == r["want"]
        assert r["ok"].committed and r["ok"].error is None
        assert r["held"] == r["expected_held"]
        assert r["after_commit"] == r["want"]
    for f in results[1]["failures"]:
        assert "rank 1" in f["result"].error and "simulated failure" in f["result"].error
    # rank 0 gives rank 1's own reason
    assert [f["result"].error for f in results[0]["failures"]] == [f["result"].error for f in results[1]["failures"]]
    # contiguous -> round robin with 2 redundant: rank 0 keeps experts 0, 2, 4, 6 and receives the rest
    assert results[0]["ok"].copies_received > 0 and results[0]["ok"].bytes_received > 0


def test_migrate_rejects_wrong_shape_before_moving(tiny_checkpoints):
    from epmoe.models.hf import load_ep_model

    ep = load_ep_model(str(tiny_checkpoints("kimi-k2.5")), ExpertPlacement.trivial(2, 16, 1), Comm(None),
                       options=MoELayerOptions(dispatcher="local"))
    with pytest.raises(ValueError, match="new placement has num_slots 18, the model serves 16"):
        rebalance.migrate(ep, ExpertPlacement.trivial(2, 16, 1, num_redundant=2))


def test_a_cap_that_admits_no_move_is_named_as_the_reason_nothing_moved():
    """Without redundant slots copies move in swapped pairs, so ``max_moves`` 1 moves nothing even where the load is
    skewed: the skipped attempt says so (not "already balanced"), and says how many copies would move uncapped; a
    balanced load is still "already balanced". Skipped attempts move nothing, so no model is needed."""
    from types import SimpleNamespace

    from epmoe.loads import ExpertLoadRecorder

    placement = ExpertPlacement.trivial(1, 4, 2)  # rank 0 holds experts 0 and 1, rank 1 experts 2 and 3
    ctl = rebalance.EPLBController(SimpleNamespace(placement=placement), ExpertLoadRecorder(1, 4), interval=0)
    skewed = torch.tensor([[10.0, 10.0, 1.0, 1.0]])
    event = ctl.rebalance(4, load=skewed, max_moves=1)
    assert not event.committed and event.copies_moved == 0
    assert event.balancedness_before == pytest.approx(11 / 20)
    assert event.skipped == ("max_moves 1 admits none of the moves that balance better (without a cap 2 copies would "
                             "move; where no slot is redundant, copies move in pairs)")
    event = ctl.rebalance(8, load=torch.tensor([[10.0, 1.0, 10.0, 1.0]]), max_moves=1)
    assert event.skipped == "already balanced: no copy to move"
    assert ctl.rebalance(12, load=skewed, max_moves=0).skipped == "max_moves is 0: no copy may move"
    # an empty window (no request since the last commit) read as "already balanced"
    event = ctl.rebalance(16, load=torch.zeros(1, 4))
    assert not event.committed and event.copies_moved == 0
    assert event.skipped == "no tokens were routed since the last rebalance: no load to balance by"


def test_an_event_describes_itself_in_one_line_per_outcome():
    done = rebalance.RebalanceEvent(8, 0.6125, 0.87449, 6, True)
    assert done.describe() == "step 8: committed, 6 expert copies moved, balancedness 0.613 -> 0.874"
    one = rebalance.RebalanceEvent(4, 0.5, 0.75, 1, True)
    assert one.describe() == "step 4: committed, 1 expert copy moved, balancedness 0.500 -> 0.750"
    skipped = rebalance.RebalanceEvent(12, 0.95, 0.95, 0, False, skipped="already balanced: no copy to move")
    assert skipped.describe() == "step 12: skipped, balancedness 0.950: already balanced: no copy to move"
    failed = rebalance.RebalanceEvent(16, 0.7, 0.7, 2, False, error="rank 1, MoE layer 0: RuntimeError: boom")
    assert failed.describe() == ("step 16: not committed (2 expert copies would have moved), balancedness 0.700 kept: "
                                 "rank 1, MoE layer 0: RuntimeError: boom")
