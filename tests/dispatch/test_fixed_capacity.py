"""The fixed-capacity dispatcher equals the local path on CPU with gloo in several processes."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epmoe.comm import Comm
from epmoe.dispatch import make_dispatcher
from epmoe.dispatch.fixed_capacity import CapacityExceededError, FixedCapacityDispatcher
from epmoe.experts import Activation, ExpertWeights, reference_experts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(seed: int, g: int, t: int):
    """Full weights of all ``P`` slots and ``G`` ranks' tokens, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    p, d, f, k = 4 * g, 32, 16, 3
    w = ExpertWeights(torch.randn(p, 2 * f, d, generator=gen) / 6, torch.randn(p, d, f, generator=gen) / 4)
    x = torch.randn(g, t, d, generator=gen)
    slots = torch.randint(0, p, (g, t, k), generator=gen)
    slots[:, :, -1] = torch.where(torch.rand(g, t, generator=gen) < 0.3, -1, slots[:, :, -1])
    tw = torch.rand(g, t, k, generator=gen)
    return w, x, slots, tw


def _slice(w: ExpertWeights, rank: int, s: int) -> ExpertWeights:
    return ExpertWeights(w.w13[rank * s:(rank + 1) * s], w.w2[rank * s:(rank + 1) * s])


def _worker(rank: int, g: int, port: int, capacity: int, t: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=g)
    try:
        w, x, slots, tw = _problem(0, g, t)
        s = w.num_slots // g
        disp = make_dispatcher("fixed_capacity", Comm(dist.group.WORLD), s, capacity=capacity)
        h = disp.dispatch(x[rank], slots[rank], tw[rank])
        y = reference_experts(h.recv_x, h.recv_slots, h.recv_weights, _slice(w, rank, s), Activation())
        try:
            out = disp.combine(y, h)
        except CapacityExceededError as err:
            results[rank] = ("overflow", str(err))
            return
        local = reference_experts(x[rank], slots[rank], tw[rank], w, Activation())
        results[rank] = ("ok", ((out - local).norm() / local.norm()).item(), tuple(h.recv_x.shape))
    finally:
        dist.destroy_process_group()


