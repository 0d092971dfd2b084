"""What a request's prompt becomes: a chat's conversation rendered by the chat template (with its tools and
``chat_template_kwargs``), and vLLM's ``/tokenize`` and ``/detokenize`` answers."""

from __future__ import annotations

import json

import jinja2

from epmoe.server.core import EngineInfo
from epmoe.server.errors import ApiError
from epmoe.server.protocol import ChatCompletionRequest, ChatMessage, DetokenizeRequest, TokenizeRequest
from epmoe.server.text import TextCodec

_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                 "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                                 "tokenizer_kwargs"})
"""``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set."""


def _template_message(i: int, m: ChatMessage) -> dict:
    """Message ``i`` as a chat template reads it: a tool call's arguments as an object where they are JSON text of
    one (templates serialise them themselves), as vLLM passes them."""
    out: dict = {"role": m.role, "content": utf8(m.text(), f"messages.{i}.content")}
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


def chat_text(req: ChatCompletionRequest | TokenizeRequest, codec: TextCodec) -> str:
    """The prompt text of a conversation (the chat template's rendering, with the request's tools and
    ``chat_template_kwargs``).

    Raises:
        ApiError: 400 naming the field: a message without content (but an assistant's) or with an empty array of
            parts, a tool's reply to a call id no earlier assistant message made, text that is not valid
            Unicode, a ``chat_template_kwargs`` key that is ``apply_chat_template``'s own, ``continue_final_message``
            with ``add_generation_prompt`` or after another role's message, a conversation the template refuses or
            fails on.
    """
    messages = req.messages
    calls: set[str] = set()  # the ids of the tool calls of the assistant messages so far
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise ApiError(400, f"messages.{i}.content: a {m.role} message needs content", f"messages.{i}.content")
        if isinstance(m.content, list) and not m.content:  # OpenAI's API refuses an empty array too
            raise ApiError(400, f"messages.{i}.content: an empty array; give at least one content part or a string",
                           f"messages.{i}.content")
        if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in calls:  # as /v1/responses does
            raise ApiError(400, f"messages.{i}.tool_call_id: no assistant message before it has a tool call with id "
                                f"{m.tool_call_id!r}", f"messages.{i}.tool_call_id")
        calls.update(c.id for c in m.tool_calls or ())
    plain = [_template_message(i, m) for i, m in enumerate(messages)]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(_TEMPLATE_ARGUMENTS & set(kwargs))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: the server sets them",
                       "chat_template_kwargs")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise ApiError(400, "continue_final_message=true continues the last message: send "
                                "add_generation_prompt=false with it", "continue_final_message")
        if messages[-1].role != "assistant":
            raise ApiError(400, f"continue_final_message=true continues an assistant's message; the last message is "
                                f"a {messages[-1].role}'s", "continue_final_message")
    try:
        return codec.chat_prompt(plain, tools or None, kwargs, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message)
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
        ids = codec.encode(utf8(req.prompt, "prompt"), True if req.add_special_tokens is None else
                           req.add_special_tokens)
    else:
        ids = codec.encode(chat_text(req, codec), bool(req.add_special_tokens))
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


def utf8(text: str, field: str) -> str:
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
