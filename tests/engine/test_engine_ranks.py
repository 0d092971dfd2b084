"""Every served family through the engine, at EP 1, 2 and 4 in several gloo processes, against the
transformers model itself (float32, greedy, token for token), eager and on the graph path's static
decode buckets.

Each rank serves its own prompts (at EP 4 one rank has none and only joins the collectives), more of
them than ``max_num_seqs``, arriving staggered; prompts are prefilled in chunks (a small
``max_num_batched_tokens``); rank 0's KV pool is small enough to force preemptions; one request is
aborted mid-generation. Afterwards every KV block is back in its pool. The MLA families (DeepSeek, Kimi)
cache the latent (``engine.mla``).
"""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.models.tiny import TINY_FAMILIES
from epmoe.runtime.launch import RankInfo, init_group, spawn

from ..hf_greedy import hf_greedy

FAMILIES = sorted(TINY_FAMILIES)
NEW_TOKENS = 10


def _prompts(rank: int, size: int) -> list[list[int]]:
    if size == 4 and rank == 3:
        return []
    gen = torch.Generator().manual_seed(1000 + rank)
    lengths = [23, 5, 1, 12][: 4 - rank % 2]
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _run_family(directory: str, comm: Comm, static: bool, graph_tokens: int = 512) -> dict:
    from transformers import AutoModelForCausalLM

    from epmoe.engine import Engine, EngineConfig, SamplingParams

    prompts = _prompts(comm.rank, comm.size)
    blocks = 10 if comm.rank == 0 else 64  # rank 0: 36 tokens of KV, one request needs 33: preemptions
    engine = Engine(EngineConfig(model=directory, max_num_seqs=3 if static else 2, max_num_batched_tokens=8,
                                 block_size=4, num_kv_blocks=blocks, static_decode_on_cpu=static,
                                 cuda_graph_max_bs=2, cuda_graph_max_tokens=graph_tokens), comm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    aborted: list[str] = []

    def on_output(out) -> None:  # abort rank 0's second request after its third token
        if comm.rank == 0 and out.request_id.endswith("-1") and len(out.token_ids) == 3 and not aborted:
            aborted.append(out.request_id)
            engine.abort(out.request_id)

    # requests 0, 1 and 3 arrive at once: 3 is admitted when 1 is aborted, while 0 still grows (a
    # preemption whatever the timing); 2 arrives later
    outs = engine.generate(prompts, params, arrival_times=[0.0, 0.0, 0.02, 0.0][: len(prompts)],
                           on_output=on_output)
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    want = [hf_greedy(ref, [p], NEW_TOKENS, 258)[0] for p in prompts]
    return {
        "got": [o.token_ids for o in outs], "want": want, "reasons": [o.finish_reason for o in outs],
        "aborted": aborted, "free": engine.allocator.num_free, "capacity": engine.allocator.capacity,
        "preemptions": engine.stats["preemptions"], "steps": engine.num_steps,
        "static_steps": engine.stats["graph_steps"], "prefill_static_steps": engine.stats["graph_prefill_steps"],
        "piecewise_steps": engine.stats["piecewise_steps"], "eager_steps": engine.stats["eager_steps"],
        "kv_kind": engine.kv_report()["kind"],
    }


def _worker(info: RankInfo, dirs: dict[str, str], families: list[str], static: bool, graph_tokens: int = 512) -> dict:
    comm = Comm(init_group(info, "cpu"))
    try:
        return {fam: _run_family(dirs[fam], comm, static, graph_tokens) for fam in families}
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dirs(tiny_checkpoints):
    return {fam: str(tiny_checkpoints(fam)) for fam in FAMILIES}


def _check(results: list[dict], families: list[str]) -> None:
    for fam in families:
        steps = {r[fam]["steps"] for r in results}
        assert len(steps) == 1, f"{fam}: ranks ran different step counts {steps}"
        for rank, r in enumerate(results):
            res = r[fam]
            assert res["free"] == res["capacity"], f"{fam} rank {rank}: KV blocks not all returned"
            assert res["kv_kind"] == ("latent" if fam.startswith(("deepseek", "kimi")) else "expanded"), fam
            for i, (got, want, reason) in enumerate(zip(res["got"], res["want"], res["reasons"])):
                if reason == "abort":
                    assert 3 <= len(got) < NEW_TOKENS and got == want[: len(got)], (fam, rank, i, got, want)
                else:
                    assert (got, reason) == (want, "length"), (fam, rank, i, got, want, reason)
        r0 = results[0][fam]
        assert r0["aborted"] and r0["reasons"][1] == "abort", fam
        assert r0["preemptions"] > 0, f"{fam}: the small KV pool of rank 0 forced no preemption"


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_engine_equals_transformers_every_family(dirs, ep):
    _check(spawn(_worker, ep, (dirs, FAMILIES, False)), FAMILIES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [2, 4])
def test_static_decode_path_equals_transformers(dirs, ep):
    """The CUDA-graph path's padded buckets and fixed-capacity dispatch (run eagerly on CPU): a rank with
    fewer rows than the bucket, or none, pads; prompt chunks (at most 8 tokens: the token budget) run as
    single-token rows in those steps; steps with more rows than the largest bucket fall back to eager."""
    families = ["gpt-oss", "kimi-k2.5", "llama4", "qwen3-moe"]
    results = spawn(_worker, ep, (dirs, families, True))
    _check(results, families)
    for fam in families:
        assert all(r[fam]["static_steps"] > 0 for r in results), fam
        assert results[0][fam]["prefill_static_steps"] > 0, fam


@pytest.mark.multiprocess
def test_piecewise_path_equals_transformers(dirs):
    """No prompt row-wise (``cuda_graph_max_tokens=0``): every step with a prompt chunk runs the piecewise path
    (``engine.piecewise``: static padded rows and fixed-capacity dispatch, attention on the real batch between the
    pieces), the rank without requests replaying it with no rows; decode steps replay their buckets."""
    families = ["kimi-k2.5"]
    results = spawn(_worker, 4, (dirs, families, True, 0))
    _check(results, families)
    for fam in families:
        assert all(r[fam]["piecewise_steps"] > 0 and r[fam]["static_steps"] > 0 for r in results), fam
        assert all(r[fam]["eager_steps"] == 0 and r[fam]["prefill_static_steps"] == 0 for r in results), fam
