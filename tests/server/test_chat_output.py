"""Tool calls and reasoning read from chat outputs (``server.tools``, ``server.reasoning``, ``server.chat_output``)
and how a chat request with tools becomes an engine request (no server process)."""

from __future__ import annotations

import json
import shutil

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.server.chat_output import ChatOutput, ChatParsers
from epmoe.server.core import EngineInfo
from epmoe.server.errors import ApiError
from epmoe.server.generate import build_job
from epmoe.server.protocol import ChatCompletionRequest
from epmoe.server.reasoning import REASONING_PARSERS, held
from epmoe.server.text import TextCodec
from epmoe.server.tools import TOOL_CALL_PARSERS, forced_calls, forced_schema

MODEL = "kimi-k2.5-tiny"
INFO = EngineInfo(max_model_len=512, vocab_size=259, ranks=1, parallel="ep", kv={"blocks": 4096, "block_size": 16})
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# a template that shows the tools and earlier calls as Qwen's does (hermes format), and Qwen3's enable_thinking
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | join(',') }});{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% else %}<think>{% endif %}{% endif %}")

KIMI_OUT = ('I will look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city": "Tokyo"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
            '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>')
OUTPUTS = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "kimi_k2": KIMI_OUT,
    "deepseek_v3": ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                    '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>'
                    '<｜tool▁calls▁end｜>'),
    "glm45": ('Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
              '</tool_call><tool_call>get_time\n</tool_call>'),
    "qwen3_coder": ('Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>'),
    "deepseek_v31": ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                     '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "mistral": ('Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]'),
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {}}',
    "llama4_json": '\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n{"name": "get_time", "parameters": {}}',
    "pythonic": '[get_weather(city="Paris"), get_time()]',
    "llama4_pythonic": "<|python_start|>[get_weather(city='Paris'), get_time()]<|python_end|>",
}
# the content before the calls (the formats whose calls are the whole output have none)
CONTENT = {"kimi_k2": "I will look.", "hermes": "Checking.\n", "qwen3_coder": "Checking.\n", "llama3_json": "",
           "llama4_json": "", "pythonic": "", "llama4_pythonic": ""}


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    """The built-in checkpoint's tokenizer with ``TOOLS_TEMPLATE``, and Kimi's tool-call markers as special
    tokens (as in Kimi's own tokenizer)."""
    from transformers import AutoTokenizer

    ckpt, out = ensure_default_checkpoint(), tmp_path_factory.mktemp("tools-ckpt")
    shutil.copy(ckpt / "config.json", out / "config.json")
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.add_special_tokens({"additional_special_tokens": list(TOOL_CALL_PARSERS["kimi_k2"].markers)})
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(out)
    return TextCodec(str(out), INFO.vocab_size + len(TOOL_CALL_PARSERS["kimi_k2"].markers))


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "max_tokens": 8, **fields}, strict=True)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_each_tool_call_parser_reads_its_format(name):
    content, calls = TOOL_CALL_PARSERS[name].parse(OUTPUTS[name])
    assert content == CONTENT.get(name, "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Tokyo" if name ==
                                                                   "kimi_k2" else "Paris"}), ("get_time", {})]
    if name == "kimi_k2":  # Kimi's header is the call's id (its template quotes it back)
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    elif name == "mistral":  # Mistral's templates refuse ids other than nine letters and digits
        assert len({c.id for c in calls}) == 2 and all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    else:
        assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder"])
