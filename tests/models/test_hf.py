"""Every family, at EP 1, 2 and 4 in several gloo processes, against the transformers model itself.

Checkpoints are written by transformers' ``save_pretrained`` (real on-disk format). Each rank feeds
its own random tokens, so every rank both serves its own batch and computes experts for the others.
"""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.layer import MoELayerOptions
from epmoe.models.tiny import TINY_FAMILIES
from epmoe.placement import ExpertPlacement
from epmoe.runtime.launch import RankInfo, init_group, spawn

from ..hf_greedy import hf_greedy

FAMILIES = sorted(TINY_FAMILIES)
# (layout, redundant slots per rank, replica policy)
VARIANTS = [("contiguous", 0, "static"), ("round_robin", 0, "static"), ("round_robin", 1, "round_robin")]


def _check_family(directory: str, comm: Comm, layout: str, redundant_per_rank: int, policy: str, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import load_ep_model
    from epmoe.spec import load_moe_spec

    spec = load_moe_spec(directory)
    placement = ExpertPlacement.trivial(
        spec.num_moe_layers, spec.num_experts, comm.size, redundant_per_rank * comm.size, layout
    )
    dispatcher = "local" if comm.size == 1 else "all_to_all"
    options = MoELayerOptions(dispatcher=dispatcher, replica_policy=policy)
    ep = load_ep_model(directory, placement, comm, options=options)
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed * 97 + comm.rank)
    ids = torch.randint(0, 256, (2, 7), generator=gen)
    with torch.no_grad():
        ours = ep.model(ids).logits
        theirs = ref(ids).logits
    prompts = [ids[0].tolist(), ids[1, :4].tolist()]
    got = hf_greedy(ep.model, prompts, 4, 258)
    want = hf_greedy(ref, prompts, 4, 258)
    held = ep.expert_bytes / ep.full_expert_bytes
    return {"rel_err": float((ours - theirs).norm() / theirs.norm()), "tokens_equal": got == want, "held": held}


def _worker(info: RankInfo, dirs: dict[str, str], every_variant: bool) -> dict:
    """Every family under every variant, or (``every_variant`` false) each family under one variant, in turn."""
    group = init_group(info, "cpu")
    comm = Comm(group)
    out = {}
    for i, fam in enumerate(FAMILIES):
        for layout, red, policy in VARIANTS if every_variant else [VARIANTS[i % len(VARIANTS)]]:
            out[(fam, layout, red)] = _check_family(dirs[fam], comm, layout, red, policy, seed=i)
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def dirs(tiny_checkpoints):
    return {fam: str(tiny_checkpoints(fam)) for fam in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-r{v[1]}")
def test_ep1_matches_transformers(dirs, family, variant):
    layout, red, policy = variant
    r = _check_family(dirs[family], Comm(None), layout, red, policy, seed=0)
    assert r["rel_err"] < 1e-5
    assert r["tokens_equal"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [2, 4])
def test_multi_rank_matches_transformers(dirs, ep):
    """EP 2: every family under every variant; EP 4: every family under one variant (all variants covered)."""
    results = spawn(_worker, ep, (dirs, ep == 2))
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert r["rel_err"] < 1e-5, (rank, key, r)
            assert r["tokens_equal"], (rank, key)
            fam, layout, red = key
            # each rank holds only its slots: (E/G + red) of E experts
            e = {"mixtral": 8, "qwen2-moe": 8, "gpt-oss": 8, "llama4": 8}.get(fam, 16)
            assert r["held"] == pytest.approx((e / ep + red) / e), key


def test_qwen_sparse_step_and_mlp_only_layers_match_transformers(tmp_path):
    """Qwen2-MoE with ``decoder_sparse_step`` 2 and ``mlp_only_layers`` [1] of 4 layers: only layer 3 is MoE, and the
    model (dense MLPs elsewhere, loaded as they are) equals transformers'."""
    from epmoe.models.tiny import build_tiny_checkpoint
    from epmoe.spec import load_moe_spec

    directory = str(build_tiny_checkpoint("qwen2-moe", tmp_path / "q", overrides=dict(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[1])))
    assert load_moe_spec(directory).moe_layers == (3,)
    r = _check_family(directory, Comm(None), "round_robin", 1, "round_robin", seed=3)
    assert r["rel_err"] < 1e-5
    assert r["tokens_equal"]


def test_tuple_block_folds_the_norm_where_its_moe_layer_does():
    """gpt-oss's and Llama-4's MoE blocks are wrapped to return a tuple: the wrapper answers the decoder's
    ``folds_norm`` with its MoE layer's answer (``False`` for a layer without one) and passes what it gets on."""
    from epmoe.models.hf import _TupleBlock

    class Layer(torch.nn.Module):
        def __init__(self, answer):
            super().__init__()
            self.answer, self.asked = answer, []

        def folds_norm(self, x, weight, weight_then_cast):
            self.asked.append((x.shape, weight.shape, weight_then_cast))
            return self.answer

        def forward(self, hidden):
            return hidden * 2

    x, w = torch.ones(1, 4), torch.ones(4)
    for answer in (True, False):
        layer = Layer(answer)
        assert _TupleBlock(layer).folds_norm(x, w, True) is answer
        assert layer.asked == [((1, 4), (4,), True)]
    assert _TupleBlock(torch.nn.Identity()).folds_norm(x, w, False) is False
    out, scores = _TupleBlock(Layer(True))(x)
    assert torch.equal(out, x * 2) and scores is None


@pytest.mark.parametrize("family, overrides, message", [
    ("olmoe", {"bogus_field": 1}, r"tiny 'olmoe': override\(s\) \['bogus_field'\] are no fields of transformers' "
                                  r"olmoe config"),  # was accepted
    ("olmoe", {"hidden_size": -1}, r"tiny 'olmoe' with overrides \{'hidden_size': -1\} cannot be built: "
                                   r"RuntimeError: .*negative dimension"),
    ("olmoe", {"vocab_size": 0}, r"tiny 'olmoe' with overrides \{'vocab_size': 0\} cannot be built: "),  # raw before
])
def test_tiny_builder_names_bad_overrides_and_leaves_nothing(tmp_path, family, overrides, message):
    from epmoe.models.tiny import build_tiny_checkpoint

    with pytest.raises(ValueError, match=message):
        build_tiny_checkpoint(family, tmp_path / "x" / "y", overrides=overrides)
    assert not (tmp_path / "x").exists()  # no parent left either
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=message):  # an existing directory: left as it was (no marker, no tokenizer)
        build_tiny_checkpoint(family, mine, overrides=overrides)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("family, overrides", [
    ("deepseek-v3", {"n_shared_experts": 0}),
    ("qwen2-moe", {"shared_expert_intermediate_size": 0}),
])
def test_the_empty_shared_expert_transformers_saves_is_read(tmp_path, family, overrides):
    """transformers saves zero-size shared-expert tensors (and Qwen2-MoE its gate) for a model without one: they
    are the model's own, not tensors config.json has no place for (a real shared expert beside
    n_shared_experts 0 is refused: tests/models/test_quantized_checkpoint.py)."""
    from epmoe.models.hf import check_checkpoint
    from epmoe.models.tiny import build_tiny_checkpoint

    directory = build_tiny_checkpoint(family, tmp_path / family, overrides=overrides)
    check_checkpoint(str(directory))
