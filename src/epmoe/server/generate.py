"""Serving one OpenAI completion or chat request on the ``Frontend``: prompts to engine requests (one per
choice), and the engine's updates back to a whole response or to server-sent events.

A request with ``P`` prompts and ``n`` choices becomes ``P * n`` engine requests; choice ``i * n + j`` is
prompt ``i``'s ``j``-th, sampled with ``(seed + j) mod 2**63`` when a seed is given (choice 0 reproduces ``n = 1``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping

from epmoe.engine import SamplingParams, TokenLogprobs
from epmoe.engine.sampling import MAX_LOGPROBS
from epmoe.engine.structured import StructuredOutputs
from epmoe.server.chat_output import ChatParsers, tool_choice
from epmoe.server.core import EngineInfo
from epmoe.server.errors import ApiError
from epmoe.server.frontend import Failure, Frontend, Unavailable, Update
from epmoe.server.job import Job
from epmoe.server.prompts import chat_text, utf8
from epmoe.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
)
from epmoe.server.replies import (
    StreamReply,
    chat_logprobs,
    chat_reply,
    completion_choice,
    completion_logprobs,
    echoed_prompt,
    final_text,
    prompt_logprobs_of,
    reads_reasoning,
    reasoning_tokens_of,
    usage_of,
)
from epmoe.server.text import StreamText, TextCodec
from epmoe.server.tools import forced_schema

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
DONE = "data: [DONE]\n\n"
def _param_of(message: str) -> str | None:
    """The field a ``SamplingParams`` message starts with (``"top_p must be ..."`` -> ``top_p``)."""
    word = message.split(" ", 1)[0]
    return word if word in _SAMPLING_FIELDS else None


def build_job(req: CompletionRequest | ChatCompletionRequest, model: str, codec: TextCodec,
              info: EngineInfo, defaults: Mapping[str, float | int] | None = None,
              parsers: ChatParsers | None = None) -> Job:
    """Check a request against the model and turn it into engine requests; the sampling fields it leaves out take
    ``defaults`` (``sampling_defaults``) where they set them; a chat's outputs are read by the server's ``parsers``
    (reasoning, tool calls), whose markers its text keeps (``skip_special_tokens`` false where the tokenizer counts
    one of them special).

    Raises:
        ApiError: 400 naming the field: an empty prompt, token ids outside the vocabulary, a prompt as
            long as the context, ``max_tokens`` past the context, a bad sampling value, logit-bias keys that are not
            token ids, a penalty, logit bias or constraint with speculative decoding, a constraint that comes in
            more than one field (``compile_constraint`` compiles it), a ``tool_choice`` the tools or the server's
            parsers cannot serve.
    """
    forced = None
    if isinstance(req, ChatCompletionRequest):
        kind, where, batch = "chat", "messages", False
        choice = tool_choice(req)
        if choice not in ("none", "auto"):
            forced = ("tool_choice", forced_schema(choice, [t.function.model_dump() for t in req.tools],
                                                   req.parallel_tool_calls))
        rendered = chat_text(req, codec)
        prompts = [codec.encode(rendered, req.add_special_tokens)]
        sent = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        implied = False  # None: what the context leaves (below)
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top and not req.logprobs:
            raise ApiError(400, f"top_logprobs ({top}) needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        prompt_logprobs = req.prompt_logprobs
    else:
        kind, where = "completion", "prompt"
        raw = req.prompt
        batch = not (isinstance(raw, str) or (raw and isinstance(raw[0], int)))  # a list of prompts
        items = list(raw) if batch else [raw]
        if not items:
            raise ApiError(400, "prompt must not be empty, got []", "prompt")
        prompts = [codec.encode(utf8(p, "prompt"), req.add_special_tokens) if isinstance(p, str) else list(p)
                   for p in items]
        sent = "max_tokens"
        max_tokens = req.max_tokens if req.max_tokens is not None else (defaults or {}).get("max_tokens", 16)
        implied = req.max_tokens is None  # a default the request never sent: capped by the context, not refused
        logprobs = req.logprobs
        asked = [k for k in (req.prompt_logprobs, logprobs if req.echo else None) if k is not None]
        prompt_logprobs = max(asked) if asked else None  # echo's legacy form and vLLM's field share one count
    prompt_only = kind == "completion" and req.echo and max_tokens == 0  # vLLM's: the prompt alone comes back
    if prompt_only:
        max_tokens = 1  # the engine computes the prompt and one token, which is not sent
    if max_tokens is not None and max_tokens < 1:
        echo = " (0 only with echo)" if kind == "completion" else ""  # vLLM's prompt-only completion
        raise ApiError(400, f"{sent} must be an integer >= 1{echo}, got {max_tokens}", sent)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, f"prompt_logprobs={req.prompt_logprobs} is not served with stream: true (as vLLM)",
                       "prompt_logprobs")
    bad_stops = [t for t in req.stop_token_ids or () if not 0 <= t < info.vocab_size]
    if bad_stops:
        raise ApiError(400, f"stop_token_ids must be in [0, {info.vocab_size}), got {bad_stops[:5]}", "stop_token_ids")
    bias = _logit_bias(req.logit_bias, info.vocab_size)
    for i, ids in enumerate(prompts):
        at = f"{where}.{i}" if batch else where  # which prompt of a batch, as the stop list's items are named
        if not ids:
            what = "the chat template rendered no text for these messages" if kind == "chat" else "it has no tokens"
            raise ApiError(400, f"{at} must not be empty: {what}", at)
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise ApiError(400, f"{at} token ids must be in [0, {info.vocab_size}), got {bad[:5]}", at)
        if len(ids) >= info.max_model_len:
            raise ApiError(400, f"{at} has {len(ids)} tokens: no room left in the model's context of "
                                f"{info.max_model_len} tokens", at)
    if req.stop and codec.tokenizer is None:
        raise ApiError(400, f"stop strings ({req.stop!r}) need the checkpoint's tokenizer and this checkpoint has "
                            "none; use stop_token_ids", "stop")
    longest = max(len(ids) for ids in prompts)
    # a batch's longest prompt named by its position, as its other errors name a prompt
    whose = f"{where}.{[len(ids) for ids in prompts].index(longest)}'s" if batch else "the prompt's"
    # a rank's KV pool holds the whole context (the server refuses to start otherwise: core.check_kv_holds_context),
    # so the context is the only bound
    defaults = defaults or {}
    if max_tokens is None:  # a chat without one: what the context leaves, capped by generation_config's
        left = info.max_model_len - longest  # each prompt is shorter than the context (checked above)
        max_tokens = min(left, max(defaults.get("max_tokens", left), req.min_tokens))  # room for its min_tokens
    elif longest + max_tokens > info.max_model_len and kind == "completion" and implied and not prompt_only:
        max_tokens = info.max_model_len - longest  # as vLLM: the default is capped by what the context leaves
    elif longest + max_tokens > info.max_model_len:
        raise ApiError(400, f"{sent} ({max_tokens}) plus {whose} {longest} tokens is past the model's "
                            f"context of {info.max_model_len} tokens", sent)
    constraint_field, constraint = _constraint(req, info, forced)
    chat = None
    if kind == "chat":
        chat = (parsers or ChatParsers()).output(req, choice, rendered, constraint is not None)
    skip = req.skip_special_tokens and not (chat is not None and codec.any_special(chat.markers))
    params = [_sampling(req, max_tokens, j, bias, defaults, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                        structured_outputs=constraint, skip_special_tokens=skip)
              for _ in prompts for j in range(req.n)]
    if info.speculative is not None:  # refused here (a 400 naming the field), not by every rank's engine
        p = params[0]
        for name, value, off in (("presence_penalty", p.presence_penalty, 0), ("frequency_penalty",
                                 p.frequency_penalty, 0), ("repetition_penalty", p.repetition_penalty, 1)):
            if value != off:
                raise ApiError(400, f"{name}={value} is not served with speculative decoding "
                                    f"({info.speculative_algorithm})",
                               name)
        if p.logit_bias:
            raise ApiError(400, f"logit_bias={req.logit_bias} is not served with speculative decoding "
                                f"({info.speculative_algorithm})", "logit_bias")
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = None
    if kind == "completion" and req.echo:  # a text prompt as sent; token ids decoded with their special tokens
        echo = [p if isinstance(p, str) and codec.tokenizer is not None else codec.decode(ids, False)
                for p, ids in zip(items, prompts)]
    return Job(kind, model, f"{prefix}-{uuid.uuid4().hex}", prompts, params, req.n, include_usage, echo,
               req.return_tokens_as_token_ids, prompt_only, req.prompt_logprobs, constraint_field, chat)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` with its keys read as token ids.

    Raises:
        ApiError: 400 naming ``logit_bias``: a key that is not a token id of the vocabulary.
    """
    out = {}
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        out[token] = value
    return out


