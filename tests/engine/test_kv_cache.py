"""The block allocator, the cache layout read from transformers configs, and cache writes."""

from __future__ import annotations

import pytest
import torch

from epmoe.engine.kv_cache import BlockAllocator, KVCache, KVLayout, blocks_for_memory


@pytest.mark.parametrize("bad", [0, 1, -3, 2.0, True, "4", None])
def test_allocator_bad_sizes(bad):
    with pytest.raises(ValueError, match=rf"num_blocks must be an integer >= 2 .*got {bad!r}"):
        BlockAllocator(bad)


def test_allocator_never_hands_out_block_zero():
    a = BlockAllocator(5)
    assert a.capacity == 4 and a.num_free == 4
    got = a.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and a.num_free == 0
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        a.allocate(1)
    a.free(got[1:3])
    assert a.num_free == 2
    again = a.allocate(2)
    assert sorted(again) == sorted(got[1:3]) and 0 not in again
    assert a.allocate(0) == []
    a.free(got[:1] + again + got[3:])
    assert a.num_free == a.capacity


def test_allocator_over_allocation_and_bad_frees():
    a = BlockAllocator(4)
    with pytest.raises(RuntimeError, match="asked for 4 KV blocks with 3 free"):
        a.allocate(4)
    assert a.num_free == 3  # nothing taken by the failed call
    with pytest.raises(ValueError, match="got -1"):
        a.allocate(-1)
    blocks = a.allocate(2)
    for bad in (0, 4, -1):
        with pytest.raises(ValueError, match=rf"block id {bad} is not in \[1, 4\)"):
            a.free([blocks[0], bad])
    assert a.num_free == 1  # a refused free frees nothing
    free_one = ({1, 2, 3} - set(blocks)).pop()
    with pytest.raises(ValueError, match=rf"block ids \[{free_one}\] are not allocated"):
        a.free([free_one])  # never allocated
    a.free(blocks[:1])
    with pytest.raises(ValueError, match=rf"block ids \[{blocks[0]}\] are not allocated"):
        a.free(blocks[:1])  # double free
    with pytest.raises(ValueError, match="not allocated"):
        a.free([blocks[1], blocks[1]])
    a.free(blocks[1:])
    assert a.num_free == a.capacity == 3
    assert len(set(a.allocate(3))) == 3  # no block handed out twice


def test_layout_gqa():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                         num_hidden_layers=3, vocab_size=100, num_experts=4, num_experts_per_tok=2)
    layout = KVLayout.from_config(cfg)
    assert layout == KVLayout(num_layers=3, num_kv_heads=2, k_head_dim=24, v_head_dim=24)
    assert layout.bytes_per_token(torch.bfloat16) == 3 * 2 * (24 + 24) * 2
    assert layout.bytes_per_token(torch.float32) == 3 * 2 * 48 * 4
    # without head_dim: hidden_size // heads
    from transformers import MixtralConfig

    mix = MixtralConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2,
                        vocab_size=100)
    mix.head_dim = None
    assert KVLayout.from_config(mix) == KVLayout(2, 3, 16, 16)


def test_layout_mla():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=5,
                           q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                           vocab_size=100, n_routed_experts=4, num_experts_per_tok=2, rope_scaling=None)
    layout = KVLayout.from_config(cfg)  # the latent: kv_lora_rank + qk_rope_head_dim values, all heads shared
    assert layout == KVLayout(num_layers=5, num_kv_heads=1, k_head_dim=16 + 4, v_head_dim=16, latent=True)
    assert layout.bytes_per_token_layer(torch.float16) == (16 + 4) * 2
    assert layout.bytes_per_token(torch.float16) == 5 * (16 + 4) * 2
    # Kimi-K2.5 at full width: 576 bf16 values per token and layer (expanded: 64 heads x (192 + 128))
    kimi = DeepseekV3Config(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, num_hidden_layers=61,
                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8, rope_scaling=None)
    assert KVLayout.from_config(kimi).bytes_per_token_layer(torch.bfloat16) == 1152


def test_latent_write_read_and_kind_checks():
    layout = KVLayout(num_layers=2, num_kv_heads=1, k_head_dim=6, v_head_dim=4, latent=True)
    cache = KVCache(layout, num_blocks=3, block_size=2, dtype=torch.float32, device="cpu")
    assert cache.k[0].shape == (3, 2, 6) and cache.v == []
    assert cache.nbytes == 2 * 3 * 2 * 6 * 4
    c = torch.randn(2, 4, dtype=torch.float64)
    r = torch.randn(2, 2, dtype=torch.float64)
    slots = torch.tensor([3, 4])  # block 1 offset 1, block 2 offset 0
    cache.write_latent(1, c, r, slots)
    assert torch.equal(cache.k[1][1, 1], torch.cat([c[0], r[0]]).float())
    assert torch.equal(cache.k[1][2, 0], torch.cat([c[1], r[1]]).float())
    assert (cache.k[0] == 0).all() and int((cache.k[1] != 0).any(-1).sum()) == 2
    assert torch.equal(cache.read_latent(1, torch.tensor([4, 3])), cache.k[1].view(-1, 6)[[4, 3]])
    with pytest.raises(ValueError, match="holds MLA latent entries: use write_latent/read_latent"):
        cache.write(0, c, c, slots)
    with pytest.raises(ValueError, match="holds MLA latent entries"):
        cache.read(0, slots)
    expanded = KVCache(KVLayout(1, 1, 2, 2), num_blocks=2, block_size=2, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="holds expanded keys and values: use write/read"):
        expanded.write_latent(0, c, r, slots)


def test_layout_missing_field_named():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="has no 'num_hidden_layers'"):
        KVLayout.from_config(SimpleNamespace(num_attention_heads=4, hidden_size=64))


def test_blocks_for_memory():
    layout = KVLayout(2, 2, 8, 8)
    per_block = layout.bytes_per_token(torch.float32) * 4
    assert blocks_for_memory(per_block * 10 + per_block - 1, layout, 4, torch.float32) == 10


def test_write_puts_rows_at_their_slots():
    layout = KVLayout(num_layers=2, num_kv_heads=2, k_head_dim=3, v_head_dim=5)
    cache = KVCache(layout, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    assert cache.k[0].shape == (4, 4, 2, 3) and cache.v[1].shape == (4, 4, 2, 5)
    assert cache.nbytes == 2 * 4 * 4 * 2 * (3 + 5) * 4
    k = torch.arange(3 * 2 * 3, dtype=torch.float64).reshape(3, 2, 3) + 1
    v = -torch.arange(3 * 2 * 5, dtype=torch.float64).reshape(3, 2, 5) - 1
    slots = torch.tensor([5, 14, 0])  # block 1 offset 1, block 3 offset 2, the padding slot
    cache.write(1, k, v, slots)
    assert cache.k[1].dtype == torch.float32
    assert torch.equal(cache.k[1][1, 1], k[0].float()) and torch.equal(cache.v[1][1, 1], v[0].float())
    assert torch.equal(cache.k[1][3, 2], k[1].float()) and torch.equal(cache.v[1][3, 2], v[1].float())
    assert torch.equal(cache.k[1][0, 0], k[2].float())
    written = torch.zeros(4, 4, dtype=torch.bool)
    written[1, 1] = written[3, 2] = written[0, 0] = True
    assert (cache.k[1][~written] == 0).all() and (cache.v[1][~written] == 0).all()
    assert (cache.k[0] == 0).all() and (cache.v[0] == 0).all()  # other layers untouched
