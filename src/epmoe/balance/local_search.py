"""epmoe's own load balancer, the algorithm behind ``balancers.balance_epmoe`` (pure numpy).

Replicate by largest load per copy (which minimises the heaviest copy), pack the copies heaviest first
onto the lightest rank with a free slot and without a copy of the same expert (LPT with cardinality),
then improve by local search: swap a copy on the busiest rank with a lighter copy on another rank while
that lowers the busiest rank, and move a redundant copy from a cold expert to a hot one on the busiest
rank while that lowers the maximum. The hierarchical option packs the expert groups onto nodes the same
way first, then balances every node on its own slots. Inputs are checked by ``balance.check_problem``.
"""

from __future__ import annotations

import numpy as np

_REL_EPS = 1e-12


def epmoe_phy2log(w: np.ndarray, num_slots: int, ep_size: int, num_nodes: int = 1, num_groups: int = 1) -> np.ndarray:
    """``phy2log [L, P]`` int64 for loads ``w [L, E]`` float64 (checked): hierarchical when ``num_nodes > 1``."""
    if num_nodes > 1:
        return _hierarchical(w, num_slots, ep_size, num_nodes, num_groups)
    return _balance_flat(w, num_slots, ep_size)


def replicate(w: np.ndarray, num_slots: int, cap: int | None) -> np.ndarray:
    """``[B, E]`` int64 copies per expert of loads ``w [B, E]``: each of the ``num_slots - E`` extra slots
    goes to the expert with the largest load per copy (among those with fewer than ``cap`` copies)."""
    counts = np.ones(w.shape, dtype=np.int64)
    rows = np.arange(w.shape[0])
    for _ in range(num_slots - w.shape[1]):
        per_copy = w / counts
        if cap is not None:
            per_copy = np.where(counts < cap, per_copy, -1.0)
        counts[rows, np.argmax(per_copy, axis=1)] += 1
    return counts