def _constraint(req: SamplingFields, info: EngineInfo, forced: tuple[str, dict] | None = None
                ) -> tuple[str | None, StructuredOutputs | None]:
    """The request's constraint on its output (``response_format``, ``structured_outputs``, a ``guided_*`` field, or
    ``forced``: a forced ``tool_choice`` and the JSON schema of its calls) and the field it came in
    (``compile_constraint`` compiles it).

    Raises:
        ApiError: 400 naming the field: more than one given, ``json_schema`` without its schema, a bad value,
            speculative decoding.
    """
    given = {forced[0]: {"json": forced[1], "disable_any_whitespace": True}} if forced is not None else {}
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif fmt.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs its json_schema (with the schema)",
                           "response_format")
        else:
            given["response_format"] = {"json": fmt.json_schema.json_schema}
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        fields["disable_any_whitespace"] = req.structured_outputs.disable_any_whitespace
        given["structured_outputs"] = fields
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given[name] = {kind: getattr(req, name)}
    if not given:
        return None, None
    if len(given) > 1:
        names = list(given)
        raise ApiError(400, f"{' and '.join(names)} both constrain the output: send one of them", names[1])
    (field, spec), = given.items()
    if info.speculative is not None:
        raise ApiError(400, f"{field} is not served with speculative decoding ({info.speculative_algorithm})",
                       field)
    try:
        return field, StructuredOutputs(**spec)
    except ValueError as exc:
        raise _constraint_error(exc, field) from None