def _run(g: int, capacity: int, t: int) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(g, _free_port(), capacity, t, results), nprocs=g, join=True)
    return dict(results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("g", [2, 4])
def test_fixed_capacity_equals_local(g):
    t = 9
    results = _run(g, capacity=t, t=t)
    assert sorted(results) == list(range(g))
    for status, err, shape in results.values():
        assert status == "ok"
        assert err < 1e-5
        assert shape == (g * t, 32)


@pytest.mark.multiprocess
def test_overflow_detected_on_every_rank():
    results = _run(2, capacity=2, t=9)
    assert sorted(results) == [0, 1]
    for status, msg in results.values():
        assert status == "overflow"
        assert "capacity is 2" in msg and "tokens to one EP rank" in msg


def test_single_rank_equals_local_and_pads():
    w, x, slots, tw = _problem(1, 1, 7)
    disp = make_dispatcher("fixed_capacity", Comm(None), w.num_slots, capacity=10)
    h = disp.dispatch(x[0], slots[0], tw[0])
    assert h.recv_x.shape == (10, 32)
    assert bool((h.recv_slots[7:] == -1).all())
    y = reference_experts(h.recv_x, h.recv_slots, h.recv_weights, w, Activation())
    out = disp.combine(y, h)
    local = reference_experts(x[0], slots[0], tw[0], w, Activation())
    torch.testing.assert_close(out, local, rtol=1e-5, atol=1e-6)


def test_single_rank_overflow_message_names_capacity_and_count():
    w, x, slots, tw = _problem(2, 1, 7)
    disp = FixedCapacityDispatcher(Comm(None), w.num_slots, capacity=3)
    h = disp.dispatch(x[0], slots[0], tw[0])
    y = reference_experts(h.recv_x, h.recv_slots, h.recv_weights, w, Activation())
    with pytest.raises(CapacityExceededError, match="routed 7 tokens to one EP rank but the capacity is 3"):
        disp.combine(y, h)


def test_bad_arguments():
    for cap in (0, 2.5, True, "4"):
        with pytest.raises(ValueError, match=f"capacity must be a positive integer, got {cap!r}"):
            FixedCapacityDispatcher(Comm(None), 4, capacity=cap)
    with pytest.raises(ValueError, match="slots_per_rank must be a positive integer, got 0"):
        FixedCapacityDispatcher(Comm(None), 0, capacity=2)
    with pytest.raises(KeyError, match="fixed_capacity"):
        make_dispatcher("nope", Comm(None), 4)
    with pytest.raises(TypeError, match="dispatcher 'all_to_all' takes no options, got capacity"):
        make_dispatcher("all_to_all", Comm(None), 4, capacity=4)


def test_handles_and_outputs_checked():
    x, slots, tw = torch.randn(3, 8), torch.tensor([[0, 1], [2, -1], [3, 0]]), torch.rand(3, 2)
    small, big = FixedCapacityDispatcher(Comm(None), 4, capacity=4), FixedCapacityDispatcher(Comm(None), 4, capacity=8)
    h = small.dispatch(x, slots, tw)
    with pytest.raises(TypeError, match="needs the handle its dispatch returned"):
        big.combine(torch.zeros(8, 8), h)  # a handle of another capacity
    with pytest.raises(ValueError, match=r"y must be \[received rows, D\] = \(4, 8\), got \(4, 9\)"):
        small.combine(torch.zeros(4, 9), h)
    local = make_dispatcher("local", Comm(None), 4)
    with pytest.raises(TypeError, match="LocalDispatcher.combine needs the handle its dispatch returned"):
        local.combine(torch.zeros(4, 8), h)
    a2a = make_dispatcher("all_to_all", Comm(None), 4)
    ha = a2a.dispatch(x, slots, tw)
    with pytest.raises(ValueError, match=r"y must be \[received rows, D\] = \(3, 8\), got \(5, 8\)"):
        a2a.combine(torch.zeros(5, 8), ha)


@pytest.mark.parametrize("name", ["local", "all_to_all", "fixed_capacity"])
@pytest.mark.parametrize("bad", [4, 9, -2])
def test_out_of_range_slots_refused_naming_range_and_ids(name, bad):
    x, tw = torch.randn(3, 8), torch.rand(3, 2)
    slots = torch.tensor([[0, 1], [2, bad], [3, 0]])
    disp = make_dispatcher(name, Comm(None), 4, **({"capacity": 4} if name == "fixed_capacity" else {}))
    lo, hi = min(bad, 0), max(bad, 3)
    with pytest.raises(ValueError, match=rf"in \[-1, 4\) \(-1 = none\).*{lo} to {hi}"):
        h = disp.dispatch(x, slots, tw)
        disp.combine(torch.zeros(h.recv_x.shape), h)


@pytest.mark.parametrize("name,capacity", [("all_to_all", None), ("fixed_capacity", 2), ("fixed_capacity", 3)])
def test_rows_of_other_dtypes_refused(name, capacity):
    """Also on one rank with ``T <= C`` (capacity 3), where the fixed-capacity path packs nothing: rows
    that one rank accepts must work on any group size."""
    disp = make_dispatcher(name, Comm(None), 4, **({"capacity": capacity} if capacity else {}))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 .* got torch.float64"):
        disp.dispatch(torch.randn(3, 8, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2))
    h = disp.dispatch(torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2))
    with pytest.raises(TypeError, match=r"y must be a float tensor \(the expert outputs\), got torch.int64"):
        disp.combine(torch.ones(h.recv_x.shape, dtype=torch.int64), h)


def _bad_slot_worker(rank: int, g: int, port: int, name: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=g)
    try:
        disp = make_dispatcher(name, Comm(dist.group.WORLD), 4, **({"capacity": 3} if name == "fixed_capacity" else {}))
        slots = torch.tensor([[0, 5], [7, 1], [2, 3]])
        if rank == 1:
            slots[1, 1] = 8 * g  # outside [-1, P)
        try:
            h = disp.dispatch(torch.randn(3, 8), slots, torch.rand(3, 2))
            disp.combine(torch.zeros(h.recv_x.shape), h)
            results[rank] = "ok"
        except ValueError as err:
            results[rank] = str(err)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["all_to_all", "fixed_capacity"])
def test_out_of_range_slot_on_one_rank(name):
    results = mp.Manager().dict()
    mp.spawn(_bad_slot_worker, args=(2, _free_port(), name, results), nprocs=2, join=True)
    if name == "all_to_all":  # the flag travels with the counts: every rank refuses, before the rows move
        for rank in (0, 1):
            assert "EP rank(s) [1] sent ids outside it" in results[rank]
        assert "here ids from 0 to 16" in results[1] and "here ids" not in results[0]
    else:  # checked with the capacity after the layer's collectives: flagged in every row rank 1 sent
        assert "another EP rank sent ids outside it" in results[0]
        assert "in [-1, 8) (-1 = none), got ids from 0 to 16" in results[1]


def test_overflow_check_has_no_opt_out():
    """An unchecked overflow gives tokens zeros: the old ``check_overflow=False`` is gone, from the registry too."""
    w, x, slots, tw = _problem(2, 1, 7)
    with pytest.raises(TypeError, match="check_overflow"):
        FixedCapacityDispatcher(Comm(None), w.num_slots, capacity=3, check_overflow=False)
    with pytest.raises(TypeError, match="check_overflow"):
        make_dispatcher("fixed_capacity", Comm(None), w.num_slots, capacity=3, check_overflow=False)
