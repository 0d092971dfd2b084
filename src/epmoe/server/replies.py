"""A choice's reply as the API writes it: whole completion choices (the prompt first with ``echo``), chat messages
read by the request's parsers (reasoning, tool calls) and their finish reasons, log-probabilities in the chat's,
the completion's and vLLM's ``prompt_logprobs`` forms, usage, and a streamed chat choice's deltas."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from epmoe.engine import TokenLogprobs
from epmoe.server.chat_output import Reply
from epmoe.server.frontend import Update
from epmoe.server.job import Job
from epmoe.server.protocol import (
    AssistantMessage,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    DeltaToolCall,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from epmoe.server.text import TextCodec
from epmoe.server.tools import ToolCall

LOGPROB_FLOOR = -9999.0
"""Log-probabilities below this (``-inf`` included, which JSON cannot carry) are sent as it, as vLLM does."""


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(codec: TextCodec, entries: list[TokenLogprobs] | None, as_ids: bool) -> ChatLogprobs | None:
    """The chat form of some tokens' log-probabilities (``None`` when the request asked for none)."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> TopLogprob:
        text = codec.token_text(token_id, as_ids)
        return TopLogprob(token=text, logprob=_logprob(logprob), bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**one(e.token_id, e.logprob).model_dump(), top_logprobs=[one(i, v) for i, v in e.top])
        for e in entries])


def completion_logprobs(codec: TextCodec, job: Job, entries: list[TokenLogprobs | None] | None, ids: list[int],
                         start: int, base: int, prompt: bool = False) -> CompletionLogprobs | None:
    """The completion form of the log-probabilities ``entries`` of tokens ``ids[start:]`` (``None`` when the
    request asked for none).

    A token's ``text_offset`` is ``base`` plus where its text begins in the decoded text of ``ids``
    (``TextCodec.text_offsets``: special tokens kept in an echoed prompt, in the completion as its
    ``skip_special_tokens`` decodes them, as the text is); its ``top_logprobs`` map the most likely tokens' texts
    to their log-probabilities (tokens of one text: the most likely one's), the token itself included.

    Args:
        entries: per token its ``TokenLogprobs``; ``None`` for an echoed prompt's first token.
        ids: the prompt's tokens (``prompt``) or the completion's so far.
    """
    if entries is None:
        return None
    end = start + len(entries)
    names = [codec.token_text(i, job.as_ids) for i in ids[start:end]]
    skip = not prompt and job.params[0].skip_special_tokens
    offsets = [base + o for o in codec.text_offsets(ids, start, end, skip_special_tokens=skip)]
    tops: list[dict[str, float] | None] = []
    for name, e in zip(names, entries):
        if e is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for i, v in e.top:
            key = codec.token_text(i, job.as_ids)
            top[key] = max(top.get(key, LOGPROB_FLOOR), _logprob(v))
        top.setdefault(name, _logprob(e.logprob))  # the generated token too, as vLLM sends it
        tops.append(top)
    return CompletionLogprobs(text_offset=offsets, tokens=names, top_logprobs=tops,
                              token_logprobs=[None if e is None else _logprob(e.logprob) for e in entries])


