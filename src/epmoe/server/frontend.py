"""The engine loop of rank 0: a background thread that owns the ``Engine`` and runs the control rounds.

The HTTP side (the asyncio event loop) calls ``submit`` and ``abort``; they only put items on a
thread-safe inbox. The engine thread takes the inbox each round, assigns each new request to the rank
with the fewest open requests, runs the round (``RankStepper.lead``), and hands each request's
``Update`` to its own ``asyncio.Queue`` through the event loop (``call_soon_threadsafe``). With nothing
open it waits on the inbox, running an empty round every ``idle_round_s`` so the other ranks' control
collectives never time out. Any failure of the loop (a rank gone, a collective error) fails every open
request with ``Failure`` and calls ``on_fatal`` once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from epmoe.engine import SamplingParams
from epmoe.server.metrics import ServerMetrics
from epmoe.server.ranks import Control, NewRequest, RankReply, RankStepper, Update

STATES = ("loading", "ready", "draining", "stopped", "failed")


class Unavailable(RuntimeError):
    """The server takes no requests now (loading, draining, stopped or failed); HTTP 503."""


@dataclass(frozen=True)
class Failure:
    """Put on a request's queue when the server fails under it.

    Attributes:
        message: what failed.
    """

    message: str


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of the loaded engine.

    Attributes:
        max_model_len: longest sequence, tokens.
        vocab_size: the model's vocabulary.
        ranks: EP ranks.
        kv: rank 0's ``Engine.kv_report()``.
        speculative: the speculative decoding proposer's description (``None`` without).
    """

    max_model_len: int
    vocab_size: int
    ranks: int
    kv: dict
    speculative: str | None = None


