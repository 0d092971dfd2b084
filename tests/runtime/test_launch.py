"""Stopping the parent of spawned ranks with a signal takes the ranks down too (no orphans)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
