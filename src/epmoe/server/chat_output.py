"""A chat choice's output text as its reply: reasoning split off (``server.reasoning``), tool calls read
(``server.tools``), whole or as a stream settles it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epmoe.server.errors import ApiError
from epmoe.server.protocol import ChatCompletionRequest
from epmoe.server.reasoning import REASONING_PARSERS, HarmonyReasoningParser, ReasoningParser
from epmoe.server.tools import TOOL_CALL_PARSERS, ToolCall, ToolCallParser, forced_calls


@dataclass(frozen=True)
class Reply:
    """A chat reply's parts: ``reasoning`` (``None`` where the model did not reason), ``content`` (``None`` where
    there is none beside reasoning or calls) and ``calls``."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ChatOutput:
    """How one chat request's outputs are read.

    Attributes:
        reasoning: the ``--reasoning-parser``, or ``None``.
        opened: its output begins in reasoning (``ReasoningParser.opens`` of the rendered prompt).
        tools: the ``--tool-call-parser`` reading the output (``tool_choice`` ``auto``), or ``None``.
        forced: ``"required"`` or the named function of a forced ``tool_choice`` (the output is its constrained
            JSON), or ``None``.
        parallel: more than one call is kept (``parallel_tool_calls``); else only the first.
        schemas: the tools' ``parameters`` schemas by name (``ToolCallParser.parse`` types arguments by them).
    """

    reasoning: ReasoningParser | HarmonyReasoningParser | None = None
    opened: bool = False
    tools: ToolCallParser | None = None
    forced: str | None = None
    parallel: bool = True
    schemas: dict[str, dict] | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the parsers read."""
        return (*(self.reasoning.markers if self.reasoning else ()), *(self.tools.markers if self.tools else ()))

    def _answer(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, self.opened, final)

    def reply(self, text: str) -> Reply:
        """The reply of a whole output ``text``."""
        if self.forced is not None:
            calls = forced_calls(self.forced, text)
            return Reply(None, None if calls else text, calls if self.parallel else calls[:1])
        reasoning, content = self._answer(text, final=True)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.parse(content, self.schemas)
        if not content and (reasoning is not None or calls):
            content = None
        return Reply(reasoning or None, content, calls if self.parallel else calls[:1])

    def reasoning_tokens(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], text: str) -> int:
        """How many of an output's tokens are reasoning (the usage's ``reasoning_tokens``): the tokens before the
        first token at which the answer (content or tool calls) begins, i.e. the reasoning's tokens with its end
        marker (``</think>``; a marker kept in the answer, as Kimi's tool-call section, begins the answer); all
        of them where the answer never begins in ``text`` (the output never leaves the reasoning, or nothing follows
        its end: a stop string cut from the text is not an answer); 0 without a reasoning parser, with a forced
        ``tool_choice``, or where the parser says the output does not reason (``reasoning`` ``None`` for the whole
        ``text``; an empty reasoning, ``<think></think>``, counts its markers' tokens).

        The token at which the answer begins is the first ``k`` whose prefix ``token_ids[:k + 1]``, decoded and
        split by the parser (as a stream splits it: text that may still become a marker held back), has answer
        text: a predicate that only turns true as the prefix grows, found by binary search. Cost, for an output of
        ``n`` tokens: one parse of ``text`` and, only where an answer follows the reasoning, at most
        ``n.bit_length()`` decodes of prefixes shorter than the output (each of at most ``n`` tokens, so
        O(n log n) tokenizer work; the whole output is never decoded again: ``text`` is it). No text is tokenized
        again. The server calls it once per finished choice, in a worker thread (``replies.reasoning_tokens_of``).

        Args:
            token_ids: the output's tokens.
            decode: the text of some of its tokens, as the output's text is decoded (special tokens the parser
                reads kept).
            text: the whole output's text (``final_text``), as ``reply`` reads it.
        """
        if self.reasoning is None or self.forced is not None:
            return 0
        reasoning, answer = self._answer(text, final=True)
        if reasoning is None:
            return 0
        n = len(token_ids)
        if not answer:
            return n

        def begun(k: int) -> bool:
            """The answer has begun within the first ``k < n`` tokens."""
            return bool(self._answer(decode(token_ids[:k]), final=False)[1])

        lo, hi = 1, n  # the least k with begun(k) lies in [lo, hi]: the whole output's text has an answer
        while lo < hi:
            mid = (lo + hi) // 2
            if begun(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo - 1

    def settled(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of an unfinished output that no later token changes: what may still become a
        marker, and a forced choice's JSON or anything after the start of the tool calls, wait for the end. Each
        part only grows as ``text`` does, and is a prefix of the part ``reply`` gives."""
        if self.forced is not None:
            return "", ""
        reasoning, content = self._answer(text, final=False)
        if self.tools is not None:
            content = content[:self.tools.held_from(content)]
        return reasoning or "", content


def tool_choice(req: ChatCompletionRequest) -> str:
    """The request's ``tool_choice`` as a word (``none``, ``auto``, ``required``) or the named function's name:
    ``auto`` where tools are sent without one, ``none`` without tools (OpenAI's defaults).

    Raises:
        ApiError: 400 naming the field: a choice other than ``none`` without tools, a named function that is not
            among them, two tools of one name.
    """
    names = [t.function.name for t in req.tools or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ApiError(400, f"tools: function name(s) {twice} given more than once", "tools")
    choice = req.tool_choice
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice != "none" and not names:
            raise ApiError(400, f"tool_choice {choice!r} needs tools: send the functions in tools", "tool_choice")
        return choice
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names function {choice.function.name!r}, which is not among tools "
                            f"({names})", "tool_choice")
    return choice.function.name


@dataclass(frozen=True)
class ChatParsers:
    """The server's output parsers.

    Attributes:
        reasoning: ``--reasoning-parser`` (a ``REASONING_PARSERS`` name), or ``None``.
        tools: ``--tool-call-parser`` (a ``TOOL_CALL_PARSERS`` name), or ``None``.
        auto_tool_choice: ``--enable-auto-tool-choice``: requests may let the model decide (``tool_choice``
            ``auto``).

    Raises:
        ValueError: an unknown parser, or ``auto_tool_choice`` without a tool-call parser (the flags named).
    """

    reasoning: str | None = None
    tools: str | None = None
    auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        for flag, value, known in (("--reasoning-parser", self.reasoning, REASONING_PARSERS),
                                   ("--tool-call-parser", self.tools, TOOL_CALL_PARSERS)):
            if value is not None and value not in known:
                raise ValueError(f"{flag} must be one of {sorted(known)}, got {value!r}")
        if self.tools == "openai" and self.reasoning != "openai_gptoss":
            raise ValueError("--tool-call-parser openai reads gpt-oss's harmony messages as --reasoning-parser "
                             "openai_gptoss hands them on: give both")
        if self.auto_tool_choice and self.tools is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model's tool calls "
                             f"are read in: one of {sorted(TOOL_CALL_PARSERS)})")

    def output(self, req: ChatCompletionRequest, choice: str, prompt: str, constrained: bool) -> ChatOutput | None:
        """How the request's outputs are read (``None``: as plain text).

        Args:
            req: the request.
            choice: ``tool_choice(req)``.
            prompt: its rendered prompt (where the template may open the reasoning).
            constrained: the output is constrained (``response_format``, ``structured_outputs``, ...) from its
                first token: it reasons only where it begins with ``<think>`` itself, whatever the prompt opened.

        Raises:
            ApiError: 400 ``tool_choice`` ``auto`` with tools on a server without ``--enable-auto-tool-choice``.
        """
        parser = None
        if choice == "auto" and req.tools:
            if not self.auto_tool_choice:
                raise ApiError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                                    '--tool-call-parser; send tool_choice "required", a named function or "none"',
                               "tool_choice")
            parser = TOOL_CALL_PARSERS[self.tools]
        forced = choice if choice not in ("none", "auto") else None
        reasoning = REASONING_PARSERS[self.reasoning] if self.reasoning is not None and forced is None else None
        if parser is None and forced is None and reasoning is None:
            return None
        opened = reasoning is not None and not constrained and reasoning.opens(prompt, req.chat_template_kwargs)
        schemas = {t.function.name: t.function.parameters or {} for t in req.tools or ()}
        return ChatOutput(reasoning, opened, parser, forced, req.parallel_tool_calls, schemas)