def echoed_prompt(codec: TextCodec, job: Job, choice: int, up: Update) -> tuple[str, CompletionLogprobs | None]:
    """An echoing completion choice's prompt text (with the separator of a checkpoint without a tokenizer when a
    completion follows) and, with ``logprobs``, its prompt tokens' log-probabilities (``up`` an update that carries
    them)."""
    text = job.echo[choice // job.n] + ("" if job.prompt_only else codec.separator)
    k, entries = job.params[choice].logprobs, up.prompt_logprobs
    if k is None or entries is None:
        return text, None
    entries = [e if e is None else dataclasses.replace(e, top=e.top[:k]) for e in entries]
    return text, completion_logprobs(codec, job, entries, job.prompt_of(choice), 0, 0, prompt=True)


def prompt_logprobs_of(codec: TextCodec, job: Job, choice: int, up: Update) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a choice (``None`` unless the request sent ``prompt_logprobs``): per prompt
    token its own entry and its position's most likely tokens', ranked."""
    if job.sent_prompt_logprobs is None or up.prompt_logprobs is None:
        return None
    k = job.sent_prompt_logprobs
    out: PromptLogprobs = []
    for e in up.prompt_logprobs:
        if e is None:
            out.append(None)
            continue
        entry = {str(i): PromptLogprob(logprob=_logprob(v), rank=r, decoded_token=codec.token_text(i, job.as_ids))
                 for r, (i, v) in enumerate(e.top[:k], 1)}
        entry.setdefault(str(e.token_id), PromptLogprob(logprob=_logprob(e.logprob), rank=e.rank,
                                                        decoded_token=codec.token_text(e.token_id, job.as_ids)))
        out.append(entry)
    return out


def _joined(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """``a``'s tokens followed by ``b``'s."""
    if a is None or b is None:
        return b if a is None else a
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs
                              + b.token_logprobs, tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs
                              + b.top_logprobs)


def completion_choice(codec: TextCodec, job: Job, choice: int, up: Update) -> CompletionChoice:
    """One whole completion choice from its final update (the prompt first with ``echo``)."""
    text = final_text(codec, up)
    prompt = prompt_logprobs_of(codec, job, choice, up)
    if job.echo is None:
        return CompletionChoice(index=choice, text=text, finish_reason=up.finish_reason, prompt_logprobs=prompt,
                                logprobs=completion_logprobs(codec, job, up.logprobs, up.token_ids, 0, 0))
    prompt_text, prompt_lp = echoed_prompt(codec, job, choice, up)
    if job.prompt_only:
        return CompletionChoice(index=choice, text=prompt_text, logprobs=prompt_lp, finish_reason="length",
                                prompt_logprobs=prompt)
    logprobs = _joined(prompt_lp, completion_logprobs(codec, job, up.logprobs, up.token_ids, 0, len(prompt_text)))
    return CompletionChoice(index=choice, text=prompt_text + text, logprobs=logprobs, finish_reason=up.finish_reason,
                            prompt_logprobs=prompt)


def final_text(codec: TextCodec, up: Update) -> str:
    """The whole text of a finished choice (the engine's, cut before a stop string)."""
    return up.text if up.text is not None else codec.decode(up.token_ids)  # no tokenizer: ids in decimal


def _tool_calls(calls: list[ToolCall], delta: bool) -> list[ToolCallOut] | None:
    """The reply's calls (``None`` without any); in a stream delta each with its ``index``."""
    if not calls:
        return None
    if delta:
        return [DeltaToolCall(index=k, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for k, c in enumerate(calls)]
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _finish(job: Job, reply: Reply, finish: str | None) -> str | None:
    """``tool_calls`` where the model chose to call (``auto``, ``required``) and stopped; a named function's call
    finishes with ``stop``, as OpenAI's."""
    chose = job.chat is not None and (job.chat.tools is not None or job.chat.forced == "required")
    return "tool_calls" if reply.calls and chose and finish == "stop" else finish


def chat_reply(job: Job, text: str, finish: str | None) -> tuple[AssistantMessage, str | None]:
    """A whole chat choice's message (its text read by ``job.chat``) and finish reason."""
    if job.chat is None:
        return AssistantMessage(role="assistant", content=text), finish
    reply = job.chat.reply(text)
    return AssistantMessage(role="assistant", content=reply.content, reasoning_content=reply.reasoning,
                            tool_calls=_tool_calls(reply.calls, delta=False)), _finish(job, reply, finish)


def usage_of(job: Job, completion_tokens: int, cached_tokens: Sequence[int],
             reasoning_tokens: int | None = None) -> Usage:
    """The response's token counts: every prompt's (each once, whatever ``n``), of those the ones served from the
    prefix cache, ``completion_tokens``, and ``reasoning_tokens`` (of those, the reasoning's) as
    ``completion_tokens_details`` unless ``None``.

    Args:
        job: the request.
        completion_tokens: the choices' generated tokens, summed.
        cached_tokens: per choice (``len(job.params)`` entries), its prompt tokens served from the prefix cache
            (``Update.num_cached_tokens``); each prompt counts its first choice's, as ``prompt_tokens`` counts each
            prompt once.
        reasoning_tokens: of ``completion_tokens``, the reasoning's, or ``None`` (no reasoning parser).
    """
    prompt = sum(len(p) for p in job.prompts)
    cached = sum(cached_tokens[i * job.n] for i in range(len(job.prompts)))
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), completion_tokens_details=details)


def reads_reasoning(job: Job) -> bool:
    """Whether a reasoning parser reads the job's outputs (its usage then counts ``reasoning_tokens``)."""
    return job.chat is not None and job.chat.reasoning is not None and job.chat.forced is None


async def reasoning_tokens_of(codec: TextCodec, job: Job, choice: int, up: Update, text: str) -> int:
    """How many of a finished choice's tokens (its final update ``up``'s) are reasoning
    (``ChatOutput.reasoning_tokens``: its tokens' prefixes decoded as its text is); 0 where no reasoning parser
    reads it. Called once per finished choice; the count runs in a worker thread, since its decodes (up to
    ``n.bit_length()`` of up to ``n`` tokens each, for an output of ``n``) take milliseconds for a long output, which
    the event loop and the other requests' streams would otherwise wait for.

    Args:
        text: the choice's whole text (``final_text(codec, up)``), which the count reads instead of decoding it
            again.
    """
    if not reads_reasoning(job):
        return 0
    skip = job.params[choice].skip_special_tokens
    return await asyncio.to_thread(job.chat.reasoning_tokens, up.token_ids, lambda ids: codec.decode(ids, skip), text)


class StreamReply:
    """One streamed chat choice read by ``job.chat``: the text so far, and how much of its reasoning and content
    was sent."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.text = ""
        self.sent = [0, 0]  # reasoning, content

    def delta(self, text: str, finished: bool, finish: str | None) -> tuple[AssistantMessage, str | None]:
        """The delta of the next chunk (what settled since the last; on the last, the rest and the calls) and its
        finish reason."""
        self.text += text
        calls = []
        if finished:
            reply = self.job.chat.reply(self.text)
            parts, calls = (reply.reasoning or "", reply.content or ""), reply.calls
            finish = _finish(self.job, reply, finish)
        else:
            parts = self.job.chat.settled(self.text)
        new = [part[sent:] for part, sent in zip(parts, self.sent)]
        self.sent = [len(part) for part in parts]
        return AssistantMessage(reasoning_content=new[0] or None, content=new[1] or None,
                                tool_calls=_tool_calls(calls, delta=True)), finish
