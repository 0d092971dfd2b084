"""OpenAI's Responses API (``POST /v1/responses``) on the chat path: a request is translated into a chat request
(``as_chat``), runs as one, and its reply comes back as a ``response`` object whose ``output`` holds a
``reasoning`` item (what a ``--reasoning-parser`` split off), a ``message`` with its ``output_text`` and one
``function_call`` item per tool call; streamed, as the Responses API's typed events.

Stateless, as vLLM without a store: a request carries its whole conversation (``input``); ``previous_response_id``
and ``background`` are refused.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator

import pydantic

from epmoe.server.errors import ApiError, validation_error
from epmoe.server.generate import check_update
from epmoe.server.job import Job
from epmoe.server.protocol import (
    ChatCompletionRequest,
    InputFunctionCall,
    InputFunctionOutput,
    ResponsesRequest,
)
from epmoe.server.replies import StreamReply, final_text, reasoning_tokens_of
from epmoe.server.text import StreamText, TextCodec

_FIELDS = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"))
"""Chat fields a translated request's errors name, as the Responses API calls them (a message's place among the
chat's ``messages`` is not its place in ``input``: such errors name ``input``)."""
_MESSAGES = re.compile(r"(?<!')\bmessages(\.\d+(\.\w+)*)?")  # not a quoted key the client sent ('messages')


