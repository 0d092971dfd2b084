"""The overlap schedule's launch and read-back: a step's tokens sampled on the device (the requests' constraints,
bans and penalties applied), on their way to the host, and read back into their requests.

Overlap schedule (SGLang's, vLLM's async scheduling; on unless ``EngineConfig.disable_overlap_schedule`` or
speculative decoding): a step's tokens are sampled on the device and copied back without waiting; the host
plans and launches the next step first (the sequences grow by a placeholder token, which that step reads
from the device token buffer, ``ModelRunner.keep_sampled``) and only then reads them back, checks stop
conditions and reports them. So ``Engine.step()`` returns a step's tokens one call later, the GPU is not left
idle while the host samples, schedules and launches, and a sequence that stops (EOS, a stop string) may be fed
once more, its extra token dropped. A sequence is never fed past ``max_tokens`` or the context.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from epmoe.engine.logprobs import RowLogprobs, logprob_entries, record_prompt_logprobs, token_logprobs
from epmoe.engine.request import PENDING_TOKEN, RequestOutput, Sequence
from epmoe.engine.sampling import TokenCounts, sample
from epmoe.engine.scheduler import ScheduledChunk, StepPlan
from epmoe.engine.stopping import banned_tokens, finish_reason
from epmoe.engine.structured import Grammars, allows_besides, apply_token_bitmask
from epmoe.engine.transfer import to_device


class _Logprobs(NamedTuple):
    """Log-probabilities of some rows of a launch on their way to the host (``logprobs.token_logprobs``' tensors,
    copied into pinned host memory on CUDA): ``index`` the rows, ``ks`` their requests' alternatives."""

    index: list[int]
    ks: list[int]
    rows: RowLogprobs


class Launch(NamedTuple):
    """A step whose sampled tokens are on their way to the host: per sampling sequence, where its placeholder
    is in ``output_token_ids``; the host buffer they are copied into, in the same order, and the event after
    the copy (``None`` on CPU); the log-probabilities of the rows whose requests ask for them."""

    rows: list[tuple[Sequence, int]]
    host: torch.Tensor | None
    event: torch.cuda.Event | None
    logprobs: _Logprobs | None = None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a non-blocking copy into pinned memory for a CUDA tensor (valid once the stream passes
    an event recorded after it), ``t`` itself on the CPU."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def sampling_rows(plan: StepPlan, logits: torch.Tensor) -> tuple[list[ScheduledChunk], torch.Tensor]:
    """The chunks of ``plan`` that sample at this step and their logits rows; records the log-probabilities of the
    prompts that ask for them on the way.

    Args:
        logits: ``[rows, V]`` the step's logits: one row per decode, then each prefill chunk's
            ``prefill_logit_rows`` (its last samples).

    Returns:
        The sampling chunks, but those of a sequence finished since the plan (by a constrained row's read-back just
        before: ``Engine.step``), and ``[len(chunks), V]`` their rows.
    """
    # logits rows: one per decode, then each prefill chunk's prefill_logit_rows (its last samples)
    spans, row = [], 0
    for c, n in [(c, 1) for c in plan.decodes] + [(c, c.prefill_logit_rows) for c in plan.prefills]:
        spans.append((c, row, n))
        row += n
    if row != sum(c.samples for c, _, _ in spans):  # rows of prompts whose log-probabilities are asked for
        record_prompt_logprobs(logits, spans)
    # the sampling rows, but those of a sequence finished since the plan (by a constrained row's read-back
    # just before: ``step``)
    sampling = [(c, r + n - 1) for c, r, n in spans if c.samples and not c.seq.finished]
    if len(sampling) != row:
        logits = logits.index_select(0, to_device([r for _, r in sampling], logits.device, torch.int64))
    return [c for c, _ in sampling], logits


