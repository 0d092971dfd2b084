"""The multi-rank step of the server: one control round per engine step.

Rank 0 (the HTTP process) leads. Each round it broadcasts a ``Control`` (the new requests, each with
the rank it was assigned to, the aborts, whether to step, whether to stop, an optional command); every
rank adds its requests, aborts its ones, steps its engine when told (all ranks together: the engine's
first collective of a step agrees on the batch), and rank 0 gathers every rank's ``RankReply`` (its
``Update`` per request, its queue and KV state, a command's result). The control traffic runs on its own
gloo group, so it works the same when the engine's group is NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from epmoe.engine import Engine, RequestOutput, SamplingParams

LOADS_COMMAND = "loads"  # each rank returns its cumulative logical loads [L, E]


@dataclass(frozen=True)
class NewRequest:
    """A request for one rank.

    Attributes:
        request_id: the server's id.
        prompt_ids: prompt token ids (checked against the context on the HTTP side).
        params: sampling options.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Control:
    """What rank 0 tells every rank at the start of a round.

    Attributes:
        add: ``(rank, request)`` pairs.
        abort: ``(rank, request_id)`` pairs.
        step: every rank steps its engine this round.
        stop: the last round: every rank returns after it.
        command: ``LOADS_COMMAND`` or ``None``.
    """

    add: tuple[tuple[int, NewRequest], ...] = ()
    abort: tuple[tuple[int, str], ...] = ()
    step: bool = False
    stop: bool = False
    command: str | None = None


@dataclass(frozen=True)
class Update:
    """One request's news from one round.

    Attributes:
        request_id: the server's id.
        token_ids: every token generated so far.
        new_token_ids: tokens of this step.
        finished: no more will come.
        finish_reason: ``stop``, ``length``, ``abort`` (or ``None``).
        text: the final text, cut before a stop string (final update only).
        error: the engine refused the request (the message); it is finished.
        num_preemptions: times the request was recomputed.
    """

    request_id: str
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None
    error: str | None = None
    num_preemptions: int = 0

    @classmethod
    def of(cls, out: RequestOutput) -> Update:
        """The update of an engine output."""
        return cls(out.request_id, out.token_ids, out.new_token_ids, out.finished, out.finish_reason,
                   out.text, None, out.num_preemptions)


@dataclass(frozen=True)
class RankReply:
    """What one rank reports at the end of a round.

    Attributes:
        rank: EP rank.
        updates: per request that got a token, finished or was refused.
        running, waiting: sequences scheduled / queued on this rank.
        kv_free, kv_capacity: KV blocks free now / usable in all.
        preemptions: preemptions so far.
        steps: engine steps so far.
        collectives: collective calls of the engine's group so far, by kind.
        result: the command's result (``LOADS_COMMAND``: ``[L, E]`` int64 loads), else ``None``.
    """

    rank: int
    updates: list[Update] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_free: int = 0
    kv_capacity: int = 0
    preemptions: int = 0
    steps: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    result: object = None


class RankStepper:
    """One rank's side of the rounds.

    Args:
        engine: this rank's engine.
        control_group: the gloo group of the control traffic (``None`` for one rank).
    """

    def __init__(self, engine: Engine, control_group: dist.ProcessGroup | None) -> None:
        self.engine = engine
        self.group = control_group
        self.rank = engine.comm.rank
        self.size = engine.comm.size

    def lead(self, control: Control) -> list[RankReply]:
        """Rank 0: run one round; returns every rank's reply in rank order."""
        if self.size > 1:
            dist.broadcast_object_list([control], src=0, group=self.group)
        reply = self._apply(control)
        if self.size == 1:
            return [reply]
        replies: list[RankReply | None] = [None] * self.size
        dist.gather_object(reply, replies, dst=0, group=self.group)
        return replies  # type: ignore[return-value]

    def follow(self) -> None:
        """Ranks 1..N-1: run rounds until rank 0 says stop."""
        while True:
            box: list[Control | None] = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            control = box[0]
            assert isinstance(control, Control), f"rank 0 sent {type(control).__name__}, expected a Control"
            dist.gather_object(self._apply(control), None, dst=0, group=self.group)
            if control.stop:
                return

    def _apply(self, control: Control) -> RankReply:
        engine = self.engine
        updates = []
        for rank, req in control.add:
            if rank != self.rank:
                continue
            try:
                engine.add_request(req.prompt_ids, req.params, req.request_id)
            except (ValueError, TypeError) as exc:
                updates.append(Update(req.request_id, [], [], True, None, error=str(exc)))
        for rank, rid in control.abort:
            if rank == self.rank:
                engine.abort(rid)
        if control.step:
            updates += [Update.of(out) for out in engine.step()]
        result = self._loads() if control.command == LOADS_COMMAND else None
        sched = engine.scheduler
        return RankReply(self.rank, updates, len(sched.running), len(sched.waiting), engine.allocator.num_free,
                         engine.allocator.capacity, engine.stats["preemptions"], engine.num_steps,
                         dict(engine.comm.stats.calls),
                         result)

    def _loads(self) -> list[list[int]]:
        """Tokens this rank routed per logical expert since start, ``[L, E]`` (``Engine.logical_loads``)."""
        return self.engine.logical_loads().tolist()
