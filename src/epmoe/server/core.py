"""The engine core: the rank processes of ``epmoe serve``, rank 0's loop apart from the HTTP process.

As vLLM's ``EngineCore``: the engine steps in a process of its own, so the engine's Python work and the
HTTP event loop never wait on one interpreter lock. The HTTP process (``epmoe.server.frontend``) and the
core talk over one ``multiprocessing`` pipe; every message is a list of ``(kind, value)`` items, so a
batch of requests, or a whole step's news, travels as one message:

- HTTP -> core: ``("add", NewRequest)``, ``("abort", request_id)``, ``("command", (command_id, name,
  arg))``, ``("stop", None)``.
- core -> HTTP: ``("ready", EngineInfo)`` once loaded, one ``("step", StepReport)`` per round,
  ``("command", (command_id, results))``, ``("failed", RankError)``, ``("stopped", None)`` last.

Each round the core takes what arrived (waiting ``idle_round_s`` when nothing is open: the empty rounds
keep the other ranks' control collectives from timing out; ``COMPILE_POLL_S`` without stepping when the only open
requests wait for their grammars to compile, instead of spinning empty steps), assigns each new request to the rank with
the fewest open requests, runs the round (``RankStepper.lead``) and sends the round's ``StepReport``.
Every ``loads_interval_s`` while busy, and once when the last open request is done, it also gathers
the expert loads, for the per-layer balancedness of the tokens routed since the previous sample. The
core times itself (``time.monotonic``): the wall time of each round that steps is busy, the rest (waiting
for and reading requests, sending reports, rounds that do not step) idle; each report carries both, so
``/metrics`` tells an engine-bound server (busy nearly all the time) from one that waits on its HTTP side.

Rank processes ignore SIGINT and SIGTERM (the HTTP process drains and stops them with its last round)
and are killed when the HTTP process dies.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from epmoe.comm import Comm
from epmoe.engine import Engine
from epmoe.runtime.launch import RankError, RankInfo, die_with_parent, init_group, set_rank_threads
from epmoe.server.config import ServeConfig
from epmoe.server.ranks import LOADS_COMMAND, STEP_KINDS, Control, NewRequest, RankReply, RankStepper, StepUpdate

if TYPE_CHECKING:
    from epmoe.runtime.rebalance import RebalanceEvent


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of the loaded engine.

    Attributes:
        max_model_len: longest sequence, tokens.
        vocab_size: the model's vocabulary.
        ranks: EP ranks.
        parallel: ``ep`` or ``tp`` (no expert placement: no ``/eplb`` routes, no balancedness).
        kv: rank 0's ``Engine.kv_report()``.
        speculative: the speculative decoding proposer's description (``None`` without), for the log.
        speculative_algorithm: its algorithm (``ngram``, ``draft``, ``eagle3``), which the 400s it causes name
            (not the description: it holds the server's paths).
    """

    max_model_len: int
    vocab_size: int
    ranks: int
    parallel: str
    kv: dict
    speculative: str | None = None
    speculative_algorithm: str | None = None


@dataclass(frozen=True)
class StepReport:
    """One round, as the core reports it to the HTTP process.

    Attributes:
        updates: every rank's ``StepUpdate``s of the round.
        running, waiting: sequences scheduled / queued, summed over ranks.
        kv_free, kv_capacity: KV blocks free now / usable in all, summed over ranks.
        preemptions: preemptions so far, summed over ranks.
        collectives_per_step: collective calls of the engine's group in this round per engine step, by kind
            (rank 0; a rebalance run in the same round adds its calls); ``None`` when no step ran (the calls of
            such a round are not counted).
        layer_balancedness: per MoE layer, the balancedness of the tokens routed since the previous sample
            (``epmoe.balance.layer_balancedness``); ``None`` when not sampled this round.
        spec: speculative decoding so far, summed over ranks: verify steps, proposed tokens, accepted tokens.
        engine_steps: rank 0's engine steps so far by kind, in the order of ``ranks.STEP_KINDS`` (every rank
            steps together).
        step_tokens: tokens rank 0 fed to the model at this round's step; ``None`` when it ran no model pass.
        round_s: wall seconds of this round in the core (broadcast, step, gather) when it stepped, else ``None``.
        idle_s: the core's other wall seconds since the previous report: waiting for and reading requests,
            sending reports, rounds that did not step.
        prefix_cache: prefix-cache queried and hit tokens so far, summed over ranks.
        rebalances: the live rebalances the engine ran by itself at this round's step (``--eplb-interval``), as
            rank 0 reports them (``RankReply.rebalances``); the HTTP process logs each.
    """

    updates: list[StepUpdate]
    running: int
    waiting: int
    kv_free: int
    kv_capacity: int
    preemptions: int
    collectives_per_step: dict[str, float] | None = None
    layer_balancedness: list[float] | None = None
    spec: tuple[int, int, int] = (0, 0, 0)
    engine_steps: tuple[int, ...] = (0,) * len(STEP_KINDS)
    step_tokens: int | None = None
    round_s: float | None = None
    idle_s: float = 0.0
    prefix_cache: tuple[int, int] = (0, 0)
    rebalances: tuple[RebalanceEvent, ...] = ()


