"""Tool calling and reasoning through a real ``epmoe serve`` process (one rank, the built-in checkpoint, a chat
template that shows tools as Qwen's does), driven by the official ``openai`` client.

The built-in checkpoint's weights are random, so its free text holds no calls: the tests lead its output with a
constraint (a forced ``tool_choice``, or a regex the text of a call or of reasoning matches) and check what the
server reads from it, whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.server.test_chat_output import TOOLS_TEMPLATE

pytestmark = pytest.mark.multiprocess

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--ep", "1", "--chat-template", TOOLS_TEMPLATE, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _streamed(client, **fields) -> tuple[str, str, dict[int, dict], str]:
    """A streamed chat's reasoning, content, tool calls (by index: id, name, arguments) and finish reason."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **fields):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or ():
            calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_auto_tool_choice_reads_the_calls_the_model_writes(client):
    fields = {"messages": USER, "tools": [WEATHER], "max_tokens": 90, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": "Hi " + CALL.replace("{", r"\{").replace("}", r"\}")}}}
    whole = client.chat.completions.create(model=MODEL, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Hi "
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    reasoning, content, calls, finish = _streamed(client, **fields)
    assert (reasoning, content, finish) == ("", "Hi ", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")


def test_a_named_or_required_tool_choice_is_a_call_of_that_tool(client):
    named = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=40, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's: a named call stops
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city"} and len(arguments["city"]) <= 6
    _, content, calls, finish = _streamed(client, messages=USER, tools=[WEATHER], max_tokens=40, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (content, finish) == ("", "stop") and json.loads(calls[0]["arguments"]) == arguments
    required = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=60,
                                              temperature=0, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == [
        "get_weather"]
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}


def test_reasoning_is_split_off_whole_and_streamed(client):
    # the template opens <think>: a free output that never closes it is all reasoning
    whole = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    message = whole.choices[0].message
    assert message.content is None and len(message.reasoning_content) > 0
    assert whole.choices[0].finish_reason == "length"
    assert _streamed(client, messages=USER, max_tokens=8, temperature=0) == (message.reasoning_content, "", {},
                                                                             "length")
    # a constrained output reasons only where it writes <think> itself; enable_thinking false: no <think> opened
    fields = {"messages": USER, "max_tokens": 40, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": "<think>plan</think>Paris"},
                             "chat_template_kwargs": {"enable_thinking": False}}}
    split = client.chat.completions.create(model=MODEL, **fields).choices[0].message
    assert (split.reasoning_content, split.content) == ("plan", "Paris")
    assert _streamed(client, **fields) == ("plan", "Paris", {}, "stop")


def test_a_conversation_with_earlier_calls_reaches_the_template(client):
    messages = [*USER, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                         max_tokens=2, temperature=0)
    rendered = (f'<tools>get_weather(city);</tools><|user|>weather?<|assistant|>{CALL}'
                '<|tool|>sunny[call_1]<|assistant|><think>')
    assert got.usage.prompt_tokens == len(rendered.encode())  # the byte-level tokenizer: one token a byte
    assert got.choices[0].message.tool_calls is None


def test_tool_requests_it_cannot_serve_are_refused_and_it_still_serves(server, client):
    with pytest.raises(openai.BadRequestError, match="tool_choice names function 'nope', which is not among tools"):
        client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tools=.* is not served by epmoe"):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"tools": [WEATHER]})
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices[0].finish_reason
    assert "chat outputs: tool calls read as hermes (tool_choice auto on); reasoning split as qwen3" in \
        server.log.read_text()


def test_skip_special_tokens_false_keeps_them_in_completions(client):
    """``skip_special_tokens`` (vLLM's field, served now): the text, whole and streamed, and its offsets keep the
    special tokens a completion holds when it is false."""
    from epmoe.models.tiny import ensure_default_checkpoint
    from epmoe.server.text import TextCodec

    tokenizer = TextCodec(str(ensure_default_checkpoint()), 259).tokenizer
    eos, shown = tokenizer.eos_token_id, tokenizer.eos_token
    for skip, text, offsets in ((False, shown * 3, [0, len(shown), 2 * len(shown)]), (True, "", [0, 0, 0])):
        fields = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0, "logit_bias": {str(eos): 100},
                  "extra_body": {"ignore_eos": True, "skip_special_tokens": skip}}
        got = client.completions.create(logprobs=0, **fields).choices[0]
        assert (got.text, got.logprobs.text_offset) == (text, offsets)
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **fields)) == text


# ---- the Responses API (/v1/responses), on the same chat path -------------------------------------------------


