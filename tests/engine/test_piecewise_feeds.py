"""What a piecewise forward (``engine.piecewise``) reads and returns besides the logits, against the eager step of
the same feeds: a token still on the device (the overlap schedule's ``Feed.sources``, read inside the first piece)
and the EAGLE-3 aux layers' outputs (kept across the pieces, concatenated in the last one). On CPU the piecewise
path runs eagerly on its padded static buffers (float32: the same values); on CUDA the pieces are captured graphs
(bf16: within rounding)."""

from __future__ import annotations

import pytest
import torch

from epmoe.engine import Engine, EngineConfig
from epmoe.engine.packing import Feed
from epmoe.engine.request import PENDING_TOKEN

from ..conftest import CONFIGS

KIMI_EAGLE = CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json"
SETUPS = {  # device: (engine options, largest relative error of the piecewise step against the eager one)
    "cpu": (dict(device="cpu", static_decode_on_cpu=True), 1e-5),
    "cuda": (dict(device="cuda", dtype="bfloat16", expert_backend="triton"), 0.03),
}
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _engine(model: str, device: str, **options) -> Engine:
    setup, _ = SETUPS[device]
    return Engine(EngineConfig(model=model, max_num_seqs=4, max_num_batched_tokens=96, block_size=4, num_kv_blocks=64,
                               cuda_graph_max_bs=4, cuda_graph_max_tokens=0, **setup, **options))


def _close(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    assert got.shape == want.shape
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < SETUPS[device][1], err


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 250, (length,), generator=gen).tolist() for length in (44, 50)]


@pytest.mark.parametrize("device", DEVICES)
def test_piecewise_step_reads_a_token_on_the_device(tiny_checkpoints, device):
    """A decode row whose token is still in the runner's token buffer, beside a prompt chunk, in a piecewise step:
    the logits equal the eager step's with the token given on the host (and with it read from the buffer)."""
    engine = _engine(str(tiny_checkpoints("qwen3-moe")), device)
    runner = engine.runner
    assert runner.tokens is not None and runner.piece_buckets == [64, 96]
    a, b = _prompts()
    bs = engine.config.block_size
    ta, tb = engine.allocator.allocate(-(-42 // bs)), engine.allocator.allocate(-(-50 // bs))
    first = [Feed(a[:40], 0, ta, False, 1)]
    _close(runner.execute(first, piece=64).logits, runner.execute(first).logits, device)
    runner.keep_sampled(torch.tensor([a[40]], device=engine.device))
    pending = [Feed([PENDING_TOKEN], 40, ta, True, 1, sources=((0, 0),)), Feed(b[:50], 0, tb, False, 1)]
    given = [Feed(a[40:41], 40, ta, True, 1), Feed(b[:50], 0, tb, False, 1)]
    want = runner.execute(given).logits
    assert want.shape[0] == 2
    _close(runner.execute(pending).logits, want, device)
    _close(runner.execute(pending, piece=runner.piece_bucket_for(51)).logits, want, device)
    engine.allocator.free(ta)
    engine.allocator.free(tb)


@pytest.mark.parametrize("device", DEVICES)
def test_piecewise_step_returns_the_eagle3_aux_layers(tiny_checkpoints, tmp_path, device):
    """EAGLE-3's aux hidden states of every row of a piecewise step (decode rows, then a chunk over a cached
    prefix) equal the eager step's, as do its logits."""
    from epmoe.models.tiny import build_tiny_eagle3_config

    target = str(tiny_checkpoints("kimi-k2.5"))
    head = build_tiny_eagle3_config(tmp_path / "eagle3", KIMI_EAGLE, target, aux_layer_ids=[0, 1, 2])
    engine = _engine(target, device, speculative_algorithm="eagle3", speculative_draft_model=str(head),
                     speculative_num_tokens=2)
    runner = engine.runner
    assert runner.aux_layers == (0, 1, 2) and runner.piece_buckets == [64, 96]
    a, b = _prompts()
    bs = engine.config.block_size
    ta, tb = engine.allocator.allocate(-(-44 // bs)), engine.allocator.allocate(-(-50 // bs))
    steps = [[Feed(a[:41], 0, ta, False, 1), Feed(b[:20], 0, tb, False, 0)],
             [Feed(a[41:44], 41, ta, True, 3), Feed(b[20:50], 20, tb, False, 1)]]  # a verify step's 3 rows
    for feeds in steps:
        rows = sum(len(f.token_ids) for f in feeds)
        eager = runner.execute(feeds)
        piece = runner.execute(feeds, piece=runner.piece_bucket_for(rows))
        assert eager.aux.shape == (rows, 3 * engine.ep_model.model.config.hidden_size)
        _close(piece.logits, eager.logits, device)
        _close(piece.aux, eager.aux, device)
    engine.allocator.free(ta)
    engine.allocator.free(tb)
