"""Log-probabilities of generated and prompt tokens (OpenAI's ``logprobs``, vLLM's ``prompt_logprobs``).

They are those of the model's own distribution, the log-softmax of the raw logits before temperature, top-k and
top-p (vLLM's default ``raw_logprobs``), so they do not depend on how the token was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from epmoe.engine.transfer import to_device


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the most likely tokens at its position (a generated or a prompt token).

    Attributes:
        token_id: the token.
        logprob: its natural-log probability under the model (float32 log-softmax of the raw logits).
        top: the request's ``logprobs`` most likely ``(token id, logprob)`` at that position, most likely first
            (ties in any order); may include ``token_id``.
        rank: 1 + the tokens more likely than it at that position (1 = the most likely; vLLM's rank).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 1


class RowLogprobs(NamedTuple):
    """``token_logprobs``' result for ``N`` rows: ``chosen [N]`` float32, ``rank [N]`` int64, ``top_values [N, k]``
    float32 (descending) and ``top_ids [N, k]`` int64, on one device."""

    chosen: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> RowLogprobs:
    """Log-probabilities and ranks of chosen tokens and the top ``k`` of their rows, on the logits' device.

    Args:
        logits: ``[N, V]`` raw next-token logits (any float dtype).
        tokens: ``[N]`` int64 the tokens chosen at those rows.
        k: alternatives per row, ``0 <= k <= V``.

    Raises:
        ValueError: ``tokens`` not ``[N]`` or ``k`` out of range.
    """
    n, v = logits.shape
    if tokens.shape != (n,):
        raise ValueError(f"token_logprobs: {n} logits rows but tokens of shape {tuple(tokens.shape)}")
    if not 0 <= k <= v:
        raise ValueError(f"token_logprobs: k must be in [0, {v}], got {k}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    rank = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp.new_empty(n, 0), tokens.new_empty(n, 0))
    return RowLogprobs(chosen, rank, top_values, top_ids)


def logprob_entries(tokens: list[int], rows: RowLogprobs, ks: list[int]) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of rows from ``token_logprobs``' result (on the host), row ``i`` keeping its ``ks[i]``
    most likely alternatives.

    Args:
        tokens: the ``N`` chosen token ids.
        rows: ``token_logprobs``' result for them.
        ks: per row, alternatives kept, ``<= k``.
    """
    values, ids = rows.top_values.tolist(), rows.top_ids.tolist()
    return [TokenLogprobs(t, c, tuple(zip(i[:n], v[:n])), r)
            for t, c, r, v, i, n in zip(tokens, rows.chosen.tolist(), rows.rank.tolist(), values, ids, ks)]


def logprobs_at(logits: torch.Tensor, rows: list[int], tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of ``tokens[i]`` chosen at row ``rows[i]`` of ``logits [R, V]``, with ``ks[i]``
    alternatives (``token_logprobs`` then ``logprob_entries``; reads the result back to the host)."""
    if not rows:
        return []
    idx = to_device(rows, logits.device, torch.int64)
    got = token_logprobs(logits.index_select(0, idx), to_device(tokens, logits.device, torch.int64), max(ks))
    return logprob_entries(tokens, got, ks)


def record_prompt_logprobs(logits: torch.Tensor, spans: list[tuple]) -> None:
    """Append to each sequence asking for them the prompt log-probabilities its chunk's rows give.

    Args:
        logits: ``[R, V]`` the step's logits rows.
        spans: per chunk ``(chunk, first row, rows)``; a prefill chunk returning every row (``rows ==
            num_tokens``, see ``ScheduledChunk.prefill_logit_rows``) has row ``first + j`` at position
            ``start + j``, which predicts prompt token ``start + j + 1``.
    """
    rows, toks, ks, owners = [], [], [], []
    for c, first, n in spans:
        seq = c.seq
        prompt = seq.prompt_token_ids
        if seq.params.prompt_logprobs is None or n != c.num_tokens:
            continue
        for t in range(max(len(seq.prompt_logprobs), c.start + 1), min(c.start + c.num_tokens, len(prompt) - 1)
                       + 1):
            rows.append(first + t - 1 - c.start)
            toks.append(prompt[t])
            ks.append(seq.params.prompt_logprobs)
            owners.append(seq)
    for seq, entry in zip(owners, logprobs_at(logits, rows, toks, ks)):
        seq.prompt_logprobs.append(entry)

def emitted_logprobs(logits: torch.Tensor, sampled: list[tuple], emitted: dict[int, tuple[list[int], int]]
                      ) -> dict[int, list]:
    """Per chunk (by ``id``) whose request asks for them, the ``TokenLogprobs`` of the tokens a speculative step
    emitted for it: token ``j`` of a chunk whose logits start at row ``r`` was chosen at row ``r + j``."""
    rows, toks, ks, owners = [], [], [], []
    for c, r, _ in sampled:
        n = c.seq.params.logprobs
        if n is None:
            continue
        for j, tok in enumerate(emitted[id(c)][0]):
            rows.append(r + j)
            toks.append(tok)
            ks.append(n)
            owners.append(id(c))
    out: dict[int, list] = {}
    for owner, entry in zip(owners, logprobs_at(logits, rows, toks, ks)):
        out.setdefault(owner, []).append(entry)
    return out
