"""The paged KV cache: fixed-size blocks in one pool per attention layer, handed out per sequence.

Two kinds of entry: expanded keys and values per kv head (every family but MLA), or MLA's latent
(DeepSeek-V2/V3/R1, Kimi-K2/K2.5): per token and layer one vector of ``kv_lora_rank +
qk_rope_head_dim`` values, the normalised compressed KV ``c_kv`` followed by the rotary key ``k_rope``,
shared by every head (``engine.mla`` expands or absorbs it).

Block 0 of every pool is never given to a sequence: the padding rows of a CUDA-graph replay write
their keys and values there, so a padded batch needs no branch.
"""

from __future__ import annotations

import hashlib
import numbers
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's cache entry.

    Attributes:
        num_layers: attention layers (every decoder layer).
        num_kv_heads: ``Hkv`` key/value heads cached per token (1 for the latent kind).
        k_head_dim: ``Dk`` (latent: the entry, ``kv_lora_rank + qk_rope_head_dim``).
        v_head_dim: ``Dv`` (latent: ``kv_lora_rank``, the values being the entry's first ``Dv``).
        latent: MLA's latent kind: one pool of entries per layer, no separate values.
    """

    num_layers: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    latent: bool = False

    @classmethod
    def from_config(cls, config) -> KVLayout:
        """Read the layout from a transformers text config (MLA, ``kv_lora_rank`` present: the latent kind).

        Raises:
            ValueError: a field the layout needs is missing (named).
        """
        def need(name: str):
            value = getattr(config, name, None)
            if value is None:
                raise ValueError(f"config {type(config).__name__} has no {name!r}: cannot size the KV cache")
            return int(value)

        heads = need("num_attention_heads")
        if getattr(config, "kv_lora_rank", None) is not None:  # MLA: the latent c_kv and the rotary key
            rank = need("kv_lora_rank")
            return cls(need("num_hidden_layers"), 1, rank + need("qk_rope_head_dim"), rank, latent=True)
        head_dim = getattr(config, "head_dim", None) or need("hidden_size") // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(need("num_hidden_layers"), int(kv_heads), int(head_dim), int(head_dim))

    def bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        """Bytes one token's cache entry takes in one layer (latent: ``Dk`` values; else ``Hkv (Dk + Dv)``)."""
        size = torch.empty(0, dtype=dtype).element_size()
        values = self.k_head_dim if self.latent else self.k_head_dim + self.v_head_dim
        return self.num_kv_heads * values * size

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take over all layers."""
        return self.num_layers * self.bytes_per_token_layer(dtype)


BlockKey = bytes
"""A full block's identity in the prefix cache: the SHA-256 digest of its parent block's key and its tokens
(``block_key``)."""


def block_key(parent: BlockKey | None, tokens: Sequence[int]) -> BlockKey:
    """The prefix-cache key of a full block of ``tokens`` following the block keyed ``parent`` (``None``: the
    sequence's first block): SHA-256 over the parent's key and the tokens as 64-bit integers, so two blocks share a
    key only when they hold the same tokens after the same prefix (a crafted collision, which a 64-bit hash would
    allow, is out of reach: vLLM moved to SHA-256 for the same reason, CVE-2025-25183)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockAllocator:
    """KV block ids ``1 .. num_blocks - 1`` (block 0 is the padding block), reference-counted, with a prefix cache.

    A block is free, held (by one or more sequences: ``acquire`` adds holders of cached blocks), or cached and free:
    a full block whose key was ``register``ed stays findable (``cached``) after its last holder frees it, until
    ``allocate`` needs it (the least recently freed first, after the never-cached free blocks). ``num_free`` counts
    both kinds of free block. Without ``register`` calls this is a plain free list.

    Source: vLLM's automatic prefix caching (hash-chained full blocks, reference counts, LRU eviction of free
    cached blocks); SGLang's radix cache shares prefixes the same way at token granularity.

    Args:
        num_blocks: blocks in each pool, padding block included (at least 2).

    Raises:
        ValueError: ``num_blocks`` not an integer >= 2.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (one is the padding block), got {num_blocks!r}")
        self.num_blocks = int(num_blocks)
        self._free: deque[int] = deque(range(1, self.num_blocks))
        self._refs: dict[int, int] = {}  # held block -> holders
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached free blocks, least recently freed first
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks free now (cached free blocks included: ``allocate`` may take them)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks findable in the prefix cache (held or free)."""
        return len(self._key_of)

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever get (all but the padding block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, each with one holder: never-cached free blocks first, then the least recently freed
        cached ones (which leave the cache).

        Raises:
            ValueError: ``n`` not an integer >= 0.
            RuntimeError: fewer than ``n`` free (callers check ``num_free`` first).
        """
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"the number of KV blocks to allocate must be an integer >= 0, got {n!r}")
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each of ``blocks``; a block without holders becomes free (cached ones stay findable).

        Raises:
            ValueError: a block id outside ``[1, num_blocks)`` (the padding block is never handed out), one that
                is not held now (a double free would hand it to two sequences) or listed twice. Nothing is freed
                then.
        """
        blocks = list(blocks)
        for b in blocks:
            if not 1 <= b < self.num_blocks:
                raise ValueError(f"block id {b} is not in [1, {self.num_blocks})")
        if len(set(blocks)) != len(blocks) or any(b not in self._refs for b in blocks):
            bad = sorted({b for b in blocks if b not in self._refs or blocks.count(b) > 1})
            raise ValueError(f"block ids {bad} are not allocated (freed twice?)")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def cached(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks of the longest run of ``keys`` from the first that the cache holds (held or free)."""
        out = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def num_revived(self, blocks: Sequence[int]) -> int:
        """How many of the cached ``blocks`` are free now: ``acquire`` takes them from ``num_free``."""
        return sum(1 for b in blocks if b in self._evictable)

    def acquire(self, blocks: Sequence[int]) -> None:
        """Add a holder to each of the cached ``blocks`` (``cached``' result).

        Raises:
            ValueError: a block that is not in the cache. Nothing is acquired then.
        """
        bad = [b for b in blocks if b not in self._key_of]
        if bad:
            raise ValueError(f"block ids {bad[:5]} are not in the prefix cache")
        for b in blocks:
            self._evictable.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1

    def register(self, block: int, key: BlockKey) -> None:
        """Make the held full ``block`` findable under ``key`` (its keys and values written, or being written by a
        step that runs before any step that could read them); nothing when the key or the block is cached already
        (the first block of a prefix stays its cached copy).

        Raises:
            ValueError: ``block`` is not held.
        """
        if block not in self._refs:
            raise ValueError(f"block id {block} is not allocated: only a held block can be cached")
        if key in self._block_of or block in self._key_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block


class KVCache:
    """Key and value pools of every attention layer.

    Attributes:
        k: per layer ``[num_blocks, block_size, Hkv, Dk]``; the latent kind: ``[num_blocks, block_size, Dk]``.
        v: per layer ``[num_blocks, block_size, Hkv, Dv]``; empty for the latent kind.

    Args:
        layout: the model's cache layout.
        num_blocks: blocks per pool (padding block included).
        block_size: tokens per block.
        dtype, device: of the pools.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        h, dk, dv = layout.num_kv_heads, layout.k_head_dim, layout.v_head_dim
        entry = (dk,) if layout.latent else (h, dk)
        self.k = [torch.zeros(num_blocks, block_size, *entry, dtype=dtype, device=device)
                  for _ in range(layout.num_layers)]
        self.v = [] if layout.latent else [torch.zeros(num_blocks, block_size, h, dv, dtype=dtype, device=device)
                                           for _ in range(layout.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes the pools take."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' keys and values (graph safe: no host sync).

        Args:
            layer: attention layer index.
            k: ``[T, Hkv, Dk]``; v: ``[T, Hkv, Dv]`` (cast to the pool dtype).
            slot_mapping: ``[T]`` int64 flat slot ``block * block_size + offset`` of each token.

        Raises:
            ValueError: the cache is of the latent kind (``write_latent``).
        """
        self._need_kind(latent=False)
        kp, vp = self.k[layer], self.v[layer]
        kp.view(-1, *kp.shape[2:]).index_copy_(0, slot_mapping, k.to(kp.dtype))
        vp.view(-1, *vp.shape[2:]).index_copy_(0, slot_mapping, v.to(vp.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[N, Hkv, Dk]`` and values ``[N, Hkv, Dv]`` at ``slots [N]`` int64 flat slots of ``layer``.

        Raises:
            ValueError: the cache is of the latent kind (``read_latent``).
        """
        self._need_kind(latent=False)
        kp, vp = self.k[layer], self.v[layer]
        return (kp.view(-1, *kp.shape[2:]).index_select(0, slots),
                vp.view(-1, *vp.shape[2:]).index_select(0, slots))

    def write_latent(self, layer: int, c_kv: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' MLA latent entries ``[c_kv, k_rope]`` (graph safe: no host sync).

        Args:
            layer: attention layer index.
            c_kv: ``[T, kv_lora_rank]`` the normalised compressed KV; k_rope: ``[T, qk_rope_head_dim]`` the
                rotary key (rotation applied); cast to the pool dtype.
            slot_mapping: ``[T]`` int64 flat slot of each token.

        Raises:
            ValueError: the cache is not of the latent kind.
        """
        self._need_kind(latent=True)
        pool = self.k[layer]
        entry = torch.cat([c_kv.to(pool.dtype), k_rope.to(pool.dtype)], dim=-1)
        pool.view(-1, pool.shape[-1]).index_copy_(0, slot_mapping, entry)

    def latent_pool(self, layer: int) -> torch.Tensor:
        """The layer's latent entries as ``[slots, kv_lora_rank + qk_rope_head_dim]`` (a view of its pool, flat
        over its blocks), for kernels that write them in place (``engine.mla_rope``).

        Raises:
            ValueError: the cache is not of the latent kind.
        """
        self._need_kind(latent=True)
        pool = self.k[layer]
        return pool.view(-1, pool.shape[-1])

    def read_latent(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """MLA latent entries ``[N, kv_lora_rank + qk_rope_head_dim]`` at ``slots [N]`` int64 flat slots.

        Raises:
            ValueError: the cache is not of the latent kind.
        """
        self._need_kind(latent=True)
        pool = self.k[layer]
        return pool.view(-1, pool.shape[-1]).index_select(0, slots)

    def _need_kind(self, latent: bool) -> None:
        if self.layout.latent != latent:
            have, use = (("MLA latent entries", "write_latent/read_latent") if self.layout.latent
                         else ("expanded keys and values", "write/read"))
            raise ValueError(f"this KV cache holds {have}: use {use}")


def blocks_for_memory(free_bytes: int, layout: KVLayout, block_size: int, dtype: torch.dtype,
                      extra_bytes_per_token: int = 0) -> int:
    """How many blocks fit in ``free_bytes`` (for ``--mem-fraction-static``); ``extra_bytes_per_token``: a
    speculative decoding draft's own cache per token (its pool has as many blocks)."""
    return free_bytes // ((layout.bytes_per_token(dtype) + extra_bytes_per_token) * block_size)
