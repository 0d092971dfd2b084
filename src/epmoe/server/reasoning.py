"""Reasoning parsers (vLLM's and SGLang's ``--reasoning-parser``): a thinking model's output split into its
reasoning (``reasoning_content`` in the reply, DeepSeek's API field) and its answer (``content``).

The served families think between ``<think>`` and ``</think>``. Where the reasoning opens differs:

- ``deepseek_r1`` (DeepSeek-R1, whose template opens ``<think>`` in the prompt): the output is reasoning from its
  first token (a leading ``<think>`` dropped) up to ``</think>``; an output cut off before ``</think>`` is all
  reasoning.
- ``qwen3`` (Qwen3, whose thinking can be switched off through ``chat_template_kwargs={"enable_thinking": false}``):
  reasoning only where it was opened, by the prompt (the rendered prompt ends with ``<think>``) or by the output
  (it begins with ``<think>``); otherwise all of it is the answer.
- ``kimi_k2`` (Kimi-K2-Thinking, Kimi-K2.5): as ``deepseek_r1``, but a tool-call section
  (``<|tool_calls_section_begin|>``) also ends the reasoning, and ``chat_template_kwargs`` with ``thinking`` or
  ``enable_thinking`` false makes the whole output the answer.

gpt-oss writes OpenAI's harmony format instead: messages ``<|start|>ROLE HEADER<|message|>BODY`` ended by
``<|end|>`` (or by ``<|call|>`` / ``<|return|>``, its stop tokens), the header naming the ``<|channel|>``
(``analysis``: reasoning; ``final``: the answer; ``commentary``: a preamble, or a tool call where the header
names a recipient ``to=functions.NAME``); its output starts inside the assistant's first header (the prompt ends
with ``<|start|>assistant``). ``openai_gptoss`` puts the analysis bodies in the reasoning and the final and
preamble bodies in the answer, followed by each tool call as ``<|start|>assistant to=functions.NAME<|message|>
ARGUMENTS`` for the ``openai`` tool-call parser. An output without harmony markup (one a constraint led) is all
answer.

A streamed choice sends only what is settled: text that might still become a marker is held back (``held``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
KIMI_TOOL_SECTION = "<|tool_calls_section_begin|>"


def held(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that begin one of ``markers`` without completing it (0 if none): they are
    held back until the next tokens tell."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


@dataclass(frozen=True)
class ReasoningParser:
    """One ``--reasoning-parser``.

    Attributes:
        name: the flag's value.
        always_open: the output is reasoning from its start (``deepseek_r1``, ``kimi_k2``), unless the request
            switched thinking off (``kimi_k2``); else only where the prompt or output opened it (``qwen3``).
        also_ends: markers besides ``</think>`` that end the reasoning (kept in the answer).
        switch: ``chat_template_kwargs`` keys whose false value means no thinking.
    """

    name: str
    always_open: bool
    also_ends: tuple[str, ...] = ()
    switch: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts this parser reads (a tokenizer must not drop them as special tokens)."""
        return (THINK_START, THINK_END, *self.also_ends)

    def opens(self, prompt: str, template_kwargs: dict | None) -> bool:
        """Whether an output of this prompt begins in reasoning (before looking at the output itself)."""
        kwargs = template_kwargs or {}
        if any(key in kwargs and not kwargs[key] for key in self.switch):
            return False
        return self.always_open or prompt.rstrip().endswith(THINK_START)

    def split(self, text: str, opened: bool, final: bool) -> tuple[str | None, str]:
        """``text`` (the output so far) as ``(reasoning, answer)``: ``reasoning`` ``None`` where the output does not
        reason. Before ``final``, text that may still turn into a marker is left out of both, so that each part
        only grows as the output does.

        Args:
            text: the output's text (special tokens the parser reads kept).
            opened: ``opens(prompt, ...)``'s answer for its prompt.
            final: the output is complete.
        """
        if not final and text and len(text) < len(THINK_START) and THINK_START.startswith(text):
            return ("" if opened else None), ""  # it may still become ``<think>``
        if text.startswith(THINK_START):
            text, opened = text[len(THINK_START):], True
        if not opened:
            return None, text
        ends = [(i, marker) for marker in (THINK_END, *self.also_ends) if (i := text.find(marker)) >= 0]
        if ends:
            i, marker = min(ends)
            return text[:i], text[i + (len(marker) if marker == THINK_END else 0):]
        if final:
            return text, ""
        return text[:len(text) - held(text, (THINK_END, *self.also_ends))], ""


HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY_CALL = "<|start|>assistant to=functions."
_RECIPIENT = re.compile(r"to=(functions\.[^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass(frozen=True)
class HarmonyReasoningParser:
    """``openai_gptoss``: gpt-oss's harmony messages read as reasoning and answer (see the module docstring)."""

    name: str = "openai_gptoss"

    @property
    def markers(self) -> tuple[str, ...]:
        """The harmony tokens this parser reads (special tokens of gpt-oss's tokenizer)."""
        return (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, "<|constrain|>", *HARMONY_ENDS)

    def opens(self, prompt: str, template_kwargs: dict | None) -> bool:
        """Always: a harmony output says itself which channel each message is on."""
        return True

    def split(self, text: str, opened: bool, final: bool) -> tuple[str | None, str]:
        """``text`` as ``(reasoning, answer)``, as ``ReasoningParser.split`` (``opened`` false: a constrained output,
        read as harmony only where it writes the markup itself)."""
        starts = (HARMONY_CHANNEL, HARMONY_START)
        if not text.startswith(starts) and HARMONY_MESSAGE not in text:
            if not final and held(text, starts) == len(text) and text:
                return None, ""  # it may still become harmony
            return None, text
        reasoning: list[str] | None = None
        answer = []
        segments = text.split(HARMONY_START)
        for k, segment in enumerate(segments):
            head, sep, body = segment.partition(HARMONY_MESSAGE)
            if not sep:
                continue  # its header is not complete yet
            ends = [i for i in (body.find(e) for e in HARMONY_ENDS) if i >= 0]
            if ends:
                body = body[:min(ends)]
            elif not final and k == len(segments) - 1:
                body = body[:len(body) - held(body, (*HARMONY_ENDS, HARMONY_START))]
            recipient = _RECIPIENT.search(head)
            channel = _CHANNEL.search(head)
            if recipient is not None:
                answer.append(f"{HARMONY_START}assistant to={recipient[1]}{HARMONY_MESSAGE}{body}")
            elif channel is not None and channel[1] == "analysis":
                reasoning = (reasoning or []) + [body]
            else:
                answer.append(body)
        return (None if reasoning is None else "".join(reasoning)), "".join(answer)


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", always_open=True),
    "qwen3": ReasoningParser("qwen3", always_open=False),
    "kimi_k2": ReasoningParser("kimi_k2", always_open=True, also_ends=(KIMI_TOOL_SECTION,),
                               switch=("thinking", "enable_thinking")),
    "openai_gptoss": HarmonyReasoningParser(),
}
"""The ``--reasoning-parser`` choices, by name."""