def test_arguments_written_as_text_take_their_schemas_types(name):
    """GLM's and Qwen3-Coder's arguments are text: each takes the type its tool's schema gives it, stays a string
    where the schema says string or the text is not of the type, and is JSON where no schema names it."""
    args = {"city": "123", "days": "3", "hot": "true", "tags": '["a", 1]', "when": "soon", "extra": '{"k": 2}'}
    if name == "glm45":
        body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
        text = f"<tool_call>plan\n{body}</tool_call>"
    else:
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        text = f"<tool_call>\n<function=plan>\n{body}</function>\n</tool_call>"
    schema = {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
                             "tags": {"type": "array"}, "when": {"type": ["integer", "null"]}}}
    (call,) = TOOL_CALL_PARSERS[name].parse(text, {"plan": schema})[1]
    assert json.loads(call.arguments) == {"city": "123", "days": 3, "hot": True, "tags": ["a", 1], "when": "soon",
                                          "extra": {"k": 2}}
    (untyped,) = TOOL_CALL_PARSERS[name].parse(text)[1]
    assert json.loads(untyped.arguments)["city"] == 123  # no schema: JSON where it reads as JSON


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    "no calls at all",
])
def test_an_output_whose_calls_do_not_read_is_all_content(text):
    assert TOOL_CALL_PARSERS["hermes"].parse(text) == (text, [])


def test_mistrals_newer_format_names_each_call_before_its_arguments():
    text = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    content, calls = TOOL_CALL_PARSERS["mistral"].parse(text)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_forced_choice_keeps_the_requests_own_function_name():
    (call,) = forced_calls("get weather", '{"city": "Rome"}')
    assert call.name == "get weather"
    assert forced_calls("get_weather", '{"x": NaN}') == []


def test_pythonic_arguments_are_literals_and_json_words():
    (call,) = TOOL_CALL_PARSERS["pythonic"].parse(
        "[plan(n=1, x=-2.5, ok=True, none=None, tags=['a', 1], nest={'k': [2]}, flag=false, gone=null)]")[1]
    assert call.name == "plan" and json.loads(call.arguments) == {
        "n": 1, "x": -2.5, "ok": True, "none": None, "tags": ["a", 1], "nest": {"k": [2]}, "flag": False,
        "gone": None}


@pytest.mark.parametrize("name, text", [
    ("pythonic", "[citation needed] is text"),
    ("pythonic", "[get_weather('Paris')]"),  # a positional argument
    ("pythonic", "[get_weather(city=town)]"),  # a variable
    ("pythonic", "[get_weather(city=open('x'))]"),  # a call
    ("pythonic", "[get_weather(**kw)]"),
    ("pythonic", "[db.query(q=1)]"),  # not a plain name
    ("pythonic", "[1, 2]"),
    ("pythonic", "[]"),
    ("pythonic", "[get_weather(city='Par"),  # cut off by max_tokens
    ("pythonic", "Sure: [get_time()]"),  # the calls must be the whole output
    ("pythonic", "[" * 5000 + "]" * 5000),  # nested past the parser's depth
    ("llama3_json", '{"name": "get_time", "parameters": {}} and then some text'),
    ("llama3_json", '{"parameters": {}}'),
    ("llama3_json", '{"name": "get_time", "parameters": [1]}'),
    ("llama3_json", "I'd use {braces} here"),
    ("mistral", "[TOOL_CALLS]"),
    ("mistral", "[TOOL_CALLS]get_weather{}"),  # no [ARGS]
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": "Paris"}]'),
    # what JSON cannot carry or a function cannot be named stays text
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 5000),  # nested past the decoder's recursion
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}]"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"),
    ("pythonic", '[f(x="\\ud800")]'),  # a lone surrogate, which no UTF-8 reply can hold
    ("llama3_json", '{"name": "f", "parameters": {"x": "\\ud800"}}'),
    ("pythonic", "[f(x=1e999)]"),  # infinity
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),
    ("mistral", "[TOOL_CALLS]hello world, not a call[ARGS]{}"),
    ("mistral", "[TOOL_CALLS]f\n[TOOL_CALLS]g[ARGS]{}"),
    ("llama3_json", '{"name": "  ", "parameters": {}}'),
    ("pythonic", '[\uff47et_weather(city="x")]'),  # a fullwidth name Python would fold to ASCII
    ("pythonic", '[get_weather(\uff43ity="x")]'),
    ("pythonic", "[f(x={True: 4, 1: 2})]"),  # keys that are not strings
])
def test_outputs_whose_calls_do_not_read_are_all_content(name, text):
    assert TOOL_CALL_PARSERS[name].parse(text) == (text, [])


