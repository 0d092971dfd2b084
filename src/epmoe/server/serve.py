"""``serve(ServeConfig)``: the whole life of ``epmoe serve``.

Processes (as vLLM's API server and engine core): this process serves HTTP only; the engine runs in rank
processes (``epmoe.server.core``). Spawned (no ``torchrun``): ``--ep`` rank processes, rank 0 the engine
core, joined to this process by one pipe (this process serves the ranks' rendezvous store). Under ``torchrun``
this process is the rank ``RANK`` says: rank 0 spawns one process, the engine core of rank 0 (it joins
torchrun's group with this process's rank facts) and serves HTTP; the other ranks follow in their own process.
Rank processes die with this one. The HTTP socket is bound before any rank process starts (``--port 0``: a free
port), and its address is logged (``listening on http://HOST:PORT``, ``https`` with ``ssl_certfile``) once
uvicorn listens on it; ``/health`` is 503 until the engine is loaded; the load is logged with the KV capacity and
the graph buckets. With ``eplb_interval``, each live rebalance the engine runs by itself is logged in one line
(``EPLB rebalance at step N: committed, ...``: copies moved and balancedness before and after, or why it did not
commit).

Shutdown: SIGTERM or SIGINT drains: no new requests (503), the running ones get ``drain_timeout_s`` to
finish, then the rest are aborted (``finish_reason`` ``abort``), the ranks stop together, exit code 0.
A rank that fails (or a failed collective) fails every open request, turns ``/health`` 503, logs every rank's
first error named by rank (``epmoe.runtime.launch.RankFailure``, as ``epmoe run`` reports them), and the server
exits within ``FATAL_EXIT_S``, killing what is left of its ranks, with the failure's exit code (1 when rank 0's
engine failed alone).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch.multiprocessing as mp
import uvicorn

from epmoe.engine.config import command_dtype, synthetic_text
from epmoe.engine.group import check_group
from epmoe.engine.sampling import sampling_defaults
from epmoe.experts import describe_expert_backend
from epmoe.experts.storage import held_as
from epmoe.experts.switches import check_switches, switched_off
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.plan.request import counted
from epmoe.runtime.launch import (
    GRACE_S,
    RankError,
    RankFailure,
    RankInfo,
    SpawnedRanks,
    check_gpus,
    torchrun_rank_info,
    under_torchrun,
)
from epmoe.server.app import AppContext, build_app
from epmoe.server.chat_output import ChatParsers
from epmoe.server.config import ServeConfig
from epmoe.server.core import EngineInfo, check_kv_holds_context, core_process, follow, follower_process
from epmoe.server.frontend import Frontend
from epmoe.server.metrics import ServerMetrics
from epmoe.server.text import TextCodec, load_chat_template
from epmoe.spec import load_moe_spec

if TYPE_CHECKING:
    from epmoe.runtime.rebalance import RebalanceEvent

FATAL_EXIT_S = 10.0  # after a fatal error, the process exits at the latest this many seconds later
_WATCH_S = 0.2  # how often the rank processes are checked

log = logging.getLogger("epmoe.serve")


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound to ``host:port`` (port 0: a free one) before anything loads; uvicorn listens on
    it.

    Raises:
        ValueError: the address is in use or not ours (the OS error named).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {exc.strerror}") from None
    return sock


def _rebalance_log(event: RebalanceEvent) -> None:
    """One line per live rebalance the engine ran by itself (``--eplb-interval``): committed (copies moved,
    balancedness before -> after), skipped (why) at ``info``; failed (the failing rank's reason) at ``warning``."""
    log.log(logging.WARNING if event.error is not None else logging.INFO, "EPLB rebalance at %s", event.describe())


def _url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, an IPv6 address in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn on a bound socket, logging its address once it listens, with SIGTERM/SIGINT starting a drain
    instead of closing at once (a second signal forces exit)."""

    def __init__(self, config: uvicorn.Config, url: str, drain) -> None:
        super().__init__(config)
        self._url = url
        self._drain = drain
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # uvicorn returns without listening when the app's startup fails
            log.info("listening on %s (/health answers 503 until the engine is loaded)", self._url)

    def handle_exit(self, sig, frame) -> None:
        if self._draining:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        threading.Thread(target=self._drain, name="epmoe-drain", daemon=True).start()


def _startup_log(cfg: ServeConfig, model_dir: str, name: str, info: EngineInfo, url: str) -> None:
    kv = info.kv
    spec = load_moe_spec(model_dir)
    log.info("model %s (%s) served as %r: %d rank(s), experts %s, %s, %s, expert backend %s, routed experts held as %s",
             model_dir, spec.model_type, name, info.ranks,
             "expert-parallel" if info.parallel == "ep" else "tensor-parallel", cfg.device, cfg.dtype,
             describe_expert_backend(cfg.engine_config(model_dir).expert_backend, cfg.device),
             held_as(spec.expert_weight_format, spec.moe_intermediate_size, info.parallel, cfg.dtype))
    log.info("KV cache per rank: %d blocks of %d tokens besides the padding block (%d tokens, %.1f MiB), %s of "
             "the full context (%d tokens) at once; graph buckets %s; piecewise graph buckets %s; prefix caching %s",
             kv["blocks"], kv["block_size"], kv["tokens"], kv["bytes"] / 2**20,
             counted(kv["max_concurrency"], "sequence"), kv["context"], kv["graph_buckets"] or "none (eager)",
             kv.get("piecewise_buckets") or "none (eager)", "on" if kv.get("prefix_caching") else "off")
    synthetic = synthetic_text(cfg.load_format, cfg.moe_routing_simulation)
    if synthetic is not None:
        log.warning("%s", synthetic)
    off = switched_off()
    if off:
        log.warning("fast paths switched off by the environment: %s", "; ".join(off))
    if info.speculative is not None:
        log.info("speculative decoding, K = %d: %s", cfg.engine_config(model_dir).num_speculative_tokens,
                 info.speculative)
    if cfg.tool_call_parser or cfg.reasoning_parser:
        log.info("chat outputs: tool calls read as %s (tool_choice auto %s); reasoning split as %s",
                 cfg.tool_call_parser or "none", "on" if cfg.enable_auto_tool_choice else "refused",
                 cfg.reasoning_parser or "none")
    log.info("ready: %s/v1", url)


def _sampling_defaults(cfg: ServeConfig, model_dir: str) -> dict[str, float | int]:
    """The sampling defaults of ``cfg.generation_config`` (logged); a repetition penalty is left out with speculative
    decoding, which does not serve penalties.

    Raises:
        ValueError: an unreadable ``generation_config.json`` or a value out of range (the file and key named).
    """
    if cfg.generation_config == "vllm":
        return {}
    directory = model_dir if cfg.generation_config == "auto" else cfg.generation_config
    defaults = sampling_defaults(directory)
    if not os.path.isfile(os.path.join(directory, "generation_config.json")):  # the checkpoint's ('auto') only
        log.info("no generation_config.json in %s: requests take the API's sampling defaults", directory)
    if cfg.speculative_algorithm is not None and defaults.get("repetition_penalty", 1) != 1:
        log.warning("generation_config.json's repetition_penalty %s is not applied: speculative decoding does not "
                    "serve penalties", defaults.pop("repetition_penalty"))
    if defaults:
        log.info("sampling defaults of requests that leave them out, from %s/generation_config.json: %s", directory,
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def _release_ranks(core: BaseProcess | None, followers: SpawnedRanks | None) -> None:
    """Kill what is left of the rank processes (those started), join them and close the followers' report queue
    (whose locks are named semaphores: the resource tracker reports them as leaked at ``os._exit`` unless
    released) and their rendezvous store."""
    if core is not None and core.pid is not None:
        if core.is_alive():
            core.kill()
        core.join()
    if followers is not None:
        followers.close()


def serve(cfg: ServeConfig) -> int:
    """Run the server until SIGTERM (see the module docstring).

    Returns:
        0 after a drain. After a fatal error (a rank failed or died, the engine failed) the process exits at
        once (``os._exit``, its rank processes killed) with the ``RankFailure``'s exit code (1 when rank 0's
        engine failed alone and named no cause).

    Raises:
        ValueError: a bad option or checkpoint (before anything starts).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model_dir = str(cfg.model) if cfg.model is not None else str(ensure_default_checkpoint(cfg.cache_dir))
    cfg = dataclasses.replace(cfg, dtype=command_dtype(cfg.dtype, cfg.device, load_moe_spec(model_dir)))
    engine_cfg = cfg.engine_config(model_dir)  # a bad engine option fails here, before any process starts
    parsers = ChatParsers(cfg.reasoning_parser, cfg.tool_call_parser, cfg.enable_auto_tool_choice)
    info = torchrun_rank_info() if under_torchrun() else None
    check_gpus(cfg.device, cfg.ep, info)  # before any rank starts, as the group's fit
    check_group(engine_cfg, info.world_size if info is not None else cfg.ep)
    check_switches()
    if cfg.num_kv_blocks is not None:  # the pool's size is known: short of the context, refused before any rank starts
        check_kv_holds_context(cfg.max_model_len or load_moe_spec(model_dir).max_position_embeddings,
                               cfg.num_kv_blocks - 1, cfg.block_size, cfg)
    if info is not None and info.rank != 0:
        follow(info, cfg, model_dir)
        return 0
    template = load_chat_template(cfg.chat_template) if cfg.chat_template is not None else None
    # the HTTP side's tokenizer, before any rank starts: one that cannot load (or runs code not trusted) is named now
    codec = TextCodec(model_dir, load_moe_spec(model_dir).vocab_size, template, cfg.trust_remote_code)
    if (parsers.tools or parsers.reasoning) and codec.tokenizer is None:
        flag = "--tool-call-parser" if parsers.tools else "--reasoning-parser"
        raise ValueError(f"{flag} reads the model's text, and the checkpoint {model_dir} has no tokenizer")
    defaults = _sampling_defaults(cfg, model_dir)
    sock = _bind(cfg.host, cfg.port)
    url = _url(cfg.scheme, cfg.host, sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe(duplex=True)
    followers: SpawnedRanks | None = None
    core: BaseProcess | None = None
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

    try:
        if info is None:  # spawned: ranks 1.. follow, watched for their own errors
            followers = SpawnedRanks(follower_process, cfg.ep, (cfg, model_dir), ranks=range(1, cfg.ep))
            info = RankInfo(0, cfg.ep, 0, f"tcp://127.0.0.1:{followers.port}", launcher_store=True)
        core = ctx.Process(target=core_process, args=(info, cfg, model_dir, there), name="epmoe-core")
        core.start()
        if followers is not None:
            followers.start()
        there.close()  # the core holds its end now: the pipe closes when the core's process ends
        frontend = Frontend(here, ServerMetrics(), on_fatal,
                            on_ready=lambda info: _startup_log(cfg, model_dir, name, info, url),
                            on_rebalance=_rebalance_log)
        app = build_app(AppContext(frontend, codec, name, model_dir, cfg.api_key, cfg.max_body_bytes, defaults,
                                   parsers, cfg.cors))
    except BaseException:  # Ctrl-C: the ranks started and the socket go with it
        sock.close()
        _release_ranks(core, followers)
        raise

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
        while True:
            if frontend.core_down.is_set():  # the engine core failed or died: every rank's own error, cause first
                errors = [] if frontend.core_error is None else [frontend.core_error]
                core.join(timeout=1.0)
                if frontend.core_error is None and core.exitcode not in (None, 0):
                    errors.append(RankError.of_exit(0, core.exitcode))  # killed without a word
                failure = rank_failure(GRACE_S)
                errors += list(failure.errors) if failure is not None else []
                if errors:
                    report = RankFailure(errors)
                    exit_code[0] = report.exit_code
                    frontend.fail(str(report))  # logged once, by on_fatal
                else:
                    frontend.fail("the engine core's process ended (its pipe closed)")
                return
            failure = rank_failure(0.0)
            if failure is not None and frontend.state in ("loading", "ready", "draining"):
                exit_code[0] = failure.exit_code
                frontend.fail(str(failure))
                return
            if frontend.state == "stopped":
                return
            time.sleep(_WATCH_S)

    server = _Server(uvicorn.Config(app, log_level=cfg.uvicorn_log_level,
                                    access_log=not cfg.disable_uvicorn_access_log, timeout_graceful_shutdown=5,
                                    ssl_keyfile=cfg.ssl_keyfile, ssl_certfile=cfg.ssl_certfile), url, drain)
    frontend.start()
    watcher = threading.Thread(target=watch, name="epmoe-watch", daemon=True)
    watcher.start()
    try:
        server.run(sockets=[sock])
    except BaseException:  # uvicorn exits when it cannot listen on the socket after all
        _release_ranks(core, followers)
        raise
    finally:
        sock.close()
    procs = [core, *(followers.procs.values() if followers is not None else ())]
    if not fatal.is_set():
        stopped = frontend.stop(timeout_s=30.0)
        if stopped and not fatal.is_set():
            for p in procs:
                p.join(timeout=10.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    failed = fatal.is_set() or frontend.state == "failed"
    if failed:
        watcher.join(GRACE_S + 2.0)  # it names the ranks' own errors and sets the exit code
    _release_ranks(core, followers)  # its queue's semaphores: os._exit below would leave them to the tracker
    if failed:
        logging.shutdown()
        sys.stderr.flush()
        os._exit(exit_code[0])  # uvicorn's and the pipe's threads may still wait on the dead core
    log.info("drained; exiting")
    return 0