def _pack_lpt(copy_w: np.ndarray, copy_e: np.ndarray, ep_size: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Heaviest copy first onto the lightest rank with a free slot and without that expert.

    Args:
        copy_w: ``[B, P]`` float64 load of each copy.
        copy_e: ``[B, P]`` int64 expert of each copy.

    Returns:
        ``(rank_w, rank_e)``: ``[B, G, P/G]`` copy loads and experts per rank.
    """
    num_rows, num_slots = copy_w.shape
    per_rank = num_slots // ep_size
    rows = np.arange(num_rows)
    order = np.argsort(-copy_w, axis=1, kind="stable")
    loads = np.zeros((num_rows, ep_size))
    fill = np.zeros((num_rows, ep_size), dtype=np.int64)
    has = np.zeros((num_rows, ep_size, num_experts), dtype=bool)
    rank_w = np.zeros((num_rows, ep_size, per_rank))
    rank_e = np.zeros((num_rows, ep_size, per_rank), dtype=np.int64)
    penalty = (2.0 * copy_w.sum(1) + 1.0)[:, None]
    for t in range(num_slots):
        item = order[:, t]
        e = copy_e[rows, item]
        cost = np.where(fill < per_rank, loads + penalty * has[rows, :, e], np.inf)
        g = np.argmin(cost, axis=1)
        rank_w[rows, g, fill[rows, g]] = copy_w[rows, item]
        rank_e[rows, g, fill[rows, g]] = e
        loads[rows, g] += copy_w[rows, item]
        fill[rows, g] += 1
        has[rows, g, e] = True
    return rank_w, rank_e


def _swap_search(rank_w: np.ndarray, rank_e: np.ndarray, num_experts: int, max_iters: int) -> None:
    """Swap a copy on the busiest rank with a lighter one elsewhere while the busiest rank gets lighter.

    Works in place on ``rank_w, rank_e [B, G, S]``. A swap must keep every rank free of duplicate
    experts and leave the partner below the old maximum, so the sorted rank loads decrease
    lexicographically and the search terminates.
    """
    num_rows, ep_size, per_rank = rank_w.shape
    active = np.arange(num_rows)
    for _ in range(max_iters):
        if active.size == 0:
            return
        w, e = rank_w[active], rank_e[active]
        n = active.size
        rows = np.arange(n)
        loads = w.sum(2)
        top = np.argmax(loads, axis=1)
        mx = loads[rows, top]
        a_w, a_e = w[rows, top], e[rows, top]  # [n, S]
        delta = a_w[:, :, None, None] - w[:, None, :, :]  # [n, S, G, S]
        new_peak = np.maximum(mx[:, None, None, None] - delta, loads[:, None, :, None] + delta)
        a_on_h = (e[:, None, :, :] == a_e[:, :, None, None]).any(-1)  # [n, S, G]
        b_on_top = (e[:, :, :, None] == a_e[:, None, None, :]).any(-1)  # [n, G, S]
        # h == top never qualifies: its load is mx, so loads[h] + delta < mx fails for delta > 0.
        ok = (delta > 0) & (new_peak < mx[:, None, None, None] * (1 - _REL_EPS))
        ok &= ~a_on_h[:, :, :, None]
        ok &= ~b_on_top[:, None, :, :]
        score = np.where(ok, new_peak, np.inf).reshape(n, -1)
        best = np.argmin(score, axis=1)
        improved = np.isfinite(score[rows, best])
        sa, h, sb = np.unravel_index(best, (per_rank, ep_size, per_rank))
        r, sa, h, sb, t = rows[improved], sa[improved], h[improved], sb[improved], top[improved]
        g_rows = active[r]
        wa, ea = rank_w[g_rows, t, sa].copy(), rank_e[g_rows, t, sa].copy()
        rank_w[g_rows, t, sa], rank_e[g_rows, t, sa] = rank_w[g_rows, h, sb], rank_e[g_rows, h, sb]
        rank_w[g_rows, h, sb], rank_e[g_rows, h, sb] = wa, ea
        active = g_rows


def _recopy_search(w: np.ndarray, rank_e: np.ndarray, max_iters: int) -> np.ndarray:
    """Move one redundant copy from a cold expert to an expert on the busiest rank, while it helps.

    One layer at a time. A candidate takes a slot holding expert ``y`` (``c_y >= 2``) and gives it to an
    expert ``x`` on the busiest rank that is not yet on the slot's rank; it is kept only when the maximum
    rank load drops. Returns the new ``[G, S]`` experts.
    """
    ep_size, per_rank = rank_e.shape
    num_experts = w.size
    slot_rank = np.repeat(np.arange(ep_size), per_rank)
    phy = rank_e.reshape(-1).copy()
    for _ in range(max_iters):
        cnt = np.bincount(phy, minlength=num_experts)
        on = np.zeros((ep_size, num_experts))
        on[slot_rank, phy] = 1.0
        loads = on @ (w / np.maximum(cnt, 1))
        top = int(np.argmax(loads))
        mx = loads[top]
        hot = phy[slot_rank == top]
        donors = np.nonzero(cnt[phy] >= 2)[0]
        slot = np.repeat(donors, hot.size)
        x = np.tile(hot, donors.size)
        h, y = slot_rank[slot], phy[slot]
        keep = on[h, x] == 0
        slot, x, h, y = slot[keep], x[keep], h[keep], y[keep]
        if slot.size == 0:
            break
        cy, cx = cnt[y], cnt[x]
        gain_y = w[y] / (cy - 1) - w[y] / cy
        drop_x = w[x] / cx - w[x] / (cx + 1)
        new = loads + on[:, y].T * gain_y[:, None] - on[:, x].T * drop_x[:, None]
        idx = np.arange(slot.size)
        new[idx, h] += -w[y] / cy - gain_y + w[x] / (cx + 1)
        peak = new.max(1)
        best = int(np.argmin(peak))
        if not peak[best] < mx * (1 - _REL_EPS):
            break
        phy[slot[best]] = x[best]
    return phy.reshape(ep_size, per_rank)


def _balance_flat(w: np.ndarray, num_slots: int, ep_size: int) -> np.ndarray:
    """epmoe's balancer on ``B`` independent rows: ``w [B, E]`` -> ``phy2log [B, P]`` int64."""
    num_rows, num_experts = w.shape
    per_rank = num_slots // ep_size
    distinct = per_rank <= num_experts
    counts = replicate(w, num_slots, cap=ep_size if distinct else None)
    copy_e = np.repeat(np.broadcast_to(np.arange(num_experts), w.shape).reshape(-1), counts.reshape(-1))
    copy_e = copy_e.reshape(num_rows, num_slots)
    copy_w = np.take_along_axis(w / counts, copy_e, axis=1)
    rank_w, rank_e = _pack_lpt(copy_w, copy_e, ep_size, num_experts)
    iters = 4 * num_slots
    _swap_search(rank_w, rank_e, num_experts, iters)
    if distinct and num_slots > num_experts:
        for b in range(num_rows):
            before = rank_w[b].sum(1).max()
            new_e = _recopy_search(w[b], rank_e[b], iters)
            if not np.array_equal(new_e, rank_e[b]):
                cnt = np.bincount(new_e.reshape(-1), minlength=num_experts)
                rw, re = (w[b][new_e] / cnt[new_e])[None], new_e[None].copy()
                _swap_search(rw, re, num_experts, iters)
                if rw[0].sum(1).max() < before:
                    rank_w[b], rank_e[b] = rw[0], re[0]
    rank_e = np.sort(rank_e, axis=2)
    return rank_e.reshape(num_rows, num_slots)


def _hierarchical(w: np.ndarray, num_slots: int, ep_size: int, num_nodes: int, num_groups: int) -> np.ndarray:
    """Groups onto nodes (LPT + swaps), then ``_balance_flat`` inside every node."""
    num_layers, num_experts = w.shape
    group_size = num_experts // num_groups
    group_w = w.reshape(num_layers, num_groups, group_size).sum(-1)
    group_ids = np.broadcast_to(np.arange(num_groups), group_w.shape).copy()
    node_w, node_g = _pack_lpt(group_w, group_ids, num_nodes, num_groups)
    _swap_search(node_w, node_g, num_groups, 4 * num_groups)
    node_g = np.sort(node_g, axis=2)  # [L, N, K/N]
    experts = (node_g[..., None] * group_size + np.arange(group_size)).reshape(num_layers, num_nodes, -1)
    local_w = np.take_along_axis(w, experts.reshape(num_layers, -1), axis=1).reshape(num_layers * num_nodes, -1)
    local_phy = _balance_flat(local_w, num_slots // num_nodes, ep_size // num_nodes)
    phy = np.take_along_axis(experts.reshape(num_layers * num_nodes, -1), local_phy, axis=1)
    return phy.reshape(num_layers, num_slots)
