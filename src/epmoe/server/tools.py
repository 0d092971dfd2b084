"""Tool calling (OpenAI's ``tools`` and ``tool_choice``): the parsers of the served families' tool-call formats
(vLLM's and SGLang's ``--tool-call-parser``) and the constraints of a forced choice.

``tool_choice``:

- ``"auto"`` (the default when ``tools`` are sent): the model decides; its output is read by the server's
  ``--tool-call-parser`` (which ``--enable-auto-tool-choice`` must allow, as in vLLM). Text before the first call is
  the reply's ``content``; an output whose calls do not parse is all ``content``.
- ``"required"``: the output is constrained (``structured_outputs``) to a JSON array of at least one
  ``{"name", "parameters"}`` object of the given tools (exactly one with ``parallel_tool_calls`` false), each
  call's arguments valid under its tool's schema.
- ``{"type": "function", "function": {"name": ...}}``: the output is constrained to that tool's arguments.
- ``"none"``: no call; the tools are still shown to the template (vLLM's default).

The formats (from the models' chat templates; vLLM's parsers of the same names read them alike). Where a format
writes each argument as text (``glm45``, ``qwen3_coder``), a value takes the type its tool's schema gives the
argument (a number, a boolean, an object or array as JSON), and stays a string where the schema says so or the
text does not read as that type; an argument the schema does not name is JSON where it reads as JSON.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call.
- ``kimi_k2`` (Kimi-K2, Kimi-K2.5): ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>``
  ``functions.NAME:INDEX`` ``<|tool_call_argument_begin|>`` the arguments ``<|tool_call_end|>``; the
  ``functions.NAME:INDEX`` header is the call's id (Kimi's template quotes it back in the tool's reply).
- ``deepseek_v3`` (DeepSeek-V3, -R1): ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME`` and the arguments in a fenced ``json`` block, then ``<｜tool▁call▁end｜>``.
- ``deepseek_v31`` (DeepSeek-V3.1): per call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>`` the arguments
  ``<｜tool▁call▁end｜>``.
- ``glm45`` (GLM-4.5, GLM-4.6): ``<tool_call>NAME`` then per argument ``<arg_key>KEY</arg_key>``
  ``<arg_value>VALUE</arg_value>``, then ``</tool_call>``.
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME>`` then per argument ``<parameter=KEY>VALUE
  </parameter>``, then ``</function></tool_call>``.
- ``openai`` (gpt-oss): harmony messages to ``functions.NAME`` on the commentary channel, as the ``openai_gptoss``
  reasoning parser hands them on (``<|start|>assistant to=functions.NAME<|message|>`` the arguments); it reads
  the output with that parser only.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One call the model made.

    Attributes:
        id: the call's id (``call_...``; Kimi's own header).
        name: the function's name.
        arguments: its arguments, a JSON object's text.
    """

    id: str
    name: str
    arguments: str


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(text: str) -> str | None:
    """``text`` as a JSON object's text (re-serialised), or ``None`` when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _typed(text: str, schema: dict | None) -> object:
    """An argument written as text (one line break either side dropped), as the type ``schema`` gives it: a string
    where the schema says ``string`` or the text does not read as the type; without a schema, JSON where it reads
    as JSON."""
    text = text.removeprefix("\n").removesuffix("\n")
    kinds = (schema or {}).get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else set()
    if "string" in kinds:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if not kinds:
        return value
    matches = {"integer": isinstance(value, int) and not isinstance(value, bool),
               "number": isinstance(value, (int, float)) and not isinstance(value, bool),
               "boolean": isinstance(value, bool), "object": isinstance(value, dict),
               "array": isinstance(value, list), "null": value is None}
    return value if any(matches.get(k, False) for k in kinds) else text


@dataclass(frozen=True)
class ToolCallParser:
    """One ``--tool-call-parser``: where the calls start and how each reads.

    Attributes:
        name: the flag's value.
        start: the marker the first call (or the calls' section) begins with; the text before it is content.
        call: the pattern of one call (named groups ``name`` and ``arguments``, and ``id`` where the format names
            the call).
        markers: every marker of the format (a tokenizer must not drop them as special tokens).
        argument: where the arguments are written one by one, the pattern of one (groups ``key`` and ``value``);
            else ``None`` (``arguments`` is a JSON object).
    """

    name: str
    start: str
    call: re.Pattern
    markers: tuple[str, ...]
    argument: re.Pattern | None = None

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of a whole output: the text before ``start`` and the calls after it; ``(text, [])``
        when it makes none, or when one does not read (a missing name, arguments that are not a JSON object).

        Args:
            text: the output.
            schemas: each tool's ``parameters`` schema by its name, which types arguments written as text.
        """
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for m in self.call.finditer(text, at):
            parts = m.groupdict()
            if parts.get("json") is not None:  # hermes: the whole call is one JSON object
                try:
                    body = json.loads(parts["json"])
                except ValueError:
                    return text, []
                if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                    return text, []
                given = body.get("arguments", {})
                name = body["name"]
                arguments = json.dumps(given, ensure_ascii=False) if isinstance(given, dict) else None
            elif self.argument is not None:  # one by one, as text
                name = parts["name"].strip()
                properties = ((schemas or {}).get(name) or {}).get("properties") or {}
                values = {a["key"].strip(): _typed(a["value"], properties.get(a["key"].strip()))
                          for a in self.argument.finditer(parts["arguments"])}
                arguments = json.dumps(values, ensure_ascii=False)
            else:
                name, arguments = parts["name"].strip(), _arguments(parts["arguments"])
                if "id" in parts:  # Kimi's header: functions.NAME:INDEX
                    name = name.removeprefix("functions.")
            if not name or arguments is None:
                return text, []
            calls.append(ToolCall(parts["id"].strip() if parts.get("id") else _call_id(), name, arguments))
        return (text[:at], calls) if calls else (text, [])


_DS_CALLS, _DS_CALL, _DS_SEP, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", \
    "<｜tool▁call▁end｜>"

TOOL_CALL_PARSERS = {
    "hermes": ToolCallParser(
        "hermes", "<tool_call>", re.compile(r"<tool_call>\s*(?P<json>.*?)\s*(?:</tool_call>|$)", re.S),
        ("<tool_call>", "</tool_call>")),
    "kimi_k2": ToolCallParser(
        "kimi_k2", "<|tool_calls_section_begin|>",
        re.compile(r"<\|tool_call_begin\|>\s*(?P<id>(?P<name>[^<]*?):\d+)\s*<\|tool_call_argument_begin\|>"
                   r"(?P<arguments>.*?)<\|tool_call_end\|>", re.S),
        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
    "deepseek_v3": ToolCallParser(
        "deepseek_v3", _DS_CALLS,
        re.compile(re.escape(_DS_CALL) + r"\s*function\s*" + re.escape(_DS_SEP) + r"(?P<name>[^\n]*)\n```json\n"
                   r"(?P<arguments>.*?)\n```\s*" + re.escape(_DS_END), re.S),
        (_DS_CALLS, "<｜tool▁calls▁end｜>", _DS_CALL, _DS_SEP, _DS_END)),
    "deepseek_v31": ToolCallParser(
        "deepseek_v31", _DS_CALLS,
        re.compile(re.escape(_DS_CALL) + r"(?P<name>.*?)" + re.escape(_DS_SEP) + r"(?P<arguments>.*?)"
                   + re.escape(_DS_END), re.S),
        (_DS_CALLS, "<｜tool▁calls▁end｜>", _DS_CALL, _DS_SEP, _DS_END)),
    "glm45": ToolCallParser(
        "glm45", "<tool_call>", re.compile(r"<tool_call>(?P<name>[^\n<]*)(?P<arguments>.*?)</tool_call>", re.S),
        ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S)),
    "qwen3_coder": ToolCallParser(
        "qwen3_coder", "<tool_call>",
        re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<arguments>.*?)</function>\s*</tool_call>", re.S),
        ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"),
        re.compile(r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)</parameter>", re.S)),
    "openai": ToolCallParser(
        "openai", "<|start|>assistant to=functions.",
        re.compile(r"<\|start\|>assistant to=functions\.(?P<name>[^<\s]+)<\|message\|>(?P<arguments>.*?)"
                   r"(?=<\|start\|>|$)", re.S),
        ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")),
}
"""The ``--tool-call-parser`` choices, by name."""


def forced_schema(choice: str, tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema a forced ``tool_choice`` constrains the output to (written without free whitespace).

    Args:
        choice: ``"required"``, or the name of the function ``tool_choice`` names.
        tools: the request's tools' ``function`` objects (``name``, ``parameters``).
        parallel: ``parallel_tool_calls``; false: ``required`` makes exactly one call.

    Returns:
        ``required``: an array of at least one ``{"name": one of the tools, "parameters": its arguments}``;
        a name: that function's ``parameters`` schema (an object of any fields where it has none).
    """
    def parameters(fn: dict) -> dict:
        return fn.get("parameters") or {"type": "object"}

    if choice != "required":
        return parameters(next(fn for fn in tools if fn["name"] == choice))
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                          "parameters": parameters(fn)},
         "required": ["name", "parameters"], "additionalProperties": False} for fn in tools]}}


def forced_calls(choice: str, text: str) -> list[ToolCall]:
    """The calls of an output a forced ``tool_choice`` constrained (``forced_schema``); ``[]`` where the output is
    not whole (cut off by ``max_tokens``).

    Args:
        choice: ``"required"``, or the named function.
        text: the output.
    """
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if choice != "required":
        return [ToolCall(_call_id(), choice, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) \
            else []
    if not isinstance(value, list):
        return []
    return [ToolCall(_call_id(), item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in value if isinstance(item, dict) and "name" in item and "parameters" in item]