def _events(client, **fields) -> tuple[list[str], str, str, list[tuple[str, str]], object]:
    """A streamed response's event types, its reasoning and output text from the deltas, its calls (name,
    arguments) from the argument events, and its last event's response."""
    kinds, reasoning, text, calls, last, names = [], "", "", [], None, {}
    for ev in client.responses.create(model=MODEL, stream=True, **fields):
        kinds.append(ev.type)
        if ev.type == "response.reasoning_text.delta":
            reasoning += ev.delta
        elif ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type == "response.output_item.added" and ev.item.type == "function_call":
            names[ev.item.id] = ev.item.name
        elif ev.type == "response.function_call_arguments.done":
            calls.append((names[ev.item_id], ev.arguments))
        last = getattr(ev, "response", last)
    return kinds, reasoning, text, calls, last


def test_responses_api_answers_as_the_chat_does_whole_and_streamed(client):
    off = {"enable_thinking": False}  # the template opens no <think>: the output is the message
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"}, *USER],
                                          max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": off})
    fields = {"instructions": "be brief", "input": "weather?", "max_output_tokens": 6, "temperature": 0,
              "extra_body": {"chat_template_kwargs": off}}
    got = client.responses.create(model=MODEL, **fields)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in got.output] == ["message"]
    assert got.output_text == chat.choices[0].message.content
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    kinds, reasoning, text, calls, last = _events(client, **fields)
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert (reasoning, text, calls) == ("", got.output_text, []) and last.output[0].content[0].text == text
    # the template opens <think>: the output is all reasoning, a reasoning item
    thought = client.responses.create(model=MODEL, input="weather?", max_output_tokens=6, temperature=0)
    assert [item.type for item in thought.output] == ["reasoning"]
    whole = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert thought.output[0].content[0].text == whole.choices[0].message.reasoning_content
    assert _events(client, input="weather?", max_output_tokens=6, temperature=0)[1] == \
        thought.output[0].content[0].text