@dataclass
class _Sampler:
    """What the core remembers between reports: the last step count and collective calls, the last loads."""

    steps: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    loads: torch.Tensor | None = None
    loads_time: float = 0.0


COMPILE_POLL_S = 0.005  # the round period while every open request waits for its grammar (``RankStepper``)


class EngineCore:
    """Rank 0's loop.

    Args:
        stepper: rank 0's ``RankStepper`` (its engine loaded, the other ranks following).
        conn: this end of the pipe to the HTTP process.
        idle_round_s: seconds between empty rounds while nothing is open.
        loads_interval_s: seconds between balancedness samples while busy (``parallel='ep'`` only; one more
            when the last open request is done).
    """

    def __init__(self, stepper: RankStepper, conn: Connection, idle_round_s: float = 1.0,
                 loads_interval_s: float = 1.0) -> None:
        self.stepper = stepper
        self.conn = conn
        self.idle_round_s = idle_round_s
        self.loads_interval_s = loads_interval_s
        self._rank_of: dict[str, int] = {}
        self._rank_load = [0] * stepper.size
        self._sampler = _Sampler(loads_time=time.monotonic())
        self._ep = not stepper.engine.tp
        self._later: list[tuple[int, str, object]] = []  # commands for the next rounds
        self._was_busy = False
        self._only_compiling = False  # the last round's open requests all wait for their grammars

    def run(self) -> None:
        """Report ready, run rounds until the HTTP side says stop, report stopped."""
        engine = self.stepper.engine
        info = EngineInfo(engine.max_model_len, engine.vocab_size, self.stepper.size, engine.config.parallel,
                          engine.kv_report(), engine.proposer.describe() if engine.proposer is not None else None,
                          engine.config.speculative_algorithm)
        self.conn.send([("ready", info)])
        mark = time.monotonic()  # the end of the previous round
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
            busy = bool(self._rank_of)
            abort_pairs = tuple((self._rank_of[r], r) for r in aborts if r in self._rank_of)
            command = commands[0] if commands else None  # one command per round; the rest wait for the next
            due = time.monotonic() - self._sampler.loads_time >= self.loads_interval_s
            sample = command is None and self._ep and ((busy and due) or (self._was_busy and not busy))
            self._was_busy = busy
            name = command[1] if command else (LOADS_COMMAND if sample else None)
            control = Control(tuple(adds), abort_pairs, step=busy and not (self._only_compiling and not adds),
                              stop=stop, command=name, command_arg=command[2] if command else None)
            start = time.monotonic()
            replies = self.stepper.lead(control)
            compiling = sum(r.compiling for r in replies)
            self._only_compiling = compiling > 0 and sum(r.running + r.waiting for r in replies) == compiling
            end = time.monotonic()
            round_s = end - start if control.step else None
            idle_s = end - mark - (round_s or 0.0)
            mark = end
            report = self._report(replies, sample or name == LOADS_COMMAND, round_s, idle_s)
            out: list[tuple[str, object]] = [("step", report)]
            if command is not None:
                out.append(("command", (command[0], [r.result for r in replies])))
            self.conn.send(out)
            if stop:
                self.conn.send([("stopped", None)])
                return
            self._later = commands[1:]

    def _take(self) -> list[tuple[str, object]]:
        """The items that arrived (waiting up to ``idle_round_s`` for the first when nothing is open, up to
        ``COMPILE_POLL_S`` when only grammars compile)."""
        items: list[tuple[str, object]] = [("command", c) for c in self._later]
        self._later = []
        if items:
            wait = 0.0
        elif self._only_compiling:
            wait = COMPILE_POLL_S
        else:
            wait = 0.0 if self._rank_of else self.idle_round_s
        while self.conn.poll(wait):
            items += self.conn.recv()
            wait = 0.0
        return items

    def _assign(self, req: NewRequest) -> tuple[int, NewRequest]:
        rank = min(range(len(self._rank_load)), key=lambda r: (self._rank_load[r], r))
        self._rank_of[req.request_id] = rank
        self._rank_load[rank] += 1
        return rank, req

    def _report(self, replies: list[RankReply], loads_sampled: bool, round_s: float | None,
                idle_s: float) -> StepReport:
        updates = []
        for reply in replies:
            for up in reply.updates:
                if up.finished and up.request_id in self._rank_of:
                    self._rank_load[self._rank_of.pop(up.request_id)] -= 1
                updates.append(up)
        lead, s = replies[0], self._sampler
        per_step = None
        if lead.steps > s.steps:
            per_step = {k: (n - s.calls.get(k, 0)) / (lead.steps - s.steps) for k, n in lead.collectives.items()}
        s.steps, s.calls = lead.steps, dict(lead.collectives)  # a round without a step: its calls skipped
        balance = self._balancedness(replies) if loads_sampled and self._ep else None
        return StepReport(updates, sum(r.running for r in replies), sum(r.waiting for r in replies),
                          sum(r.kv_free for r in replies), sum(r.kv_capacity for r in replies),
                          sum(r.preemptions for r in replies), per_step, balance,
                          tuple(sum(r.spec[i] for r in replies) for i in range(3)), lead.engine_steps,
                          lead.step_tokens, round_s, idle_s,
                          (sum(r.prefix_cache[0] for r in replies), sum(r.prefix_cache[1] for r in replies)),
                          lead.rebalances)

    def _balancedness(self, replies: list[RankReply]) -> list[float] | None:
        """Per layer, the balancedness of the tokens routed since the last sample (``None``: none routed)."""
        from epmoe.balance import layer_balancedness

        s = self._sampler
        s.loads_time = time.monotonic()
        total = torch.tensor([r.result for r in replies], dtype=torch.int64).sum(0)
        delta = total if s.loads is None else total - s.loads
        s.loads = total
        if not int(delta.sum()):
            return None
        return layer_balancedness(delta, self.stepper.engine.ep_model.placement).tolist()


