"""``epmoe serve`` under faults: SIGTERM while requests run (drain, exit 0) and a rank killed with SIGKILL
(every open request gets an error, exit non-zero within 30 s, no rank left behind)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from epmoe.runtime.launch import free_port
from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.multiprocess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _stream_all(url: str, max_tokens: int, results: list, i: int) -> None:
    body = {"model": MODEL, "prompt": f"drain {i}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            results[i] = (r.status_code, [line for line in r.iter_lines() if line])
    except httpx.TransportError as exc:
        results[i] = ("transport", str(exc))


def _wait_submitted(server, prompt_tokens: int, timeout_s: float = 30.0) -> None:
    """Wait until the server has taken requests with ``prompt_tokens`` prompt tokens in all."""
    deadline = time.monotonic() + timeout_s
    while server.metric("epmoe:prompt_tokens_total") < prompt_tokens:
        assert time.monotonic() < deadline, f"requests not submitted within {timeout_s} s"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def test_sigterm_drains_running_requests_and_exits_0(start_server):
    # 0.5 s: the short requests (6 tokens) finish within it, the long ones (240) would need 480 steps a second
    # (with 3 s a fast machine finished them too)
    server = start_server("--ep", "2", "--drain-timeout", "0.5")
    ranks = server.rank_pids()
    assert len(ranks) == 2  # the engine core (rank 0) and rank 1; this process serves HTTP only
    results: list = [None] * 8
    threads = [threading.Thread(target=_stream_all, args=(server.url, 6 if i < 4 else 240, results, i))
               for i in range(8)]
    for t in threads:
        t.start()
    _wait_submitted(server, sum(len(f"drain {i}") for i in range(8)))
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/health").status_code == 503
    refused = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "late"}, headers=AUTH)
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert server.proc.wait(30) == 0
    for t in threads:
        t.join(10)
    reasons = []
    for status, lines in results:
        assert status == 200 and lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        reasons.append(next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]))
    assert reasons[:4] == ["length"] * 4  # short ones finish
    assert set(reasons[4:]) <= {"length", "abort"} and "abort" in reasons[4:]  # long ones end at the bound
    assert not any(_alive(p) for p in ranks)


@pytest.mark.parametrize("victim", [0, 1], ids=["rank 0, the engine core", "rank 1"])
def test_rank_killed_fails_requests_and_exits_nonzero(start_server, victim):
    server = start_server("--ep", "2")
    ranks = sorted(server.rank_pids())  # spawned in rank order
    assert len(ranks) == 2
    results: list = [None] * 4
    threads = [threading.Thread(target=_stream_all, args=(server.url, 240, results, i)) for i in range(4)]
    for t in threads:
        t.start()
    _wait_submitted(server, sum(len(f"drain {i}") for i in range(4)))
    t0 = time.monotonic()
    os.kill(ranks[victim], signal.SIGKILL)
    try:
        code = server.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still running 30 s after a rank was killed:\n{server.log.read_text()}")
    assert code == 4 and time.monotonic() - t0 < 30, server.log.read_text()  # 4: a rank killed by a signal
    for t in threads:
        t.join(10)
    killed = f"rank {victim} was killed by SIGKILL (signal 9)"
    for result in results:  # each stream ended with an error event naming the cause first (or the connection closed)
        errors = [line for line in result[1] if '"error"' in line] if result[0] != "transport" else []
        assert result[0] == "transport" or (errors and killed in errors[-1]), result
    log = server.log.read_text()
    assert "fatal" in log and f"rank {victim} was killed by SIGKILL (signal 9)" in log, log
    assert not any(_alive(p) for p in ranks + server.children())


def test_refused_checkpoint_is_one_line_without_a_traceback(tiny_checkpoints, tmp_path):
    # config.json of another expert width than the weights: the ranks' loaders refuse it, the server exits 2 with
    # that one error line (named tensor and shapes), no Python traceback
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoints("qwen3-moe"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    cmd = [sys.executable, "-m", "epmoe.cli", "serve", "--model", str(bad), "--ep", "2", "--port", str(free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)  # until every writer is gone
    err = done.stderr
    assert done.returncode == 2, err
    assert re.search(r"fatal: (rank [01]|ranks 0 and 1) failed: ValueError: checkpoint .*expected", err), err
    assert "Traceback" not in err and "ready" not in err, err
    # the ranks' report queue was closed before the exit: multiprocessing's resource tracker (whose output ends this
    # stderr) found no semaphore left
    assert "leaked semaphore" not in err, err


def test_port_in_use_is_refused_before_loading(capsys):
    import socket

    from epmoe.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--ep", "1", "--port", str(port)]) == 2
        assert time.monotonic() - t0 < 60
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in capsys.readouterr().err


def test_kv_pool_short_of_the_context_is_refused_at_start(capsys, caplog):
    # 16 blocks of 16 tokens per rank, one the padding block: 240 tokens, short of the built-in model's context of
    # 256; vLLM refuses to start then, and so does the server: exit 2 (bad input), before any rank starts (the ranks
    # found it while loading, after the server had said it was listening)
    from epmoe.cli import main

    assert main(["serve", "--ep", "2", "--port", str(free_port()), "--num-kv-blocks", "16"]) == 2
    err = capsys.readouterr().err
    assert ("epmoe serve: error: the model's max seq len (256 tokens, the model's context; --max-model-len not given) "
            "is larger than the maximum number of tokens that can be stored in the KV cache (240: 15 blocks of 16 "
            "besides the padding block); try increasing --num-kv-blocks (now 16) to at least 17 or decreasing "
            "--max-model-len") in err, err
    assert "listening" not in caplog.text + err and "rank" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("flags, message", [
    # more ranks than the built-in model's 16 experts: it spawned the 32 ranks first (a minute on two cores), each
    # failing with this, while the server listened
    (["--ep", "32"], r"--ep 32: EP size 32 with redundant 0: EP size \(32\) is larger than the number of slots \(16\)"),
    (["--ep", "2", "--redundant", "1"], r"--ep 2: EP size 2 with redundant 1: num_slots \(17 = 16 experts \+ 1 "
                                        r"redundant\) must be divisible by the EP group size \(2\)"),
    (["--ep", "3", "--parallel", "tp"], r"--ep 3: moe_intermediate_size \(32\) of model .* must be divisible by the "
                                        r"TP group size \(3\)"),
])
def test_experts_that_do_not_fit_the_ranks_are_refused_before_any_rank_starts(flags, message, capsys, caplog):
    from epmoe.cli import main

    assert main(["serve", "--port", str(free_port()), *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^epmoe serve: error: {message}", err, re.M), err
    logged = caplog.text
    assert "listening" not in logged + err and "rank 0 failed" not in err and "Traceback" not in err, err


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(capsys, monkeypatch, tiny_checkpoints):
    """``epmoe run`` met it on an H100 as rank 1's "CUDA error: invalid device ordinal"; serve starts its ranks
    the same way. Named before a process starts (this machine has no GPU: CUDA is pretended up to that check)."""
    import torch

    from epmoe.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = str(tiny_checkpoints("qwen3-moe"))
    assert main(["serve", "--model", model, "--device", "cuda", "--dtype", "bfloat16", "--ep", "2", "--port", "0"]) == 2
    assert ("--ep 2 on --device cuda starts one rank a GPU, and this machine has 1 visible GPU: pass --ep 1 or less"
            in capsys.readouterr().err)