def test_reasoning_tokens_are_counted_whole_and_streamed(server, client):
    """``usage.output_tokens_details.reasoning_tokens`` (Responses API) and ``completion_tokens_details`` (chat):
    the output's tokens before its answer begins, with ``</think>``; all of an output that never leaves its
    reasoning; 0 without reasoning (was always 0)."""
    import httpx

    def post(path: str, body: dict) -> dict:
        got = httpx.post(f"{server.url}{path}", json=body, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"})
        assert got.status_code == 200, got.text
        return got.json()

    def responses(**fields) -> list[tuple[int, int]]:
        """(output_tokens, reasoning_tokens) of the whole response, then of the streamed one's last event."""
        usages = [client.responses.create(model=MODEL, **fields).usage, _events(client, **fields)[4].usage]
        return [(u.output_tokens, u.output_tokens_details.reasoning_tokens) for u in usages]

    def chats(**fields) -> list[tuple[int, int | None]]:
        """(completion_tokens, reasoning_tokens) of the whole chat, then of the streamed one's usage chunk."""
        usages = [client.chat.completions.create(model=MODEL, messages=USER, **fields).usage,
                  [c.usage for c in client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                                   stream_options={"include_usage": True}, **fields)
                   if c.usage is not None][-1]]
        return [(u.completion_tokens, u.completion_tokens_details and u.completion_tokens_details.reasoning_tokens)
                for u in usages]

    # (a) the template opens <think> and the output never closes it: all of it is reasoning
    assert responses(input="weather?", max_output_tokens=6, temperature=0) == [(6, 6)] * 2
    assert chats(max_tokens=6, temperature=0) == [(6, 6)] * 2
    # (b) reasoning, then the answer: the tokens up to and with </think>, from the output's own token ids
    off = {"enable_thinking": False}
    forced = {"structured_outputs": {"regex": "<think>plan</think>Paris"}, "chat_template_kwargs": off}
    ids = [int(t.token.removeprefix("token_id:")) for t in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=40, temperature=0, logprobs=True,
        extra_body={**forced, "return_tokens_as_token_ids": True}).choices[0].logprobs.content]
    thought = next(k for k in range(1, len(ids) + 1)
                   if post("/detokenize", {"model": MODEL, "tokens": ids[:k]})["prompt"].endswith("</think>"))
    assert thought == post("/tokenize", {"model": MODEL, "prompt": "<think>plan</think>",
                                         "add_special_tokens": False})["count"]
    assert 0 < thought < len(ids)
    assert responses(input="weather?", max_output_tokens=40, temperature=0, extra_body=forced) == [
        (len(ids), thought)] * 2
    assert chats(max_tokens=40, temperature=0, extra_body=forced) == [(len(ids), thought)] * 2
    # (c) thinking off, no <think> written: no reasoning
    assert responses(input="weather?", max_output_tokens=6, temperature=0,
                     extra_body={"chat_template_kwargs": off}) == [(6, 0)] * 2
    assert chats(max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": off}) == [(6, 0)] * 2
    # a forced tool call: no reasoning parser reads it, the chat has no details
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    assert responses(input="weather?", tools=[tool], max_output_tokens=40, temperature=0,
                     tool_choice={"type": "function", "name": "get_weather"})[0][1] == 0
    assert chats(tools=[WEATHER], max_tokens=40, temperature=0, tool_choice="required")[0][1] is None


def test_responses_api_calls_tools_and_takes_their_outputs(client):
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    fields = {"input": "weather?", "tools": [tool], "max_output_tokens": 40, "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"}}
    got = client.responses.create(model=MODEL, **fields)
    (call,) = got.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"} and got.status == "completed"
    kinds, _, _, calls, last = _events(client, **fields)
    assert calls == [("get_weather", call.arguments)] and last.status == "completed"
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    # the call and its output come back as input: the template shows them as the chat's messages would
    follow = client.responses.create(model=MODEL, tools=[tool], tool_choice="none", max_output_tokens=2,
                                     temperature=0, input=[
                                         {"role": "user", "content": "weather?"},
                                         {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                          "arguments": '{"city": "Paris"}'},
                                         {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    rendered = (f'<tools>get_weather(city);</tools><|user|>weather?<|assistant|>{CALL}'
                '<|tool|>sunny[call_1]<|assistant|><think>')
    assert follow.usage.input_tokens == len(rendered.encode())


@pytest.mark.parametrize("fields, param, message", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "epmoe stores no responses"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "epmoe stores no prompts"),  # was ignored
    # the key sent is named as sent (was rewritten to 'input', as the chat's messages field is)
    ({"input": "hi", "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs",
     "chat_template_kwargs may not set ['messages']"),
    ({"input": "hi", "max_output_tokens": 999}, "max_output_tokens",
     "max_output_tokens (999) plus the prompt's"),
    # the type named (was the function tool's missing name: "tools.0.name: Field required")
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type",
     'tools.0.type="web_search" is not served by epmoe: only function tools are (type "function")'),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format of type json_schema needs its schema"),
    ({"input": [{"role": "user", "content": 5}]}, "input.0", ""),
    # was a 500 and a traceback in the log (the translated chat's own check, a pydantic error, was not caught)
    ({"input": []}, "input", "input must not be empty, got []"),
    # an empty input, as OpenAI refuses it (were served: a chat of the instructions alone, or of an empty message)
    ({"input": [], "instructions": "be brief"}, "input", "input must not be empty, got []"),
    ({"input": ""}, "input", "input must not be empty, got ''"),
    ({"input": "", "instructions": "be brief"}, "input", "input must not be empty, got ''"),
    ('{"instructions": "x", "input": [{"role": "user", "content": "a\\ud800"}]}', "input",
     "is not valid Unicode text: a lone surrogate"),  # JSON's escape of a lone surrogate, sent as it is
    # an output answering no call was rendered as a tool message (OpenAI refuses it)
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]}, "input.1.call_id",
     "input[1]: no function_call before it has call_id 'call_9', which this function_call_output answers"),
])
def test_responses_api_bad_requests_name_their_fields(server, fields, param, message):
    import httpx

    body = json.dumps({"model": MODEL, **fields}) if isinstance(fields, dict) else \
        f'{{"model": "{MODEL}", {fields[1:]}'
    got = httpx.post(f"{server.url}/v1/responses", content=body, timeout=30,
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("body, param, message", [
    ({"model": MODEL}, "messages", "messages: Field required"),  # what was sent is not echoed for a missing field
    ({"model": MODEL, "messages": USER, "tool_choice": {"type": "function"}}, "tool_choice.function",
     "tool_choice.function: Field required"),  # the union member's model name is not a field
    ({"model": MODEL, "messages": USER, "tool_choice": "sometimes"}, "tool_choice",
     "tool_choice: must be literal['none','auto','required'] | an object (got 'sometimes')"),
])
def test_chat_field_errors_name_the_fields_sent(server, body, param, message):
    import httpx

    got = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30,
                     headers={"Authorization": f"Bearer {API_KEY}"})
    assert got.status_code == 400 and got.json()["error"]["param"] == param
    assert got.json()["error"]["message"] == message


@pytest.mark.parametrize("parser, output, content", [
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure. "),
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None),
])
def test_mistral_and_llama_formats_through_a_server(start_server, parser, output, content):
    """A server with another ``--tool-call-parser``: the calls the model writes come back whole and streamed; a
    Mistral call's id is nine letters and digits; text that only looks like a call stays content."""
    spec = start_server("--ep", "1", "--chat-template", TOOLS_TEMPLATE, "--enable-auto-tool-choice",
                        "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=f"{spec.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    regex = "".join("\\" + ch if ch in "[]{}()|.\\" else ch for ch in output)
    fields = {"messages": USER, "tools": [WEATHER], "max_tokens": 100, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": regex}}}
    choice = client.chat.completions.create(model=MODEL, **fields).choices[0]
    (call,) = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", content)
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    if parser == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()
    _, streamed, calls, finish = _streamed(client, **fields)
    assert (streamed, finish) == (content or "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    plain = dict(fields, extra_body={"structured_outputs": {"regex": r"\[citation needed\] text"}})
    assert client.chat.completions.create(model=MODEL, **plain).choices[0].message.content == "[citation needed] text"
