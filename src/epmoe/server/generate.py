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
from dataclasses import dataclass

import jinja2

from epmoe.engine import SamplingParams, TokenLogprobs
from epmoe.engine.sampling import MAX_LOGPROBS
from epmoe.engine.structured import StructuredOutputs
from epmoe.engine.tokenizer import generation_config
from epmoe.server.chat_output import ChatOutput, ChatParsers, Reply, tool_choice
from epmoe.server.core import EngineInfo
from epmoe.server.errors import ApiError
from epmoe.server.frontend import Failure, Frontend, Unavailable, Update
from epmoe.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaToolCall,
    DetokenizeRequest,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    TokenizeRequest,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from epmoe.server.text import StreamText, TextCodec
from epmoe.server.tools import ToolCall, forced_schema

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
DONE = "data: [DONE]\n\n"
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""The ``generation_config.json`` keys a request's left-out fields default to, and the fields (vLLM's set)."""

LOGPROB_FLOOR = -9999.0
"""Log-probabilities below this (``-inf`` included, which JSON cannot carry) are sent as it, as vLLM does."""


@dataclass(frozen=True)
class Job:
    """The engine requests of one HTTP request.

    Attributes:
        kind: ``completion`` or ``chat``.
        model: the model name answered.
        request_id: the response id (``cmpl-...`` / ``chatcmpl-...``).
        prompts: token ids of each prompt.
        params: per choice, its sampling options.
        n: choices per prompt.
        include_usage: streams end with a usage chunk.
        echo: completions with ``echo``: each prompt's text (as sent, or its token ids decoded with their special
            tokens), put before its choices' text; else ``None``.
        as_ids: log-probabilities name tokens ``token_id:<id>`` (``return_tokens_as_token_ids``).
        prompt_only: ``echo`` with ``max_tokens`` 0: each choice is its prompt alone (its text and log-probabilities;
            no completion tokens counted), finished with ``length``.
        sent_prompt_logprobs: vLLM's ``prompt_logprobs`` as the request sent it (the response carries them).
        constraint_field: the field the request's constraint came in (``response_format``, ``structured_outputs``,
            ``guided_*``, a forced ``tool_choice``; every choice's ``SamplingParams.structured_outputs``), or
            ``None``.
        chat: how a chat's outputs are read (reasoning, tool calls: ``chat_output.ChatOutput``), or ``None``
            (plain text).
    """

    kind: str
    model: str
    request_id: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    include_usage: bool
    echo: list[str] | None = None
    as_ids: bool = False
    prompt_only: bool = False
    sent_prompt_logprobs: int | None = None
    constraint_field: str | None = None
    chat: ChatOutput | None = None

    def choice_ids(self) -> list[str]:
        """The engine request id of each choice."""
        return [f"{self.request_id}-{i}" for i in range(len(self.params))]

    def prompt_of(self, choice: int) -> list[int]:
        """The prompt of a choice."""
        return self.prompts[choice // self.n]


def sampling_defaults(directory: str) -> dict[str, float | int]:
    """The sampling defaults of ``directory``'s ``generation_config.json`` (``GENERATION_DEFAULTS``' keys that it
    sets, by field name); ``{}`` without the file.

    Raises:
        ValueError: the file cannot be read, or a value ``SamplingParams`` refuses (the file and key named).
    """
    raw = generation_config(directory)
    out: dict[str, float | int] = {}
    for key, name in GENERATION_DEFAULTS.items():
        if raw.get(key) is None:
            continue
        try:
            SamplingParams(**{name: raw[key]})
        except ValueError as exc:
            raise ValueError(f"{directory}/generation_config.json: {key}: {exc}") from None
        out[name] = raw[key]
    return out


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
        kind, where = "chat", "messages"
        choice = tool_choice(req)
        if choice not in ("none", "auto"):
            forced = ("tool_choice", forced_schema(choice, [t.function.model_dump() for t in req.tools],
                                                   req.parallel_tool_calls))
        rendered = _chat_text(req, codec)
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
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items:
            raise ApiError(400, "prompt must not be empty, got []", "prompt")
        prompts = [codec.encode(_utf8(p, "prompt"), req.add_special_tokens) if isinstance(p, str) else list(p)
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
        raise ApiError(400, f"{sent} must be an integer >= 1 (0 only with echo), got {max_tokens}", sent)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, f"prompt_logprobs={req.prompt_logprobs} is not served with stream: true (as vLLM)",
                       "prompt_logprobs")
    bad_stops = [t for t in req.stop_token_ids or () if not 0 <= t < info.vocab_size]
    if bad_stops:
        raise ApiError(400, f"stop_token_ids must be in [0, {info.vocab_size}), got {bad_stops[:5]}", "stop_token_ids")
    bias = _logit_bias(req.logit_bias, info.vocab_size)
    for ids in prompts:
        if not ids:
            what = "the chat template rendered no text for these messages" if kind == "chat" else "it has no tokens"
            raise ApiError(400, f"{where} must not be empty: {what}", where)
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise ApiError(400, f"{where} token ids must be in [0, {info.vocab_size}), got {bad[:5]}", where)
        if len(ids) >= info.max_model_len:
            raise ApiError(400, f"{where} has {len(ids)} tokens: no room left in the model's context of "
                                f"{info.max_model_len} tokens", where)
    if req.stop and codec.tokenizer is None:
        raise ApiError(400, f"stop strings ({req.stop!r}) need the checkpoint's tokenizer and this checkpoint has "
                            "none; use stop_token_ids", "stop")
    longest = max(len(ids) for ids in prompts)
    # a rank's KV pool holds the whole context (the server refuses to start otherwise: core.check_kv_holds_context),
    # so the context is the only bound
    defaults = defaults or {}
    if max_tokens is None:  # a chat without one: what the context leaves, capped by generation_config's
        left = info.max_model_len - longest  # each prompt is shorter than the context (checked above)
        max_tokens = min(left, max(defaults.get("max_tokens", left), req.min_tokens))  # room for its min_tokens
    elif longest + max_tokens > info.max_model_len and kind == "completion" and implied and not prompt_only:
        max_tokens = info.max_model_len - longest  # as vLLM: the default is capped by what the context leaves
    elif longest + max_tokens > info.max_model_len:
        raise ApiError(400, f"{sent} ({max_tokens}) plus the prompt's {longest} tokens is past the model's "
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


_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                 "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                                 "tokenizer_kwargs"})
"""``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set."""


def _template_message(i: int, m: ChatMessage) -> dict:
    """Message ``i`` as a chat template reads it: a tool call's arguments as an object where they are JSON text of
    one (templates serialise them themselves), as vLLM passes them."""
    out: dict = {"role": m.role, "content": _utf8(m.text(), f"messages.{i}.content")}
    for name in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, name) is not None:
            out[name] = getattr(m, name)
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


def _chat_text(req: ChatCompletionRequest | TokenizeRequest, codec: TextCodec) -> str:
    """The prompt text of a conversation (the chat template's rendering, with the request's tools and
    ``chat_template_kwargs``).

    Raises:
        ApiError: 400 naming the field: a message without content (but an assistant's), text that is not valid
            Unicode, a ``chat_template_kwargs`` key that is ``apply_chat_template``'s own, a conversation the
            template refuses or fails on.
    """
    messages = req.messages
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"messages.{i}.content: a {m.role} message needs content", f"messages.{i}.content")
    plain = [_template_message(i, m) for i, m in enumerate(messages)]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(_TEMPLATE_ARGUMENTS & set(kwargs))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: the server sets them",
                       "chat_template_kwargs")
    try:
        return codec.chat_prompt(plain, tools or None, kwargs)
    except jinja2.TemplateError as exc:  # the template refused the conversation (e.g. roles not alternating)
        raise ApiError(400, f"messages: the chat template refused them: {exc}", "messages") from None
    except Exception as exc:  # the template failed on what the request gave it (a type, a sandbox limit)
        raise ApiError(400, f"messages: the chat template failed on them: {type(exc).__name__}: {exc}",
                       "messages") from None


def tokenize(req: TokenizeRequest, codec: TextCodec, info: EngineInfo) -> dict:
    """vLLM's ``/tokenize`` answer: the token ids a completion's ``prompt`` or a chat's ``messages`` become, their
    count and the context.

    Raises:
        ApiError: 400 naming the field: neither or both of ``prompt`` and ``messages``, ``tools`` or
            ``chat_template_kwargs`` with a ``prompt``, or as a request with them.
    """
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send one of prompt and messages", "prompt")
    for name in ("tools", "chat_template_kwargs"):
        if req.prompt is not None and getattr(req, name) is not None:
            raise ApiError(400, f"{name} go with messages (a chat's prompt), not with prompt", name)
    if req.prompt is not None:
        ids = codec.encode(_utf8(req.prompt, "prompt"), True if req.add_special_tokens is None else
                           req.add_special_tokens)
    else:
        ids = codec.encode(_chat_text(req, codec), bool(req.add_special_tokens))
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}


def detokenize(req: DetokenizeRequest, codec: TextCodec, info: EngineInfo) -> dict:
    """vLLM's ``/detokenize`` answer: the text of ``tokens``, special tokens kept.

    Raises:
        ApiError: 400 naming ``tokens``: an id outside the vocabulary.
    """
    bad = [t for t in req.tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(400, f"tokens must be in [0, {info.vocab_size}), got {bad[:5]}", "tokens")
    return {"prompt": codec.decode(req.tokens, skip_special_tokens=False)}


def _utf8(text: str, field: str) -> str:
    """``text`` if it can be sent as UTF-8.

    Raises:
        ApiError: 400 naming ``field``: ``text`` holds a lone surrogate (JSON's ``\\ud800`` escapes), which no
            tokenizer takes.
    """
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        shown = repr(text) if len(text) <= 80 else repr(text[:77]) + "..."
        raise ApiError(400, f"{field} {shown} is not valid Unicode text: a lone surrogate "
                            f"{text[exc.start]!r} at position {exc.start}", field) from None
    return text


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
    stop = [_utf8(s, "stop") for s in ([req.stop] if isinstance(req.stop, str) else req.stop or ())]
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


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _chat_logprobs(codec: TextCodec, entries: list[TokenLogprobs] | None, as_ids: bool) -> ChatLogprobs | None:
    """The chat form of some tokens' log-probabilities (``None`` when the request asked for none)."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> TopLogprob:
        text = codec.token_text(token_id, as_ids)
        return TopLogprob(token=text, logprob=_logprob(logprob), bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**one(e.token_id, e.logprob).model_dump(), top_logprobs=[one(i, v) for i, v in e.top])
        for e in entries])