def test_reasoning_parsers_split_where_each_opens():
    r1, qwen3, kimi = (REASONING_PARSERS[n] for n in ("deepseek_r1", "qwen3", "kimi_k2"))
    assert r1.split("plan</think>\n\nParis", True, True) == ("plan", "\n\nParis")
    assert r1.split("<think>plan</think>Paris", True, True) == ("plan", "Paris")
    assert r1.split("cut off while thinking", True, True) == ("cut off while thinking", "")
    # qwen3: reasoning only where the prompt or the output opened it
    assert qwen3.opens("<|assistant|><think>\n", None) and not qwen3.opens("<|assistant|><think></think>", None)
    assert qwen3.split("Paris", False, True) == (None, "Paris")
    assert qwen3.split("<think>plan</think>Paris", False, True) == ("plan", "Paris")
    assert qwen3.split("plan</think>Paris", True, True) == ("plan", "Paris")
    # kimi_k2: a tool-call section ends the reasoning too; thinking switched off by the template's kwargs
    assert kimi.split("plan<|tool_calls_section_begin|>x", True, True) == ("plan", "<|tool_calls_section_begin|>x")
    assert kimi.opens("", None) and not kimi.opens("", {"thinking": False})
    assert not kimi.opens("", {"enable_thinking": False})


def test_held_is_the_longest_unfinished_marker_at_the_end():
    assert held("abc</thi", ("</think>",)) == 5
    assert held("abc<", ("</think>", "<tool_call>")) == 1
    assert held("abc</think>", ("</think>",)) == 0 and held("", ("</think>",)) == 0


HARMONY_CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')
HARMONY_FINAL = ("<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "2 + 2 = 4.")
HARMONY_PREAMBLE = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time"
                    "<|channel|>commentary json<|message|>{}")


def test_harmony_messages_read_as_reasoning_content_and_calls():
    """gpt-oss's harmony output (its stop tokens <|call|> and <|return|> are not in the text): the analysis channel
    is reasoning, final and preamble bodies content, messages to functions.NAME calls, the recipient in either
    part of the header."""
    output = ChatOutput(REASONING_PARSERS["openai_gptoss"], True, TOOL_CALL_PARSERS["openai"])
    call = output.reply(HARMONY_CALL)
    assert (call.reasoning, call.content) == ("Need the weather.", None)
    assert [(c.name, json.loads(c.arguments)) for c in call.calls] == [("get_weather", {"city": "Paris"})]
    final = output.reply(HARMONY_FINAL)
    assert (final.reasoning, final.content, final.calls) == ("Simple sum.", "2 + 2 = 4.", [])
    preamble = output.reply(HARMONY_PREAMBLE)
    assert (preamble.reasoning, preamble.content, [c.name for c in preamble.calls]) == (None, "Checking.",
                                                                                         ["get_time"])
    assert output.reply("no markup: a constrained output").content == "no markup: a constrained output"
    with pytest.raises(ValueError, match="--tool-call-parser openai reads gpt-oss's harmony messages as "
                                         "--reasoning-parser openai_gptoss hands them on: give both"):
        ChatParsers(tools="openai", auto_tool_choice=True)