def as_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request of a Responses API request: ``instructions`` as a system message, ``input``'s messages,
    runs of function calls as one assistant message with those ``tool_calls``, function outputs as ``tool``
    messages; the tools, the choice, ``text.format`` and ``structured_outputs`` in their chat form.

    Raises:
        ApiError: 400 ``previous_response_id``, ``background`` or ``prompt`` (nothing is stored), ``text.format``
            ``json_schema`` without its ``schema``, an empty ``input`` (``""`` or ``[]``, with ``instructions`` or
            without, as OpenAI refuses it), a translated request the chat endpoint refuses (named as there,
            ``renamed`` for the Responses API), a ``function_call_output`` whose ``call_id`` no ``function_call``
            before it has.
    """
    if req.previous_response_id is not None:
        raise ApiError(400, f"previous_response_id={req.previous_response_id!r} is not served: epmoe stores no "
                            "responses; send the whole conversation in input", "previous_response_id")
    if req.background:
        raise ApiError(400, "background=true is not served: epmoe answers while the request is open", "background")
    if req.prompt is not None:
        raise ApiError(400, "prompt (a stored prompt's reference) is not served: epmoe stores no prompts; send its "
                            "text in instructions and input", "prompt")
    if not req.input:  # as OpenAI: instructions alone are no input
        raise ApiError(400, f"input must not be empty, got {req.input!r}: send a message's text or a list of "
                            "input items", "input")
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    calls: set[str] = set()  # the call ids of the function calls so far: an output answers one of them
    for i, item in enumerate(items):
        if isinstance(item, dict):
            messages.append(item)
        elif isinstance(item, InputFunctionCall):
            calls.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, InputFunctionOutput):
            if item.call_id not in calls:  # as OpenAI refuses it: the template would show an answer to no call
                raise ApiError(400, f"input[{i}]: no function_call before it has call_id {item.call_id!r}, which "
                                    f"this function_call_output answers", f"input.{i}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            messages.append({"role": item.role, "content": item.text()})
    body: dict = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
                  "top_k": req.top_k, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("seed", "user", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.structured_outputs is not None:
        body["structured_outputs"] = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.json_schema is None:
            raise ApiError(400, "text.format of type json_schema needs its schema", "text.format")
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(body, strict=False)
    except pydantic.ValidationError as exc:  # named as the chat endpoint names it, then renamed for input
        raise validation_error(exc) from None


def renamed(exc: ApiError) -> ApiError:
    """``exc`` (of the chat path) naming the Responses API's fields (``max_tokens`` -> ``max_output_tokens``,
    ``messages.2.content`` -> ``input``)."""
    param, message = exc.param, _MESSAGES.sub("input", exc.message)
    if param is not None:
        param = _MESSAGES.sub("input", param)
    for chat, ours in _FIELDS:
        message = message.replace(chat, ours)
        if param is not None and (param == chat or param.startswith(chat + ".")):
            param = ours + param[len(chat):]
    return ApiError(exc.status, message, param)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _response(req: ResponsesRequest, job: Job, created: int, status: str, output: list[dict],
              usage: dict | None, finish: str | None) -> dict:
    """The ``response`` object."""
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    return {"id": job.request_id.replace("chatcmpl", "resp", 1), "object": "response", "created_at": created,
            "status": status, "model": job.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or ()],
            "text": {"format": {"type": "text"}} if req.text is None or req.text.format is None
            else {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "store": False, "background": False}


def _usage(job: Job, output_tokens: int, reasoning_tokens: int, cached_tokens: int) -> dict:
    """The response's ``usage``.

    Args:
        job: the request (one prompt, one choice).
        output_tokens: the tokens generated.
        reasoning_tokens: of those, the reasoning's (``ChatOutput.reasoning_tokens``: up to and with its end marker
            ``</think>``, all where the answer never begins, 0 where no reasoning parser reads the output or it does
            not reason).
        cached_tokens: the prompt tokens the engine served from its prefix cache (``Update.num_cached_tokens``).
    """
    prompt = len(job.prompts[0])
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + output_tokens}


def _status(finish: str | None) -> str:
    return "incomplete" if finish in ("length", "abort") else "completed"


def whole(req: ResponsesRequest, job: Job, chat: dict) -> dict:
    """The ``response`` of a whole chat completion (``generate.collect``'s answer)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict] = []
    if message.get("reasoning_content") is not None:
        output.append(_reasoning_item(_id("rs"), message["reasoning_content"]))
    if message.get("content") is not None:
        output.append(_message_item(_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        output.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = chat["usage"]
    details = usage.get("completion_tokens_details") or {"reasoning_tokens": 0}  # none: no reasoning parser
    return _response(req, job, chat["created"], _status(choice["finish_reason"]), output,
                     _usage(job, usage["completion_tokens"], details["reasoning_tokens"],
                            usage["prompt_tokens_details"]["cached_tokens"]), choice["finish_reason"])


class _Events:
    """The numbered server-sent events of one streamed response."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def stream(req: ResponsesRequest, job: Job, updates: asyncio.Queue, codec: TextCodec,
                 pending: set[str]) -> AsyncIterator[str]:
    """The Responses API's events of a streamed response: ``response.created`` and ``response.in_progress``; per
    output item ``response.output_item.added``, its deltas (``response.reasoning_text.delta``,
    ``response.output_text.delta`` in a ``content_part``, a call's ``response.function_call_arguments.delta``),
    their ``.done`` events and ``response.output_item.done``; last ``response.completed`` (or
    ``response.incomplete``). An error after the stream started is one ``error`` event.

    Args:
        pending: the request's engine request id; removed once finished (the caller aborts it when the client
            goes away).
    """
    event, created = _Events(), int(time.time())
    yield event("response.created", response=_response(req, job, created, "in_progress", [], None, None))
    yield event("response.in_progress", response=_response(req, job, created, "in_progress", [], None, None))
    params = job.params[0]
    text, reply = StreamText(codec, params.stop, params.skip_special_tokens), StreamReply(job)
    output: list[dict] = []
    open_kind: str | None = None  # the item being streamed: "reasoning" or "message"
    parts = {"reasoning": "", "message": ""}

    def close() -> list[str]:
        """The events that end the open item."""
        if open_kind is None:
            return []
        item, index = output[-1], len(output) - 1
        if open_kind == "reasoning":
            item.update(_reasoning_item(item["id"], parts["reasoning"]))
            return [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=parts["reasoning"]),
                    event("response.output_item.done", output_index=index, item=item)]
        item.update(_message_item(item["id"], parts["message"], "completed"))
        part = item["content"][0]
        return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=parts["message"], logprobs=[]),
                event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=index, item=item)]

    def open_item(kind: str) -> list[str]:
        """The events that start an item of ``kind``."""
        index = len(output)
        if kind == "reasoning":
            output.append({"type": "reasoning", "id": _id("rs"), "summary": [], "content": []})
            return [event("response.output_item.added", output_index=index, item=dict(output[-1]))]
        output.append({**_message_item(_id("msg"), "", "in_progress"), "content": []})
        return [event("response.output_item.added", output_index=index, item=dict(output[-1])),
                event("response.content_part.added", item_id=output[-1]["id"], output_index=index,
                      content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    finish, tokens, reasoning, cached = None, 0, 0, 0
    try:
        while pending:
            up = check_update(await updates.get())
            tokens, cached = len(up.token_ids), up.num_cached_tokens
            whole_text = final_text(codec, up) if up.finished else None
            if up.finished:
                pending.discard(up.request_id)
                finish = up.finish_reason
                reasoning = await reasoning_tokens_of(codec, job, 0, up, whole_text)
            new = text.delta(up.token_ids, whole_text)
            delta, finish = reply.delta(new, up.finished, finish) if job.chat is not None else (None, finish)
            pieces = ([("reasoning", delta.reasoning_content), ("message", delta.content)] if delta is not None
                      else [("message", new)])
            for kind, piece in pieces:
                if not piece:
                    continue
                if open_kind != kind:
                    for line in close() + open_item(kind):
                        yield line
                    open_kind = kind
                parts[kind] += piece
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                yield event(name, item_id=output[-1]["id"], output_index=len(output) - 1, content_index=0,
                            delta=piece, **extra)
            if up.finished:
                for line in close():
                    yield line
                open_kind = None
                for call in (delta.tool_calls or ()) if delta is not None else ():
                    index, arguments = len(output), call.function.arguments
                    item = {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.function.name,
                            "arguments": "", "status": "in_progress"}
                    output.append(item)
                    yield event("response.output_item.added", output_index=index, item=dict(item))
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=arguments)
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=arguments)
                    item.update(arguments=arguments, status="completed")
                    yield event("response.output_item.done", output_index=index, item=item)
    except ApiError as exc:
        yield event("error", code=str(exc.status), message=exc.message, param=exc.param)
        return
    status = _status(finish)
    yield event(f"response.{status}", response=_response(req, job, created, status, output,
                                                         _usage(job, tokens, reasoning, cached), finish))