def _ignore_signals() -> None:
    """A rank follows the HTTP process: Ctrl-C (to the whole process group) and SIGTERM are its to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def check_kv_holds_context(context: int, blocks: int, block_size: int, cfg: ServeConfig) -> None:
    """Refuse a KV pool that cannot hold one sequence of the whole context, as vLLM refuses to start then (a server
    would otherwise start and answer 400 to every request that long). ``epmoe serve`` calls it before any rank starts
    where ``--num-kv-blocks`` gives the pool, and each rank with the pool its engine made. ``epmoe run`` does not: its
    requests are known up front and each is checked against the pool.

    Args:
        context: the longest sequence, tokens (the engine's ``max_model_len``).
        blocks: the pool's blocks besides the padding block.
        block_size: tokens a block.
        cfg: the server's options (which flags set the context and the pool).

    Raises:
        ValueError: the context is larger than the pool's tokens (``blocks * block_size``); the message names both
            and the flags that change them.
    """
    if context <= blocks * block_size:
        return
    need = -(-context // block_size) + 1  # blocks of the full context, plus the padding block
    source = "--max-model-len" if cfg.max_model_len is not None else "the model's context; --max-model-len not given"
    if cfg.num_kv_blocks is not None:
        fix = f"increasing --num-kv-blocks (now {cfg.num_kv_blocks}) to at least {need}"
    elif cfg.device == "cuda":
        fix = f"increasing --mem-fraction-static (now {cfg.mem_fraction_static}), setting --num-kv-blocks {need}"
    else:
        fix = f"setting --num-kv-blocks {need}"
    raise ValueError(f"the model's max seq len ({context} tokens, {source}) is larger than the maximum number of "
                     f"tokens that can be stored in the KV cache ({blocks * block_size}: {blocks} blocks of "
                     f"{block_size} besides the padding block); try {fix} or decreasing --max-model-len")


def start_rank(info: RankInfo, cfg: ServeConfig, model_dir: str) -> RankStepper:
    """Join the EP group (and the gloo control group), load this rank's engine.

    Raises:
        ValueError: a bad option or checkpoint, or a KV pool smaller than the context (``check_kv_holds_context``).
    """
    group = init_group(info, cfg.device) if info.world_size > 1 else None
    control = dist.new_group(backend="gloo") if group is not None else None
    engine = Engine(cfg.engine_config(model_dir), Comm(group))
    kv = engine.kv_report()
    check_kv_holds_context(engine.max_model_len, kv["blocks"], kv["block_size"], cfg)
    return RankStepper(engine, control)


def follow(info: RankInfo, cfg: ServeConfig, model_dir: str) -> None:
    """Rank ``1..N-1``: load, follow rank 0's rounds until it says stop."""
    start_rank(info, cfg, model_dir).follow()
    dist.destroy_process_group()


def follower_process(info: RankInfo, cfg: ServeConfig, model_dir: str) -> None:
    """The body of a follower rank's process (``SpawnedRanks`` reports its first error, named by rank): it
    ignores SIGINT/SIGTERM (the server drains and stops it) and follows rank 0's rounds."""
    _ignore_signals()
    follow(info, cfg, model_dir)


# errors whose message names the bad input (a checkpoint, config.json or option the loader refuses): reported in
# one line by the HTTP process, without a traceback
_NAMED_ERRORS = (ValueError, KeyError, FileNotFoundError)


def core_process(info: RankInfo, cfg: ServeConfig, model_dir: str, conn: Connection) -> None:
    """The body of rank 0's process: the ``EngineCore``, talking to the HTTP process over ``conn``.

    A failure is sent to the HTTP process as ``("failed", RankError)``; the process then exits with code 1 at
    once (a collective with a dead rank may never return).
    """
    die_with_parent(signal.SIGKILL)
    _ignore_signals()
    set_rank_threads(info.world_size)
    try:
        EngineCore(start_rank(info, cfg, model_dir), conn).run()
    except BaseException as exc:  # a rank gone, a collective error, a bad checkpoint
        try:
            conn.send([("failed", RankError.of(info.rank, exc))])
        except OSError:
            pass
        if not isinstance(exc, _NAMED_ERRORS):  # the HTTP process logs the message; a traceback for the unexpected
            traceback.print_exc()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
