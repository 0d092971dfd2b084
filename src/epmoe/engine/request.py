"""A request's state inside the engine (``Sequence``) and what the engine hands back (``RequestOutput``)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from epmoe.engine.kv_cache import BlockKey
from epmoe.engine.logprobs import TokenLogprobs
from epmoe.engine.sampling import SamplingParams
from epmoe.engine.speculative import SpecStats
from epmoe.engine.structured import Matcher

PENDING_TOKEN = -1
"""The id a generated token has on the host while it is still on the device (sampled by a step in flight)."""


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued for (re)prefill, scheduled each step, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request as the scheduler sees it.

    The tokens are the prompt followed by the generated tokens. ``num_computed`` of them have their
    keys and values in the KV cache; the rest are fed at the next steps (a whole prompt, a chunk of it,
    or the one newest token in decode). A preempted sequence loses its blocks and sets
    ``num_computed`` to 0: it is recomputed from its tokens, generated ones included.

    With the overlap schedule, a step's sampled tokens stay on the device until the engine reads them back
    during the next step: meanwhile each is in ``output_token_ids`` as ``PENDING_TOKEN`` (the last
    ``num_pending`` entries), so the scheduler plans with the right lengths, and the next step reads the
    token itself from row ``device_row`` of the engine's device token buffer.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt's token ids.
        params: its sampling options.
        arrival: order of arrival (the scheduler admits and keeps sequences in this order).
        output_token_ids: generated token ids so far.
        block_table: KV block ids holding positions ``[i * block_size, (i + 1) * block_size)``.
        num_computed: leading tokens whose KV is in the cache.
        status: waiting, running or finished.
        finish_reason: ``stop`` (EOS, a stop token or string), ``length`` (``max_tokens`` or the
            context), ``abort``; ``None`` while running.
        stop_text_len: with a stop string, the length of the output text kept (the match cut off).
        generator: this request's sampling generator (seeded requests), else ``None``.
        num_preemptions: times it was preempted.
        arrival_time, first_token_time: ``time.perf_counter()`` seconds.
        spec: its speculative decoding counts (verify steps, proposed and accepted tokens).
        num_pending: trailing entries of ``output_token_ids`` still on the device (``PENDING_TOKEN``).
        device_row: row of the engine's device token buffer holding the newest pending token (valid while
            ``num_pending > 0``).
        output_logprobs: with ``params.logprobs`` set, one entry per read-back generated token (the pending ones
            get theirs when read back).
        prompt_logprobs: with ``params.prompt_logprobs`` set, one entry per prompt token computed so far (the
            first ``None``); complete once it has as many entries as the prompt has tokens.
        block_keys: prefix-cache keys of its first full blocks of tokens (``kv_cache.block_key``), computed as
            needed.
        num_registered: leading blocks of ``block_table`` put in the prefix cache (or taken from it).
        matcher: with ``params.structured_outputs``, its position in the constraint (``structured.Matcher``), past
            every read-back token.
        constraint_done: it stopped because its constraint was complete (its last token is kept in the text).
        error: why it ended with ``abort`` on its own (its constraint engine failed), else ``None``.
        count_row: with penalties, its row of the engine's ``sampling.TokenCounts`` (from its first sample on).
        num_cached_tokens: prompt tokens its first admission took from the prefix cache (0 without prefix caching
            or before it is admitted); a preempted sequence's re-admission, which may find its own blocks again,
            leaves it as it was: it counts what the request was served, not what its recomputation reused.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_text_len: int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    num_pending: int = 0
    device_row: int = -1
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    num_registered: int = 0
    matcher: Matcher | None = None
    constraint_done: bool = False
    error: str | None = None
    count_row: int | None = None
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output (``0 <= start <= end``)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def resolved_output(self) -> list[int]:
        """The generated tokens whose ids are on the host (``output_token_ids`` without the pending ones)."""
        return self.output_token_ids[: len(self.output_token_ids) - self.num_pending]

    def drop_pending(self) -> None:
        """Forget the pending tokens (the sequence finished before they were read back)."""
        del self.output_token_ids[len(self.output_token_ids) - self.num_pending:]
        self.num_pending = 0

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What a step reports for one request (vLLM's name).

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt (the request's own list: do not modify it).
        token_ids: every token generated so far.
        new_token_ids: tokens generated at this step (empty for an abort).
        text: the generated text, cut before a stop string and without the stop or EOS token that ended it (that
            token stays in ``token_ids``, as vLLM's), on the final output (``None`` before it and without a
            tokenizer: decode ``token_ids`` for partial text).
        finished: no more tokens will come.
        finish_reason: ``stop``, ``length``, ``abort`` or ``None`` while running.
        num_preemptions: times the request was preempted (recomputed).
        ttft_s: seconds from arrival to its first token (``None`` before it).
        num_verify_steps: speculative steps that verified proposed tokens for it.
        num_draft_tokens: proposed tokens verified for it.
        num_accepted_tokens: proposed tokens accepted (its mean accepted length per verify step is
            ``(num_accepted_tokens + num_verify_steps) / num_verify_steps``).
        logprobs: with ``SamplingParams.logprobs`` set, one entry per token of ``token_ids``; else ``None``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, one entry per prompt token (the first
            ``None``), from the first output on; else ``None``.
        error: set when the engine ended the request itself (``finish_reason`` ``abort``): what failed, named (a
            structured output's constraint engine giving up mid-generation); else ``None``.
        num_cached_tokens: prompt tokens served from the prefix cache at its first admission (vLLM's name;
            ``Sequence.num_cached_tokens``: a preempted request's recomputation does not change it); 0 before it
            is admitted and without prefix caching.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None
    num_preemptions: int = 0
    ttft_s: float | None = None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