def _constraint_error(exc: ValueError, field: str) -> ApiError:
    """A 400 naming ``field`` for ``StructuredOutputs``' or the compiler's message (which names its own field)."""
    message = str(exc)
    if field != "structured_outputs":
        message = message.replace("structured_outputs.", f"{field}: ", 1)
    return ApiError(400, message, field)


async def compile_constraint(job: Job, codec: TextCodec) -> None:
    """Compile ``job``'s constraint (if it has one) in a worker thread before anything is queued, so that a large one
    does not hold up the event loop (llguidance releases the GIL). Each process keeps its own compiled grammars
    (``Grammars``): the engine's ranks compile a grammar once, when it first reaches them.

    Raises:
        ApiError: 400 naming the request's field: the constraint does not compile, or the checkpoint has no
            tokenizer llguidance can read.
    """
    if job.constraint_field is None:
        return
    constraint = job.params[0].structured_outputs

    def compile_here() -> StructuredOutputs:
        lark = constraint.as_lark()  # a GBNF grammar converted here, not in the engine core beside its steps
        codec.constraints().matcher(lark)
        return lark

    try:
        lark = await asyncio.to_thread(compile_here)
    except ValueError as exc:
        raise _constraint_error(exc, job.constraint_field) from None
    if lark is not constraint:
        job.params[:] = [dataclasses.replace(p, structured_outputs=lark) for p in job.params]


