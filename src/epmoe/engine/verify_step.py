"""The step of speculative decoding after its model pass: sample the rows without proposals, verify the
proposals (``epmoe.engine.speculative``), advance each request by the proposals that stand plus one token, and
feed the proposer the step's tokens (and its auxiliary hidden states).

With speculative decoding (``EngineConfig.speculative_algorithm``), a proposer (``epmoe.engine.ngram``,
``draft``, ``eagle3``) proposes up to K tokens per decoding request before the model runs; the step then
verifies them: a decode step of ``B (K + 1)`` rows, replayed from its own CUDA-graph buckets, after which each
request advances by the proposals that stand plus one token. Its tokens are read back at once (the proposers
need them for the next step: no overlap schedule).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from epmoe.engine.logprobs import emitted_logprobs, record_prompt_logprobs
from epmoe.engine.model_runner import StepOutput
from epmoe.engine.request import RequestOutput, Sequence
from epmoe.engine.sampling import sample
from epmoe.engine.scheduler import StepPlan
from epmoe.engine.speculative import Proposal, Proposer, SpecStats, verify, verify_greedy
from epmoe.engine.stopping import banned_tokens, finish_reason
from epmoe.engine.transfer import to_device


def _rows(aux: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if aux is None else aux[start:start + n]


def advance(plan: StepPlan, out: StepOutput, proposals: list[Proposal] | None, *, vocab_size: int,
            eos_ids: tuple[int, ...] | list[int], tokenizer, max_model_len: int, generator: torch.Generator,
            spec_stats: SpecStats, proposer: Proposer | None, finish: Callable[[Sequence, str], None],
            output: Callable[[Sequence, list[int]], RequestOutput]) -> list[RequestOutput]:
    """Sample or verify the step's rows and advance its requests.

    Args:
        plan: the step's plan.
        out: its model pass (``out.logits`` ``[rows, >= vocab_size]``; ``out.aux`` the proposer's hidden states).
        proposals: one per decode chunk (``None``: no proposals this step).
        vocab_size, eos_ids, tokenizer, max_model_len: the model's (bans and stop conditions).
        generator: the engine's, for requests without a seed of their own.
        spec_stats: the engine's acceptance statistics (a request's own are counted too).
        proposer: told the tokens that stand (``Proposer.observe``).
        finish: ends a sequence with a finish reason (the engine's, freeing its blocks).
        output: the ``RequestOutput`` of a sequence with its new tokens.

    Returns:
        One ``RequestOutput`` per request that got tokens.
    """
    logits = out.logits[:, : vocab_size]
    # rows of the packed step: each decode chunk 1 + k (all sampled), then each prefill chunk's tokens
    sampled: list[tuple] = []  # (chunk, first logits row, proposal or None)
    first_row: list[int] = []  # packed row of each chunk's first token (aux hidden states)
    logit_row = packed_row = 0
    for i, c in enumerate(plan.decodes):
        prop = proposals[i] if proposals is not None else Proposal()
        sampled.append((c, logit_row, prop))
        first_row.append(packed_row)
        logit_row += 1 + len(prop.token_ids)
        packed_row += 1 + len(prop.token_ids)
    spans = []  # prefill chunks: (chunk, first logits row, rows)
    for c in plan.prefills:
        first_row.append(packed_row)
        packed_row += c.num_tokens
        n = c.prefill_logit_rows
        spans.append((c, logit_row, n))
        if c.samples:
            sampled.append((c, logit_row + n - 1, None))
        logit_row += n
    record_prompt_logprobs(logits, spans)
    emitted: dict[int, tuple[list[int], int]] = {}
    plain = [(c, r) for c, r, p in sampled if p is None or not p.token_ids]
    if plain:
        rows = to_device([r for _, r in plain], logits.device, torch.int64)
        toks = sample(logits.index_select(0, rows), [c.seq.params for c, _ in plain],
                      [c.seq.generator for c, _ in plain], generator,
                      banned=[banned_tokens(c.seq, eos_ids, vocab_size) for c, _ in plain]).tolist()
        for (c, _), t in zip(plain, toks):
            emitted[id(c)] = ([t], 0)
    spec = [(c, r, p) for c, r, p in sampled if p is not None and p.token_ids]
    top = logits.argmax(dim=-1).tolist() if any(c.seq.params.greedy for c, _, _ in spec) else []
    for c, r, p in spec:
        k = len(p.token_ids)
        if c.seq.params.greedy:
            emitted[id(c)] = verify_greedy(top[r:r + k + 1], p.token_ids)
        else:
            gen = c.seq.generator if c.seq.generator is not None else generator
            emitted[id(c)] = verify(logits[r:r + k + 1], p, c.seq.params, gen)
        c.seq.spec.add(k, emitted[id(c)][1])
        spec_stats.add(k, emitted[id(c)][1])
    entries = emitted_logprobs(logits, sampled, emitted)
    now = time.perf_counter()
    outputs = []
    for c, row in zip(plan.chunks, first_row):
        seq = c.seq
        if id(c) not in emitted:
            if proposer is not None:
                proposer.observe(seq, c.start, c.num_tokens, _rows(out.aux, row, c.num_tokens))
            continue
        tokens, accepted = emitted[id(c)]
        new = []
        for j, tok in enumerate(tokens):
            seq.output_token_ids.append(tok)
            new.append(tok)
            if id(c) in entries:
                seq.output_logprobs.append(entries[id(c)][j])
            reason = finish_reason(seq, tok, eos_ids, tokenizer, max_model_len)
            if reason is not None:
                finish(seq, reason)
                break
        if seq.first_token_time is None:
            seq.first_token_time = now
        if not seq.finished:
            seq.num_computed += accepted  # the accepted proposals' keys are in the cache; the rest are past it
            if proposer is not None:
                valid = c.num_tokens + accepted
                proposer.observe(seq, c.start, valid, _rows(out.aux, row, valid))
        outputs.append(output(seq, new))
    return outputs
