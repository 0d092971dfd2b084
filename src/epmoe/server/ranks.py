"""The multi-rank step of the server: one control round per engine step.

Rank 0 (the engine core, ``epmoe.server.core``) leads. Each round it broadcasts a ``Control`` (the new
requests, each with the rank it was assigned to, the aborts, whether to step, whether to stop, an
optional command); every rank adds its requests, aborts its ones, steps its engine when told (all ranks
together: the engine's first collective of a step agrees on the batch), runs the command, and rank 0
gathers every rank's ``RankReply`` (its ``StepUpdate`` per request, its queue and KV state, the
command's result). The control traffic runs on its own gloo group, so it works the same when the
engine's group is NCCL.

A request with structured outputs whose grammar the rank's engine has not compiled yet waits in a worker thread
(``Engine.compile_constraint``) instead of compiling in the step loop, which would hold up every running request's
steps for as long (a large JSON schema takes a second or more; vLLM compiles its grammars asynchronously too); it
joins the engine at the first round after its grammar is ready. It counts as waiting meanwhile; an abort drops it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from epmoe.engine import Engine, RequestOutput, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from epmoe.runtime.rebalance import RebalanceEvent

LOADS_COMMAND = "loads"  # each rank returns its logical loads since start, [L, E]
REBALANCE_COMMAND = "rebalance"  # every rank rebalances together (argument: max_moves); each returns the outcome
# the engine's step kinds (``Engine.stats[f"{kind}_steps"]``), in the order of ``RankReply.engine_steps``;
# ``graph_prefill`` steps are graph steps too (a graph step that carried prompt tokens as single-token rows)
STEP_KINDS = ("graph", "graph_prefill", "piecewise", "eager", "idle")


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
        command: ``LOADS_COMMAND``, ``REBALANCE_COMMAND`` or ``None``; run after the step.
        command_arg: the command's argument (``REBALANCE_COMMAND``: ``max_moves`` or ``None``).
    """

    add: tuple[tuple[int, NewRequest], ...] = ()
    abort: tuple[tuple[int, str], ...] = ()
    step: bool = False
    stop: bool = False
    command: str | None = None
    command_arg: object = None


