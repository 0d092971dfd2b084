"""The OpenAI API schema the server speaks (pydantic): requests, responses, stream chunks, errors.

Requests are validated strictly (a string where a number belongs is refused, not coerced); ``null`` for a field
with a default means the default (the OpenAI schema marks them nullable, and its clients send ``None`` through).
Fields that would change the output but are not served (``UNSERVED``: ``suffix``, ``best_of``, beam search,
a completion's tools, ...) are refused unless left at their neutral value, so that no client gets
something other than it asked for; other fields the schema does not name are ignored (``user``-like metadata).
Value ranges (``temperature >= 0``, ``0 < top_p <= 1``, ``max_tokens >= 1``) are checked by
``epmoe.engine.SamplingParams``; ``n`` is capped here at ``MAX_N``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator
from pydantic_core import PydanticCustomError

from epmoe.server.config import MAX_N

UNSERVED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""), "best_of": (None, 1), "use_beam_search": (None, False),
    "allowed_token_ids": (None,), "bad_words": (None, []), "include_stop_str_in_output": (None, False),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True), "length_penalty": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
    "chat_template": (None,),
}
"""OpenAI and vLLM request fields that change the output and that this server does not serve, with the values that
leave the output as it is (a request with another value is refused, naming the field)."""


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` equals one of ``allowed`` as JSON values: ``null`` and booleans only themselves (in Python ``False ==
    0``), numbers any number of the same value (``0.0`` for ``0``), strings, lists and objects their equals."""
    for a in allowed:
        if a is None or isinstance(a, bool):
            same = value is a
        elif isinstance(a, (int, float)):
            same = type(value) in (int, float) and value == a
        else:
            same = type(value) is type(a) and value == a
        if same:
            return True
    return False


def _refuse_unserved(cls: type[BaseModel], data: dict, unserved: dict[str, tuple[Any, ...]]) -> None:
    """Refuse (pydantic's ``unserved`` error) a field of ``unserved`` that request type ``cls`` does not have, sent
    at another value than its neutral ones."""
    for name, allowed in unserved.items():
        if name in data and name not in cls.model_fields and not _neutral(data[name], allowed):
            raise PydanticCustomError(
                "unserved", "{field}={shown} is not served by epmoe (the output would not be what was asked); "
                "leave {field} out or send {allowed}",
                {"field": name, "shown": _shown(data[name]), "allowed": " or ".join(json.dumps(a) for a in allowed)})


