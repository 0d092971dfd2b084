"""Process launch: spawn ``N`` local ranks, or join the group ``torchrun`` set up.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK`` in the
environment) the current process is one rank and the group may span several machines. Otherwise
``spawn`` starts ``N`` processes on this machine with a free local port. Either way the worker gets
its rank facts explicitly; nothing is read from a global later.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

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
    """

    rank: int
    world_size: int
    local_rank: int
    init_method: str


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(info: RankInfo, device: str, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Initialise ``torch.distributed`` for this rank and return the EP group over all ranks.

    Backend: ``gloo`` on CPU, ``nccl`` on CUDA (and the rank's CUDA device is selected).
    """
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(
        backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.new_group(list(range(info.world_size)))


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


def _spawned(local_rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue) -> None:
    die_with_parent()
    info = RankInfo(local_rank, world_size, local_rank, f"tcp://127.0.0.1:{port}")
    # the ranks share this machine's cores: without this each would start one thread per core
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        # plain pickle copies tensors by value: torch's shared-memory handles would die with this process
        queue.put((local_rank, True, pickle.dumps(fn(info, *args))))
    except BaseException as exc:  # report the failure to the parent; it raises one clear error
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        queue.put((local_rank, False, (f"{type(exc).__name__}: {message}", traceback.format_exc())))
        os._exit(1)


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = ()) -> list[Any]:
    """Run ``fn(RankInfo, *args)`` in ``world_size`` fresh local processes and return their results.

    ``fn`` must be importable (a module-level function); its return value must be picklable.

    Raises:
        ValueError: ``world_size`` is not positive.
        RuntimeError: a rank failed: the first failure reported, ``rank N failed: <error>`` (the rank's
            traceback is attached as an exception note).
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_spawned, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    while len(results) + len(errors) < world_size:
        if queue.empty() and not any(p.is_alive() for p in procs):
            break
        if queue.empty():
            for p in procs:
                p.join(timeout=0.05)
            continue
        rank, ok, value = queue.get()
        if ok:
            results[rank] = pickle.loads(value)
        else:
            errors[rank] = value
        if errors:
            break
    if errors:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join()
    if errors:
        rank = next(iter(errors))  # the first failure reported; peers may fail after it as a consequence
        message, trace = errors[rank]
        error = RuntimeError(f"rank {rank} failed: {message}")
        error.add_note(trace)
        raise error
    lost = [r for r in range(world_size) if r not in results]
    if lost:
        codes = {r: procs[r].exitcode for r in lost}
        raise RuntimeError(f"ranks {lost} exited without a result (exit codes {codes})")
    return [results[r] for r in range(world_size)]
