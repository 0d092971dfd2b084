"""What the engine holds, sized at start: the KV pool's blocks (from the memory the weights leave, or asked for) and
the row and token counts of its CUDA-graph buckets."""

from __future__ import annotations

import os

import torch

from epmoe.engine.config import EngineConfig
from epmoe.engine.kv_cache import KVLayout, blocks_for_memory
from epmoe.engine.piecewise import piece_buckets
from epmoe.memory import free_bytes

CPU_KV_BYTES = 1 << 30
"""The KV budget on the CPU, bytes (there is no memory query there)."""


def graph_buckets(max_bs: int) -> list[int]:
    """Row counts captured up to ``max_bs`` (SGLang's ``--cuda-graph-max-bs``): 1, 2, 4, 8, then every multiple
    of 16 up to 256, of 32 up to 512, of 64 up to 1024 and of 128 above (a padded step wastes at most an eighth of
    its rows there), and ``max_bs`` itself.

    Raises:
        ValueError: ``max_bs`` < 1.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_bs}
    for start, stop, step in ((16, 256, 16), (288, 512, 32), (576, 1024, 64), (1152, max_bs, 128)):
        sizes |= set(range(start, min(max_bs, stop) + 1, step))
    sizes.add(max_bs)
    return sorted(sizes)


def _ranks_on_host(size: int) -> int:
    """Of a group of ``size`` ranks, those on this host: under torchrun its ``LOCAL_WORLD_SIZE`` where that is a count
    within the group, else all of them (ranks spawned here share this host, whatever the environment says)."""
    from epmoe.runtime.launch import under_torchrun

    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if under_torchrun() and local.isdigit() and 1 <= int(local) <= size else size


def check_kv_pool_room(config: EngineConfig, size: int) -> None:
    """Before any rank starts, a ``num_kv_blocks`` whose pool could not be held: on the CPU the pools of the ranks on
    this host together against its free memory (spawned ranks: all ``size``; under torchrun, ``LOCAL_WORLD_SIZE`` of
    them), on CUDA one rank's pool against a GPU's whole memory. A lower bound of what
    the ranks will need (weights and a draft model's cache come on top): ``kv_blocks`` checks again as each rank
    makes its pool. Nothing to check without ``num_kv_blocks``.

    Raises:
        ValueError: the pool past that memory, with the blocks, the bytes a rank and the memory named.
    """
    if config.num_kv_blocks is None:
        return
    from epmoe.models.hf import hf_config

    text = hf_config(config.model)
    layout = KVLayout.from_config(text.get_text_config() if hasattr(text, "get_text_config") else text)
    per_rank = config.num_kv_blocks * config.block_size * layout.bytes_per_token(config.torch_dtype)
    if config.device == "cuda":
        need, have = per_rank, torch.cuda.get_device_properties(0).total_memory
        where = f"a rank's GPU holds {have / 2**30:.1f} GiB in all"
    else:
        host = _ranks_on_host(size)
        need, have = host * per_rank, free_bytes("cpu")
        where = f"the {host} CPU rank(s) share the host's {have / 2**30:.1f} GiB free" if have is not None else ""
    if have is not None and need > have:
        raise ValueError(f"--num-kv-blocks {config.num_kv_blocks} of --block-size {config.block_size} is "
                         f"{per_rank / 2**30:.1f} GiB of KV cache a rank, and {where}")


def kv_blocks(config: EngineConfig, layout: KVLayout, device: torch.device, max_model_len: int,
              extra_bytes_per_token: int = 0) -> int:
    """KV blocks of the pool: ``config.num_kv_blocks`` where given (checked against the free memory), else as many
    as ``mem_fraction_static`` of the GPU leaves after the weights (``CPU_KV_BYTES`` on the CPU), at most what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens fill.

    Args:
        config: the engine's options.
        layout: the KV cache's layout (bytes per token).
        device: where the pool lives.
        max_model_len: the context, tokens.
        extra_bytes_per_token: a proposer's own cache per token, bytes (its pool has as many blocks).

    Raises:
        ValueError: ``num_kv_blocks`` past the free memory, or room for fewer than two blocks (the budget named).
    """
    per_token = layout.bytes_per_token(config.torch_dtype) + extra_bytes_per_token
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the load freed but the allocator keeps: free memory for the pool
    if config.num_kv_blocks is not None:
        want = config.num_kv_blocks * config.block_size * per_token
        have = free_bytes(device)
        if have is not None and want > have:
            raise ValueError(f"num_kv_blocks {config.num_kv_blocks} needs {want / 2**30:.1f} GiB of KV cache; "
                             f"{have / 2**30:.1f} GiB are free on {device}")
        return int(config.num_kv_blocks)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - int((1 - config.mem_fraction_static) * total)
        what = (f"mem_fraction_static {config.mem_fraction_static} of {total / 2**30:.1f} GiB leaves "
                f"{budget / 2**30:.2f} GiB for the KV cache after the weights")
    else:
        budget = CPU_KV_BYTES
        what = f"the CPU KV budget of {CPU_KV_BYTES >> 20} MiB"
    blocks = blocks_for_memory(max(0, budget), layout, config.block_size, config.torch_dtype, extra_bytes_per_token)
    blocks = min(blocks, config.max_num_seqs * -(-max_model_len // config.block_size) + 1)
    if blocks < 2:
        raise ValueError(f"no room for a KV cache: {what}")
    return blocks


def decode_sizes(config: EngineConfig) -> list[int]:
    """Row counts of the decode batches' graphs: the buckets up to ``cuda_graph_max_bs`` and ``max_num_seqs``."""
    return [b for b in graph_buckets(config.cuda_graph_max_bs) if b <= config.max_num_seqs]


def graph_sizes(config: EngineConfig, num_spec_tokens: int) -> list[int]:
    """Row counts of the static steps: the decode batches, with ``num_spec_tokens`` (K) proposed tokens the verify
    steps' ``batch x (K + 1)`` rows, and the steps with prompts fed row-wise, up to ``cuda_graph_max_tokens``."""
    plain = decode_sizes(config)
    tokens = min(config.cuda_graph_max_tokens, config.max_num_batched_tokens)
    rowwise = graph_buckets(tokens) if tokens else []
    return sorted(set(plain) | {b * (num_spec_tokens + 1) for b in plain} | set(rowwise))


def piece_sizes(config: EngineConfig) -> list[int]:
    """Token counts of the piecewise graphs: up to ``piecewise_cuda_graph_max_tokens`` and the step's token budget
    (a verify step's proposed tokens are fed within it: the scheduler's lookahead slots)."""
    return piece_buckets(1, min(config.piecewise_cuda_graph_max_tokens, config.max_num_batched_tokens))


def draft_sizes(config: EngineConfig) -> list[int]:
    """Row counts of a draft model's static steps: up to two catch-up rows per request, then one."""
    plain = decode_sizes(config)
    return sorted(set(plain) | {2 * b for b in plain})
