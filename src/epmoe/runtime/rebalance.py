"""Live rebalancing: move expert weights to a new placement, commit it everywhere or nowhere.

Protocol, per MoE layer: every rank works out which of its new slots it already holds (copied
locally) and which it must receive (from the first copy under the old placement), then the ranks agree
with one small all-reduce that all of them are ready, post matched batched point-to-point sends and
receives into staging buffers (only the copies that change travel), and agree again that every
transfer landed. Only after all layers are staged on all ranks does any layer switch; if any rank
fails at any point, every rank drops its staging buffers and the old placement keeps serving. Because
the ranks agree *before* posting transfers, no rank is left waiting on a peer that gave up.

The EPLB loop (``EPLBController``) feeds the windowed loads to the movement-aware balancer every
``interval`` steps and runs this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from epmoe.balance import balancedness
from epmoe.balance.moves import rebalance_with_moves
from epmoe.layer import MoELayer
from epmoe.loads import ExpertLoadRecorder
from epmoe.models.hf import EPModel
from epmoe.placement import ExpertPlacement


@dataclass(frozen=True)
class MigrationResult:
    """Outcome of ``migrate``.

    Attributes:
        committed: the new placement serves now on every rank.
        copies_moved: slots (over all ranks and layers) whose logical expert changed.
        copies_received: expert copies this rank received over the network.
        bytes_received: bytes this rank received.
        error: why the move was abandoned (``None`` when committed).
    """

    committed: bool
    copies_moved: int
    copies_received: int
    bytes_received: int
    error: str | None = None


def _weights_of(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in layer.experts.named_parameters()}


def _source_rank(old: ExpertPlacement, layer: int, expert: int) -> int:
    return int(old.slot_rank[old.log2phy[layer, expert, 0]])


def _agree(ok: bool, layer: MoELayer) -> bool:
    """True when every rank passes ``ok`` (one tiny all-reduce on the weights' device)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=next(layer.experts.parameters()).device)
    return int(layer.comm.all_reduce(flag)) == layer.comm.size


def _failing_reason(why: str | None, layer: MoELayer) -> str:
    """After a failed ``_agree``: the failing ranks' own reasons, gathered on every rank (the failure path only),
    the lowest failing rank's first."""
    comm = layer.comm
    if comm.size == 1:
        return why or f"MoE layer {layer.moe_index} failed"
    reasons: list[str | None] = [None] * comm.size
    dist.all_gather_object(reasons, why, group=comm.group)
    return "; ".join(r for r in reasons if r is not None)


def _stage_layer(
    layer: MoELayer, old: ExpertPlacement, new: ExpertPlacement, tag_base: int
) -> tuple[dict[str, torch.Tensor], list[dist.P2POp], list[tuple[int, torch.Tensor]]]:
    """Staging buffers with the local copies filled in, and the P2P ops this rank must post."""
    comm, index = layer.comm, layer.moe_index
    rank, per_rank = comm.rank, new.slots_per_rank
    current = _weights_of(layer)
    names = list(current)
    staged = {n: torch.empty_like(t) for n, t in current.items()}
    old_local = old.local_experts(rank)[index].tolist()
    row_bytes = [current[n][0].numel() * current[n].element_size() for n in names]
    device = current[names[0]].device

    def flat(slot: int) -> torch.Tensor:
        # one message per copy, as bytes: packed INT4/MXFP4 weights travel with their scales (and biases)
        return torch.cat([_bytes(current[n][slot]) for n in names])

    ops: list[dist.P2POp] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    for j, expert in enumerate(new.local_experts(rank)[index].tolist()):
        if expert in old_local:
            src_slot = old_local.index(expert)
            for n in names:
                staged[n][j].copy_(current[n][src_slot])
        else:
            buf = torch.empty(sum(row_bytes), dtype=torch.uint8, device=device)
            tag = tag_base + index * new.num_slots + rank * per_rank + j
            ops.append(dist.P2POp(dist.irecv, buf, _source_rank(old, index, expert), comm.group, tag))
            recvs.append((j, buf))
    for dest in range(comm.size):
        if dest == rank:
            continue
        dest_old = old.local_experts(dest)[index].tolist()
        for j, expert in enumerate(new.local_experts(dest)[index].tolist()):
            if expert not in dest_old and _source_rank(old, index, expert) == rank:
                tag = tag_base + index * new.num_slots + dest * per_rank + j
                ops.append(dist.P2POp(dist.isend, flat(old_local.index(expert)), dest, comm.group, tag))
    return staged, ops, recvs


def _bytes(row: torch.Tensor) -> torch.Tensor:
    """A contiguous slot row seen as its bytes (``[numel * element_size]`` uint8, no copy)."""
    return row.reshape(-1).view(torch.uint8)


def _unpack(staged: dict[str, torch.Tensor], recvs: list[tuple[int, torch.Tensor]]) -> None:
    for j, buf in recvs:
        offset = 0
        for tensor in staged.values():
            dest = _bytes(tensor[j])
            dest.copy_(buf[offset:offset + dest.numel()])
            offset += dest.numel()


def migrate(ep_model: EPModel, new: ExpertPlacement, *, epoch: int = 0, timeout_s: float = 60.0) -> MigrationResult:
    """Move this rank's expert weights to ``new`` and commit it on all ranks, or on none.

    Every rank of the EP group must call this with the same ``new`` and ``epoch`` (the epoch keeps the
    message tags of successive moves apart).

    Args:
        ep_model: the model serving on this rank (its ``placement`` is the old one).
        new: the placement to move to (same ``P``, ``E`` and EP size).
        epoch: a per-move counter, equal on all ranks.
        timeout_s: how long a transfer may take before this rank gives up (seconds).

    Returns:
        ``MigrationResult``; on failure ``committed`` is False, ``error`` gives every failing rank's own reason
        (the same text on every rank), and the model still serves the old placement with its old weights.

    Raises:
        ValueError: ``new`` does not match the model's placement in shape (checked before anything moves).
    """
    old = ep_model.placement
    for name in ("num_layers", "num_slots", "num_experts", "ep_size"):
        if getattr(old, name) != getattr(new, name):
            raise ValueError(f"new placement has {name} {getattr(new, name)}, the model serves {getattr(old, name)}")
    comm = ep_model.comm
    moved = int((old.phy2log != new.phy2log).sum())
    staged_all: list[dict[str, torch.Tensor]] = []
    received = nbytes = 0
    error: str | None = None
    tag_base = epoch * old.num_layers * old.num_slots
    for layer in ep_model.moe_layers:
        try:
            staged, ops, recvs = _stage_layer(layer, old, new, tag_base)
            ok, why = True, None
        except Exception as exc:  # any local failure is reported to every rank below
            ok, why = False, f"rank {comm.rank}, MoE layer {layer.moe_index}: {type(exc).__name__}: {exc}"
        if not _agree(ok, layer):
            error = _failing_reason(why, layer)
            break
        try:
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait(timeout=timedelta(seconds=timeout_s))
            _unpack(staged, recvs)
            ok, why = True, None
        except Exception as exc:
            ok, why = False, f"rank {comm.rank}, MoE layer {layer.moe_index} transfer: {type(exc).__name__}: {exc}"
        if not _agree(ok, layer):
            error = _failing_reason(why, layer)
            break
        staged_all.append(staged)
        received += len(recvs)
        nbytes += sum(b.numel() * b.element_size() for _, b in recvs)
    if error is not None:
        return MigrationResult(False, moved, 0, 0, f"rebalance abandoned, the old placement keeps serving: {error}")
    for layer, staged in zip(ep_model.moe_layers, staged_all):
        layer.commit_placement(new, staged)
    ep_model.placement = new
    return MigrationResult(True, moved, received, nbytes)


@dataclass
class RebalanceEvent:
    """One EPLB decision.

    Attributes:
        step: generation step at which it ran.
        balancedness_before: of the window's loads under the old placement (even split over copies).
        balancedness_after: of the same loads under the new placement.
        copies_moved: slots whose expert changed.
        committed: the new placement serves.
        error: why it failed (the failing rank's own reason), if it did.
        skipped: why nothing was tried (``already balanced: no copy to move``; no tokens routed since the last
            rebalance), if so; a skipped attempt is
            neither committed nor failed.
    """

    step: int
    balancedness_before: float
    balancedness_after: float
    copies_moved: int
    committed: bool
    error: str | None = None
    skipped: str | None = None

    def describe(self) -> str:
        """The event in one line, for a log: ``step S: committed, N expert copies moved, balancedness B -> A``;
        ``step S: not committed (N expert copies would have moved), balancedness B kept: <error>``; ``step S:
        skipped, balancedness B: <why>`` (``B``, ``A``: ``balancedness_before``, ``balancedness_after`` with three
        decimals)."""
        copies = f"{self.copies_moved} expert {'copy' if self.copies_moved == 1 else 'copies'}"
        if self.committed:
            return (f"step {self.step}: committed, {copies} moved, balancedness {self.balancedness_before:.3f} -> "
                    f"{self.balancedness_after:.3f}")
        if self.skipped is not None:
            return f"step {self.step}: skipped, balancedness {self.balancedness_before:.3f}: {self.skipped}"
        return (f"step {self.step}: not committed ({copies} would have moved), balancedness "
                f"{self.balancedness_before:.3f} kept: {self.error}")


@dataclass
class EPLBController:
    """Every ``interval`` steps: loads -> movement-aware balancer -> ``migrate``.

    Args:
        ep_model: the model serving on this rank.
        recorder: the load recorder its layers feed.
        interval: steps between rebalances (0 = only when ``rebalance`` is called).
        max_moves: most expert copies one rebalance may move (``None`` = as few as reach the target).
        algorithm: balancer name for the from-scratch target.
        timeout_s: transfer timeout of one move, seconds.
        on_commit: called with the old placement right after a new one commits (before the recorder is
            reset), e.g. to fold counts kept per slot into logical loads.

    Raises:
        ValueError: ``interval`` negative.
    """

    ep_model: EPModel
    recorder: ExpertLoadRecorder
    interval: int
    max_moves: int | None = None
    algorithm: str = "epmoe"
    timeout_s: float = 60.0
    on_commit: Callable[[ExpertPlacement], None] | None = None
    events: list[RebalanceEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"eplb interval must be a non-negative number of steps, got {self.interval}")

    def on_step(self, step: int) -> None:
        """Call after every generation step; rebalances when ``step`` is a positive multiple of ``interval``."""
        if self.interval and step > 0 and step % self.interval == 0:
            self.rebalance(step)

    def rebalance(self, step: int, load: torch.Tensor | None = None, max_moves: int | None = None) -> RebalanceEvent:
        """Rebalance now (all ranks must call together, with the same arguments).

        Args:
            step: the engine step it runs at (recorded in the event).
            load: ``[L, E]`` tokens per logical expert summed over the EP group; ``None`` = the recorder's
                window.
            max_moves: most copies to move this time; ``None`` = the controller's ``max_moves``.

        Raises:
            ValueError: ``load`` does not match the placement (before anything moves).
        """
        current = self.ep_model.placement
        if load is None:
            load = self.recorder.logical_load(current, self.ep_model.comm.group)
        load = load.double()
        before = balancedness(load, current)
        if not load.sum():  # an empty window: nothing to balance by (its balancedness is 1 by definition)
            event = RebalanceEvent(step, before, before, 0, False,
                                   skipped="no tokens were routed since the last rebalance: no load to balance by")
            self.events.append(event)
            return event
        cap = self.max_moves if max_moves is None else max_moves
        plan = rebalance_with_moves(load, current, max_moves=cap, algorithm=self.algorithm)
        after = balancedness(load, plan.placement)
        if not plan.moves:
            if cap == 0:
                why = "max_moves is 0: no copy may move"
            elif cap is not None and (free := rebalance_with_moves(load, current, algorithm=self.algorithm)).moves:
                why = (f"max_moves {cap} admits none of the moves that balance better (without a cap "
                       f"{len(free.moves)} copies would move; where no slot is redundant, copies move in pairs)")
            else:
                why = "already balanced: no copy to move"
            event = RebalanceEvent(step, before, before, 0, False, skipped=why)
        else:
            result = migrate(self.ep_model, plan.placement, epoch=len(self.events) + 1, timeout_s=self.timeout_s)
            event = RebalanceEvent(step, before, after if result.committed else before, result.copies_moved,
                                   result.committed, result.error)
            if result.committed:
                if self.on_commit is not None:
                    self.on_commit(current)
                self.recorder.reset()
        self.events.append(event)
        return event
