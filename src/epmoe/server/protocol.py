"""The OpenAI API schema the server speaks (pydantic): requests, responses, stream chunks, errors.

Requests are validated strictly (a string where a number belongs is refused, not coerced); fields the
schema does not name are ignored, as vLLM does (``logprobs``, ``presence_penalty``, ... have no effect).
Value ranges (``temperature >= 0``, ``0 < top_p <= 1``, ``max_tokens >= 1``) are checked by
``epmoe.engine.SamplingParams``; ``n`` is capped here at ``MAX_N``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from epmoe.server.config import MAX_N


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class SamplingFields(_Request):
    """The sampling fields both endpoints share (OpenAI's names, plus vLLM's ``top_k``, ``min_tokens``,
    ``ignore_eos``, ``stop_token_ids``)."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either (one choice set
    each)."""

    prompt: str | list[int] | list[str] | list[list[int]]


class ContentPart(_Request):
    """One part of a message's content (only text parts are served)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class RebalanceRequest(_Request):
    """``POST /eplb/rebalance`` (the body may be left out): ``max_moves`` caps the expert copies moved. Unlike the
    OpenAI routes (whose clients send fields this server does not use), epmoe's own route refuses unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_moves: int | None = Field(None, ge=0)


class Usage(BaseModel):
    """Token counts of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """One choice of a completion (a whole one, or a stream chunk's delta text)."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, or one stream chunk of it (``object`` is ``text_completion`` in both, as OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    """The assistant's reply (a whole one) or a stream delta of it."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One served model (``GET /v1/models``); ``max_model_len`` is vLLM's extra field."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "epmoe"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error body: ``message`` names the field and the value; ``param`` is the field."""

    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``."""

    error: ErrorInfo
