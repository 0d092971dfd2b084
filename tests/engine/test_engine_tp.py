"""``parallel='tp'``: data-parallel attention with tensor-parallel experts (``DPTPMoELayer``) through the same
engine, in several gloo processes, against the transformers model itself (float32, greedy, token for token).

Each rank serves its own prompts of uneven lengths (at TP 4 one rank has none and only joins the
collectives); prompts are prefilled in chunks; one run uses the static decode buckets.
"""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.comm import Comm
from epmoe.engine import EngineConfig
from epmoe.layer import check_tp_sizes
from epmoe.runtime.launch import RankInfo, init_group, spawn
from epmoe.spec import load_moe_spec

from ..hf_greedy import hf_greedy

NEW_TOKENS = 6


def _prompts(rank: int, size: int) -> list[list[int]]:
    if rank == size - 1 and size > 2:
        return []
    gen = torch.Generator().manual_seed(2000 + rank)
    lengths = [17, 3, 9][: 3 - rank % 2]
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _run(directory: str, comm: Comm, static: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from epmoe.engine import Engine, SamplingParams

    prompts = _prompts(comm.rank, comm.size)
    engine = Engine(EngineConfig(model=directory, parallel="tp", max_num_seqs=2, max_num_batched_tokens=8,
                                 block_size=4, num_kv_blocks=64, static_decode_on_cpu=static, cuda_graph_max_bs=2),
                    comm)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           arrival_times=[0.0, 0.01, 0.0][: len(prompts)])
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return {"got": [o.token_ids for o in outs], "want": [hf_greedy(ref, [p], NEW_TOKENS, 258)[0] for p in prompts],
            "steps": engine.num_steps, "stats": dict(engine.stats), "slice": engine.ep_model.expert_bytes,
            "full": engine.ep_model.full_expert_bytes}


def _worker(info: RankInfo, dirs: dict[str, str], static: bool) -> dict:
    comm = Comm(init_group(info, "cpu"))
    try:
        return {fam: _run(d, comm, static) for fam, d in dirs.items()}
    finally:
        torch.distributed.destroy_process_group()


def _check(results: list[dict], static: bool = False) -> None:
    for fam in results[0]:
        assert len({r[fam]["steps"] for r in results}) == 1, fam
        for rank, r in enumerate(results):
            res = r[fam]
            assert res["got"] == res["want"], (fam, rank, res["got"], res["want"])
            if static:
                assert res["stats"]["graph_steps"] > 0, (fam, rank, res["stats"])


def _with_expert_biases(src, dst) -> str:
    """A copy of the gpt-oss checkpoint ``src`` whose expert biases are non-zero (transformers makes them 0)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(7)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if "experts" in name and name.endswith("_bias"):
                tensors[name] = (torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.multiprocess
def test_tp_engine_equals_transformers_two_ranks(tiny_checkpoints, tmp_path):
    families = ["kimi-k2.5", "mixtral", "qwen3-moe"]
    dirs = {f: str(tiny_checkpoints(f)) for f in families}
    dirs["gpt-oss"] = _with_expert_biases(tiny_checkpoints("gpt-oss"), tmp_path / "gpt-oss-biased")
    results = spawn(_worker, 2, (dirs, False))
    _check(results)
    r = results[0]["kimi-k2.5"]
    assert r["full"] == 2 * r["slice"]


@pytest.mark.multiprocess
def test_tp_engine_four_ranks_idle_rank_and_static_decode(tiny_checkpoints):
    families = ["kimi-k2.5", "qwen3-moe"]
    results = spawn(_worker, 4, ({f: str(tiny_checkpoints(f)) for f in families}, True))
    _check(results, static=True)
    assert all(r["kimi-k2.5"]["got"] == [] for r in results[3:])


def _bad_size_worker(info: RankInfo, directory: str) -> str:
    from epmoe.engine import Engine

    comm = Comm(init_group(info, "cpu"))
    try:
        Engine(EngineConfig(model=directory, parallel="tp", num_kv_blocks=8), comm)
    except ValueError as exc:
        return str(exc)
    finally:
        torch.distributed.destroy_process_group()
    return "no error"


@pytest.mark.multiprocess
def test_tp_refuses_sizes_the_group_does_not_divide(tiny_checkpoints, tmp_path):
    from epmoe.models.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint("qwen3-moe", tmp_path / "odd", overrides={"moe_intermediate_size": 33})
    messages = spawn(_bad_size_worker, 2, (str(directory),))
    assert all("moe_intermediate_size (33)" in m and "TP group size (2)" in m for m in messages), messages


def test_check_tp_sizes_names_the_shared_size(tiny_checkpoints):
    spec = load_moe_spec(tiny_checkpoints("kimi-k2.5"))
    check_tp_sizes(spec, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(32\).*TP group size \(3\)"):
        check_tp_sizes(spec, 3)


@pytest.mark.parametrize("option", [{"placement": "x.json"}, {"redundant": 2}, {"eplb_interval": 4},
                                    {"dispatcher": "all_to_all"}])
def test_tp_refuses_ep_only_options(tiny_checkpoints, option):
    with pytest.raises(ValueError, match=f"{next(iter(option))}.*parallel 'tp'"):
        EngineConfig(model=str(tiny_checkpoints("kimi-k2.5")), parallel="tp", **option)


@pytest.mark.multiprocess
def test_run_parallel_tp_matches_reference(tmp_path):
    from epmoe.cli import main

    out = tmp_path / "report.json"
    code = main(["run", "--parallel", "tp", "--ep", "2", "--max-new-tokens", "4", "--prompt", "hello",
                 "--prompt", "tensor parallel", "--prompt", "abc", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["matches_reference"] is True and report["mismatches"] == []
    for r in report["ranks"]:  # no all-to-all in tp: all-gathers and all-reduces per MoE layer
        assert r["collectives"]["all_to_all"] == 0 and r["collectives"]["all_reduce"] > 0
        assert r["expert_mb"] == pytest.approx(r["full_expert_mb"] / 2)


def _simulated_routes(info: RankInfo, directory: str, parallel: str) -> list[list[list[int]]]:
    """Every routing of MoE layer 0 on this rank (``moe_routing_simulation='uniform_random'``), the same prompt on
    each rank."""
    from epmoe.engine import Engine, SamplingParams

    comm = Comm(init_group(info, "cpu"))
    try:
        engine = Engine(EngineConfig(model=directory, parallel=parallel, max_num_seqs=2, seed=3,
                                     moe_routing_simulation="uniform_random"), comm)
        seen: list[list[list[int]]] = []
        engine.ep_model.moe_layers[0].gate.register_forward_hook(lambda m, a, out: seen.append(out[0].tolist()))
        engine.generate([[5, 9, 2, 7, 1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        return seen
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_routing_simulation_draws_alike_under_tp_and_apart_under_ep(tiny_checkpoints):
    # TP ranks route the same gathered tokens: the simulated experts must be the same on each (each computes its slice
    # of them); EP ranks route their own tokens from generators seeded apart
    directory = str(tiny_checkpoints("qwen3-moe"))
    tp = spawn(_simulated_routes, 2, (directory, "tp"))
    assert tp[0] and tp[0] == tp[1]
    ep = spawn(_simulated_routes, 2, (directory, "ep"))
    assert len(ep[0]) == len(ep[1]) and ep[0] != ep[1]