def _shown(value: Any) -> str:
    """``value`` as JSON for an error message, cut to 80 characters."""
    shown = json.dumps(value, default=repr)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _null_as_default(cls: type[BaseModel], data: dict) -> dict:
    """A request body without the ``null`` values of ``cls``'s fields that have a default other than ``None``
    (the OpenAI schema marks them nullable: ``null`` means the default)."""
    fields = cls.model_fields
    return {k: v for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema (under ``schema``), with OpenAI's ``name``, ``description``
    and ``strict`` (the output always holds to the schema here)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (a JSON object) or ``json_schema``
    (a JSON value its ``json_schema.schema`` validates)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (Lark or GBNF),
    ``json_object``; ``disable_any_whitespace`` for JSON without free whitespace. Unknown keys are refused (vLLM's
    other backends' options would change the output)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict | str | None = Field(None, alias="json")  # ``json`` would shadow pydantic's method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(_Request):
    """The sampling fields both endpoints share (OpenAI's names, plus vLLM's ``top_k``, ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``return_tokens_as_token_ids``,
    ``prompt_logprobs``); ``logit_bias`` maps token ids (as JSON object keys: strings) to biases. A constraint on
    the output comes as OpenAI's ``response_format``, vLLM's ``structured_outputs`` or vLLM's older ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar`` (at most one of them). ``model`` may be left out, as vLLM
    allows (the served model)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_unserved(cls, data: Any) -> Any:
        """``null`` for a field with a default: the default; an ``UNSERVED`` field that this request type does not
        have at another value: refused."""
        if not isinstance(data, dict):
            return data
        _refuse_unserved(cls, data, UNSERVED)
        return _null_as_default(cls, data)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either (one choice set
    each); ``logprobs`` asks for each token's log-probability and those of that many most likely tokens; ``echo``
    puts the prompt before the completion, in the text and (with ``logprobs``) in the log-probabilities;
    ``add_special_tokens`` (vLLM's; default true) lets the tokenizer add its special tokens (a BOS) to a text
    prompt."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True


class ContentPart(_Request):
    """One part of a message's content (only text parts are served)."""

    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    """A function call of an earlier assistant message: its name and its arguments' JSON text."""

    name: str
    arguments: str


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    """One chat message; an assistant's may carry its ``tool_calls`` (and no content), a tool's reply the
    ``tool_call_id`` it answers; ``reasoning_content`` is an assistant's earlier reasoning (templates that show it
    read it)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    """A tool's function: its name, description and the JSON schema of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    """One of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    """The function a ``tool_choice`` names."""

    name: str


class NamedToolChoice(_Request):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``; ``logprobs``
    asks for each token's log-probability, ``top_logprobs`` for those of that many most likely tokens too;
    ``add_special_tokens`` (vLLM's; default false: the template's text holds them) lets the tokenizer add its own.
    ``tools`` and ``tool_choice`` as OpenAI's (``server.tools``; ``parallel_tool_calls`` false keeps the first
    call); ``chat_template_kwargs`` (vLLM's) are passed to the chat template (Qwen3's ``enable_thinking``);
    ``add_generation_prompt`` (default true) and ``continue_final_message`` (default false; the reply continues the
    last, assistant, message) as vLLM's and ``apply_chat_template``'s."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None


class InputText(_Request):
    """A text part of a Responses API input message (``input_text``; an earlier reply's ``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Request):
    """A message of a Responses API ``input`` list (``type`` ``message``, or left out as the SDK allows)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        """The message's text."""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _CallItem(_Request):
    """An item of a Responses API ``input`` list about one function call (``call_id``); ``id`` and ``status`` as
    an earlier response gave them."""

    call_id: str
    id: str | None = None
    status: str | None = None


class InputFunctionCall(_CallItem):
    """An earlier function call of the model."""

    type: Literal["function_call"]
    name: str
    arguments: str


class InputFunctionOutput(_CallItem):
    """A function's result."""

    type: Literal["function_call_output"]
    output: str


class ResponseFunctionTool(FunctionDefinition):
    """A function tool of the Responses API (the function's fields at the top, not under ``function``)."""

    type: Literal["function"]


class ResponseNamedChoice(NamedFunction):
    """The Responses API's ``tool_choice`` naming a function (its ``name`` at the top)."""

    type: Literal["function"]


class ResponseTextFormat(_Request):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``schema`` (and OpenAI's ``name``,
    ``description``, ``strict``)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(_Request):
    """``text``: the output's ``format``."""

    format: ResponseTextFormat | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it, stateless): ``input`` a string or a list of
    messages, earlier function calls and their outputs; ``instructions`` a system message before them; ``tools``
    function tools; ``text.format`` a constraint as chat's ``response_format``, vLLM's ``structured_outputs`` one as
    the chat's. Nothing is stored:
    ``previous_response_id``, ``background`` and ``prompt`` (a stored prompt's reference) are refused
    (``server.responses`` translates the rest to a chat request). ``model`` may be left out, as vLLM allows (the
    served model)."""

    model: str | None = None
    input: str | list[InputMessage | InputFunctionCall | InputFunctionOutput]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stream: bool = False
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    store: bool = True
    metadata: dict | None = None
    user: str | None = None
    previous_response_id: str | None = None
    background: bool = False
    prompt: dict | None = None
    chat_template_kwargs: dict | None = None
    structured_outputs: StructuredOutputsField | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """``null`` for a field with a default: the default (as the other requests); a tool of another type than
        ``function`` (OpenAI's built-in tools: web search, file search, ...) refused by its type, which the function
        tool's missing fields would otherwise hide."""
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            if isinstance(tool, dict) and tool.get("type", "function") != "function":
                raise PydanticCustomError(
                    "unserved", "{field}={shown} is not served by epmoe: only function tools are (type \"function\")",
                    {"field": f"tools.{i}.type", "shown": _shown(tool["type"])})
        return _null_as_default(cls, data)


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a ``prompt`` as a completion encodes it, or ``messages`` as a chat renders and
    encodes them (with its ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` and
    ``continue_final_message``); ``add_special_tokens`` defaults as there (true for a prompt, false for messages).
    ``model`` may be left out, as vLLM allows (the served model)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _unserved(cls, data: Any) -> Any:
        """A request's own ``chat_template`` is refused, as on chats."""
        if isinstance(data, dict):
            _refuse_unserved(cls, data, {"chat_template": UNSERVED["chat_template"]})
        return data


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids to text, special tokens kept; ``model`` may be left out, as vLLM
    allows (the served model)."""

    model: str | None = None
    tokens: list[int]


class RebalanceRequest(_Request):
    """``POST /eplb/rebalance`` (the body may be left out): ``max_moves`` caps the expert copies moved. Unlike the
    OpenAI routes (whose clients send fields this server does not use), epmoe's own route refuses unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_moves: int | None = Field(None, ge=0)


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of the completion tokens: ``reasoning_tokens``, the output's reasoning
    (``ChatOutput.reasoning_tokens``, summed over the choices)."""

    reasoning_tokens: int


class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt tokens: ``cached_tokens``, those the engine served from its prefix cache
    (``RequestOutput.num_cached_tokens``, counted once per prompt as ``prompt_tokens`` is)."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of one response; ``completion_tokens_details`` only for a chat whose output a reasoning parser
    reads (else ``null``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The log-probabilities of a completion's tokens (OpenAI's legacy form): per token its text, its offset in
    the choice's text, its log-probability and a map of the most likely tokens' texts to theirs (the token itself
    included); ``null`` for an echoed prompt's first token (nothing predicts it)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's log-probabilities: the value, the rank at its position (1 = most likely)
    and the token's text."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt token (``null`` for the first), its entry and those of the most likely
tokens at its position, keyed by token id (a JSON string)."""


class CompletionChoice(BaseModel):
    """One choice of a completion (a whole one, or a stream chunk's delta text); ``prompt_logprobs`` is vLLM's."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completion, or one stream chunk of it (``object`` is ``text_completion`` in both, as OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    """A function the model called: its name and its arguments' JSON text."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A tool call of the reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCallOut):
    """A tool call in a stream chunk's delta (sent whole), ``index`` its place in the reply's calls."""

    index: int


class AssistantMessage(BaseModel):
    """The assistant's reply (a whole one) or a stream delta of it; ``reasoning_content`` (DeepSeek's and vLLM's
    field) is what a ``--reasoning-parser`` split off."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[SerializeAsAny[ToolCallOut]] | None = None


class TopLogprob(BaseModel):
    """One token's text, its log-probability and its text's UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    """A generated token with the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """The log-probabilities of a chat choice's (or stream chunk's) tokens."""

    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; ``prompt_logprobs`` is vLLM's (the rendered conversation's tokens)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


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
