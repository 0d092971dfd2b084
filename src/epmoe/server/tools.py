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
- ``mistral`` (Mixtral, Mistral): ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``; Mistral's newer
  tokenizers write ``[TOOL_CALLS]NAME[ARGS]`` and the arguments per call. Each call's id is nine letters and digits
  (Mistral's templates refuse others when the conversation comes back).
- ``llama3_json``, ``llama4_json`` (Llama-3.1+, Llama-4 with JSON templates): the whole output, after an optional
  ``<|python_tag|>``, is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.
- ``pythonic``, ``llama4_pythonic`` (Llama-4 with its pythonic template, Llama-3.2): the whole output is a Python
  list of calls with keyword arguments, ``[get_weather(city="Paris")]``, optionally between ``<|python_start|>`` and
  ``<|python_end|>``; the values are read as literals (``ast``), never evaluated.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from epmoe.server.reasoning import held


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


_NOT_JSON = object()
_NAME = re.compile(r"[\w.:/-]+")  # a function's name: no white space, quotes, brackets or markers


def _loads(text: str) -> object:
    """``text``'s JSON value, or ``_NOT_JSON`` (not JSON, or nested past what the decoder's recursion takes)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _call(call_id: str, name: object, arguments: object, named: bool = False) -> ToolCall | None:
    """A call, where it reads: ``name`` a function's name (``named``: the request's own, taken as it is) and
    ``arguments`` an object that JSON can carry (no NaN or infinity, no lone surrogate, string keys); else
    ``None``."""
    if not isinstance(name, str) or not (named or _NAME.fullmatch(name)) or not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode()
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return ToolCall(call_id, name, text)


def _typed(text: str, schema: dict | None) -> object:
    """An argument written as text (one line break either side dropped), as the type ``schema`` gives it: a string
    where the schema says ``string`` or the text does not read as the type; without a schema, JSON where it reads
    as JSON."""
    text = text.removeprefix("\n").removesuffix("\n")
    kinds = (schema or {}).get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else set()
    if "string" in kinds:
        return text
    value = _loads(text)
    if value is _NOT_JSON:
        return text
    if not kinds:
        return value
    matches = {"integer": isinstance(value, int) and not isinstance(value, bool),
               "number": isinstance(value, (int, float)) and not isinstance(value, bool),
               "boolean": isinstance(value, bool), "object": isinstance(value, dict),
               "array": isinstance(value, list), "null": value is None}
    return value if any(matches.get(k, False) for k in kinds) else text


_ALNUM = string.ascii_letters + string.digits


def _mistral_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other call id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCallParser:
    """One ``--tool-call-parser``: where the calls start and how they read (the subclasses' ``read``).

    Attributes:
        name: the flag's value.
        starts: the markers the calls (or their section) may begin with; the text before the first is content.
        markers: every marker of the format (a tokenizer must not drop them as special tokens).
        leading: the calls are the whole output: they are read only where the output, leading white space aside,
            begins with one of ``starts`` (a bare ``[`` or ``{`` elsewhere is text).
        new_id: makes the id of a call the format does not name (``call_...``; Mistral's nine letters and digits).
    """

    name: str
    starts: tuple[str, ...]
    markers: tuple[str, ...]
    leading: bool = False
    new_id: Callable[[], str] = _call_id

    def section(self, text: str) -> int:
        """Where the calls begin in ``text``; -1 where they do not."""
        if self.leading:
            body = text.lstrip()
            return len(text) - len(body) if body.startswith(self.starts) else -1
        found = [at for at in (text.find(s) for s in self.starts) if at >= 0]
        return min(found, default=-1)

    def held_from(self, text: str) -> int:
        """Where an unfinished output's text stops being content that no later token changes: the start of its
        calls, or of what may still become one; ``len(text)`` where all of it is settled."""
        if self.leading:  # the white space before the calls is not content either
            body = text.lstrip()
            return 0 if body.startswith(self.starts) or any(s.startswith(body) for s in self.starts) else len(text)
        at = self.section(text)
        return at if at >= 0 else len(text) - held(text, self.starts)

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of a whole output: the text before the calls and the calls; ``(text, [])`` when it
        makes none, or when one does not read (a missing name, arguments that are not a JSON object).

        Args:
            text: the output.
            schemas: each tool's ``parameters`` schema by its name, which types arguments written as text.
        """
        at = self.section(text)
        calls = self.read(text[at:], schemas or {}) if at >= 0 else None
        return (text[:at] if not self.leading else "", calls) if calls else (text, [])

    def read(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        """The calls of ``body`` (the output from where they begin); ``None`` where one does not read."""
        raise NotImplementedError


@dataclass(frozen=True)
class PatternToolCallParser(ToolCallParser):
    """A format whose calls each match one pattern.

    Attributes:
        call: the pattern of one call (named groups ``name`` and ``arguments``, and ``id`` where the format names
            the call; hermes: ``json``, the whole call as one object).
        argument: where the arguments are written one by one, the pattern of one (groups ``key`` and ``value``);
            else ``None`` (``arguments`` is a JSON object).
    """

    call: re.Pattern = field(kw_only=True)
    argument: re.Pattern | None = None

    def read(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        calls = []
        for m in self.call.finditer(body):
            parts = m.groupdict()
            if parts.get("json") is not None:  # hermes: the whole call is one JSON object
                whole = _loads(parts["json"])
                if not isinstance(whole, dict):
                    return None
                name, arguments = whole.get("name"), whole.get("arguments", {})
            elif self.argument is not None:  # one by one, as text
                name = parts["name"].strip()
                properties = (schemas.get(name) or {}).get("properties") or {}
                arguments = {a["key"].strip(): _typed(a["value"], properties.get(a["key"].strip()))
                             for a in self.argument.finditer(parts["arguments"])}
            else:
                name, arguments = parts["name"].strip(), _loads(parts["arguments"])
                if "id" in parts:  # Kimi's header: functions.NAME:INDEX
                    name = name.removeprefix("functions.")
            call = _call(parts["id"].strip() if parts.get("id") else self.new_id(), name, arguments)
            if call is None:
                return None
            calls.append(call)
        return calls


@dataclass(frozen=True)
class JsonToolCallParser(ToolCallParser):
    """A format whose calls are JSON objects ``{"name": ..., "arguments" (or "parameters"): {...}}``, alone,
    several separated by ``;`` or ``,``, or in an array; each start marker may precede one. Mistral's newer
    tokenizers write a call as ``NAME[ARGS]`` and its arguments' object, which this reads too where ``named`` is
    given.

    Attributes:
        named: the marker between a call's name and its arguments (``[ARGS]``), or ``None``.
    """

    named: str | None = None

    def read(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        decoder, at, found = json.JSONDecoder(), 0, []
        while True:
            at = self._skip(body, at)
            if at == len(body):
                break
            name = None
            if self.named is not None and body[at] not in "[{":
                cut = body.find(self.named, at)
                if cut < 0:
                    return None
                name, at = body[at:cut].strip(), cut + len(self.named)
            try:
                value, at = decoder.raw_decode(body, self._skip(body, at))
            except (ValueError, RecursionError):
                return None
            if name is not None:
                value = {"name": name, "arguments": value}
            found.extend(value if isinstance(value, list) else [value])
        calls = []
        for item in found:
            if not isinstance(item, dict):
                return None
            call = _call(self.new_id(), item.get("name"), item.get("arguments", item.get("parameters", {})))
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def _skip(self, body: str, at: int) -> int:
        """``at`` past white space, separators and start markers."""
        while at < len(body):
            marker = next((s for s in self.starts if s not in ("[", "{") and body.startswith(s, at)), None)
            if marker is not None:
                at += len(marker)
            elif body[at].isspace() or body[at] in ";,":
                at += 1
            else:
                break
        return at


@dataclass(frozen=True)
class PythonicToolCallParser(ToolCallParser):
    """Calls written as a Python list of calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``
    (Llama-3.2 and Llama-4 with pythonic templates), optionally between ``<|python_start|>`` and
    ``<|python_end|>``. Argument values are Python literals (strings, numbers, ``True``, ``None``, lists, dicts);
    ``true``, ``false`` and ``null`` read as JSON's."""

    def read(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        body = body.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            with warnings.catch_warnings():  # the model's text is not ours to warn about ("invalid decimal literal")
                warnings.simplefilter("ignore")
                tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                    or any(k.arg is None for k in node.keywords):
                return None
            # Python folds identifiers to NFKC (a fullwidth name would read as ASCII): names as written only
            written = [ast.get_source_segment(body, node.func)] + [
                (ast.get_source_segment(body, k) or "").split("=", 1)[0].strip() for k in node.keywords]
            if written != [node.func.id] + [k.arg for k in node.keywords]:
                return None
            try:
                values = {k.arg: _literal(k.value) for k in node.keywords}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            call = _call(self.new_id(), node.func.id, values)
            if call is None:
                return None
            calls.append(call)
        return calls


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> object:
    """A pythonic call's argument value: a Python literal, with JSON's ``true``, ``false`` and ``null`` as names.

    Raises:
        ValueError: anything else (a call, a variable, an operation), or a dict whose keys are not distinct
            strings.
    """
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [None if k is None else _literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise ValueError("a JSON object's keys are distinct strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    return ast.literal_eval(node)


_DS_CALLS, _DS_CALL, _DS_SEP, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", \
    "<｜tool▁call▁end｜>"
_LLAMA_JSON = dict(starts=("<|python_tag|>", "{"), markers=("<|python_tag|>",), leading=True)
_PYTHONIC = dict(starts=("[", "<|python_start|>"), markers=("<|python_start|>", "<|python_end|>"), leading=True)

TOOL_CALL_PARSERS = {
    "hermes": PatternToolCallParser(
        "hermes", ("<tool_call>",), ("<tool_call>", "</tool_call>"),
        call=re.compile(r"<tool_call>\s*(?P<json>.*?)\s*(?:</tool_call>|$)", re.S)),
    "kimi_k2": PatternToolCallParser(
        "kimi_k2", ("<|tool_calls_section_begin|>",),
        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
        call=re.compile(r"<\|tool_call_begin\|>\s*(?P<id>(?P<name>[^<]*?):\d+)\s*<\|tool_call_argument_begin\|>"
                        r"(?P<arguments>.*?)<\|tool_call_end\|>", re.S)),
    "deepseek_v3": PatternToolCallParser(
        "deepseek_v3", (_DS_CALLS,), (_DS_CALLS, "<｜tool▁calls▁end｜>", _DS_CALL, _DS_SEP, _DS_END),
        call=re.compile(re.escape(_DS_CALL) + r"\s*function\s*" + re.escape(_DS_SEP) + r"(?P<name>[^\n]*)\n```json\n"
                        r"(?P<arguments>.*?)\n```\s*" + re.escape(_DS_END), re.S)),
    "deepseek_v31": PatternToolCallParser(
        "deepseek_v31", (_DS_CALLS,), (_DS_CALLS, "<｜tool▁calls▁end｜>", _DS_CALL, _DS_SEP, _DS_END),
        call=re.compile(re.escape(_DS_CALL) + r"(?P<name>.*?)" + re.escape(_DS_SEP) + r"(?P<arguments>.*?)"
                        + re.escape(_DS_END), re.S)),
    "glm45": PatternToolCallParser(
        "glm45", ("<tool_call>",), ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                    "</arg_value>"),
        call=re.compile(r"<tool_call>(?P<name>[^\n<]*)(?P<arguments>.*?)</tool_call>", re.S),
        argument=re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S)),
    "qwen3_coder": PatternToolCallParser(
        "qwen3_coder", ("<tool_call>",),
        ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>"),
        call=re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<arguments>.*?)</function>\s*</tool_call>",
                        re.S),
        argument=re.compile(r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)</parameter>", re.S)),
    "openai": PatternToolCallParser(
        "openai", ("<|start|>assistant to=functions.",),
        ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"),
        call=re.compile(r"<\|start\|>assistant to=functions\.(?P<name>[^<\s]+)<\|message\|>(?P<arguments>.*?)"
                        r"(?=<\|start\|>|$)", re.S)),
    "mistral": JsonToolCallParser("mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]", "[ARGS]"), new_id=_mistral_id,
                                  named="[ARGS]"),
    "llama3_json": JsonToolCallParser("llama3_json", **_LLAMA_JSON),
    "llama4_json": JsonToolCallParser("llama4_json", **_LLAMA_JSON),
    "pythonic": PythonicToolCallParser("pythonic", **_PYTHONIC),
    "llama4_pythonic": PythonicToolCallParser("llama4_pythonic", **_PYTHONIC),
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
    value = _loads(text)
    if choice != "required":
        call = _call(_call_id(), choice, value, named=True)
        return [call] if call is not None else []
    if not isinstance(value, list):
        return []
    calls = [_call(_call_id(), item.get("name"), item.get("parameters"), named=True) for item in value
             if isinstance(item, dict)]
    return [c for c in calls if c is not None]
