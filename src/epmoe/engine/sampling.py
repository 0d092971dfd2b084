"""Sampling options of a request and the sampler that turns logits into tokens.

``SamplingParams`` follows vLLM's names (``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``,
``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``); ``temperature == 0`` is greedy. The sampler draws
with the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which samples from ``p`` exactly; a request
with a ``seed`` draws its ``q`` from its own generator, so the same seed gives the same tokens on rerun.

Log-probabilities (``token_logprobs``) are those of the model's own distribution, the log-softmax of the raw
logits before temperature, top-k and top-p (vLLM's default ``raw_logprobs``), so they do not depend on how the
token was chosen.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from epmoe.engine.transfer import to_device

MAX_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities of per token (vLLM's default ``max_logprobs``)."""


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: softmax temperature, ``>= 0``; ``0`` = greedy (argmax).
        top_p: keep the smallest set of tokens whose probability sums to at least ``top_p``, in ``(0, 1]``.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` or ``0`` = all.
        seed: seed of this request's own generator (reproducible sampling); ``None`` = the engine's.
        max_tokens: most tokens generated, ``>= 1``.
        min_tokens: EOS and stop token ids are ignored before this many tokens, ``>= 0``.
        stop: strings that end the generation (the text is cut before the match).
        stop_token_ids: token ids that end the generation (kept in the output, like EOS).
        ignore_eos: keep generating past the model's EOS token.
        logprobs: report each generated token's log-probability and those of the ``logprobs`` most likely
            tokens at its position, ``0 <= logprobs <= MAX_LOGPROBS``; ``None`` = none.

    Raises:
        ValueError: a value out of range or of the wrong type (the field and the value named).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            object.__setattr__(self, name, tuple(value or ()))
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 = all tokens), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax."""
        return self.temperature == 0

    @classmethod
    def from_dict(cls, options: dict) -> SamplingParams:
        """Build from a dict of options (the server's request fields, ``epmoe run``'s flags).

        Raises:
            ValueError: an unknown option (named, with the known ones) or a bad value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown sampling option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely tokens at its position.

    Attributes:
        token_id: the token generated.
        logprob: its natural-log probability under the model (float32 log-softmax of the raw logits).
        top: the request's ``logprobs`` most likely ``(token id, logprob)`` at that position, most likely first
            (ties in any order); may include ``token_id``.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """Log-probabilities of chosen tokens and the top ``k`` of their rows, on the logits' device.

    Args:
        logits: ``[N, V]`` raw next-token logits (any float dtype).
        tokens: ``[N]`` int64 the tokens chosen at those rows.
        k: alternatives per row, ``0 <= k <= V``.

    Returns:
        ``chosen [N]`` float32, ``top_values [N, k]`` float32 (descending) and ``top_ids [N, k]`` int64.

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
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp.new_empty(n, 0), tokens.new_empty(n, 0))
    return chosen, top_values, top_ids


def logprob_entries(tokens: list[int], chosen: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor,
                    ks: list[int]) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of rows from ``token_logprobs``' results (on the host), row ``i`` keeping its ``ks[i]``
    most likely alternatives.

    Args:
        tokens: the ``N`` chosen token ids.
        chosen, top_values, top_ids: ``[N]``, ``[N, k]``, ``[N, k]`` as ``token_logprobs`` returns them.
        ks: per row, alternatives kept, ``<= k``.
    """
    values, ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(t, c, tuple(zip(i[:n], v[:n])))
            for t, c, v, i, n in zip(tokens, chosen.tolist(), values, ids, ks)]


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax of ``logits / temperature``, cut to ``top_k`` tokens and
    to the ``top_p`` nucleus (not renormalised: the kept probabilities sum to at most 1).

    Args:
        logits: ``[N, V]`` next-token logits of ``N`` rows that do not sample greedily.
        params: the rows' sampling options (``temperature > 0``).

    Returns:
        ``[N, V]`` float32 probabilities, 0 for cut tokens.
    """
    x = logits.float()
    temps = to_device([p.temperature for p in params], x.device, x.dtype)
    x = x / temps.unsqueeze(1)
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        v = x.shape[1]
        ks = to_device([k if 0 < k < v else v for k in top_ks], x.device, torch.int64)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_ps = [p.top_p for p in params]
    if any(p < 1 for p in top_ps):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
        ps = to_device(top_ps, x.device, probs.dtype).unsqueeze(1)
        drop_sorted = before >= ps
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the (unnormalised) distribution ``probs [V]`` with the exponential race
    (``argmax(p / q)``, ``q ~ Exp(1)`` drawn from ``generator``; ``None`` = torch's global one)."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits``.

    Args:
        logits: ``[N, V]`` float32 next-token logits.
        params: the ``N`` rows' sampling options.
        generators: per row, its request's generator (seeded requests) or ``None`` (the default one).
        default_generator: generator of the unseeded rows (``None`` = torch's global one).

    Returns:
        ``[N]`` int64 token ids, on ``logits.device``.

    Raises:
        ValueError: ``params`` or ``generators`` not of length ``N``.
    """
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"sample: {n} logits rows, {len(params)} params, {len(generators)} generators")
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    idx = to_device(rows, logits.device, torch.int64)
    probs = probabilities(logits.index_select(0, idx), [params[i] for i in rows])
    # the unseeded rows' noise in one draw from the default generator; a seeded row's from its own, alone, so that
    # its tokens do not depend on the rows beside it
    seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
    q = torch.empty_like(probs).exponential_(generator=default_generator)
    for j in seeded:
        q[j].exponential_(generator=generators[rows[j]])
    picked = (probs / q).argmax(dim=-1)
    out[idx] = picked
    return out
