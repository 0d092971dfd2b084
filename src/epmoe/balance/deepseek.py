"""DeepSeek's published expert-parallel load balancer (EPLB), both policies.

Source: github.com/deepseek-ai/EPLB (README and ``eplb.py``), written here from its description:

* **Hierarchical** policy (used when the expert groups divide evenly over the nodes): pack the expert
  groups onto the nodes so that node loads are even (greedy, heaviest group first, onto the lightest
  node that still has room for a group), replicate experts inside each node (each extra slot goes to
  the expert with the largest load per copy), then pack the copies of each node onto its GPUs with the
  same greedy packing (heaviest copy first, onto the lightest GPU that still has a free slot).
* **Global** policy: the hierarchical one with a single group and a single node: replicate over all
  experts, then pack all copies onto all GPUs.

Like DeepSeek, the copies of one logical expert are assumed to share its load evenly. The greedy
packing does not keep two copies of one expert off the same GPU; epmoe's own balancer does.
Ties are broken towards the lower index (heaviest first with a stable order, lightest pack first).
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy cardinality-constrained packing of DeepSeek's EPLB.

    Each row's items, heaviest first, go to the lightest pack that holds fewer than
    ``items / num_packs`` items.

    Args:
        weight: ``[n, m]`` float64 item weights per row (tokens); ``m`` divisible by ``num_packs``.
        num_packs: packs per row.

    Returns:
        ``(pack_index, rank_in_pack)``: both ``[n, m]`` int64, the pack of each item and its position
        inside the pack (order of arrival).
    """
    n, m = weight.shape
    per_pack = m // num_packs
    pack_index = np.empty((n, m), dtype=np.int64)
    rank_in_pack = np.empty((n, m), dtype=np.int64)
    rows = np.arange(n)
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_load = np.zeros((n, num_packs))
    pack_fill = np.zeros((n, num_packs), dtype=np.int64)
    for t in range(m):
        item = order[:, t]
        cost = np.where(pack_fill < per_pack, pack_load, np.inf)
        pack = np.argmin(cost, axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_fill[rows, pack]
        pack_load[rows, pack] += weight[rows, item]
        pack_fill[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """Give each redundant slot to the expert with the largest load per copy (DeepSeek's EPLB).

    Args:
        weight: ``[n, m]`` float64 loads of ``m`` logical experts per row.
        num_physical: physical slots per row (``>= m``); slot ``i < m`` holds expert ``i``.

    Returns:
        ``(phy2log, logcnt)``: ``[n, num_physical]`` int64 expert of each slot and ``[n, m]`` int64
        copies per expert.
    """
    n, m = weight.shape
    rows = np.arange(n)
    phy2log = np.empty((n, num_physical), dtype=np.int64)
    phy2log[:, :m] = np.arange(m)
    logcnt = np.ones((n, m), dtype=np.int64)
    for slot in range(m, num_physical):
        hot = np.argmax(weight / logcnt, axis=1)
        phy2log[:, slot] = hot
        logcnt[rows, hot] += 1
    return phy2log, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def deepseek_phy2log(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """DeepSeek's hierarchical policy (the global one is ``num_groups = num_nodes = 1``).

    Args:
        weight: ``[L, E]`` float64 logical expert loads (tokens), validated by the caller.
        num_physical: ``P`` slots per layer, divisible by ``num_gpus``.
        num_groups: expert groups (``E`` divisible by it, divisible by ``num_nodes``).
        num_nodes: nodes (``num_gpus`` divisible by it).
        num_gpus: ``G`` EP ranks.

    Returns:
        ``[L, P]`` int64 ``phy2log``; rank ``g`` holds slots ``[g*P/G, (g+1)*P/G)``.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # 1. Groups onto nodes. "mlog" numbers experts node by node: node-major, then group arrival.
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_node, group_pos = balanced_packing(group_load, num_nodes)
    group_start = (group_node * groups_per_node + group_pos) * group_size
    log2mlog = (group_start[:, :, None] + np.arange(group_size)).reshape(num_layers, num_experts)
    mlog2log = _inverse(log2mlog)

    # 2. Replicate inside each node (every node gets P / N slots).
    node_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, experts_per_node)
    phy2mlog, mlogcnt = replicate_experts(node_load, slots_per_node)

    # 3. Copies of each node onto its GPUs.
    copy_load = np.take_along_axis(node_load / mlogcnt, phy2mlog, axis=1)
    gpu, pos = balanced_packing(copy_load, num_gpus // num_nodes)
    phy2pphy = gpu * slots_per_gpu + pos
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = pphy2mlog.reshape(num_layers, num_nodes, slots_per_node) + (
        np.arange(num_nodes) * experts_per_node
    )[None, :, None]
    return np.take_along_axis(mlog2log, pphy2mlog.reshape(num_layers, num_physical), axis=1)
