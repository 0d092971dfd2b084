"""Process launch: spawn ``N`` local ranks, or join the group ``torchrun`` set up.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK`` in the
environment) the current process is one rank and the group may span several machines. Otherwise
``spawn`` starts ``N`` processes on this machine, and the launching process serves their rendezvous store (as
torchrun's agent serves its workers'), so that a rank that fails takes no store with it: its peers are stopped
by the launcher instead of each failing on the lost store (a ``DistNetworkError``, with a C++ stack trace on
stderr). Either way the worker gets its rank facts explicitly; nothing is read from a global later.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    """Where one rank stands.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank on this machine (selects the CUDA device).
        init_method: ``tcp://host:port`` rendezvous address.
        launcher_store: the rendezvous store at ``init_method`` is served by the process that launched the ranks
            (``SpawnedRanks``), every rank a client; else ``tcp://`` finds it: rank 0 serves it, or under torchrun
            its agent.
    """

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    launcher_store: bool = False


def under_torchrun() -> bool:
    """True when the environment ``torchrun`` sets is present."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_rank_info() -> RankInfo:
    """This process's ``RankInfo`` from the torchrun environment.

    Raises:
        ValueError: a variable is missing or not an integer (named).
    """
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(f"torchrun environment variables missing: {missing}")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise ValueError(f"torchrun environment variable is not an integer: {exc}") from None
    return RankInfo(rank, world, local, f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")


def check_gpus(device: str, size: int, info: RankInfo | None = None) -> None:
    """That every rank this machine starts on ``device`` ``cuda`` has a GPU of its own, checked before any rank starts
    (``epmoe run`` and ``epmoe serve`` call it; a rank without one failed inside with "invalid device ordinal").

    Args:
        device: ``cpu`` (nothing to check) or ``cuda``.
        size: the EP size, ``--ep``: spawned ranks, one a GPU of this machine.
        info: under torchrun, this rank's ``RankInfo``: its ``local_rank`` must name a visible GPU (the group may
            span machines); ``None`` when this process spawns the ranks.

    Raises:
        ValueError: fewer visible GPUs than the ranks need (the count, and ``CUDA_VISIBLE_DEVICES`` when set).
    """
    if device != "cuda":
        return
    gpus = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"{gpus} visible GPU{'' if gpus == 1 else 's'}" + (
        f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    if info is None and size > gpus:
        raise ValueError(f"--ep {size} on --device cuda starts one rank a GPU, and this machine has {shown}: "
                         f"pass --ep {gpus} or less")
    if info is not None and not 0 <= info.local_rank < gpus:
        if "LOCAL_RANK" not in os.environ:  # torchrun_rank_info took RANK for it
            raise ValueError(f"LOCAL_RANK is not set, so this rank takes GPU {info.local_rank} (its RANK), and the "
                             f"machine has {shown}: set LOCAL_RANK to the rank's index on its machine (torchrun "
                             f"does)")
        raise ValueError(f"this rank's LOCAL_RANK {info.local_rank} names no GPU: the machine has {shown}; "
                         f"start at most {gpus} ranks on it")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_default_group(info: RankInfo, backend: str, timeout: timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` for this rank at ``info.init_method``: a client of the launcher's
    store when ``info.launcher_store``. ``timeout``: of the collectives and the store's waits (default: torch's)."""
    limit = {} if timeout is None else {"timeout": timeout}
    if info.launcher_store:
        url = urlparse(info.init_method)
        store = dist.TCPStore(url.hostname, url.port, info.world_size, is_master=False, **limit)
        dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, **limit)
    else:
        dist.init_process_group(backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size,
                                **limit)


def init_group(info: RankInfo, device: str, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Initialise ``torch.distributed`` for this rank and return the EP group over all ranks.

    Backend: ``gloo`` on CPU, ``nccl`` on CUDA (and the rank's CUDA device is selected).
    """
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    init_default_group(info, backend, timedelta(seconds=timeout_s))
    return dist.new_group(list(range(info.world_size)))


def set_rank_threads(world_size: int) -> int:
    """Set and return the threads torch's CPU ops use in this rank process: ``OMP_NUM_THREADS`` when it is set to a
    positive integer (the variable torch itself reads at start), else the machine's cores over ``world_size`` (at
    least one), so that ranks sharing a machine do not each start one thread per core."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(env) if env.isdigit() and int(env) > 0 else max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    return threads


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``sig`` when its parent exits (Linux ``PR_SET_PDEATHSIG``).

    Spawned ranks call it first, so stopping ``epmoe run`` or ``epmoe calibrate`` with a signal leaves no
    ranks behind (a rank that ignores SIGTERM asks for SIGKILL). Elsewhere (or without ``prctl``) it does
    nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was gone before the request took effect
        os._exit(1)


# exit codes of ``epmoe`` when something failed (0: success, 1: output differs from the reference)
EXIT_BAD_INPUT = 2  # a bad flag, file or checkpoint, on any rank (ValueError, KeyError, TypeError, OSError)
EXIT_RANK_ERROR = 3  # a rank raised another error while running (a failed collective, out of memory, a bug)
EXIT_RANK_KILLED = 4  # a rank was killed by a signal, or exited without saying why

_BAD_INPUT = (ValueError, KeyError, TypeError, OSError)
# what gloo and NCCL say when the process at the other end of a collective went away
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "NCCL communicator was aborted", "Socket Timeout")
GRACE_S = 1.0  # after a rank fails, how long the others get to report their own first error before they are stopped


@dataclass(frozen=True)
class RankError:
    """How one rank ended without a result.

    Attributes:
        rank: the rank.
        kind: ``error`` (it raised ``message``), ``peer_lost`` (it raised because a peer went away during a
            collective), ``signal`` (killed by signal number ``code``), ``exit`` (exited with code ``code`` without
            reporting anything), ``stopped`` (stopped by the launcher after another rank failed).
        message: one line: ``Type: text`` of the exception, or what happened to the process.
        bad_input: the error is of a kind bad input raises (``ValueError``, ``KeyError``, ``TypeError``, ``OSError``).
        code: the signal number or exit code (0 for raised errors).
        trace: the rank's traceback (empty unless it raised).
    """

    rank: int
    kind: Literal["error", "peer_lost", "signal", "exit", "stopped"]
    message: str
    bad_input: bool = False
    code: int = 0
    trace: str = ""

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankError:
        """The error of ``exc`` raised on ``rank`` (a ``KeyError``'s message without the quotes ``str()`` adds)."""
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        message = f"{type(exc).__name__}: {text}"
        kind = "peer_lost" if any(s in message for s in _PEER_LOST) else "error"
        return cls(rank, kind, message, isinstance(exc, _BAD_INPUT), 0, traceback.format_exc())

    @classmethod
    def of_exit(cls, rank: int, exitcode: int) -> RankError:
        """A rank process that ended with ``exitcode`` (negative: the signal that killed it) without reporting."""
        if exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
            return cls(rank, "signal", f"killed by {name} (signal {-exitcode})", code=-exitcode)
        return cls(rank, "exit", f"exited with code {exitcode} without reporting an error", code=exitcode)

    def line(self) -> str:
        """One line naming the rank: ``rank 1 failed: KeyError: ...``, ``rank 1 was killed by SIGKILL (signal 9)``."""
        if self.kind == "signal":
            return f"rank {self.rank} was {self.message}"
        if self.kind == "exit":
            return f"rank {self.rank} {self.message}"
        if self.kind == "peer_lost":
            return f"rank {self.rank} stopped: a peer went away during a collective ({self.message})"
        if self.kind == "stopped":
            return f"rank {self.rank} {self.message}"
        return f"rank {self.rank} failed: {self.message}"


_ORDER = {"signal": 0, "error": 1, "exit": 2, "peer_lost": 3, "stopped": 4}


def _lines(errors: list[RankError]) -> list[str]:
    """One line per error, in order, but one for all the ranks that raised the same error (``ranks 0 and 1 failed:
    ValueError: ...``): a bad flag or file fails every rank alike."""
    lines, done = [], set()
    for i, e in enumerate(errors):
        if i in done:
            continue
        same = [j for j in range(i, len(errors)) if errors[j].kind == "error" == e.kind
                and errors[j].message == e.message]
        done.update(same)
        if len(same) < 2:
            lines.append(e.line())
            continue
        ranks = [str(r) for r in sorted(errors[j].rank for j in same)]
        lines.append(f"ranks {', '.join(ranks[:-1])} and {ranks[-1]} failed: {e.message}")
    return lines


class RankFailure(RuntimeError):
    """One or more ranks failed; every rank's first error, the cause first.

    The cause is a rank killed by a signal if there is one, else the first error reported that is not a
    consequence of a peer going away; the other ranks' errors follow, one line each (ranks that raised the same
    error share one line).

    Attributes:
        errors: the ``RankError`` of every rank that ended without a result, the cause first.
        exit_code: ``EXIT_RANK_KILLED`` when the cause is a signal or a silent exit, ``EXIT_BAD_INPUT`` when it
            is a bad-input error, else ``EXIT_RANK_ERROR``.
    """

    def __init__(self, errors: list[RankError]) -> None:
        ordered = sorted(errors, key=lambda e: _ORDER[e.kind])  # stable: report order kept within a kind
        self.errors = tuple(ordered)
        cause = ordered[0]
        if cause.kind in ("signal", "exit"):
            self.exit_code = EXIT_RANK_KILLED
        else:
            self.exit_code = EXIT_BAD_INPUT if cause.bad_input else EXIT_RANK_ERROR
        super().__init__("\n".join(_lines(ordered)))
        if cause.trace:
            self.add_note(cause.trace)

    @property
    def cause(self) -> RankError:
        """The error reported first (the one the others follow from)."""
        return self.errors[0]


def _run_rank(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue) -> None:
    """A spawned rank: run ``fn(RankInfo, *args)`` and put ``(rank, True, result)`` or ``(rank, False, RankError)``
    on ``queue``."""
    die_with_parent()
    info = RankInfo(rank, world_size, rank, f"tcp://127.0.0.1:{port}", launcher_store=True)
    set_rank_threads(world_size)
    try:
        # plain pickle copies tensors by value: torch's shared-memory handles would die with this process
        queue.put((rank, True, pickle.dumps(fn(info, *args))))
    except BaseException as exc:  # the launcher reports it, named by rank
        queue.put((rank, False, RankError.of(rank, exc)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


class SpawnedRanks:
    """Ranks started as local processes (``spawn``), watched for results and failures.

    Each rank runs ``fn(RankInfo, *args)``; its return value (picklable) or its first error comes back to this
    process. A rank that dies without a word (a signal, ``os._exit``) is seen by its exit code. This process serves
    the ranks' rendezvous store on 127.0.0.1 at ``port`` until ``close``; a rank started elsewhere (the server's
    rank 0) joins it with ``RankInfo(..., f"tcp://127.0.0.1:{port}", launcher_store=True)``.

    Args:
        fn: an importable (module-level) function.
        world_size: ranks in the group.
        args: extra arguments of ``fn``.
        ranks: the ranks to start here (default all; the server runs rank 0 in its own process).

    Raises:
        ValueError: ``world_size`` is not positive.
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple = (), ranks: range | None = None) -> None:
        if world_size <= 0:
            raise ValueError(f"world_size must be positive, got {world_size}")
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self._store.port
        self._queue = ctx.SimpleQueue()
        self.procs = {r: ctx.Process(target=_run_rank, args=(r, world_size, self.port, fn, args, self._queue),
                                     name=f"epmoe-rank{r}", daemon=False)
                      for r in (range(world_size) if ranks is None else ranks)}
        self.results: dict[int, Any] = {}
        self.errors: dict[int, RankError] = {}
        self._failed_at: float | None = None

    def start(self) -> None:
        """Start every rank process."""
        for p in self.procs.values():
            p.start()

    def _drain(self) -> None:
        while self._queue is not None and not self._queue.empty():
            rank, ok, value = self._queue.get()
            if ok:
                self.results[rank] = pickle.loads(value)
            else:
                self.errors.setdefault(rank, value)

    def poll(self) -> None:
        """Collect what the ranks reported, and the exit codes of ranks that ended without reporting."""
        self._drain()
        for rank, p in self.procs.items():
            if rank in self.results or rank in self.errors or p.exitcode is None:
                continue
            self._drain()  # a report put just before the process ended is in the pipe now
            if rank not in self.results and rank not in self.errors:
                self.errors[rank] = RankError.of_exit(rank, p.exitcode)
        if self.errors and self._failed_at is None:
            self._failed_at = time.monotonic()

    @property
    def done(self) -> bool:
        """Every rank started here returned a result or failed."""
        return len(self.results) + len(self.errors) == len(self.procs)

    def failure(self, grace_s: float = GRACE_S) -> RankFailure | None:
        """The failure to report, once a rank failed and the others reported or had ``grace_s`` seconds to; the
        ranks still running then are stopped (and named as such). ``None`` while nothing failed, or during the
        grace period."""
        self.poll()
        if not self.errors:
            return None
        if not self.done and time.monotonic() - self._failed_at < grace_s:
            return None
        self.stop()
        return RankFailure(list(self.errors.values()))

    def stop(self) -> None:
        """Stop the ranks still running (SIGTERM, then SIGKILL after 5 s); each is recorded as ``stopped``."""
        running = [r for r, p in self.procs.items() if p.is_alive() and r not in self.results and r not in self.errors]
        cause = min(self.errors.values(), key=lambda e: _ORDER[e.kind], default=None)
        for r in running:
            self.procs[r].terminate()
        for r in running:
            self.procs[r].join(5.0)
            if self.procs[r].is_alive():
                self.procs[r].kill()
                self.procs[r].join()
        self._drain()
        for r in running:
            why = f"after rank {cause.rank} failed" if cause is not None else "by the launcher"
            self.errors.setdefault(r, RankError(r, "stopped", f"was stopped {why}"))

    def join(self) -> None:
        """Wait for every rank process started to end."""
        for p in self.procs.values():
            if p.pid is not None:
                p.join()

    def close(self) -> None:
        """Release the ranks for good, on every way out (a result, a failure, a server's fatal exit): kill the rank
        processes still running, join them all, stop serving the rendezvous store and close the report queue. The
        queue's two locks are named POSIX semaphores, registered with multiprocessing's resource tracker, which
        reports them as leaked when this process ends without releasing them (as ``os._exit`` does); they are
        released here, with the queue's last reference. Reports not read before are dropped (``poll`` or ``failure``
        keep them). A second call does nothing.
        """
        if self._queue is None:
            return
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        self.join()
        self._store = None  # its last reference: the store's server stops
        self._queue.close()
        self._queue = None  # the locks' finalizers unlink the semaphores and tell the tracker now


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = ()) -> list[Any]:
    """Run ``fn(RankInfo, *args)`` in ``world_size`` fresh local processes and return their results.

    ``fn`` must be importable (a module-level function); its return value must be picklable. When a rank fails,
    the others get ``GRACE_S`` seconds to report their own first error (they usually fail at once, in the
    collective they shared with it), then those still running are stopped.

    Raises:
        ValueError: ``world_size`` is not positive.
        RankFailure: a rank failed: every rank's first error, named by rank, the cause first (a rank killed by a
            signal is named with the signal); the cause's traceback is attached as an exception note.
    """
    ranks = SpawnedRanks(fn, world_size, args)
    ranks.start()
    try:
        while True:
            failure = ranks.failure()
            if failure is not None:
                ranks.join()
                raise failure
            if ranks.done:
                break
            for p in ranks.procs.values():
                p.join(timeout=0.05 / world_size)
        ranks.join()
        return [ranks.results[r] for r in range(world_size)]
    finally:
        ranks.close()
