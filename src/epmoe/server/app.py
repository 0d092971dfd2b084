"""The FastAPI app: routes, API-key check, request bodies (size-limited, strictly validated), errors in
OpenAI's JSON shape.

Routes: ``GET /health`` (200 once ready, 503 while loading, draining or failed), ``GET /metrics``
(Prometheus text), ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/responses`` (OpenAI's Responses API, stateless), ``POST /tokenize`` and ``POST /detokenize``
(vLLM's), ``GET /eplb/loads``, ``POST /eplb/rebalance``. With an API key, every route but ``/health`` and
``/metrics`` needs ``Authorization: Bearer KEY``. A client that goes away aborts its request, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pydantic
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from epmoe import __version__
from epmoe.loads import LOADS_FORMAT
from epmoe.server.chat_output import ChatParsers
from epmoe.server.errors import ApiError, validation_error
from epmoe.server.frontend import Frontend, Unavailable
from epmoe.server.generate import build_job, collect, compile_constraint, stream, submit
from epmoe.server.metrics import CONTENT_TYPE
from epmoe.server.prompts import detokenize, tokenize
from epmoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    RebalanceRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from epmoe.server.ranks import LOADS_COMMAND, REBALANCE_COMMAND
from epmoe.server.responses import as_chat, renamed
from epmoe.server.responses import stream as response_events
from epmoe.server.responses import whole as whole_response
from epmoe.server.text import TextCodec

log = logging.getLogger("epmoe.server")

INLINE_TOKENIZE_BYTES = 16 << 10
"""Requests whose body is at most this many bytes are tokenized on the event loop (a few milliseconds at most);
longer ones on the server's tokenizing thread."""


@dataclass(frozen=True)
class AppContext:
    """What the routes serve with.

    Attributes:
        frontend: the engine loop.
        codec: the HTTP side's tokenizer.
        model_name: the model id clients send (``/v1/models``).
        model_dir: the checkpoint directory.
        api_key: the bearer token, or ``None``.
        max_body_bytes: largest request body (413 past it).
        sampling_defaults: what requests' left-out sampling fields take (``engine.sampling.sampling_defaults``).
        parsers: how chat outputs are read (reasoning, tool calls).
        cors: the keyword arguments of Starlette's ``CORSMiddleware`` (``allow_origins``, ``allow_methods``,
            ``allow_headers``, ``allow_credentials``); ``None`` = no CORS answers.
    """

    frontend: Frontend
    codec: TextCodec
    model_name: str
    model_dir: str
    api_key: str | None
    max_body_bytes: int
    sampling_defaults: dict = field(default_factory=dict)
    parsers: ChatParsers = field(default_factory=ChatParsers)
    cors: dict | None = None


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body().model_dump(), status_code=exc.status)


