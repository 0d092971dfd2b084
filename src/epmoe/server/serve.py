"""``serve(ServeConfig)``: the whole life of ``epmoe serve``.

Start-up: resolve the checkpoint, spawn ranks ``1..N-1`` (each: join the group, load its engine, follow
rank 0's rounds; ``die_with_parent`` so none outlives the server), start rank 0's engine thread, and
serve HTTP on this process (``/health`` is 503 until the engine is loaded; the load is logged with the
KV capacity and the graph buckets). Under ``torchrun`` this process is the rank ``RANK`` says: rank 0
serves, the others follow.

Shutdown: SIGTERM or SIGINT drains: no new requests (503), the running ones get ``drain_timeout_s`` to
finish, then the rest are aborted (``finish_reason`` ``abort``), the ranks stop together, exit code 0.
A rank that fails (or a failed collective) fails every open request, turns ``/health`` 503, logs every rank's
first error named by rank (``epmoe.runtime.launch.RankFailure``, as ``epmoe run`` reports them), and the server
exits within ``FATAL_EXIT_S``, killing what is left of its ranks, with the failure's exit code (1 when rank 0's
engine failed alone).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import uvicorn

from epmoe.comm import Comm
from epmoe.engine import Engine
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.runtime.launch import (
    GRACE_S,
    RankFailure,
    RankInfo,
    SpawnedRanks,
    init_group,
    torchrun_rank_info,
    under_torchrun,
)
from epmoe.server.app import AppContext, build_app
from epmoe.server.config import ServeConfig
from epmoe.server.frontend import Frontend
from epmoe.server.metrics import ServerMetrics
from epmoe.server.ranks import RankStepper
from epmoe.server.text import TextCodec
from epmoe.spec import load_moe_spec

FATAL_EXIT_S = 10.0  # after a fatal error, the process exits at the latest this many seconds later
_WATCH_S = 0.2  # how often the rank processes are checked

log = logging.getLogger("epmoe.serve")


def _start_rank(info: RankInfo, cfg: ServeConfig, model_dir: str) -> RankStepper:
    """Join the EP group (and the gloo control group), load this rank's engine."""
    group = init_group(info, cfg.device) if info.world_size > 1 else None
    control = dist.new_group(backend="gloo") if group is not None else None
    engine = Engine(cfg.engine_config(model_dir), Comm(group))
    return RankStepper(engine, control)


def _follower(info: RankInfo, cfg: ServeConfig, model_dir: str) -> None:
    """Rank ``1..N-1``: load, follow rank 0's rounds until it says stop."""
    _start_rank(info, cfg, model_dir).follow()
    dist.destroy_process_group()