@pytest.mark.parametrize("output, text", [
    (ChatOutput(REASONING_PARSERS["openai_gptoss"], True, TOOL_CALL_PARSERS["openai"]), HARMONY_CALL),
    (ChatOutput(REASONING_PARSERS["openai_gptoss"], True, TOOL_CALL_PARSERS["openai"]), HARMONY_PREAMBLE),
    (ChatOutput(REASONING_PARSERS["openai_gptoss"], True, None), HARMONY_FINAL),
    (ChatOutput(REASONING_PARSERS["kimi_k2"], True, TOOL_CALL_PARSERS["kimi_k2"]), "thinking</think>" + KIMI_OUT),
    (ChatOutput(REASONING_PARSERS["qwen3"], False, TOOL_CALL_PARSERS["hermes"]),
     "<think>a < b</think>\n" + OUTPUTS["hermes"]),
    (ChatOutput(REASONING_PARSERS["deepseek_r1"], True, TOOL_CALL_PARSERS["deepseek_v3"]),
     "x</thin y</think>" + OUTPUTS["deepseek_v3"]),
    (ChatOutput(None, False, TOOL_CALL_PARSERS["hermes"]), "a <tool_call> that never closes"),
    (ChatOutput(REASONING_PARSERS["qwen3"], True, TOOL_CALL_PARSERS["glm45"]), "x</think>" + OUTPUTS["glm45"]),
    (ChatOutput(REASONING_PARSERS["qwen3"], False, None), "<thin and no reasoning"),
    (ChatOutput(None, False, TOOL_CALL_PARSERS["llama4_pythonic"]), OUTPUTS["llama4_pythonic"]),
    (ChatOutput(None, False, TOOL_CALL_PARSERS["pythonic"]), "[citation needed] is text"),
    (ChatOutput(None, False, TOOL_CALL_PARSERS["pythonic"]), " Plain text with [brackets]"),
    (ChatOutput(REASONING_PARSERS["deepseek_r1"], True, TOOL_CALL_PARSERS["llama3_json"]),
     "plan</think>\n\n" + OUTPUTS["llama3_json"]),
    (ChatOutput(None, False, TOOL_CALL_PARSERS["mistral"]), OUTPUTS["mistral"]),
], ids=["harmony-call", "harmony-preamble", "harmony-final", "kimi", "qwen3-hermes", "r1-deepseek", "unclosed-call",
        "glm45", "qwen3-plain", "llama4-pythonic", "pythonic-text", "pythonic-plain", "r1-llama3-json", "mistral"])
def test_a_stream_settles_only_what_no_later_token_changes(output, text):
    """At every character the settled reasoning and content only grow, and each ends as a prefix of the whole
    reply's: a stream never sends text it would have to take back."""
    before = ("", "")
    for n in range(len(text) + 1):
        now = output.settled(text[:n])
        assert now[0].startswith(before[0]) and now[1].startswith(before[1]), (n, before, now)
        before = now
    reply = output.reply(text)
    assert (reply.reasoning or "").startswith(before[0]) and (reply.content or "").startswith(before[1])


@pytest.mark.parametrize("output, pieces, count", [
    (ChatOutput(REASONING_PARSERS["qwen3"], False), ["<", "think", ">", "plan", "</", "think>", "Par", "is"], 6),
    (ChatOutput(REASONING_PARSERS["qwen3"], True), ["pl", "an", " on"], 3),  # never leaves the reasoning: all
    (ChatOutput(REASONING_PARSERS["qwen3"], False), ["Par", "is"], 0),  # thinking off, not opened: no reasoning
    (ChatOutput(REASONING_PARSERS["qwen3"], False), ["<think>", "</think>", "Paris"], 2),  # an empty reasoning
    (ChatOutput(None, False, TOOL_CALL_PARSERS["hermes"]), ["plan", "</think>", "x"], 0),  # no reasoning parser
    (ChatOutput(REASONING_PARSERS["qwen3"], True, forced="get_weather"), ["{}"], 0),  # a forced call
    (ChatOutput(REASONING_PARSERS["deepseek_r1"], True), ["plan", "</think>"], 2),  # nothing after its end
    (ChatOutput(REASONING_PARSERS["deepseek_r1"], True), ["plan", "</think>Par", "is"], 1),  # answer in its token
    (ChatOutput(REASONING_PARSERS["deepseek_r1"], True, TOOL_CALL_PARSERS["hermes"]),
     ["a", " <", "/think", ">", "\n", "<tool_call>", "{}"], 4),
    (ChatOutput(REASONING_PARSERS["kimi_k2"], True, TOOL_CALL_PARSERS["kimi_k2"]),
     ["hmm", "<|tool_calls_section_begin|>", "<|tool_call_begin|>"], 1),  # the kept section begins the answer
    (ChatOutput(REASONING_PARSERS["openai_gptoss"], True),
     ["<|channel|>", "analysis", "<|message|>", "Simple sum.", "<|end|>", "<|start|>", "assistant", "<|channel|>",
      "final", "<|message|>", "2 + 2", " = 4."], 10),
])
def test_reasoning_tokens_are_those_before_the_answer_begins(output, pieces, count):
    """``ChatOutput.reasoning_tokens``: the tokens before the first one at which the answer begins (with the end
    marker ``</think>``), found in at most ``n.bit_length()`` decodes of prefixes shorter than the output: the whole
    output's text is given, never decoded again (it was, once per count)."""
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join(pieces[i] for i in ids)

    ids, text = list(range(len(pieces))), "".join(pieces)
    assert output.reasoning_tokens(ids, decode, text) == count
    assert len(decoded) <= len(ids).bit_length() and all(k < len(ids) for k in decoded), decoded