class _AbortingStream(StreamingResponse):
    """A streamed response that aborts its unfinished choices however it ends (done, client gone, error)."""

    def __init__(self, content, frontend: Frontend, pending: set[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._frontend = frontend
        self._pending = pending

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for rid in list(self._pending):
                self._frontend.abort(rid)
            await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (its body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(ctx: AppContext) -> FastAPI:
    """The server's ASGI app."""
    app = FastAPI(title="epmoe", docs_url=None, redoc_url=None, openapi_url=None)
    if ctx.cors is not None:
        app.add_middleware(CORSMiddleware, **ctx.cors)
    frontend, codec = ctx.frontend, ctx.codec
    # a long text prompt takes seconds to tokenize: a thread of its own does it, off the event loop, so the other
    # requests (and streams already running) are answered meanwhile; a short one is tokenized at once on the loop,
    # not queued behind the long ones. A fast tokenizer's encode only reads it once a first call has set its
    # truncation and padding off, which this one makes before any request
    codec.encode("")
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epmoe-tokenize")

    async def tokenized(request: Request, fn, *args):
        """``fn(*args)``, a function that tokenizes the request's text: at once when the request's body is at most
        ``INLINE_TOKENIZE_BYTES``, else on the tokenizing thread, awaited (its exceptions raised here).

        Raises:
            ApiError: 499 when the client goes away first (a request whose turn on the thread has not come is then
                not tokenized at all).
        """
        if request.state.body_bytes <= INLINE_TOKENIZE_BYTES:
            return fn(*args)
        left = threading.Event()
        gone = "the client went away before its prompt was tokenized"

        def unless_left():
            if left.is_set():
                log.info("client gone before its %d-byte request was tokenized: skipped", request.state.body_bytes)
                raise ApiError(499, gone)
            return fn(*args)

        work = asyncio.get_running_loop().run_in_executor(tokenizing, unless_left)
        leaving = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
        if not work.done():  # nobody reads the answer: a turn not yet come is skipped, a running one ends unread
            left.set()
            work.add_done_callback(lambda done: done.exception())  # retrieved, so asyncio does not report it
            raise ApiError(499, gone)
        return work.result()

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
            # Starlette's Allow header lists a route's methods in a set's order: sorted, so one answer reads alike
            message += f" (use {', '.join(sorted(m.strip() for m in allowed.split(',')))})" if allowed else ""
        elif exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        return _error(ApiError(exc.status_code, message))

    def check_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), ctx.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'" if token or header
                           else "missing API key: send 'Authorization: Bearer <key>'")

    async def read_body(request: Request, schema: type[pydantic.BaseModel], optional: bool = False):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > ctx.max_body_bytes:
            raise ApiError(413, f"request body of {int(length)} bytes is over the limit of {ctx.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > ctx.max_body_bytes:
                raise ApiError(413, f"request body is over the limit of {ctx.max_body_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        request.state.body_bytes = size
        if not raw.strip():
            if optional:
                return schema()
            raise ApiError(400, "request body is empty: send a JSON object")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to parse: send a JSON object of the request's "
                                "fields") from None
        except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's 4300-digit conversion limit
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
        try:
            return schema.model_validate(body, strict=True)
        except pydantic.ValidationError as exc:
            raise validation_error(exc) from None

    def ready_info():
        if frontend.state != "ready" or frontend.info is None:
            raise ApiError(503, f"the server is {frontend.state}" + (f": {frontend.failure}" if frontend.failure
                                                                     else ""))
        return frontend.info

    def check_model(name: str | None) -> None:
        """A request's ``model``: the served one, or left out or empty (the served one, as vLLM takes them)."""
        if name and name != ctx.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {ctx.model_name!r}", "model")

    async def generate(request: Request, schema: type[pydantic.BaseModel]) -> Response:
        check_key(request)
        req = await read_body(request, schema)
        check_model(req.model)
        job = await tokenized(request, build_job, req, ctx.model_name, codec, ready_info(), ctx.sampling_defaults,
                              ctx.parsers)
        await compile_constraint(job, codec)
        return await run(request, job, req.stream, lambda updates, pending: stream(job, updates, codec, pending),
                         lambda whole: whole)

    async def run(request: Request, job, streamed: bool, events, answer) -> Response:
        """Submit ``job``; stream ``events(updates, pending)`` or answer ``answer(collect's whole response)``,
        aborting its choices when the client goes away."""
        updates = submit(frontend, job)
        if streamed:
            pending = set(job.choice_ids())
            return _AbortingStream(events(updates, pending), frontend, pending)
        work = asyncio.ensure_future(collect(frontend, job, updates, codec))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # this handler is cancelled (shutdown): so is its work
            work.cancel()
            raise
        finally:
            gone.cancel()
        if not work.done():  # the client went away: cancelling collect aborts the unfinished choices
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return JSONResponse(answer(work.result()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, run as a chat (``server.responses``)."""
        check_key(request)
        req = await read_body(request, ResponsesRequest)
        check_model(req.model)
        try:
            job = await tokenized(request, build_job, as_chat(req), ctx.model_name, codec, ready_info(),
                                  ctx.sampling_defaults, ctx.parsers)
            await compile_constraint(job, codec)
        except ApiError as exc:
            raise renamed(exc) from None
        return await run(request, job, req.stream,
                         lambda updates, pending: response_events(req, job, updates, codec, pending),
                         lambda chat: whole_response(req, job, chat))

    async def answer(request: Request, schema: type[pydantic.BaseModel], fn) -> JSONResponse:
        """A request answered at once from the tokenizer: ``fn(request body, codec, engine info)``."""
        check_key(request)
        req = await read_body(request, schema)
        check_model(req.model)
        return JSONResponse(await tokenized(request, fn, req, codec, ready_info()))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        """vLLM's: the tokens a prompt or a conversation becomes."""
        return await answer(request, TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        """vLLM's: the text of token ids."""
        return await answer(request, DetokenizeRequest, detokenize)

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.model_name, created=int(time.time()), root=ctx.model_dir,
                         max_model_len=ready_info().max_model_len)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_key(request)
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> JSONResponse:
        """OpenAI's model retrieval (``client.models.retrieve``): the served model's card, or 404 naming it (an
        empty id too: a request's left-out ``model`` means the served one, a path's does not)."""
        check_key(request)
        if not name:
            raise ApiError(404, f"GET /v1/models/ names no model id; this server serves {ctx.model_name!r}", "model")
        check_model(name)
        return JSONResponse(model_card().model_dump())

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        """200 once the engine is loaded, else 503 saying what the server is doing (``/ping``: vLLM's name)."""
        if frontend.state == "ready":
            return JSONResponse({"status": "ready"})
        return _error(ApiError(503, f"the server is {frontend.state}" + (f": {frontend.failure}" if frontend.failure
                                                                         else "")))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=CONTENT_TYPE)

    def expert_parallel(route: str) -> None:
        if frontend.info is not None and frontend.info.parallel != "ep":
            raise ApiError(400, f"{route} needs expert parallelism; this server runs --parallel "
                                f"{frontend.info.parallel} (no expert placement)")

    async def run_command(name: str, arg: object = None) -> list:
        try:
            return await asyncio.wrap_future(frontend.command(name, arg))
        except Unavailable as exc:
            raise ApiError(503, str(exc)) from None

    @app.get("/eplb/loads")
    async def eplb_loads(request: Request) -> JSONResponse:
        """Tokens routed per logical expert since start, summed over ranks, as ``epmoe balance --loads`` reads."""
        check_key(request)
        expert_parallel("/eplb/loads")
        per_rank = await run_command(LOADS_COMMAND)
        load = [[sum(col) for col in zip(*rows)] for rows in zip(*per_rank)]
        return JSONResponse({"format": LOADS_FORMAT, "load": load})

    @app.post("/eplb/rebalance")
    async def eplb_rebalance(request: Request) -> JSONResponse:
        """One live rebalance now, between two steps, from the loads routed since the last committed one: its
        moves and balancedness, or why it did not commit (``committed`` false, ``error``)."""
        check_key(request)
        body = await read_body(request, RebalanceRequest, optional=True)
        ready_info()
        expert_parallel("/eplb/rebalance")
        per_rank = await run_command(REBALANCE_COMMAND, body.max_moves)
        return JSONResponse(per_rank[0])  # every rank took part in the same move; rank 0 speaks for them

    return app