@dataclass(frozen=True)
class StepUpdate:
    """One request's news from one round (only this round's tokens: the HTTP side keeps the rest).

    Attributes:
        request_id: the server's id.
        new_token_ids: tokens of this step.
        finished: no more will come.
        finish_reason: ``stop``, ``length``, ``abort`` (or ``None``).
        text: the final text, cut before a stop string (final update only; ``None`` without a tokenizer).
        error: the engine refused the request, or ended it itself (the message); it is finished.
        num_preemptions: times the request was recomputed.
        num_verify_steps, num_accepted_tokens: speculative verify steps for it and proposed tokens accepted.
        new_logprobs: with ``SamplingParams.logprobs`` set, one entry per token of ``new_token_ids``; else ``None``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, the prompt's (``RequestOutput``'s), on the
            first update that brings tokens only; else ``None``.
        num_cached_tokens: prompt tokens served from the prefix cache (``RequestOutput.num_cached_tokens``).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_verify_steps: int = 0
    num_accepted_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @classmethod
    def of(cls, out: RequestOutput) -> StepUpdate:
        """The update of an engine output."""
        new_logprobs = None
        if out.logprobs is not None:
            new_logprobs = out.logprobs[len(out.token_ids) - len(out.new_token_ids):]
        first = bool(out.new_token_ids) and len(out.new_token_ids) == len(out.token_ids)
        return cls(out.request_id, out.new_token_ids, out.finished, out.finish_reason, out.text, out.error,
                   out.num_preemptions, out.num_verify_steps, out.num_accepted_tokens, new_logprobs,
                   out.prompt_logprobs if first else None, out.num_cached_tokens)


@dataclass(frozen=True)
class RankReply:
    """What one rank reports at the end of a round.

    Attributes:
        rank: EP rank.
        updates: per request that got a token, finished or was refused.
        running, waiting: sequences scheduled / queued on this rank (waiting: with the requests whose grammar
            compiles).
        kv_free, kv_capacity: KV blocks free now / usable in all.
        preemptions: preemptions so far.
        steps: engine steps so far.
        collectives: collective calls of the engine's group so far, by kind.
        result: the command's result (``LOADS_COMMAND``: ``[L, E]`` loads as lists; ``REBALANCE_COMMAND``: a
            dict, see ``RankStepper.rebalance``), else ``None``.
        spec: speculative decoding so far: verify steps, proposed tokens, accepted tokens.
        engine_steps: engine steps so far by kind, in the order of ``STEP_KINDS``.
        step_tokens: tokens this rank fed to the model at this round's step (``Engine.last_step_tokens``);
            ``None`` when the round ran no model pass (no step, nothing to do on any rank, an idle step).
        prefix_cache: prefix-cache queried and hit tokens so far (``Scheduler.prefix_queries``, ``prefix_hits``).
        compiling: requests of ``waiting`` whose grammar still compiles (not in the engine yet).
        rebalances: the live rebalances the engine ran by itself at this round's step (``--eplb-interval``:
            committed, skipped or failed), oldest first; rank 0 only (every rank's are the same), and not those
            of ``REBALANCE_COMMAND`` (its result tells them).
    """

    rank: int
    updates: list[StepUpdate] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_free: int = 0
    kv_capacity: int = 0
    preemptions: int = 0
    steps: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    result: object = None
    spec: tuple[int, int, int] = (0, 0, 0)
    engine_steps: tuple[int, ...] = (0,) * len(STEP_KINDS)
    step_tokens: int | None = None
    prefix_cache: tuple[int, int] = (0, 0)
    compiling: int = 0
    rebalances: tuple[RebalanceEvent, ...] = ()


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
        self._compiler: ThreadPoolExecutor | None = None  # compiles new grammars off the step loop (made on first use)
        self._compiling: dict[str, tuple[NewRequest, Future]] = {}  # by request id, in arrival order
        self._rebalances_seen = 0  # the engine's EPLB events already reported (or answered)

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
        updates: list[StepUpdate] = []
        for rank, req in control.add:
            if rank != self.rank:
                continue
            spec = req.params.structured_outputs
            if spec is not None and not engine.constraint_ready(spec):
                if self._compiler is None:
                    self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epmoe-grammars")
                self._compiling[req.request_id] = (req, self._compiler.submit(engine.compile_constraint, spec))
            else:
                self._add(req, updates)
        for rank, rid in control.abort:
            if rank != self.rank:
                continue
            if self._compiling.pop(rid, None) is not None:  # its compile finishes unused (the grammar stays cached)
                updates.append(StepUpdate(rid, [], True, "abort"))
            else:
                engine.abort(rid)
        for rid, (req, compiled) in list(self._compiling.items()):
            if compiled.done():
                del self._compiling[rid]
                err = compiled.exception()
                if err is None:
                    self._add(req, updates)
                else:
                    updates.append(StepUpdate(rid, [], True, None, error=str(err)))
        if control.stop and self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
        step_tokens = None
        rebalances: tuple[RebalanceEvent, ...] = ()
        if control.step:
            updates += [StepUpdate.of(out) for out in engine.step()]
            step_tokens = engine.last_step_tokens
            rebalances = self._new_rebalances()
        result = None
        if control.command == LOADS_COMMAND:
            result = engine.logical_loads().tolist()
        elif control.command == REBALANCE_COMMAND:
            result = self.rebalance(control.command_arg)
            self._new_rebalances()  # the command's own event: its result answers it
        sched = engine.scheduler
        return RankReply(self.rank, updates, len(sched.running), len(sched.waiting) + len(self._compiling),
                         engine.allocator.num_free, engine.allocator.capacity, engine.stats["preemptions"],
                         engine.num_steps,
                         dict(engine.comm.stats.calls), result,
                         (engine.spec_stats.verify_steps, engine.spec_stats.draft_tokens,
                          engine.spec_stats.accepted_tokens),
                         tuple(engine.stats[f"{kind}_steps"] for kind in STEP_KINDS), step_tokens,
                         (sched.prefix_queries, sched.prefix_hits), len(self._compiling),
                         rebalances if self.rank == 0 else ())

    def _new_rebalances(self) -> tuple[RebalanceEvent, ...]:
        """The engine's EPLB events since the last call, oldest first (none without ``eplb_interval``)."""
        eplb = self.engine.eplb
        if eplb is None:
            return ()
        new = tuple(eplb.events[self._rebalances_seen:])
        self._rebalances_seen = len(eplb.events)
        return new

    def _add(self, req: NewRequest, updates: list[StepUpdate]) -> None:
        """Queue ``req`` in the engine; a refusal becomes its final update (the error named)."""
        try:
            self.engine.add_request(req.prompt_ids, req.params, req.request_id)
        except (ValueError, TypeError) as exc:
            updates.append(StepUpdate(req.request_id, [], True, None, error=str(exc)))

    def rebalance(self, max_moves: int | None) -> dict:
        """One live rebalance of every rank (``Engine.rebalance_now``), as the HTTP answer.

        Returns:
            ``{"committed", "step", "balancedness_before", "balancedness_after", "copies_moved", "moves",
            "error", "skipped"}``; ``moves`` lists ``{"layer", "slot", "old_expert", "new_expert"}`` of the
            committed placement (empty when nothing committed); ``error`` why a tried rebalance did not commit
            (the failing rank's reason), ``skipped`` why none was tried (already balanced, ``max_moves`` 0).
        """
        from epmoe.balance.moves import placement_moves

        old = self.engine.ep_model.placement
        try:
            event = self.engine.rebalance_now(max_moves)
        except ValueError as exc:  # raised on every rank alike, before any collective
            return {"committed": False, "step": self.engine.num_steps, "balancedness_before": None,
                    "balancedness_after": None, "copies_moved": 0, "moves": [], "error": str(exc), "skipped": None}
        moves = placement_moves(old, self.engine.ep_model.placement) if event.committed else []
        return {"committed": event.committed, "step": event.step, "balancedness_before": event.balancedness_before,
                "balancedness_after": event.balancedness_after, "copies_moved": event.copies_moved,
                "moves": [{"layer": m[0], "slot": m[1], "old_expert": m[2], "new_expert": m[3]} for m in moves],
                "error": event.error, "skipped": event.skipped}
