"""Speculative decoding at EP 2 and 4 in gloo processes: greedy output equal to plain greedy decoding token
for token, with an MoE draft of its own placement (expert-parallel, its steps collectives every rank joins,
a rank with no requests included; or replicated), an EAGLE-3 head on Kimi's architecture, ngram, on the
eager path and on the graph path's static buckets (verify rows B x (K + 1), fixed-capacity dispatch), and
the target rebalanced live mid-run while an expert-parallel draft speculates: the draft's placement is
never touched."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.runtime.launch import RankInfo, init_group, spawn

from ..conftest import CONFIGS

NEW_TOKENS = 9


def _prompts(rank: int, size: int) -> list[list[int]]:
    if size == 4 and rank == 3:
        return []  # this rank only joins the target's and the draft's collectives
    gen = torch.Generator().manual_seed(50 + rank)
    rep = torch.randint(0, 256, (4,), generator=gen).tolist()
    return [rep * 4, torch.randint(0, 256, (7,), generator=gen).tolist(), [rep[0]]]


def _worker(info: RankInfo, dirs: dict[str, str], cases: dict[str, dict]) -> dict:
    from epmoe.engine import Engine, EngineConfig, SamplingParams

    comm = Comm(init_group(info, "cpu"))
    try:
        prompts = _prompts(comm.rank, comm.size)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        plain: dict[str, list] = {}
        out = {}
        for name, case in cases.items():
            target = dirs[case.pop("target")]
            options = dict(max_num_seqs=4, num_kv_blocks=64, block_size=4, **case)
            if target not in plain:
                plain[target] = [o.token_ids for o in Engine(EngineConfig(model=target, max_num_seqs=4,
                                                                          num_kv_blocks=64, block_size=4),
                                                             comm).generate(prompts, params)]
            engine = Engine(EngineConfig(model=target, **options), comm)
            draft_placement = getattr(engine.proposer, "placement", None)
            before = draft_placement.phy2log.clone() if draft_placement is not None else None
            got = [o.token_ids for o in engine.generate(prompts, params)]
            out[name] = {
                "got": got, "want": plain[target], "verify_steps": engine.spec_stats.verify_steps,
                "graph_steps": engine.stats["graph_steps"], "steps": engine.num_steps,
                "collective": engine.proposer.collective, "describe": engine.proposer.describe(),
                "committed": [e.committed for e in engine.eplb.events] if engine.eplb is not None else [],
                "target_moved": engine.placement is not None and engine.placement is not engine.ep_model.placement,
                "draft_kept": before is None or (engine.proposer.placement is draft_placement
                                                 and torch.equal(engine.proposer.ep_model.placement.phy2log, before)
                                                 and all(layer.placement is draft_placement
                                                         for layer in engine.proposer.ep_model.moe_layers)),
            }
        return out
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dirs(tiny_checkpoints, tmp_path_factory):
    from epmoe.models.tiny import build_tiny_eagle3_config
    from epmoe.placement import ExpertPlacement

    root = tmp_path_factory.mktemp("spec-ranks")
    out = {fam: str(tiny_checkpoints(fam)) for fam in ("qwen3-moe", "kimi-k2.5", "mixtral")}
    out["eagle3"] = str(build_tiny_eagle3_config(root / "eagle3", CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai"
                                                 ".config.json", out["kimi-k2.5"]))
    for ep in (2, 4):  # the draft's own placement: 8 experts, round robin (the target has 16, contiguous)
        path = root / f"mixtral-rr-{ep}.json"
        ExpertPlacement.trivial(2, 8, ep, layout="round_robin").save(path)
        out[f"draft-placement-{ep}"] = str(path)
    return out


def _cases(dirs: dict[str, str], ep: int) -> dict[str, dict]:
    moe_draft = dict(speculative_algorithm="draft", speculative_draft_model=dirs["mixtral"],
                     speculative_draft_placement=dirs[f"draft-placement-{ep}"])
    if ep == 4:
        return {"moe-draft-ep-k3-rebalanced-target": dict(target="kimi-k2.5", speculative_num_tokens=3, redundant=4,
                                                          eplb_interval=2, **moe_draft)}
    return {
        "moe-draft-ep-k1": dict(target="qwen3-moe", speculative_num_tokens=1, **moe_draft),
        "moe-draft-ep-k5-static": dict(target="qwen3-moe", speculative_num_tokens=5, static_decode_on_cpu=True,
                                       cuda_graph_max_bs=2, **moe_draft),
        "ngram-k3-static": dict(target="qwen3-moe", speculative_algorithm="ngram", speculative_num_tokens=3,
                                static_decode_on_cpu=True, cuda_graph_max_bs=2),
        "eagle3-kimi-k3": dict(target="kimi-k2.5", speculative_algorithm="eagle3",
                               speculative_draft_model=dirs["eagle3"], speculative_num_tokens=3),
        "replicated-draft-rebalanced-target": dict(
            target="kimi-k2.5", speculative_algorithm="draft", speculative_draft_model=dirs["mixtral"],
            speculative_draft_parallel="replicated", speculative_num_tokens=3, redundant=2, eplb_interval=2),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [2, 4])
def test_speculation_equals_plain_greedy_across_ranks(dirs, ep):
    cases = _cases(dirs, ep)
    results = spawn(_worker, ep, (dirs, cases))
    for name in cases:
        per_rank = [r[name] for r in results]
        assert len({r["steps"] for r in per_rank}) == 1, f"{name}: ranks ran different step counts"
        for rank, r in enumerate(per_rank):
            assert r["got"] == r["want"], (name, rank, r["got"], r["want"])
        assert sum(r["verify_steps"] for r in per_rank) > 0, name
        if "static" in name:
            assert all(r["graph_steps"] > 0 for r in per_rank if r["got"]), name
        if "moe-draft-ep" in name:
            assert all(r["collective"] for r in per_rank), name
            assert f"placement file {dirs[f'draft-placement-{ep}']}" in per_rank[0]["describe"]
        if "replicated" in name:
            assert not any(r["collective"] for r in per_rank)
            assert "replicated" in per_rank[0]["describe"]
        if "rebalanced" in name:
            assert any(per_rank[0]["committed"]), f"{name}: no rebalance committed"
            assert all(r["target_moved"] for r in per_rank), name
            assert all(r["draft_kept"] for r in per_rank), f"{name}: the draft's placement was touched"