def _sampling(req: SamplingFields, max_tokens: int, choice: int, logit_bias: dict[int, float],
              defaults: Mapping[str, float | int], **extra) -> SamplingParams:
    """Choice ``choice``'s ``SamplingParams``; ``extra`` (log-probability counts, the constraint) passed as given."""
    stop = [utf8(s, "stop") for s in ([req.stop] if isinstance(req.stop, str) else req.stop or ())]
    seed = req.seed  # a seed out of range is refused as sent; choice j of a good one samples with seed + j, wrapped
    if seed is not None and 0 <= seed < 2**63:
        seed = (seed + choice) % 2**63
    sent = {name: getattr(req, name) if name in req.model_fields_set else defaults.get(name, getattr(req, name))
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    try:
        return SamplingParams(
            seed=seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=logit_bias,
            **sent, **extra,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), _param_of(str(exc))) from None


def submit(frontend: Frontend, job: Job) -> asyncio.Queue:
    """Queue every choice of ``job``; their updates arrive on the one queue returned.

    Raises:
        ApiError: 503 when the server takes no requests (nothing is left queued).
    """
    out: asyncio.Queue = asyncio.Queue()
    ids = job.choice_ids()
    for i, rid in enumerate(ids):
        try:
            frontend.submit(rid, job.prompt_of(i), job.params[i], out)
        except Unavailable as exc:
            for done in ids[:i]:
                frontend.abort(done)
            raise ApiError(503, str(exc)) from None
    return out


def check_update(item: Update | Failure) -> Update:
    """``item`` when it is news of the request; else the error to answer (500: the server failed under it; 400:
    the engine refused it)."""
    if isinstance(item, Failure):
        raise ApiError(500, f"the server failed while serving the request: {item.message}")
    if item.error is not None:
        raise ApiError(400, item.error, "prompt")
    return item


async def collect(frontend: Frontend, job: Job, updates: asyncio.Queue, codec: TextCodec) -> dict:
    """Wait for every choice and return the whole response (a JSON-ready dict).

    Raises:
        ApiError: 400 the engine refused a prompt; 503 the server failed under it.
    """
    ids = job.choice_ids()
    index = {rid: i for i, rid in enumerate(ids)}
    finals: dict[int, Update] = {}
    try:
        while len(finals) < len(ids):
            up = check_update(await updates.get())
            if up.finished:
                finals[index[up.request_id]] = up
    finally:
        for rid in ids:
            if index[rid] not in finals:
                frontend.abort(rid)
    texts = [final_text(codec, finals[i]) for i in range(len(ids))] if job.kind == "chat" else []
    reasoning = None
    if reads_reasoning(job):
        reasoning = sum(await asyncio.gather(*(reasoning_tokens_of(codec, job, i, finals[i], texts[i])
                                               for i in range(len(ids)))))
    usage = usage_of(job, 0 if job.prompt_only else sum(len(u.token_ids) for u in finals.values()),
                     [finals[i].num_cached_tokens for i in range(len(ids))], reasoning)
    created = int(time.time())
    if job.kind == "chat":
        choices = []
        for i in range(len(ids)):
            message, finish = chat_reply(job, texts[i], finals[i].finish_reason)
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                      logprobs=chat_logprobs(codec, finals[i].logprobs, job.as_ids)))
        return ChatCompletionResponse(id=job.request_id, created=created, model=job.model, usage=usage,
                                      choices=choices,
                                      prompt_logprobs=prompt_logprobs_of(codec, job, 0, finals[0])).model_dump()
    return CompletionResponse(id=job.request_id, created=created, model=job.model, usage=usage, choices=[
        completion_choice(codec, job, i, finals[i]) for i in range(len(ids))]).model_dump()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _chunk(job: Job, created: int, index: int, text: str | None, finish: str | None, role: bool = False,
           logprobs: ChatLogprobs | CompletionLogprobs | None = None, delta: AssistantMessage | None = None) -> str:
    if job.kind == "chat":
        delta = delta or AssistantMessage(role="assistant" if role else None, content=text)
        return _event(ChatCompletionChunk(id=job.request_id, created=created, model=job.model, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)]
        ).model_dump(exclude={"usage"}))
    return _event(CompletionResponse(id=job.request_id, created=created, model=job.model, choices=[
        CompletionChoice(index=index, text=text or "", logprobs=logprobs, finish_reason=finish)]
    ).model_dump(exclude={"usage"}))


