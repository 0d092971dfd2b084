"""The HTTP process's side of the engine core (``epmoe.server.core``): request queues over one pipe.

The HTTP side (the asyncio event loop) calls ``submit``, ``abort`` and ``command``; they only put items
on an outbox, which a writer thread sends to the core, all that waits as one message (the event loop
never blocks on the pipe). A reader thread receives the core's messages: one ``StepReport`` per round,
whose updates it turns into ``Update``s (each request's tokens so far kept here), records in the metrics,
and hands to the requests' ``asyncio.Queue``s with one wake-up of each event loop per round
(``call_soon_threadsafe``). A pipe that closes before the core said ``stopped`` (the core died) or a
``failed`` message sets ``core_down`` (and ``core_error``): the server's watcher then gathers the other ranks'
errors, so that the message every open request fails with (``fail``: ``Failure``, then ``on_fatal`` once)
names the cause first, e.g. the rank a signal killed, not the core's "a peer went away".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from epmoe.engine import SamplingParams, TokenLogprobs
from epmoe.runtime.launch import RankError
from epmoe.server.core import EngineInfo, StepReport
from epmoe.server.metrics import ServerMetrics
from epmoe.server.ranks import STEP_KINDS, NewRequest, StepUpdate

if TYPE_CHECKING:
    from epmoe.runtime.rebalance import RebalanceEvent

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
class Update:
    """One request's news, as its HTTP handler reads it.

    Attributes:
        request_id: the server's id.
        token_ids: every token generated so far.
        new_token_ids: tokens of this step.
        finished: no more will come.
        finish_reason: ``stop``, ``length``, ``abort`` (or ``None``).
        text: the final text, cut before a stop string (final update only; ``None`` without a tokenizer).
        error: the engine refused the request (the message); it is finished.
        logprobs, new_logprobs: with ``SamplingParams.logprobs`` set, one entry per token of ``token_ids`` /
            ``new_token_ids``; else ``None``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, the prompt's, from the first update with
            tokens on; else ``None``.
        num_cached_tokens: prompt tokens the engine served from its prefix cache (``RequestOutput``'s).
    """

    request_id: str
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass
class _Open:
    """One open request, as the reader thread tracks it."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


class Frontend:
    """The engine core as the HTTP routes see it.

    Args:
        conn: this end of the pipe to the engine core (rank 0's process).
        metrics: where the rounds are reported.
        on_fatal: called once, on any thread, with the reason, when the core fails or its process ends.
        on_ready: called once, on the reader thread, with the core's ``EngineInfo`` when it is ready, before the
            state turns ``ready`` (so what it logs precedes every answer of a ready server).
        on_rebalance: called on the reader thread with each live rebalance the engine ran by itself
            (``StepReport.rebalances``: ``--eplb-interval``), in order, before the round's updates are delivered.
    """

    def __init__(self, conn: Connection, metrics: ServerMetrics, on_fatal: Callable[[str], None],
                 on_ready: Callable[[EngineInfo], None] | None = None,
                 on_rebalance: Callable[[RebalanceEvent], None] | None = None) -> None:
        self._conn = conn
        self.metrics = metrics
        self._on_fatal = on_fatal
        self._on_ready = on_ready
        self._on_rebalance = on_rebalance
        self.state = "loading"
        self.info: EngineInfo | None = None
        self.failure: str | None = None
        self.core_error: RankError | None = None  # the engine core's own error, when it reported one
        self.core_down = threading.Event()  # the core failed or its pipe closed: the watcher fails the requests
        self.stop_requested = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[str, _Open] = {}
        self._commands: dict[int, concurrent.futures.Future] = {}
        self._command_ids = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reader = threading.Thread(target=self._read, name="epmoe-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="epmoe-core-writer", daemon=True)
        self._preemptions = 0
        self._spec = (0, 0, 0)  # verify steps, proposed, accepted tokens already counted
        self._prefix_cache = (0, 0)  # prefix-cache queried and hit tokens already counted
        self._engine_steps = (0,) * len(STEP_KINDS)  # rank 0's engine steps by kind already counted

    # ---- the HTTP side ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the reader and writer threads (the core reports ``ready`` once its engine is loaded)."""
        self._reader.start()
        self._writer.start()

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
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._outbox.put(("add", NewRequest(request_id, prompt_ids, params)))

    def abort(self, request_id: str) -> None:
        """Abort a request (a client gone); its KV blocks are freed at the next round. Unknown ids are ignored."""
        self._outbox.put(("abort", request_id))

    def command(self, name: str, arg: object = None) -> concurrent.futures.Future:
        """Run a ``RankStepper`` command at a coming round; the future gets every rank's result, in rank order.

        Raises:
            Unavailable: not ready.
        """
        if self.state not in ("ready", "draining"):
            raise Unavailable(f"the server is {self.state}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            command_id = next(self._command_ids)
            self._commands[command_id] = future
        self._outbox.put(("command", (command_id, name, arg)))
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
        """Have the core run its last round (every rank returns) and wait for it to say so.

        Returns:
            True when the core stopped within ``timeout_s``.
        """
        self.stop_requested = True
        self._outbox.put(("stop", None))
        return self._stopped.wait(timeout_s)

    def fail(self, reason: str) -> None:
        """Fail every open request and command with ``reason``, refuse new ones, call ``on_fatal`` (first call
        only)."""
        with self._lock:
            if self.state in ("failed", "stopped"):
                return
            self.state = "failed"
            self.failure = reason
            opened, self._open = self._open, {}
            commands, self._commands = self._commands, {}
        for item in opened.values():
            try:
                item.loop.call_soon_threadsafe(item.queue.put_nowait, Failure(reason))
            except RuntimeError:  # the event loop is closed: nobody waits for it any more
                pass
        for future in commands.values():
            future.set_exception(Unavailable(f"the server failed: {reason}"))
        self._on_fatal(reason)

    # ---- the pipe ---------------------------------------------------------------------------------

    def _write(self) -> None:
        while True:
            items = [self._outbox.get()]
            while True:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._conn.send(items)
            except (OSError, ValueError):  # the core is gone: the reader reports it
                return
            if any(kind == "stop" for kind, _ in items):
                return

    def _read(self) -> None:
        try:
            while True:
                for kind, value in self._conn.recv():
                    if kind == "step":
                        self._deliver(value)
                    elif kind == "command":
                        with self._lock:
                            future = self._commands.pop(value[0], None)
                        if future is not None:
                            future.set_result(value[1])
                    elif kind == "ready":
                        self.info = value
                        if self.state == "loading":
                            if self._on_ready is not None:
                                self._on_ready(value)
                            self.state = "ready"
                    elif kind == "failed":
                        self.core_error = value
                        self.core_down.set()
                        return
                    else:
                        with self._lock:
                            if self.state != "failed":
                                self.state = "stopped"
                        self._stopped.set()
                        return
        except (EOFError, OSError):
            self.core_down.set()

    def _deliver(self, report: StepReport) -> None:
        if self._on_rebalance is not None:
            for event in report.rebalances:
                self._on_rebalance(event)
        now = time.perf_counter()
        m = self.metrics
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Open, Update]]] = {}
        for up in report.updates:
            delivered = self._deliver_one(up, now)
            if delivered is not None:
                batches.setdefault(delivered[0].loop, []).append(delivered)
        for loop, batch in batches.items():  # one wake-up of each event loop per round, not one per request
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop is closed: nobody waits for it any more
                pass
        m.running.set(report.running)
        m.waiting.set(report.waiting)
        free, cap = report.kv_free, report.kv_capacity
        m.kv_blocks_free.set(free)
        m.kv_blocks_used.set(cap - free)
        m.kv_usage.set((cap - free) / cap if cap else 0.0)
        m.preemptions.inc(report.preemptions - self._preemptions)
        self._preemptions = report.preemptions
        m.prefix_cache_queries.inc(report.prefix_cache[0] - self._prefix_cache[0])
        m.prefix_cache_hits.inc(report.prefix_cache[1] - self._prefix_cache[1])
        self._prefix_cache = report.prefix_cache
        if report.collectives_per_step is not None:
            for kind, calls in report.collectives_per_step.items():
                m.collectives_per_step.labels(kind=kind).set(calls)
        if report.layer_balancedness is not None:
            for layer, value in enumerate(report.layer_balancedness):
                m.layer_balancedness.labels(layer=str(layer)).set(value)
        for kind, now_n, before in zip(STEP_KINDS, report.engine_steps, self._engine_steps):
            if now_n > before:
                m.engine_steps.labels(kind=kind).inc(now_n - before)
        self._engine_steps = report.engine_steps
        if report.step_tokens is not None:
            m.iteration_tokens.observe(report.step_tokens)
        if report.round_s is not None:
            m.core_busy_seconds.inc(report.round_s)
            m.round_seconds.observe(report.round_s)
        m.core_idle_seconds.inc(report.idle_s)
        if report.spec[0]:
            steps, drafts, accepted = report.spec
            m.spec_verify_steps.inc(steps - self._spec[0])
            m.spec_draft_tokens.inc(drafts - self._spec[1])
            m.spec_accepted_tokens.inc(accepted - self._spec[2])
            self._spec = report.spec
            m.spec_accepted_length.set((accepted + steps) / steps)
            m.spec_acceptance_rate.set(accepted / drafts if drafts else 0.0)

    def _deliver_one(self, up: StepUpdate, now: float) -> tuple[_Open, Update] | None:
        """Metrics of one update and its ``Update``, with its request's entry (``None``: no longer open)."""
        m = self.metrics
        with self._lock:
            item = self._open.get(up.request_id)
            if item is None:
                return None
            if up.finished:
                del self._open[up.request_id]
        item.token_ids.extend(up.new_token_ids)
        if up.new_logprobs is not None:
            item.logprobs.extend(up.new_logprobs)
        if up.prompt_logprobs is not None:
            item.prompt_logprobs = up.prompt_logprobs
        if up.new_token_ids:
            m.generation_tokens.inc(len(up.new_token_ids))
            if item.first_token is None:
                item.first_token = now
                m.ttft.observe(now - item.submitted)
        if up.finished:
            m.requests.labels(finished_reason="error" if up.error else up.finish_reason).inc()
            n = len(item.token_ids)
            if n > 1 and item.first_token is not None:
                m.tpot.observe((now - item.first_token) / (n - 1))
            if up.num_verify_steps:
                m.spec_request_accepted_length.observe((up.num_accepted_tokens + up.num_verify_steps)
                                                       / up.num_verify_steps)
        logprobs = list(item.logprobs) if up.new_logprobs is not None else None
        return item, Update(up.request_id, list(item.token_ids), up.new_token_ids, up.finished, up.finish_reason,
                            up.text, up.error, logprobs, up.new_logprobs, item.prompt_logprobs, up.num_cached_tokens)


def _put_all(batch: list[tuple[_Open, Update]]) -> None:
    """On the event loop: hand each update to its request's queue."""
    for item, up in batch:
        item.queue.put_nowait(up)
