"""Spawned ranks: stopping their parent with a signal takes them down too (no orphans), close() releases them, and
every rank's error comes back named by rank."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from epmoe.runtime.launch import spawn

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"),
]
REPO = Path(__file__).resolve().parents[2]

PARENT = """
import time
from epmoe.runtime.launch import spawn

def rank_main(info):
    time.sleep(120)

if __name__ == "__main__":
    spawn(rank_main, 2)
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                cmd = (entry / "cmdline").read_bytes()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_spawned_ranks_exit_when_the_parent_is_terminated(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(0.2)
            ranks = _children(parent.pid)
        assert len(ranks) == 2, "the two ranks did not start"
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(r) for r in ranks):
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks), "a rank outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


CLOSE = """
import os, sys, time
from epmoe.runtime.launch import SpawnedRanks

def rank_main(info):
    if info.rank == 1:
        raise ValueError("refused")
    time.sleep(120)

if __name__ == "__main__":
    ranks = SpawnedRanks(rank_main, 3, ranks=range(1, 3))
    ranks.start()
    while 1 not in ranks.errors:
        ranks.poll()
        time.sleep(0.05)
    ranks.close()
    print(*(p.exitcode for p in ranks.procs.values()), flush=True)
    os._exit(0)  # as a server's fatal exit: no finalizers run
"""


def test_close_joins_every_rank_and_leaks_no_semaphore(tmp_path):
    # the report queue's locks are named semaphores: without close() the resource tracker warns about 2 leaked
    # ones when the parent ends by os._exit; close() kills the sleeping rank and joins both
    script = tmp_path / "close.py"
    script.write_text(CLOSE)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["1", "-9"], done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr


def _fail_on_rank_1(info, how: str):
    """Rank 1 fails as ``how`` says while rank 0 waits for it in a collective; rank 2 (if any) just waits."""
    import torch
    import torch.distributed as dist

    from epmoe.runtime.launch import init_group

    group = init_group(info, "cpu", timeout_s=60)
    if info.rank == 1:
        if how == "keyerror":
            raise KeyError("checkpoint /x has no tensor 'model.layers.1.mlp.experts.9.up_proj.weight'")
        os.kill(os.getpid(), signal.SIGKILL)
    if info.rank == 2:
        time.sleep(120)
    dist.all_reduce(torch.ones(2), group=group)


def test_every_rank_error_is_reported_by_rank_with_the_cause_first():
    from epmoe.runtime.launch import EXIT_BAD_INPUT, RankFailure

    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        spawn(_fail_on_rank_1, 3, ("keyerror",))
    assert time.monotonic() - start < 60
    failure = caught.value
    lines = str(failure).splitlines()
    assert lines[0] == ("rank 1 failed: KeyError: checkpoint /x has no tensor "
                        "'model.layers.1.mlp.experts.9.up_proj.weight'")
    assert lines[1].startswith("rank 0 stopped: a peer went away during a collective (RuntimeError: ")
    assert re.search("Connection (closed|reset) by peer", lines[1])
    assert lines[2] == "rank 2 was stopped after rank 1 failed"  # it was sleeping, not in the collective
    assert [e.rank for e in failure.errors] == [1, 0, 2]
    assert failure.exit_code == EXIT_BAD_INPUT


def _fail_alike(info, bad_rank_2):
    """Every rank raises the same bad-input error (a bad flag is seen by all), rank 2 its own if asked; all at
    once, after a barrier (a rank still starting when another fails would be stopped, not fail)."""
    import torch.distributed as dist

    from epmoe.runtime.launch import init_group

    dist.barrier(group=init_group(info, "cpu", timeout_s=60))
    if bad_rank_2 and info.rank == 2:
        raise ValueError("checkpoint /y is damaged")
    raise ValueError("--prompt-file 'p.txt' does not exist")


def test_ranks_that_raise_the_same_error_share_one_line():  # the message was printed once per rank
    from epmoe.runtime.launch import EXIT_BAD_INPUT, RankFailure

    with pytest.raises(RankFailure) as caught:
        spawn(_fail_alike, 2, (False,))
    assert str(caught.value) == "ranks 0 and 1 failed: ValueError: --prompt-file 'p.txt' does not exist"
    assert caught.value.exit_code == EXIT_BAD_INPUT and sorted(e.rank for e in caught.value.errors) == [0, 1]
    with pytest.raises(RankFailure) as caught:
        spawn(_fail_alike, 3, (True,))
    assert sorted(str(caught.value).splitlines()) == [
        "rank 2 failed: ValueError: checkpoint /y is damaged",
        "ranks 0 and 1 failed: ValueError: --prompt-file 'p.txt' does not exist"]


