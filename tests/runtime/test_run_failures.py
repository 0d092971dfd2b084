"""``epmoe run`` when a rank fails: every rank's first error reaches the user, named by rank, in spawned and
torchrun launches alike; a rank killed by a signal is named with the signal and its own exit code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
MISSING = "model.layers.1.mlp.experts.9.up_proj.weight"  # expert 9: only rank 1 of 2 holds it
MISSING_RANK0 = "model.layers.1.mlp.experts.0.up_proj.weight"  # expert 0: only rank 0 of 2 holds it


@pytest.fixture(scope="module")
def kimi(tiny_checkpoints):
    return tiny_checkpoints("kimi-k2.5")


def _without(kimi: Path, name: str, broken: Path) -> Path:
    """A copy of the tiny Kimi checkpoint in ``broken`` without the tensor ``name``."""
    from safetensors.torch import load_file, save_file

    for f in kimi.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in kimi.glob("*.safetensors"):
        tensors.update(load_file(f))
    del tensors[name]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return broken


@pytest.fixture(scope="module")
def missing_rank1_tensor(kimi, tmp_path_factory):
    """The tiny Kimi checkpoint without one tensor of expert 9 of the first MoE layer."""
    return _without(kimi, MISSING, tmp_path_factory.mktemp("broken"))


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_torchrun_shows_the_error_of_the_rank_that_failed(missing_rank1_tensor):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*torchrun, "-m", "epmoe.cli", "run", "--model", str(missing_rank1_tensor),
                           "--max-new-tokens", "2", "--no-reference"],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert (f"epmoe run: error: rank 1 failed: KeyError: checkpoint is missing a tensor of logical expert 9 of "
            f"model.layers.1.mlp: checkpoint {missing_rank1_tensor} has no tensor '{MISSING}'") in out, out
    # rank 0, blocked in the process-group setup waiting for rank 1, takes torchrun's SIGTERM (143), not its SIGKILL
    # 30 s later (-9)
    assert "epmoe: terminated (SIGTERM)" in out and "SIGKILL" not in out, out
    assert re.search(r"rank +: 0 \(local_rank: 0\)\n +exitcode +: 143 ", out), out


def test_spawned_run_shows_the_failed_ranks_error_once_and_no_lost_store_error(kimi, tmp_path):
    # rank 0 fails loading while rank 1 has loaded and waits for it: rank 1 is stopped, with no error of its own
    # about the rendezvous store (the launcher serves it, not rank 0)
    broken = _without(kimi, MISSING_RANK0, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "epmoe.cli", "run", "--model", str(broken), "--ep", "2",
                           "--max-new-tokens", "2", "--no-reference"],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr  # 2: bad input
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0] == (
        f"epmoe run: error: rank 0 failed: KeyError: checkpoint is missing a tensor of logical expert 0 of "
        f"model.layers.1.mlp: checkpoint {broken} has no tensor '{MISSING_RANK0}'"), proc.stderr
    # stopped while it loaded or waited at the store, or (had it reached a collective with rank 0) failed in it
    assert re.fullmatch(r"rank 1 (was stopped after rank 0 failed|stopped: a peer went away during a collective "
                        r"\(RuntimeError: .*\))", lines[1]), proc.stderr


def _rank_pids(parent: int) -> list[int]:
    """The spawned rank processes of ``parent``, oldest first (started in rank order)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmd \
                    and b"resource_tracker" not in cmd:
                pids.append((int(stat.rsplit(")", 1)[1].split()[19]), int(entry.name)))  # field 22: start time
    return [pid for _, pid in sorted(pids)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_killed_mid_generation_is_named_with_its_signal(kimi):
    # 4 prompts per rank arriving every 4 s: generation lasts at least 12 s once the ranks are loaded
    prompts = [a for i in range(8) for a in ("--prompt", f"p{i}")]
    proc = subprocess.Popen([sys.executable, "-m", "epmoe.cli", "run", "--model", str(kimi), "--ep", "2",
                             "--max-new-tokens", "4", "--request-rate", "0.25", "--no-reference", *prompts],
                            env={**_env(), "TTY_COMPATIBLE": "1"},  # rich draws rank 0's progress as on a tty
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shown = bytearray()

    def read_stderr() -> None:  # rank 0's progress bars, as they are drawn, then the error
        while chunk := os.read(proc.stderr.fileno(), 4096):
            shown.extend(chunk)

    reader = threading.Thread(target=read_stderr)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and b"generating (tokens, rank 0)" not in shown:
            time.sleep(0.2)
        assert b"generating (tokens, rank 0)" in shown, "rank 0's progress never showed generation"
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(60)
        assert time.monotonic() - killed < 30
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    err = shown.decode(errors="replace")
    assert proc.returncode == 4, err
    err = err[err.index("epmoe run: error:"):]  # after the progress bars
    lines = err.strip().splitlines()
    assert lines[0] == "epmoe run: error: rank 1 was killed by SIGKILL (signal 9)", err
    # rank 0 failed in its next collective, or was stopped while it waited for the next arrival
    assert re.match(r"rank 0 (stopped: a peer went away during a collective|was stopped after rank 1 failed)",
                    lines[1]), err