@dataclass
class _Open:
    """One open request, as the engine thread tracks it."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    rank: int = -1
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


class Frontend:
    """Rank 0's engine loop and the request queues.

    Args:
        start: builds the engine on this thread: returns the rank's ``RankStepper`` (called once, on the
            engine thread; the other ranks must be starting theirs).
        metrics: where the loop reports.
        on_fatal: called once, on any thread, with the reason, when the loop fails.
        idle_round_s: seconds between empty rounds while nothing is open.
    """

    def __init__(self, start: Callable[[], RankStepper], metrics: ServerMetrics,
                 on_fatal: Callable[[str], None], idle_round_s: float = 1.0) -> None:
        self._start = start
        self.metrics = metrics
        self._on_fatal = on_fatal
        self.idle_round_s = idle_round_s
        self.state = "loading"
        self.info: EngineInfo | None = None
        self.failure: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="epmoe-engine", daemon=True)
        self._rank_load: list[int] = []
        self._preemptions = 0
        self._spec = (0, 0, 0)  # verify steps, proposed, accepted tokens already counted

    # ---- the HTTP side ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (it loads the engine, then serves)."""
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, out: asyncio.Queue) -> None:
        """Queue a request; call on the event loop. Its ``Update``s (or a ``Failure``) arrive on ``out``; the
        last one has ``finished``.

        Raises:
            Unavailable: not ready (loading, draining, stopped, failed).
        """
        if self.state != "ready":
            raise Unavailable(f"the server is {self.state}" + (f": {self.failure}" if self.failure else ""))
        with self._lock:
            self._open[request_id] = _Open(out, asyncio.get_running_loop())
        self._inbox.put(("add", NewRequest(request_id, prompt_ids, params)))

    def abort(self, request_id: str) -> None:
        """Abort a request (a client gone); its KV blocks are freed at the next round. Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def command(self, name: str) -> concurrent.futures.Future:
        """Run a ``RankStepper`` command at the next round; the future gets every rank's result, in rank order.

        Raises:
            Unavailable: not ready.
        """
        if self.state not in ("ready", "draining"):
            raise Unavailable(f"the server is {self.state}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("command", (name, future)))
        return future

    def num_open(self) -> int:
        """Requests submitted and not finished."""
        with self._lock:
            return len(self._open)

    def open_ids(self) -> list[str]:
        """Ids of the open requests."""
        with self._lock:
            return list(self._open)

    def begin_drain(self) -> None:
        """Take no new requests (``submit`` raises ``Unavailable``); open ones go on."""
        if self.state in ("loading", "ready"):
            self.state = "draining"

    def stop(self, timeout_s: float) -> bool:
        """Run the last round (every rank returns) and end the engine thread.

        Returns:
            True when the thread ended within ``timeout_s``.
        """
        self._inbox.put(("stop", None))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def fail(self, reason: str) -> None:
        """Fail every open request with ``reason``, refuse new ones, call ``on_fatal`` (first call only)."""
        with self._lock:
            if self.state == "failed":
                return
            self.state = "failed"
            self.failure = reason
            opened, self._open = self._open, {}
        for item in opened.values():
            self._put(item, Failure(reason))
        while True:  # commands still queued get the failure too
            try:
                kind, value = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "command":
                value[1].set_exception(Unavailable(f"the server failed: {reason}"))
        self._on_fatal(reason)

    # ---- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            stepper = self._start()
            engine = stepper.engine
            self.info = EngineInfo(engine.max_model_len, engine.vocab_size, stepper.size, engine.kv_report(),
                                   engine.proposer.describe() if engine.proposer is not None else None)
            self._rank_load = [0] * stepper.size
            if self.state == "loading":
                self.state = "ready"
            self._loop(stepper)
            if self.state != "failed":
                self.state = "stopped"
        except BaseException as exc:  # a rank gone, a collective error: fail every request, exit
            self.fail(f"engine loop failed: {type(exc).__name__}: {exc}")

    def _take(self) -> list[tuple[str, object]]:
        with self._lock:
            idle = not self._open
        items = []
        try:
            items.append(self._inbox.get(timeout=self.idle_round_s) if idle else self._inbox.get_nowait())
        except queue.Empty:
            return items
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _loop(self, stepper: RankStepper) -> None:
        while True:
            adds, aborts, commands, stop = [], [], [], False
            for kind, value in self._take():
                if kind == "add":
                    adds.append(self._assign(value))
                elif kind == "abort":
                    aborts.append(value)
                elif kind == "command":
                    commands.append(value)
                else:
                    stop = True
            with self._lock:
                abort_pairs = tuple((self._open[r].rank, r) for r in aborts if r in self._open)
                busy = bool(self._open)
            command = commands[0] if commands else None
            for name, future in commands[1:]:  # one command per round; the rest wait for the next
                self._inbox.put(("command", (name, future)))
            control = Control(tuple(adds), abort_pairs, step=busy, stop=stop,
                              command=command[0] if command else None)
            replies = stepper.lead(control)
            self._deliver(replies)
            if command is not None:
                command[1].set_result([r.result for r in replies])
            if stop:
                return

    def _assign(self, req: NewRequest) -> tuple[int, NewRequest]:
        rank = min(range(len(self._rank_load)), key=lambda r: (self._rank_load[r], r))
        with self._lock:
            item = self._open.get(req.request_id)
            if item is not None:
                item.rank = rank
        self._rank_load[rank] += 1
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        return rank, req

    def _deliver(self, replies: list[RankReply]) -> None:
        now = time.perf_counter()
        m = self.metrics
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Open, Update]]] = {}
        for reply in replies:
            for up in reply.updates:
                item = self._deliver_one(up, now)
                if item is not None:
                    batches.setdefault(item.loop, []).append((item, up))
        for loop, batch in batches.items():  # one wake-up of each event loop per step, not one per request
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop is closed: nobody waits for it any more
                pass
        m.running.set(sum(r.running for r in replies))
        m.waiting.set(sum(r.waiting for r in replies))
        free, cap = sum(r.kv_free for r in replies), sum(r.kv_capacity for r in replies)
        m.kv_blocks_free.set(free)
        m.kv_blocks_used.set(cap - free)
        m.kv_usage.set((cap - free) / cap if cap else 0.0)
        preemptions = sum(r.preemptions for r in replies)
        m.preemptions.inc(preemptions - self._preemptions)
        self._preemptions = preemptions
        steps, drafts, accepted = (sum(r.spec[i] for r in replies) for i in range(3))
        if steps:
            m.spec_verify_steps.inc(steps - self._spec[0])
            m.spec_draft_tokens.inc(drafts - self._spec[1])
            m.spec_accepted_tokens.inc(accepted - self._spec[2])
            self._spec = (steps, drafts, accepted)
            m.spec_accepted_length.set((accepted + steps) / steps)
            m.spec_acceptance_rate.set(accepted / drafts if drafts else 0.0)
        lead = replies[0]
        for kind, calls in lead.collectives.items():
            m.collectives_per_step.labels(kind=kind).set(calls / lead.steps if lead.steps else 0.0)

    def _deliver_one(self, up: Update, now: float) -> _Open | None:
        """Metrics of one update; returns its request's entry (``None``: no longer open)."""
        m = self.metrics
        with self._lock:
            item = self._open.get(up.request_id)
            if item is None:
                return None
            if up.finished:
                del self._open[up.request_id]
        if up.new_token_ids:
            m.generation_tokens.inc(len(up.new_token_ids))
            if item.first_token is None:
                item.first_token = now
                m.ttft.observe(now - item.submitted)
        if up.finished:
            self._rank_load[item.rank] -= 1
            m.requests.labels(finished_reason="error" if up.error else up.finish_reason).inc()
            n = len(up.token_ids)
            if n > 1 and item.first_token is not None:
                m.tpot.observe((now - item.first_token) / (n - 1))
            if up.num_verify_steps:
                m.spec_request_accepted_length.observe((up.num_accepted_tokens + up.num_verify_steps)
                                                       / up.num_verify_steps)
        return item

    @staticmethod
    def _put(item: _Open, value: Update | Failure) -> None:
        try:
            item.loop.call_soon_threadsafe(item.queue.put_nowait, value)
        except RuntimeError:  # the event loop is closed: nobody waits for it any more
            pass


def _put_all(batch: list[tuple[_Open, Update]]) -> None:
    """On the event loop: hand each update to its request's queue."""
    for item, up in batch:
        item.queue.put_nowait(up)
