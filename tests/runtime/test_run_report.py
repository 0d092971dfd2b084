"""The tables ``epmoe run`` prints: live rebalances by outcome, the failing rank's own reason, the float32
judge of half-precision runs."""

from __future__ import annotations

import io
import re

from rich.console import Console

from epmoe.runtime.report import RankReport, RunReport, print_run_report


def _report(rebalances: list[dict], **fields) -> RunReport:
    rank = RankReport(rank=0, prompts=[0], tokens=[[5, 6]], finish_reasons=["length"], gen_s=1.0, steps=8,
                      step_kinds={"eager_steps": 8}, tokens_per_step=1.0, ttft_ms=[3.0], rank_counts=[[2]],
                      rebalances=rebalances, collectives={"all_to_all": 6.0, "all_reduce": 0.0, "all_gather": 1.0},
                      bytes_per_step={"all_to_all": 100.0, "all_reduce": 0.0, "all_gather": 8.0}, peak_rss_mb=500.0,
                      peak_cuda_mb=0.0, expert_mb=0.5, full_expert_mb=1.0,
                      kv={"blocks": 8, "block_size": 16, "bytes": 1024, "max_concurrency": 2, "context": 64,
                          "bytes_per_token_layer": 96, "kind": "latent"})
    values = dict(model="ckpt", model_type="deepseek_v3", ep=1, parallel="ep", device="cpu", prompts=["p"],
                  outputs=["xy"], ranks=[rank], tokens_per_s=2.0, balancedness=1.0, routed_tokens_per_step=[1.0],
                  matches_reference=True)
    values.update(fields)
    return RunReport(**values)


def _printed(report: RunReport) -> str:
    out = io.StringIO()
    print_run_report(report, Console(file=out, width=400))
    return out.getvalue()


def _event(step, committed, moved=0, error=None, skipped=None, before=0.8, after=0.8):
    return {"step": step, "balancedness_before": before, "balancedness_after": after, "copies_moved": moved,
            "committed": committed, "error": error, "skipped": skipped}


def test_rebalances_are_counted_by_outcome_with_reasons():
    reason = ("rebalance abandoned, the old placement keeps serving: rank 1, MoE layer 1 transfer: RuntimeError: "
              "simulated failure")
    text = _printed(_report([
        _event(2, True, moved=3, before=0.8, after=0.95), _event(4, False, skipped="already balanced: no copy to move"),
        _event(6, False, skipped="already balanced: no copy to move"), _event(8, False, moved=2, error=reason),
    ]))
    assert ("live rebalances (committed / skipped / failed) │ 1 / 2 / 1, 3 copies moved; last commit at step 2: "
            "balancedness 0.800 -> 0.950; skipped at step(s) 4, 6: already balanced: no copy to move") in text
    assert f"first failed rebalance (step 8)                │ {reason}" in text


def test_half_precision_mismatches_are_judged_by_the_float32_reference():
    from epmoe.runtime.report import judge_mismatches

    ours = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    same_dtype = [[1, 2, 3], [4, 5, 7], [7, 8, 1]]
    # prompt 1: ours equal float32, transformers' bf16 run flipped; prompt 2: ours differ from float32 too
    failing, judged = judge_mismatches(ours, same_dtype, {1: [4, 5, 6], 2: [7, 8, 1]})
    assert failing == [2]
    assert judged == [{"prompt": 1, "epmoe_equals_float32": True, "reference_equals_float32": False},
                      {"prompt": 2, "epmoe_equals_float32": False, "reference_equals_float32": True}]
    assert judge_mismatches(ours, same_dtype, {}) == ([1, 2], [])  # float32 runs: no second judge


def test_a_bf16_run_equal_to_float32_passes_and_says_so():
    judged = [{"prompt": 0, "epmoe_equals_float32": True, "reference_equals_float32": False}]
    text = _printed(_report([], dtype="bfloat16", matches_reference=True, float32_judged=judged))
    assert ("│ YES: prompts [0] differ from transformers' bfloat16 run, but equal its "
            "float32 run (its bfloat16 run rounded a near-tie the other way); the others token for token") in text
    assert re.search(r"│ 0 │ p\s+│ 'xy'\s+│ yes \(float32\)", text)
    failed = [{"prompt": 0, "epmoe_equals_float32": False, "reference_equals_float32": True}]
    text = _printed(_report([], dtype="bfloat16", matches_reference=False, float32_judged=failed, mismatches=[0],
                            first_mismatch=(0, 1, 6, 9)))
    assert ("NO: prompts [0] differ; first at prompt 0, step 1: token 6 here, 9 in the reference; the float32 "
            "reference equals transformers' bfloat16 there") in text


def test_counts_of_one_are_singular():
    """One block of one token, one sequence, one copy moved, one proposed token in one verify step: no "1 blocks"."""
    report = _report([_event(2, True, moved=1, before=0.8, after=0.9)])
    report.ranks[0].kv.update(blocks=1, block_size=1, max_concurrency=1, context=1)
    report.speculative = {"algorithm": "ngram", "num_tokens": 1, "proposer": "prompt lookup", "verify_steps": 1,
                          "draft_tokens": 1, "accepted_tokens": 1, "accepted_length": 2.0, "acceptance_rate": 1.0,
                          "requests": [{"verify_steps": 1, "accepted_length": 2.0}]}
    text = _printed(report)
    assert "│ 1 / 0 / 0, 1 copy moved; last commit at step 2" in text
    assert "│ 1 block of 1 token (1.0 KiB; 96 B per token and layer, latent), 1 sequence of 1 token at once" in text
    assert "│ 2.00 / 1.00 (1 of 1 proposed token, 1 verify step)" in text
    text = _printed(_report([_event(2, True, moved=2)]))
    assert "2 copies moved" in text and "8 blocks of 16 tokens" in text and "2 sequences of 64 tokens" in text


def test_tensor_parallel_runs_are_titled_tp_and_route_nothing_to_ranks():
    """``--parallel tp``: the per-rank table names TP ranks and the TP size, its routed column and the balancedness
    row (every rank computes a slice of every expert) are not shown as if experts were routed to ranks."""
    ep = _printed(_report([], ep=2, routed_tokens_per_step=[2.5]))
    assert "EP ranks (deepseek_v3, EP 2, cpu)" in ep and "TP" not in ep
    assert "balancedness (mean/max routed tokens per rank)" in ep
    assert re.search(r"│\s+0 │\s+1 │\s+0/0/8/0 │\s+1.0 │\s+2.5 │", ep)
    tp = _printed(_report([], ep=2, parallel="tp"))
    assert "TP ranks (deepseek_v3, TP 2, cpu)" in tp and "EP" not in tp
    assert "balancedness" not in tp
    assert re.search(r"│\s+0 │\s+1 │\s+0/0/8/0 │\s+1.0 │\s+- │", tp)
    assert "routed = - (tensor-parallel experts: every rank computes its slice of every expert)" in tp