def _completion_logprobs(codec: TextCodec, job: Job, entries: list[TokenLogprobs | None] | None, ids: list[int],
                         start: int, base: int, prompt: bool = False) -> CompletionLogprobs | None:
    """The completion form of the log-probabilities ``entries`` of tokens ``ids[start:]`` (``None`` when the
    request asked for none).

    A token's ``text_offset`` is ``base`` plus where its text begins in the decoded text of ``ids``
    (``TextCodec.text_offsets``: special tokens kept in an echoed prompt, in the completion as its
    ``skip_special_tokens`` decodes them, as the text is); its ``top_logprobs`` map the most likely tokens' texts
    to their log-probabilities (tokens of one text: the most likely one's), the token itself included.

    Args:
        entries: per token its ``TokenLogprobs``; ``None`` for an echoed prompt's first token.
        ids: the prompt's tokens (``prompt``) or the completion's so far.
    """
    if entries is None:
        return None
    end = start + len(entries)
    names = [codec.token_text(i, job.as_ids) for i in ids[start:end]]
    skip = not prompt and job.params[0].skip_special_tokens
    offsets = [base + o for o in codec.text_offsets(ids, start, end, skip_special_tokens=skip)]
    tops: list[dict[str, float] | None] = []
    for name, e in zip(names, entries):
        if e is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for i, v in e.top:
            key = codec.token_text(i, job.as_ids)
            top[key] = max(top.get(key, LOGPROB_FLOOR), _logprob(v))
        top.setdefault(name, _logprob(e.logprob))  # the generated token too, as vLLM sends it
        tops.append(top)
    return CompletionLogprobs(text_offset=offsets, tokens=names, top_logprobs=tops,
                              token_logprobs=[None if e is None else _logprob(e.logprob) for e in entries])


