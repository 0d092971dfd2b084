"""The ranks' agreement at each step. Attention is data-parallel (a rank schedules its own requests alone) but
the experts are expert-parallel, so every rank runs every step: at the start of a step the ranks exchange a few
numbers (one ``all_gather``, over a gloo group of the same ranks: host values, so it never waits for the
device): whether any rank has work, the most rows of a step, whether some rank has a prompt chunk too long for a
graph step, the most single-token rows and the longest context."""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe.comm import Comm


def host_group(comm: Comm) -> Comm | None:
    """A gloo group of ``comm``'s ranks for the step's agreement (``None`` for one rank, or where ``comm`` is not
    the whole world): over the device group it would wait for the step in flight (a collective on the stream,
    then a copy to the host), which the overlap schedule hides."""
    if comm.size > 1 and dist.get_world_size() == comm.size:
        return Comm(dist.new_group(list(range(comm.size)), backend="gloo"), comm.stats)
    return None


def agree(local: torch.Tensor, comm: Comm, host_comm: Comm | None, device: torch.device) -> list[int]:
    """The element-wise maximum of ``local`` (int64 on the host) over the ranks: over ``host_comm`` where there
    is one, else over ``comm`` (on ``device`` where it is CUDA)."""
    if comm.size == 1:
        glob = local
    elif host_comm is not None:  # host values over gloo: never waits for the step in flight
        glob = host_comm.all_gather(local).amax(dim=0)
    else:
        dev = device if device.type == "cuda" else torch.device("cpu")
        glob = comm.all_gather(local.to(dev)).amax(dim=0).cpu()
    return glob.tolist()


def agree_max(values: list[int], comm: Comm, device: torch.device) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks of ``comm`` (one ``all_gather``; the values
    themselves on one rank), over ``comm`` itself (``agree`` without a host group)."""
    return values if comm.size == 1 else agree(torch.tensor(values, dtype=torch.int64), comm, None, device)
