"""A real ``epmoe serve`` process on a free 127.0.0.1 port (``--port 0``: the port the server logs it bound; the
built-in checkpoint, float32, CPU ranks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from epmoe.runtime.launch import free_port

MODEL = "kimi-k2.5-tiny"  # the built-in checkpoint's directory name: the served model id
API_KEY = "test-key"
START_TIMEOUT_S = 120.0


class ServerProcess:
    """One server process: ``url`` (``http://127.0.0.1:PORT``, the port from its ``listening on`` log line),
    ``port``, ``proc``, ``log`` (its stderr file), ``started`` and ``ready`` (``time.monotonic()`` before the start
    and once ``/health`` answered 200).

    With ``torchrun_world`` N, ``proc`` is rank 0 of N processes started with the environment ``torchrun``
    sets (``RANK``, ``WORLD_SIZE``, ...); ``followers`` are ranks 1..N-1. ``verify``: how ``/health`` is checked
    over HTTPS (httpx's ``verify``: a CA bundle's path or an ``ssl.SSLContext``).
    """

    def __init__(self, tmp: Path, *args: str, torchrun_world: int | None = None, verify=True) -> None:
        self.log = tmp / "serve.log"
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
        cmd = [sys.executable, "-m", "epmoe.cli", "serve", "--port", "0", "--api-key", API_KEY, *args]
        self.followers: list[subprocess.Popen] = []
        self.started = time.monotonic()
        if torchrun_world is not None:
            env.update(WORLD_SIZE=str(torchrun_world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            for rank in range(1, torchrun_world):
                with (tmp / f"serve-rank{rank}.log").open("w") as out:
                    self.followers.append(subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
            env.update(RANK="0", LOCAL_RANK="0")
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            listening = re.search(r"listening on (https?://127\.0\.0\.1:(\d+)) ", self.log.read_text())
            if listening is not None:
                self.url, self.port = listening[1], int(listening[2])
                try:
                    if httpx.get(f"{self.url}/health", timeout=2, verify=verify).status_code == 200:
                        self.ready = time.monotonic()
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready within {START_TIMEOUT_S} s:\n{self.log.read_text()}")

    def children(self) -> list[int]:
        """Pids of the processes whose parent is the server (its ranks, the resource tracker)."""
        kids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    kids.append(int(entry.name))
        return kids

    def rank_pids(self) -> list[int]:
        """Pids of the spawned rank processes."""
        out = []
        for pid in self.children():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmd:
                out.append(pid)
        return out

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric from ``/metrics``."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        for proc in (self.proc, *self.followers):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """Start servers (``start_server(*args, torchrun_world=None, verify=True)``); every one is stopped at the end
    of the module."""
    started: list[ServerProcess] = []

    def start(*args: str, torchrun_world: int | None = None, verify=True) -> ServerProcess:
        server = ServerProcess(tmp_path_factory.mktemp("serve"), *args, torchrun_world=torchrun_world, verify=verify)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