def test_a_rank_killed_by_a_signal_is_named_with_the_signal():
    from epmoe.runtime.launch import EXIT_RANK_KILLED, RankFailure

    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        spawn(_fail_on_rank_1, 2, ("sigkill",))
    assert time.monotonic() - start < 60
    lines = str(caught.value).splitlines()
    assert lines[0] == "rank 1 was killed by SIGKILL (signal 9)"
    assert lines[1].startswith("rank 0 stopped: a peer went away during a collective")
    assert caught.value.exit_code == EXIT_RANK_KILLED == 4


def _fail_on_rank_0_while_rank_1_joins_a_group(info):
    """Rank 0 fails while rank 1 waits for it at the rendezvous store, making a new group."""
    import torch.distributed as dist

    from epmoe.runtime.launch import init_group

    init_group(info, "cpu", timeout_s=60)
    if info.rank == 0:
        raise ValueError("checkpoint /x: no tensor 'model.layers.1.mlp.experts.0.up_proj.weight'")
    dist.new_group(backend="gloo")


def test_the_failed_rank_is_reported_once_and_its_peers_get_no_lost_store_error(capfd):
    """The launcher serves the rendezvous store: rank 0 failing takes no store with it, so rank 1, waiting there,
    does not fail on the lost store (a ``DistNetworkError``, a C++ stack trace on stderr); it is stopped."""
    from epmoe.runtime.launch import EXIT_BAD_INPUT, RankFailure

    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        spawn(_fail_on_rank_0_while_rank_1_joins_a_group, 2)
    assert time.monotonic() - start < 60
    assert str(caught.value).splitlines() == [
        "rank 0 failed: ValueError: checkpoint /x: no tensor 'model.layers.1.mlp.experts.0.up_proj.weight'",
        "rank 1 was stopped after rank 0 failed"]
    assert caught.value.exit_code == EXIT_BAD_INPUT
    err = capfd.readouterr().err  # the ranks' stderr too: they write to this process's descriptor
    assert "DistNetworkError" not in err and "TCPStore" not in err and "frame #" not in err, err


def _threads(info):
    import torch

    return torch.get_num_threads()


def test_rank_threads_follow_omp_num_threads_or_share_the_cores(monkeypatch):
    import torch

    from epmoe.runtime.launch import set_rank_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert set_rank_threads(2) == 3 and torch.get_num_threads() == 3
        cores = os.cpu_count() or 1
        for value in ("", "0", "two"):  # unset, zero or not a number: the cores shared by the ranks
            monkeypatch.setenv("OMP_NUM_THREADS", value)
            assert set_rank_threads(2) == max(1, cores // 2) == torch.get_num_threads(), value
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_rank_threads(4 * cores) == 1
    finally:
        torch.set_num_threads(before)
    # spawned ranks set theirs before running the function
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert spawn(_threads, 2) == [1, 1]


def test_check_gpus_names_the_ranks_a_machine_cannot_hold(monkeypatch):
    """--ep 2 on a one-GPU machine failed inside rank 1 with "CUDA error: invalid device ordinal" (seen on an H100);
    it is named before any rank starts, with the GPUs visible."""
    from epmoe.runtime.launch import RankInfo, check_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    check_gpus("cuda", 1)
    check_gpus("cpu", 8)  # gloo ranks need no GPU
    with pytest.raises(ValueError, match=r"^--ep 2 on --device cuda starts one rank a GPU, and this machine has 1 "
                                         r"visible GPU: pass --ep 1 or less$"):
        check_gpus("cuda", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match=r"has 0 visible GPUs \(CUDA_VISIBLE_DEVICES=''\)"):
        check_gpus("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    check_gpus("cuda", 16, RankInfo(9, 16, 3, "tcp://h:1"))  # under torchrun the group may span machines
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match=r"^this rank's LOCAL_RANK 4 names no GPU: the machine has 4 visible GPUs "
                                         r"\(CUDA_VISIBLE_DEVICES=''\); start at most 4 ranks on it$"):
        check_gpus("cuda", 16, RankInfo(12, 16, 4, "tcp://h:1"))
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match=r"^this rank's LOCAL_RANK -1 names no GPU"):  # it reached the rank before
        check_gpus("cuda", 16, RankInfo(12, 16, -1, "tcp://h:1"))
    # without LOCAL_RANK, torchrun_rank_info takes RANK for it: the missing variable is the cause, not the count
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match=r"^LOCAL_RANK is not set, so this rank takes GPU 12 \(its RANK\), and the "
                                         r"machine has 4 visible GPUs"):
        check_gpus("cuda", 16, RankInfo(12, 16, 12, "tcp://h:1"))