def _echoed(codec: TextCodec, job: Job, choice: int, up: Update) -> tuple[str, CompletionLogprobs | None]:
    """An echoing completion choice's prompt text (with the separator of a checkpoint without a tokenizer when a
    completion follows) and, with ``logprobs``, its prompt tokens' log-probabilities (``up`` an update that carries
    them)."""
    text = job.echo[choice // job.n] + ("" if job.prompt_only else codec.separator)
    k, entries = job.params[choice].logprobs, up.prompt_logprobs
    if k is None or entries is None:
        return text, None
    entries = [e if e is None else dataclasses.replace(e, top=e.top[:k]) for e in entries]
    return text, _completion_logprobs(codec, job, entries, job.prompt_of(choice), 0, 0, prompt=True)


def _prompt_logprobs(codec: TextCodec, job: Job, choice: int, up: Update) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a choice (``None`` unless the request sent ``prompt_logprobs``): per prompt
    token its own entry and its position's most likely tokens', ranked."""
    if job.sent_prompt_logprobs is None or up.prompt_logprobs is None:
        return None
    k = job.sent_prompt_logprobs
    out: PromptLogprobs = []
    for e in up.prompt_logprobs:
        if e is None:
            out.append(None)
            continue
        entry = {str(i): PromptLogprob(logprob=_logprob(v), rank=r, decoded_token=codec.token_text(i, job.as_ids))
                 for r, (i, v) in enumerate(e.top[:k], 1)}
        entry.setdefault(str(e.token_id), PromptLogprob(logprob=_logprob(e.logprob), rank=e.rank,
                                                        decoded_token=codec.token_text(e.token_id, job.as_ids)))
        out.append(entry)
    return out


def _joined(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """``a``'s tokens followed by ``b``'s."""
    if a is None or b is None:
        return b if a is None else a
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs
                              + b.token_logprobs, tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs
                              + b.top_logprobs)


def _completion_choice(codec: TextCodec, job: Job, choice: int, up: Update) -> CompletionChoice:
    """One whole completion choice from its final update (the prompt first with ``echo``)."""
    text = final_text(codec, up)
    prompt = _prompt_logprobs(codec, job, choice, up)
    if job.echo is None:
        return CompletionChoice(index=choice, text=text, finish_reason=up.finish_reason, prompt_logprobs=prompt,
                                logprobs=_completion_logprobs(codec, job, up.logprobs, up.token_ids, 0, 0))
    prompt_text, prompt_lp = _echoed(codec, job, choice, up)
    if job.prompt_only:
        return CompletionChoice(index=choice, text=prompt_text, logprobs=prompt_lp, finish_reason="length",
                                prompt_logprobs=prompt)
    logprobs = _joined(prompt_lp, _completion_logprobs(codec, job, up.logprobs, up.token_ids, 0, len(prompt_text)))
    return CompletionChoice(index=choice, text=prompt_text + text, logprobs=logprobs, finish_reason=up.finish_reason,
                            prompt_logprobs=prompt)


def final_text(codec: TextCodec, up: Update) -> str:
    """The whole text of a finished choice (the engine's, cut before a stop string)."""
    return up.text if up.text is not None else codec.decode(up.token_ids)  # no tokenizer: ids in decimal


def _tool_calls(calls: list[ToolCall], delta: bool) -> list[ToolCallOut] | None:
    """The reply's calls (``None`` without any); in a stream delta each with its ``index``."""
    if not calls:
        return None
    if delta:
        return [DeltaToolCall(index=k, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for k, c in enumerate(calls)]
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _finish(job: Job, reply: Reply, finish: str | None) -> str | None:
    """``tool_calls`` where the model chose to call (``auto``, ``required``) and stopped; a named function's call
    finishes with ``stop``, as OpenAI's."""
    chose = job.chat is not None and (job.chat.tools is not None or job.chat.forced == "required")
    return "tool_calls" if reply.calls and chose and finish == "stop" else finish


def _chat_reply(job: Job, text: str, finish: str | None) -> tuple[AssistantMessage, str | None]:
    """A whole chat choice's message (its text read by ``job.chat``) and finish reason."""
    if job.chat is None:
        return AssistantMessage(role="assistant", content=text), finish
    reply = job.chat.reply(text)
    return AssistantMessage(role="assistant", content=reply.content, reasoning_content=reply.reasoning,
                            tool_calls=_tool_calls(reply.calls, delta=False)), _finish(job, reply, finish)


def _usage(job: Job, completion_tokens: int) -> Usage:
    prompt = sum(len(p) for p in job.prompts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


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
    usage = _usage(job, 0 if job.prompt_only else sum(len(u.token_ids) for u in finals.values()))
    created = int(time.time())
    if job.kind == "chat":
        choices = []
        for i in range(len(ids)):
            message, finish = _chat_reply(job, final_text(codec, finals[i]), finals[i].finish_reason)
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                      logprobs=_chat_logprobs(codec, finals[i].logprobs, job.as_ids)))
        return ChatCompletionResponse(id=job.request_id, created=created, model=job.model, usage=usage,
                                      choices=choices,
                                      prompt_logprobs=_prompt_logprobs(codec, job, 0, finals[0])).model_dump()
    return CompletionResponse(id=job.request_id, created=created, model=job.model, usage=usage, choices=[
        _completion_choice(codec, job, i, finals[i]) for i in range(len(ids))]).model_dump()


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


class StreamReply:
    """One streamed chat choice read by ``job.chat``: the text so far, and how much of its reasoning and content
    was sent."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.text = ""
        self.sent = [0, 0]  # reasoning, content

    def delta(self, text: str, finished: bool, finish: str | None) -> tuple[AssistantMessage, str | None]:
        """The delta of the next chunk (what settled since the last; on the last, the rest and the calls) and its
        finish reason."""
        self.text += text
        calls = []
        if finished:
            reply = self.job.chat.reply(self.text)
            parts, calls = (reply.reasoning or "", reply.content or ""), reply.calls
            finish = _finish(self.job, reply, finish)
        else:
            parts = self.job.chat.settled(self.text)
        new = [part[sent:] for part, sent in zip(parts, self.sent)]
        self.sent = [len(part) for part in parts]
        return AssistantMessage(reasoning_content=new[0] or None, content=new[1] or None,
                                tool_calls=_tool_calls(calls, delta=True)), finish


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
            if not echoed[i]:  # the first update: the prompt (with its log-probabilities) before any token
                echoed[i] = True
                prompt_text, prompt_lp = _echoed(codec, job, i, up)
                base[i] = len(prompt_text)
                yield _chunk(job, created, i, prompt_text, None, logprobs=prompt_lp)
            if job.prompt_only:  # the token computed beside the prompt is not sent
                if up.finished:
                    pending.discard(up.request_id)
                    yield _chunk(job, created, i, "", "length")
                continue
            tokens[i] = len(up.token_ids)
            text = texts[i].delta(up.token_ids, final_text(codec, up) if up.finished else None)
            if up.finished:
                pending.discard(up.request_id)
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
                        logprobs = _chat_logprobs(codec, unsent[i], job.as_ids)
                    else:
                        logprobs = _completion_logprobs(codec, job, unsent[i], up.token_ids, sent[i], base[i])
                    sent[i] += len(unsent[i])
                    unsent[i] = []
                yield _chunk(job, created, i, text, finish, logprobs=logprobs, delta=delta)
    except ApiError as exc:
        yield _event(exc.body().model_dump())
    else:
        if job.include_usage:
            yield _event({"id": job.request_id, "object": "chat.completion.chunk" if job.kind == "chat"
                          else "text_completion", "created": created, "model": job.model, "choices": [],
                          "usage": _usage(job, sum(tokens)).model_dump()})
    yield DONE
