"""Dispatch and combine: move each token to the EP ranks holding its chosen slots and back.

``base`` holds the ``Dispatcher`` protocol, the handle base type and the shared checks; ``local`` (EP = 1,
the reference), ``all_to_all`` (exact blocks after a count exchange) and ``fixed_capacity`` (static shapes,
CUDA-graph safe) are the dispatchers, each with its own handle type; ``layout`` is the send-buffer layout
both multi-rank dispatchers share (``layout_triton``: its kernels on CUDA; ``blocks``: its two block layouts,
``FixedBlocks`` and ``ExactBlocks``). Dispatchers are built by name
through the read-only registry ``DISPATCHERS`` (``make_dispatcher``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

from epmoe.comm import Comm
from epmoe.dispatch.all_to_all import AllToAllDispatcher, AllToAllHandle
from epmoe.dispatch.base import Dispatcher, DispatchHandle
from epmoe.dispatch.fixed_capacity import CapacityExceededError, FixedCapacityDispatcher, FixedCapacityHandle
from epmoe.dispatch.local import LocalDispatcher, LocalHandle

__all__ = [
    "DISPATCHERS", "AllToAllDispatcher", "AllToAllHandle", "CapacityExceededError", "DispatchHandle", "Dispatcher",
    "FixedCapacityDispatcher", "FixedCapacityHandle", "LocalDispatcher", "LocalHandle", "make_dispatcher",
]


def _no_options(name: str, options: dict) -> None:
    if options:
        raise TypeError(f"dispatcher {name!r} takes no options, got {', '.join(sorted(options))}")


def _local(comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    _no_options("local", options)
    return LocalDispatcher(slots_per_rank * comm.size, comm)


def _all_to_all(comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    _no_options("all_to_all", options)
    return AllToAllDispatcher(comm, slots_per_rank)


def _fixed_capacity(comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    return FixedCapacityDispatcher(comm, slots_per_rank, **options)


DISPATCHERS: Mapping[str, Callable[..., Dispatcher]] = MappingProxyType({
    "local": _local,
    "all_to_all": _all_to_all,
    "fixed_capacity": _fixed_capacity,
})


def make_dispatcher(name: str, comm: Comm, slots_per_rank: int, **options) -> Dispatcher:
    """Build the dispatcher registered as ``name`` for the EP group ``comm``.

    Args:
        name: ``local`` (EP = 1 only), ``all_to_all`` or ``fixed_capacity``.
        comm: the EP group.
        slots_per_rank: ``P / G``.
        options: backend-specific options (``fixed_capacity``: ``capacity``).

    Raises:
        KeyError: unknown name (the message lists the registered ones).
        ValueError: ``local`` asked for with more than one EP rank.
    """
    if name not in DISPATCHERS:
        raise KeyError(f"unknown dispatcher {name!r}; supported: {sorted(DISPATCHERS)}")
    if name == "local" and comm.size != 1:
        raise ValueError(f"the local dispatcher serves EP size 1 only, the EP group has {comm.size} ranks")
    return DISPATCHERS[name](comm, slots_per_rank, **options)