def test_kimi_reply_with_reasoning_content_and_calls():
    reply = ChatOutput(REASONING_PARSERS["kimi_k2"], True, TOOL_CALL_PARSERS["kimi_k2"]).reply("hmm</think>" + KIMI_OUT)
    assert (reply.reasoning, reply.content) == ("hmm", "I will look.")
    assert [c.name for c in reply.calls] == ["get_weather", "get_time"]
    single = ChatOutput(None, False, TOOL_CALL_PARSERS["kimi_k2"], parallel=False).reply(KIMI_OUT)
    assert [c.name for c in single.calls] == ["get_weather"]


def test_forced_choices_constrain_to_the_tools_and_read_back():
    functions = [WEATHER["function"], TIME["function"]]
    assert forced_schema("get_weather", functions) == WEATHER["function"]["parameters"]
    schema = forced_schema("required", functions)
    assert schema["minItems"] == 1 and [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    calls = forced_calls("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                     '"parameters": {"city": "Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert [(c.name, c.arguments) for c in forced_calls("get_weather", '{"city":"Rome"}')] == [
        ("get_weather", '{"city": "Rome"}')]
    assert forced_calls("required", '[{"name": "get_ti') == []  # cut off by max_tokens: no call


def test_a_chat_with_tools_renders_them_and_earlier_calls(codec):
    req = _chat(tools=[WEATHER], tool_choice="none", messages=[
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    job = build_job(req, MODEL, codec, INFO, parsers=ChatParsers())
    assert job.chat is None and job.constraint_field is None
    prompt = codec.decode(job.prompts[0])
    assert prompt == ('<tools>get_weather(city);</tools><|user|>Paris?<|assistant|><tool_call>{"name": "get_weather", '
                      '"arguments": {"city": "Paris"}}</tool_call><|tool|>sunny[call_1]<|assistant|><think>')


def test_tool_choice_requests_become_constraints_or_parsers(codec):
    parsers = ChatParsers("kimi_k2", "kimi_k2", auto_tool_choice=True)
    user = [{"role": "user", "content": "weather?"}]
    named = build_job(_chat(messages=user, tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), MODEL, codec, INFO, parsers=parsers)
    assert named.constraint_field == "tool_choice" and named.chat.forced == "get_weather"
    assert named.params[0].structured_outputs.json == WEATHER["function"]["parameters"]
    required = build_job(_chat(messages=user, tools=[WEATHER], tool_choice="required"), MODEL, codec, INFO,
                         parsers=parsers)
    assert required.chat.forced == "required" and required.params[0].structured_outputs.json["minItems"] == 1
    auto = build_job(_chat(messages=user, tools=[WEATHER]), MODEL, codec, INFO, parsers=parsers)  # auto: default
    assert auto.chat.tools is TOOL_CALL_PARSERS["kimi_k2"] and auto.constraint_field is None
    assert auto.chat.schemas == {"get_weather": WEATHER["function"]["parameters"]}
    assert auto.chat.reasoning is REASONING_PARSERS["kimi_k2"] and auto.chat.opened
    # Kimi's markers are special tokens of this tokenizer: the text keeps them, or the calls could not be read
    assert auto.params[0].skip_special_tokens is False
    plain = build_job(_chat(messages=user), MODEL, codec, INFO, parsers=ChatParsers("qwen3"))
    assert plain.chat.tools is None and plain.params[0].skip_special_tokens is True
    assert plain.chat.opened  # the template opened <think>
    off = build_job(_chat(messages=user, chat_template_kwargs={"enable_thinking": False}), MODEL, codec, INFO,
                    parsers=ChatParsers("qwen3"))
    assert not off.chat.opened and codec.decode(off.prompts[0]).endswith("<think></think>")


@pytest.mark.parametrize("fields, parsers, param, message", [
    ({"tools": [WEATHER]}, ChatParsers(), "tool_choice",
     'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser'),
    ({"tool_choice": "required"}, ChatParsers(), "tool_choice", "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, ChatParsers(),
     "tool_choice", "tool_choice names function 'nope', which is not among tools (['get_weather'])"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, ChatParsers(), "tools",
     "tools: function name(s) ['get_weather'] given more than once"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, ChatParsers(),
     "response_format", "tool_choice and response_format both constrain the output"),
    ({"chat_template_kwargs": {"tokenize": True}}, ChatParsers(), "chat_template_kwargs",
     "chat_template_kwargs may not set ['tokenize']"),
])
def test_tool_requests_the_server_cannot_serve_are_400s(codec, fields, parsers, param, message):
    with pytest.raises(ApiError) as err:
        build_job(_chat(messages=[{"role": "user", "content": "hi"}], **fields), MODEL, codec, INFO, parsers=parsers)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message, err.value.message


def test_parser_options_are_checked():
    with pytest.raises(ValueError, match=r"--enable-auto-tool-choice needs --tool-call-parser"):
        ChatParsers(auto_tool_choice=True)
    with pytest.raises(ValueError, match=r"--tool-call-parser must be one of \['deepseek_v3', 'deepseek_v31', "
                                         r"'glm45', 'hermes', 'kimi_k2', 'llama3_json', 'llama4_json', "
                                         r"'llama4_pythonic', 'mistral', 'openai', 'pythonic', 'qwen3_coder'\], "
                                         r"got 'json'"):
        ChatParsers(tools="json")


def test_skip_special_tokens_false_keeps_them_in_the_engines_text():
    """The engine decodes with the request's ``skip_special_tokens``: special tokens the output holds are in its
    text only when it is false (a final EOS never is)."""
    engine = Engine(EngineConfig(model=str(ensure_default_checkpoint())))
    eos = engine.tokenizer.eos_token_id
    params = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "logit_bias": {eos: 100}}
    kept, dropped = engine.generate(["hi", "hi"], [SamplingParams(**params, skip_special_tokens=False),
                                                   SamplingParams(**params)])
    assert kept.token_ids == dropped.token_ids == [eos] * 3
    assert kept.text == engine.tokenizer.eos_token * 3 and dropped.text == ""


def test_a_template_failing_on_a_request_is_a_400(codec):
    """A template that fails while it renders (a type error, the sandbox's range limit) on what a request gave it
    is the request's 400, as a template's own raise_exception is."""
    template = ("{% if boom %}{{ messages[0].content + 1 }}{% endif %}{% if loopy %}{% for i in range(10**9) %}x"
                "{% endfor %}{% endif %}{{ messages[0].content }}")
    failing = TextCodec(codec.tokenizer.name_or_path, codec.vocab_size, template)
    for kwargs, kind in (({"boom": True}, "TypeError"), ({"loopy": True}, "OverflowError")):
        with pytest.raises(ApiError) as err:
            build_job(_chat(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs), MODEL,
                      failing, INFO)
        assert err.value.status == 400 and err.value.param == "messages"
        assert err.value.message.startswith(f"messages: the chat template failed on them: {kind}: ")
    assert build_job(_chat(messages=[{"role": "user", "content": "hi"}]), MODEL, failing, INFO).prompts


def test_tokenize_renders_messages_with_tools_and_template_kwargs_as_the_chat_does(codec):
    from epmoe.server.prompts import tokenize
    from epmoe.server.protocol import TokenizeRequest

    fields = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
              "chat_template_kwargs": {"enable_thinking": False}}
    job = build_job(_chat(tool_choice="none", **fields), MODEL, codec, INFO)
    got = tokenize(TokenizeRequest.model_validate(fields, strict=True), codec, INFO)
    assert got["tokens"] == job.prompts[0] and codec.decode(got["tokens"]).startswith("<tools>get_weather(city);")
    with pytest.raises(ApiError) as err:
        tokenize(TokenizeRequest.model_validate({"prompt": "hi", "tools": [WEATHER]}, strict=True), codec, INFO)
    assert err.value.param == "tools" and "tools go with messages" in err.value.message


def test_generation_prompt_and_continuing_the_final_message_are_served(codec):
    """``add_generation_prompt: false`` and ``continue_final_message: true`` were ignored (the prompt still ended in
    a new assistant header), and a request's own ``chat_template`` was ignored too. Now the first two render as
    ``apply_chat_template`` renders them, for a chat and for ``/tokenize``, and the third is refused."""
    import pydantic

    from epmoe.server.prompts import tokenize
    from epmoe.server.protocol import TokenizeRequest

    asked = [{"role": "user", "content": "hi"}]
    started = asked + [{"role": "assistant", "content": "par"}]
    for fields, text in (({"messages": asked}, "<|user|>hi<|assistant|><think>"),
                         ({"messages": asked, "add_generation_prompt": False}, "<|user|>hi"),
                         ({"messages": started, "add_generation_prompt": False, "continue_final_message": True},
                          "<|user|>hi<|assistant|>par")):
        got = tokenize(TokenizeRequest.model_validate(fields, strict=True), codec, INFO)["tokens"]
        assert codec.decode(got, skip_special_tokens=False) == text, fields
        assert build_job(_chat(**fields), MODEL, codec, INFO).prompts[0] == got
    for fields, message in (
            ({"messages": started, "continue_final_message": True}, "send add_generation_prompt=false with it"),
            ({"messages": asked, "add_generation_prompt": False, "continue_final_message": True},
             "the last message is a user's")):
        with pytest.raises(ApiError) as err:
            build_job(_chat(**fields), MODEL, codec, INFO)
        assert err.value.param == "continue_final_message" and message in err.value.message
    with pytest.raises(pydantic.ValidationError, match="chat_template=.* is not served by epmoe"):
        _chat(messages=asked, chat_template="{{ bad")
    with pytest.raises(pydantic.ValidationError, match="chat_template=.* is not served by epmoe"):  # was ignored
        TokenizeRequest.model_validate({"messages": asked, "chat_template": "{{ 'x' }}"}, strict=True)
    with pytest.raises(pydantic.ValidationError, match="continue_final_message"):
        _chat(messages=started, continue_final_message="x")


def test_named_chat_templates_are_chosen_as_transformers_chooses_them(tmp_path):
    """tokenizer_config.json's list of named templates (Command-R's layout) reached apply_chat_template as a dict:
    every chat was a 400 ("unhashable type: 'dict'"). Now 'default' renders a chat, 'tool_use' one with tools."""
    import shutil

    ckpt = tmp_path / "named"
    shutil.copytree(ensure_default_checkpoint(), ckpt)
    path = ckpt / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"}]
    path.write_text(json.dumps(cfg))
    named = TextCodec(str(ckpt), 259)
    assert named.chat_prompt([{"role": "user", "content": "hi"}]) == "Dhi"
    assert named.chat_prompt([{"role": "user", "content": "hi"}], [WEATHER]) == "T1hi"


def test_a_kimi_function_name_keeps_its_dots():
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.db.query:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>")
    (call,) = TOOL_CALL_PARSERS["kimi_k2"].parse(text)[1]
    assert (call.id, call.name) == ("functions.db.query:0", "db.query")