def sample_rows(sampling: list[ScheduledChunk], logits: torch.Tensor, eos_ids: tuple[int, ...] | list[int],
                vocab_size: int, grammars: Grammars | None, token_counts: TokenCounts | None,
                generator: torch.Generator) -> tuple[torch.Tensor, TokenCounts | None]:
    """Sample one token per sampling chunk on the device: the constraints' masks first, then ``min_tokens``' bans
    and the penalties (``sampling.sample``).

    Args:
        sampling: the sampling chunks (``sampling_rows``).
        logits: ``[len(sampling), V]`` their rows (masked in place where constrained).
        eos_ids, vocab_size: the model's (``stopping.banned_tokens``).
        grammars: the compiled grammars of the constrained requests (``None`` before the first one).
        token_counts: the penalized requests' tokens (``None`` before the first one).
        generator: the engine's, for requests without a seed of their own.

    Returns:
        ``[len(sampling)]`` int64 the tokens, on the device; the penalized requests' tokens, made on the first one
        (these tokens counted).
    """
    banned = [banned_tokens(c.seq, eos_ids, vocab_size) for c in sampling]
    constrained = [i for i, c in enumerate(sampling) if c.seq.matcher is not None]
    if constrained:  # before any other adjustment: the tokens the constraints allow (vLLM's order)
        mask = grammars.bitmask([sampling[i].seq.matcher for i in constrained])
        apply_token_bitmask(logits, constrained, mask)
        for j, i in enumerate(constrained):  # min_tokens' bans yield where they would leave no allowed token
            if banned[i] is not None and not allows_besides(mask[j], banned[i]):
                banned[i] = None
    penalized = [i for i, c in enumerate(sampling) if c.seq.params.penalized]
    for i in penalized:
        seq = sampling[i].seq
        if seq.count_row is None:  # its first sample: every token it has is on the host
            if token_counts is None:
                token_counts = TokenCounts(vocab_size, logits.device)
            seq.count_row = token_counts.open(seq.prompt_token_ids, seq.resolved_output)
    toks = sample(logits, [c.seq.params for c in sampling], [c.seq.generator for c in sampling], generator,
                  token_counts, [c.seq.count_row for c in sampling], banned)
    if penalized:  # the penalties of the next steps count these tokens (still on the device)
        token_counts.count([sampling[i].seq.count_row for i in penalized],
                           toks.index_select(0, to_device(penalized, toks.device, torch.int64)))
    return toks, token_counts


def start_copy(sampling: list[ScheduledChunk], logits: torch.Tensor, toks: torch.Tensor,
               host: torch.Tensor) -> Launch:
    """Start the copy of a step's sampled tokens to the host; each sampling sequence grows by a placeholder
    (``PENDING_TOKEN``) until ``resolve``.

    Args:
        sampling: the step's sampling chunks, one per row of ``logits`` and ``toks``.
        logits: ``[len(sampling), V]`` their logits rows (for the log-probabilities their requests ask for).
        toks: ``[len(sampling)]`` int64 the tokens sampled from them, on the device.
        host: ``[len(sampling)]`` int64 the host buffer they are copied into (pinned on CUDA).
    """
    event = None
    want = [i for i, c in enumerate(sampling) if c.seq.params.logprobs is not None]
    logprobs = None
    if want:
        ks = [sampling[i].seq.params.logprobs for i in want]
        idx = to_device(want, logits.device, torch.int64)
        rows = token_logprobs(logits.index_select(0, idx), toks.index_select(0, idx), max(ks))
        logprobs = _Logprobs(want, ks, RowLogprobs(*(_host_copy(t) for t in rows)))
    if toks.is_cuda:
        host.copy_(toks, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host.copy_(toks)
    rows = []
    for i, c in enumerate(sampling):
        seq = c.seq
        seq.output_token_ids.append(PENDING_TOKEN)
        seq.num_pending += 1
        seq.device_row = i
        rows.append((seq, len(seq.output_token_ids) - 1))
    return Launch(rows, host, event, logprobs)


def resolve(launch: Launch | None, eos_ids: tuple[int, ...] | list[int], tokenizer, max_model_len: int,
            finish: Callable[[Sequence, str], None],
            output: Callable[[Sequence, list[int]], RequestOutput]) -> list[RequestOutput]:
    """Read back the tokens of ``launch`` (waiting for its copy), put them in place of their placeholders,
    finish the sequences they stop and report them; a sequence finished or aborted since drops its token.

    Args:
        launch: the step in flight (``None``: none).
        eos_ids, tokenizer, max_model_len: the stop conditions' (``stopping.finish_reason``).
        finish: ends a sequence with a finish reason (the engine's, freeing its blocks).
        output: the ``RequestOutput`` of a sequence with its new tokens.
    """
    if launch is None or not launch.rows:
        return []
    if launch.event is not None:
        launch.event.synchronize()
    now = time.perf_counter()
    tokens = launch.host.tolist()
    entries = {}
    if launch.logprobs is not None:
        lp = launch.logprobs
        entries = dict(zip(lp.index, logprob_entries([tokens[i] for i in lp.index], lp.rows, lp.ks)))
    outputs = []
    for i, ((seq, at), tok) in enumerate(zip(launch.rows, tokens)):
        if seq.finished:
            continue
        seq.output_token_ids[at] = tok
        seq.num_pending -= 1
        if i in entries:
            seq.output_logprobs.append(entries[i])
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.matcher is not None:
            seq.matcher.accept(tok)  # allowed by its mask (EOS where the constraint may end)
        reason = finish_reason(seq, tok, eos_ids, tokenizer, max_model_len)
        if reason is not None:
            finish(seq, reason)
        outputs.append(output(seq, [tok]))
    return outputs
