"""Speculative decoding: the proposer interface, the verification rule and the acceptance statistics.

A step with speculation feeds, for each decoding request, its last token followed by up to ``K`` proposed
tokens; each of these ``k + 1`` rows is a decode row of its own (it attends over the keys before it, the
earlier proposed ones included), so the verify step is a decode step of ``B (K + 1)`` rows: the same
attention kernel, the same CUDA-graph buckets (sized for those rows), the same fixed-capacity dispatch.
The target's logits of the rows then decide how many proposals stand (``verify``); the keys and values of
rejected rows stay in the cache past the sequence's length and are overwritten later, never read.

Verification (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): greedy requests
keep proposals while they equal the target's argmax and then take the target's argmax; sampled requests
accept proposal ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` and, at the first rejection, draw
from ``max(0, p_i - q_i)`` normalised, or after ``k`` acceptances one more token from ``p_k``. The output
is then distributed as the target's alone. A deterministic proposer (``ngram``) has a one-hot ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.engine.sampling import SamplingParams, draw, probabilities


@dataclass(frozen=True)
class Proposal:
    """The tokens proposed for one request at one step.

    Attributes:
        token_ids: ``k`` proposed token ids (possibly none).
        probs: ``[k, V]`` float32 the distributions they were drawn from (sampled requests of a model proposer),
            ``None`` when each was chosen deterministically (``q`` one-hot).
    """

    token_ids: tuple[int, ...] = ()
    probs: torch.Tensor | None = None


class Proposer:
    """What an algorithm implements (``epmoe.engine.ngram``, ``draft``, ``eagle3``).

    Attributes:
        name: the algorithm's name.
        collective: its forwards join collectives over the EP group (an expert-parallel MoE draft): every rank
            calls ``propose`` at every step in which any rank decodes, with its own (possibly empty) chunks.
        aux_layers: decoder layers of the target whose outputs it reads (EAGLE-3), ``()`` for none.
        kv_bytes_per_token: bytes of its own KV cache per token (its pool has the target's blocks and block ids).
    """

    name = "base"
    collective = False
    aux_layers: tuple[int, ...] = ()
    kv_bytes_per_token = 0

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Make the proposer's KV pool: ``num_blocks`` blocks of ``block_size`` tokens, indexed by the target's
        block ids (a sequence's draft keys at position ``p`` live in its target block table's block)."""

    def describe(self) -> str:
        """One line for the start of a run: what proposes and how its weights are placed."""
        return self.name

    def propose(self, chunks: list, limits: list[int], engine) -> list[Proposal]:
        """Proposals for the decoding ``chunks`` (``ScheduledChunk``, one token each), ``limits[i]`` tokens at
        most for chunk ``i``; ``engine`` is the target's (its sampling generator, its agreement over the ranks)."""
        raise NotImplementedError

    def observe(self, seq, start: int, num_valid: int, aux: torch.Tensor | None) -> None:
        """After a target step fed ``seq`` positions from ``start`` and ``num_valid`` of them stand (the chunk,
        or the last token and the accepted proposals); ``aux`` holds their ``[num_valid, n D]`` target hidden
        states of ``aux_layers`` (``None`` when it reads none)."""

    def release(self, seq) -> None:
        """Forget ``seq`` (finished, aborted or preempted: its blocks are gone)."""

    def capture(self, sizes: list[int]) -> None:
        """Prepare the draft's static steps (CUDA graphs) for these row counts; nothing for a proposer
        without a model."""


@dataclass
class SpecStats:
    """Acceptance counts (per request and per engine).

    Attributes:
        verify_steps: steps that verified at least one proposed token.
        draft_tokens: proposed tokens verified.
        accepted_tokens: proposed tokens accepted.
    """

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        """Count one verify step of ``proposed`` tokens, ``accepted`` of them kept."""
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted

    @property
    def accepted_length(self) -> float:
        """Mean tokens a verify step yields (the accepted proposals plus the target's own token); 0 without
        any verify step."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 when none was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_json(self) -> dict:
        """The counts and their ratios."""
        return {"verify_steps": self.verify_steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_length": self.accepted_length,
                "acceptance_rate": self.acceptance_rate}


def verify(logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """The tokens a verify step yields for one request.

    Args:
        logits: ``[k + 1, V]`` float32 the target's logits after the last token and after each proposed token.
        proposal: the ``k`` proposed tokens (and their distributions, if drawn from one).
        params: the request's sampling options (greedy: exact argmax match).
        generator: its generator (seeded requests), ``None`` = torch's global one.

    Returns:
        ``(tokens, accepted)``: the ``accepted`` leading proposals that stand followed by one token of the
        target (``accepted + 1`` tokens).

    Raises:
        ValueError: ``logits`` not of ``k + 1`` rows.
    """
    draft = list(proposal.token_ids)
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify: {k} proposed tokens need {k + 1} rows of logits, got {logits.shape[0]}")
    if params.greedy:
        return verify_greedy(logits.argmax(dim=-1).tolist(), draft)
    p = probabilities(logits, [params] * (k + 1))
    p = p / p.sum(dim=-1, keepdim=True)
    for i, d in enumerate(draft):
        q_d = 1.0 if proposal.probs is None else float(proposal.probs[i, d])
        p_d = float(p[i, d])
        u = float(torch.rand((), generator=generator, device=logits.device))
        if q_d > 0 and u * q_d < p_d:
            continue
        if proposal.probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - proposal.probs[i].to(p.device)).clamp_min(0.0)
        if not float(residual.sum()) > 0:  # p == q: a rejection has probability 0; keep the target's law
            residual = p[i]
        return draft[:i] + [draw(residual, generator)], i
    return draft + [draw(p[k], generator)], k


def verify_greedy(target: list[int], draft: list[int] | tuple[int, ...]) -> tuple[list[int], int]:
    """``verify`` for a greedy request from the target's argmax tokens ``target`` (``k + 1`` of them): the
    proposals that equal them, then the target's next token."""
    m = 0
    while m < len(draft) and draft[m] == target[m]:
        m += 1
    return list(draft[:m]) + [target[m]], m


def propose_tokens(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[tuple[int, torch.Tensor | None]]:
    """A model proposer's tokens from its logits ``[N, V]`` (float32, the target's vocabulary), one per row: the
    argmax for a greedy request (one host transfer for all of them); for a sampled one a draw from the
    request's own distribution over the draft's logits (its temperature, top-k and top-p), returned with it as
    ``q`` ``[V]`` for verification."""
    greedy = logits.argmax(dim=-1).tolist() if any(p.greedy for p in params) else []
    out: list[tuple[int, torch.Tensor | None]] = []
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append((greedy[i], None))
            continue
        q = probabilities(logits[i:i + 1], [p])[0]
        q = q / q.sum()
        out.append((draw(q, gen), q))
    return out


def last_rows(feeds: list) -> list[int]:
    """Per feed (``packing.Feed``, each sampling), the index of its last row's logits in a step's output:
    the row-wise feeds come first in packed order, then the chunks, each with ``feed.sample`` rows of logits."""
    order = [i for i, f in enumerate(feeds) if f.rowwise] + [i for i, f in enumerate(feeds) if not f.rowwise]
    out = [0] * len(feeds)
    row = 0
    for i in order:
        row += feeds[i].sample
        out[i] = row - 1
    return out