def _check_port_free(host: str, port: int) -> None:
    """Raise before loading anything when ``host:port`` cannot be bound.

    Raises:
        ValueError: the address is in use or not ours (the OS error named).
    """
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"--host {host} --port {port}: cannot listen there: {exc.strerror}") from None


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain instead of closing at once (a second signal forces exit)."""

    def __init__(self, config: uvicorn.Config, drain) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        threading.Thread(target=self._drain, name="epmoe-drain", daemon=True).start()


def _startup_log(cfg: ServeConfig, model_dir: str, name: str, frontend: Frontend) -> None:
    info = frontend.info
    kv = info.kv
    log.info("model %s (%s) served as %r: %d EP rank(s), %s, %s", model_dir, load_moe_spec(model_dir).model_type,
             name, info.ranks, cfg.device, cfg.dtype)
    log.info("KV cache per rank: %d blocks of %d tokens (%d tokens, %.1f MiB), %d sequences of the full context "
             "(%d tokens) at once; graph buckets %s", kv["blocks"], kv["block_size"], kv["tokens"],
             kv["bytes"] / 2**20, kv["max_concurrency"], kv["context"], kv["graph_buckets"] or "none (eager)")
    log.info("ready: http://%s:%d/v1", cfg.host, cfg.port)


def serve(cfg: ServeConfig) -> int:
    """Run the server until SIGTERM (see the module docstring).

    Returns:
        0 after a drain. After a fatal error (a rank failed or died, the engine failed) the process exits at
        once with the ``RankFailure``'s exit code (1 when rank 0's engine failed alone), through ``os._exit``:
        the engine thread may be stuck in a collective with the dead rank.

    Raises:
        ValueError: a bad option or checkpoint (before anything starts).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model_dir = str(cfg.model) if cfg.model is not None else str(ensure_default_checkpoint(cfg.cache_dir))
    cfg.engine_config(model_dir)  # a bad engine option fails here, before any process starts
    _check_port_free(cfg.host, cfg.port)
    if under_torchrun():
        info = torchrun_rank_info()
        if info.rank != 0:
            _follower(info, cfg, model_dir)
            return 0
        world, followers = info.world_size, None
    else:
        world = cfg.ep
        followers = SpawnedRanks(_follower, world, (cfg, model_dir), ranks=range(1, world))
        info = RankInfo(0, world, 0, f"tcp://127.0.0.1:{followers.port}")
        followers.start()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    name = cfg.served_model_name or os.path.basename(os.path.normpath(model_dir))
    fatal = threading.Event()
    exit_code = [1]  # of a fatal error: the rank failure's, once the ranks have reported
    server: _Server | None = None

    def on_fatal(reason: str) -> None:
        log.error("fatal: %s; failing every open request and exiting", reason)
        fatal.set()
        if server is not None:
            server.should_exit = True
        timer = threading.Timer(FATAL_EXIT_S, lambda: os._exit(exit_code[0]))
        timer.daemon = True
        timer.start()

    frontend = Frontend(lambda: _start_rank(info, cfg, model_dir), ServerMetrics(), on_fatal)
    codec = TextCodec(model_dir, load_moe_spec(model_dir).vocab_size)
    app = build_app(AppContext(frontend, codec, name, model_dir, cfg.api_key, cfg.max_body_bytes))

    def drain() -> None:
        log.info("draining: %d open request(s), %.0f s to finish", frontend.num_open(), cfg.drain_timeout_s)
        frontend.begin_drain()
        deadline = time.monotonic() + cfg.drain_timeout_s
        while frontend.num_open() and time.monotonic() < deadline and not fatal.is_set():
            time.sleep(0.05)
        left = frontend.open_ids()
        if left:
            log.info("drain timeout: aborting %d request(s)", len(left))
            for rid in left:
                frontend.abort(rid)
            end = time.monotonic() + 5.0
            while frontend.num_open() and time.monotonic() < end:
                time.sleep(0.05)
        server.should_exit = True

    def rank_failure(grace_s: float) -> RankFailure | None:
        """The followers' failure (every rank's first error), waiting up to ``grace_s`` for one to show."""
        deadline = time.monotonic() + grace_s
        while followers is not None:
            failure = followers.failure()
            if failure is not None or time.monotonic() >= deadline:
                return failure
            time.sleep(0.05)
        return None

    def watch() -> None:
        was_ready = False
        while True:
            if frontend.state == "failed":  # rank 0's engine failed first: name the followers' own errors too
                failure = rank_failure(GRACE_S)
                if failure is not None:
                    exit_code[0] = failure.exit_code
                    log.error("%s", failure)
                return
            failure = rank_failure(0.0)
            if failure is not None and frontend.state in ("loading", "ready", "draining"):
                exit_code[0] = failure.exit_code
                frontend.fail(str(failure))
                return
            if frontend.state == "ready" and not was_ready:
                was_ready = True
                _startup_log(cfg, model_dir, name, frontend)
            if frontend.state == "stopped":
                return
            time.sleep(_WATCH_S)

    server = _Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=5),
                     drain)
    frontend.start()
    watcher = threading.Thread(target=watch, name="epmoe-watch", daemon=True)
    watcher.start()
    server.run()
    procs = list(followers.procs.values()) if followers is not None else []
    if not fatal.is_set():
        stopped = frontend.stop(timeout_s=30.0)
        if stopped and not fatal.is_set():
            for p in procs:
                p.join(timeout=10.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    if fatal.is_set() or frontend.state == "failed":
        watcher.join(GRACE_S + 1.0)  # it names the ranks' own errors and sets the exit code
        # the engine thread may be stuck in a collective with the dead rank: no clean interpreter exit
        logging.shutdown()
        sys.stderr.flush()
        os._exit(exit_code[0])
    if dist.is_initialized():
        dist.destroy_process_group()
    log.info("drained; exiting")
    return 0