async def stream(job: Job, updates: asyncio.Queue, codec: TextCodec, pending: set[str]) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, ending with ``data: [DONE]``.

    A chunk carries the log-probabilities of the tokens that arrived since the last chunk of its choice (a token
    whose text is held back sends them with the chunk that sends its text). An error after the stream started is
    sent as one ``{"error": ...}`` event before ``[DONE]``.

    Args:
        pending: the choices' engine request ids; finished ones are removed (the caller aborts the rest
            when the client goes away).
    """
    ids = job.choice_ids()
    index = {rid: i for i, rid in enumerate(ids)}
    texts = [StreamText(codec, p.stop, p.skip_special_tokens) for p in job.params]
    readers = [StreamReply(job) for _ in ids]
    tokens = [0] * len(ids)
    reasoning = [0] * len(ids)  # per choice, its reasoning tokens (counted when it finishes, for the usage)
    cached = [0] * len(ids)  # per choice, its prompt tokens served from the prefix cache (for the usage)
    unsent: list[list[TokenLogprobs]] = [[] for _ in ids]  # per choice, log-probabilities not sent yet
    sent = [0] * len(ids)  # per choice, tokens whose log-probabilities were sent
    base = [0] * len(ids)  # completions: where the completion's text begins (past an echoed prompt)
    echoed = [job.echo is None] * len(ids)  # the prompt was sent first (echo)
    created = int(time.time())
    if job.kind == "chat":
        for i in range(len(ids)):
            yield _chunk(job, created, i, "", None, role=True)
    try:
        while pending:
            up = check_update(await updates.get())
            i = index[up.request_id]
            cached[i] = up.num_cached_tokens
            if not echoed[i]:  # the first update: the prompt (with its log-probabilities) before any token
                echoed[i] = True
                prompt_text, prompt_lp = echoed_prompt(codec, job, i, up)
                base[i] = len(prompt_text)
                yield _chunk(job, created, i, prompt_text, None, logprobs=prompt_lp)
            if job.prompt_only:  # the token computed beside the prompt is not sent
                if up.finished:
                    pending.discard(up.request_id)
                    yield _chunk(job, created, i, "", "length")
                continue
            tokens[i] = len(up.token_ids)
            whole = final_text(codec, up) if up.finished else None
            text = texts[i].delta(up.token_ids, whole)
            if up.finished:
                pending.discard(up.request_id)
                if job.include_usage:
                    reasoning[i] = await reasoning_tokens_of(codec, job, i, up, whole)
            if up.new_logprobs is not None:
                unsent[i] += up.new_logprobs
            delta, finish = None, up.finish_reason if up.finished else None
            news = bool(text)
            if job.chat is not None:  # reasoning and tool calls: the settled growth of each part
                delta, finish = readers[i].delta(text, up.finished, finish)
                news = bool(delta.content or delta.reasoning_content or delta.tool_calls)
            if news or up.finished:
                logprobs = None
                if job.params[i].logprobs is not None:
                    if job.kind == "chat":
                        logprobs = chat_logprobs(codec, unsent[i], job.as_ids)
                    else:
                        logprobs = completion_logprobs(codec, job, unsent[i], up.token_ids, sent[i], base[i])
                    sent[i] += len(unsent[i])
                    unsent[i] = []
                yield _chunk(job, created, i, text, finish, logprobs=logprobs, delta=delta)
    except ApiError as exc:
        yield _event(exc.body().model_dump())
    else:
        if job.include_usage:
            yield _event({"id": job.request_id, "object": "chat.completion.chunk" if job.kind == "chat"
                          else "text_completion", "created": created, "model": job.model, "choices": [],
                          "usage": usage_of(job, sum(tokens), cached,
                                            sum(reasoning) if reads_reasoning(job) else None).model_dump()})
    yield DONE
