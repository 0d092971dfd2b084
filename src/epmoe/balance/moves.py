"""Movement-aware rebalancing: a well balanced placement that moves few expert copies.

A *move* is one physical slot whose logical expert changes: ``(layer, slot, old_expert, new_expert)``;
serving it means copying one expert's weights into that slot. Loads follow the model of ``balance``:
the copies of one logical expert share its load evenly.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

from epmoe.balance.problem import rank_balancedness, rank_loads_array
from epmoe.balance.registry import get_balancer
from epmoe.checks import check_int
from epmoe.loads import as_load_array
from epmoe.placement import ExpertPlacement

Move = tuple[int, int, int, int]

_SOFTMAX_BETA = 50.0
_REL_EPS = 1e-12


@dataclass(frozen=True)
class Rebalance:
    """Result of ``rebalance_with_moves``.

    Attributes:
        placement: the new placement.
        moves: ``(layer, slot, old_expert, new_expert)`` for every slot that changes, ascending.
        target_balancedness: balancedness of the from-scratch placement the tolerance refers to.
    """

    placement: ExpertPlacement
    moves: list[Move]
    target_balancedness: float


def placement_moves(current: ExpertPlacement, new: ExpertPlacement) -> list[Move]:
    """Slots whose logical expert differs between two placements of the same shape.

    Raises:
        ValueError: the placements differ in layers, slots, experts or EP size.
    """
    _check_same_shape(current, new)
    diff = (current.phy2log != new.phy2log).nonzero().tolist()
    return [(layer, s, int(current.phy2log[layer, s]), int(new.phy2log[layer, s])) for layer, s in diff]


def _check_same_shape(a: ExpertPlacement, b: ExpertPlacement) -> None:
    for name in ("num_layers", "num_slots", "num_experts", "ep_size"):
        if getattr(a, name) != getattr(b, name):
            raise ValueError(f"{name} differs between the placements: {getattr(a, name)} vs {getattr(b, name)}")


def _align_layer(old: np.ndarray, new: np.ndarray, ep_size: int, num_experts: int) -> np.ndarray:
    # scipy is imported here, not at the top: rank processes and the CLI import this package without needing it
    from scipy.optimize import linear_sum_assignment

    per_rank = old.size // ep_size
    old_r, new_r = old.reshape(ep_size, per_rank), new.reshape(ep_size, per_rank)
    cnt_old = np.zeros((ep_size, num_experts), dtype=np.int64)
    cnt_new = np.zeros((ep_size, num_experts), dtype=np.int64)
    np.add.at(cnt_old, (np.repeat(np.arange(ep_size), per_rank), old), 1)
    np.add.at(cnt_new, (np.repeat(np.arange(ep_size), per_rank), new), 1)
    overlap = np.minimum(cnt_old[:, None, :], cnt_new[None, :, :]).sum(-1)
    old_rank, new_rank = linear_sum_assignment(-overlap)
    out = np.empty_like(old_r)
    for g_old, g_new in zip(old_rank, new_rank):
        want = list(new_r[g_new])
        row = [-1] * per_rank
        for j, e in enumerate(old_r[g_old]):
            if e in want:
                want.remove(e)
                row[j] = e
        for j in range(per_rank):
            if row[j] < 0:
                row[j] = want.pop()
        out[g_old] = row
    return out.reshape(-1)


def align_placement(current: ExpertPlacement, new: ExpertPlacement) -> ExpertPlacement:
    """``new`` with its ranks renumbered and slots reordered to change as few slots of ``current`` as possible.

    Rank contents are matched by maximum overlap (Hungarian assignment, ``scipy.optimize.
    linear_sum_assignment``); inside a matched rank, experts already present keep their slot. Rank loads
    are the same multiset as ``new``'s, so balancedness is unchanged.

    Raises:
        ValueError: the placements differ in shape.
    """
    _check_same_shape(current, new)
    old, nw = current.phy2log.numpy(), new.phy2log.numpy()
    phy = np.stack([_align_layer(old[layer], nw[layer], new.ep_size, new.num_experts)
                    for layer in range(new.num_layers)])
    return ExpertPlacement(torch.from_numpy(phy), num_experts=new.num_experts, ep_size=new.ep_size)


class _LayerSearch:
    """Greedy improvement of one layer from the current placement; each step is the best gain per move."""

    def __init__(self, w: np.ndarray, phy: np.ndarray, ep_size: int, target: float):
        self.w, self.phy, self.ep_size, self.target = w, phy.copy(), ep_size, target
        self.per_rank = phy.size // ep_size
        self.slot_rank = np.repeat(np.arange(ep_size), self.per_rank)
        self.changed: set[int] = set()

    def loads(self) -> np.ndarray:
        return rank_loads_array(self.w[None], self.phy[None], self.ep_size)[0]

    def balancedness(self) -> float:
        return float(rank_balancedness(self.loads()))

    def done(self) -> bool:
        return self.balancedness() >= self.target

    def best_step(self) -> tuple[float, list[tuple[int, int]]] | None:
        """``(gain per slot changed, [(slot, new_expert), ...])`` of the best improving step, or None."""
        w, phy, g_of = self.w, self.phy, self.slot_rank
        num_experts = w.size
        cnt = np.bincount(phy, minlength=num_experts)
        on = np.zeros((self.ep_size, num_experts))
        np.add.at(on, (g_of, phy), 1.0)
        copy_w = w / np.maximum(cnt, 1)
        loads = on @ copy_w
        top = int(np.argmax(loads))
        mx, mean = loads[top], loads.mean()
        if mx <= 0:
            return None

        def soft(r: np.ndarray) -> np.ndarray:
            return np.exp(_SOFTMAX_BETA * (r - mx) / mean).sum(-1)

        f0 = soft(loads)
        cands: list[tuple[float, list[tuple[int, int]]]] = []
        # Reassign one slot (y -> x); y keeps at least one copy, x is not already on that rank.
        top_slots = np.nonzero(g_of == top)[0]
        donors = np.nonzero(cnt[phy] >= 2)[0]
        s1 = np.repeat(top_slots, num_experts)
        x1 = np.tile(np.arange(num_experts), top_slots.size)
        s2 = np.repeat(donors, top_slots.size)
        x2 = np.tile(phy[top_slots], donors.size)
        slot, x = np.concatenate([s1, s2]), np.concatenate([x1, x2])
        y, h = phy[slot], g_of[slot]
        keep = (cnt[y] >= 2) & (on[h, x] == 0)
        slot, x, y, h = slot[keep], x[keep], y[keep], h[keep]
        if slot.size:
            cy, cx = cnt[y].astype(float), cnt[x].astype(float)
            gain_y = w[y] / (cy - 1) - w[y] / cy
            drop_x = w[x] / cx - w[x] / (cx + 1)
            new = loads + on[:, y].T * gain_y[:, None] - on[:, x].T * drop_x[:, None]
            new[np.arange(slot.size), h] += w[x] / (cx + 1) - w[y] / (cy - 1)
            ok = new.max(1) <= mx * (1 + _REL_EPS)
            gain = np.where(ok, f0 - soft(new), -np.inf)
            b = int(np.argmax(gain))
            if gain[b] > f0 * _REL_EPS:
                cands.append((float(gain[b]), [(int(slot[b]), int(x[b]))]))
        # Swap a slot of the busiest rank with a slot of another rank.
        a = np.repeat(top_slots, phy.size)
        bb = np.tile(np.arange(phy.size), top_slots.size)
        ea, eb, h = phy[a], phy[bb], g_of[bb]
        keep = (h != top) & (ea != eb) & (on[h, ea] == 0) & (on[top, eb] == 0)
        a, bb, ea, eb, h = a[keep], bb[keep], ea[keep], eb[keep], h[keep]
        if a.size:
            d = copy_w[ea] - copy_w[eb]
            new = np.broadcast_to(loads, (a.size, self.ep_size)).copy()
            new[:, top] -= d
            new[np.arange(a.size), h] += d
            ok = new.max(1) <= mx * (1 + _REL_EPS)
            gain = np.where(ok, f0 - soft(new), -np.inf) / 2
            b = int(np.argmax(gain))
            if gain[b] > f0 * _REL_EPS:
                cands.append((float(gain[b]), [(int(a[b]), int(eb[b])), (int(bb[b]), int(ea[b]))]))
        return max(cands, key=lambda c: c[0]) if cands else None

    def prune(self, old: np.ndarray) -> None:
        """Undo single changed slots (largest load first) while the layer stays valid and on target."""
        for slot in sorted(self.changed, key=lambda s: -self.w[old[s]]):
            if self.phy[slot] == old[slot]:
                continue
            keep = self.phy[slot]
            self.phy[slot] = old[slot]
            rank = self.phy[self.slot_rank == self.slot_rank[slot]]
            valid = (self.phy == keep).any() and np.unique(rank).size == rank.size
            if not (valid and self.done()):
                self.phy[slot] = keep

    def apply(self, step: list[tuple[int, int]]) -> None:
        for slot, expert in step:
            self.phy[slot] = expert
            self.changed.add(slot)


def rebalance_with_moves(
    load: torch.Tensor | np.ndarray,
    current: ExpertPlacement,
    *,
    max_moves: int | None = None,
    tolerance: float = 0.02,
    algorithm: str = "epmoe",
) -> Rebalance:
    """From ``current`` and new loads, a placement within ``tolerance`` of the best balancedness, moving few copies.

    The from-scratch placement of ``algorithm`` sets the target: each layer must reach
    ``(1 - tolerance)`` times its balancedness (so the average does too). Starting from ``current``, the
    layer furthest below its target takes the step with the largest gain per moved copy: reassign one
    slot from an expert with several copies to another expert, or swap two slots between ranks (2 moves).
    A layer whose greedy search stalls below target takes the from-scratch layer aligned to ``current``
    (``align_placement``) when the budget allows. With ``max_moves``, no more than that many slots change
    in all; the target may then be missed.

    Args:
        load: ``[L, E]`` new tokens per logical expert.
        current: the placement serving now.
        max_moves: most slots that may change over all layers; None = no limit.
        tolerance: allowed relative loss of balancedness against the from-scratch placement.
        algorithm: balancer name for the from-scratch target (see ``balance.BALANCERS``).

    Returns:
        ``Rebalance`` (placement, moves, target balancedness).

    Raises:
        ValueError: bad loads, a load shape that differs from ``current``, ``max_moves < 0`` or a
            tolerance outside ``[0, 1)``.
        KeyError: unknown ``algorithm``.
    """
    w = as_load_array(load)
    if w.shape != (current.num_layers, current.num_experts):
        raise ValueError(
            f"load has shape {tuple(w.shape)} but the current placement covers "
            f"[{current.num_layers}, {current.num_experts}] (layers, experts)"
        )
    if max_moves is not None:
        check_int("max_moves", max_moves, 0, wording="a non-negative integer or None")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must lie in [0, 1), got {tolerance!r}")
    fresh = get_balancer(algorithm)(w, current.ep_size, current.num_redundant)
    fresh = align_placement(current, fresh)
    fresh_r = rank_loads_array(w, fresh.phy2log.numpy(), fresh.ep_size)
    fresh_bal = rank_balancedness(fresh_r).numpy()
    old = current.phy2log.numpy()
    searches = [
        _LayerSearch(w[layer], old[layer], current.ep_size, (1 - tolerance) * fresh_bal[layer])
        for layer in range(w.shape[0])
    ]
    budget = math.inf if max_moves is None else max_moves
    used = 0
    heap = [(s.balancedness() / max(s.target, 1e-300), layer) for layer, s in enumerate(searches) if not s.done()]
    heapq.heapify(heap)
    stalled: list[int] = []
    while heap:
        _, layer = heapq.heappop(heap)
        s = searches[layer]
        best = s.best_step()
        if best is None:
            stalled.append(layer)
            continue
        step = best[1]
        cost = len({slot for slot, _ in step} - s.changed)
        if used + cost > budget:
            stalled.append(layer)
            continue
        s.apply(step)
        used += cost
        if not s.done():
            heapq.heappush(heap, (s.balancedness() / max(s.target, 1e-300), layer))
    for s in searches:
        if s.done():
            s.prune(old[searches.index(s)])
    phy = np.stack([s.phy for s in searches])
    fresh_phy = fresh.phy2log.numpy()
    for layer in stalled:
        now = int((phy[layer] != old[layer]).sum())
        swap_cost = int((fresh_phy[layer] != old[layer]).sum())
        if searches[layer].balancedness() < fresh_bal[layer] * (1 - tolerance) and used - now + swap_cost <= budget:
            phy[layer] = fresh_phy[layer]
            used += swap_cost - now
    placement = ExpertPlacement(torch.from_numpy(phy), num_experts=current.num_experts, ep_size=current.ep_size)
    return Rebalance(
        placement=placement,
        moves=placement_moves(current, placement),
        target_balancedness=float(fresh_bal.mean()),
    )
