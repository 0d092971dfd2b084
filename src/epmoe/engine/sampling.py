"""Sampling options of a request and the sampler that turns logits into tokens.

``SamplingParams`` follows vLLM's names (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``max_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``, the penalties, ``logit_bias``,
``structured_outputs``);
``temperature`` below ``GREEDY_BELOW`` is greedy. The sampler draws with the exponential race (``argmax(p / q)``,
``q ~ Exp(1)``), which samples from ``p`` exactly; a request with a ``seed`` draws its ``q`` from its own
generator, so the same seed gives the same tokens on rerun.

Logits are adjusted before sampling (greedy rows too) in vLLM's order: the logit bias is added, then the
penalties applied: the repetition penalty (Keskar et al. 2019, "CTRL": a logit of a token of the prompt or the
output so far divided by it where positive, multiplied where negative), then OpenAI's frequency and presence
penalties (the logit minus ``frequency_penalty`` times the token's count in the output, minus
``presence_penalty`` once it occurs there). Only the rows that ask pay for it: their token counts live on the device
(``TokenCounts``), filled once and counted step by step.

Log-probabilities are in ``epmoe.engine.logprobs``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from epmoe.checks import is_int, valid_seed
from epmoe.engine.structured import KINDS, StructuredOutputs
from epmoe.engine.tokenizer import generation_config
from epmoe.engine.transfer import to_device

MAX_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities of per token (vLLM's default ``max_logprobs``)."""


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily, as vLLM's (its ``_SAMPLING_EPS``): dividing the logits by a smaller one
(in float32, where 1e-39 is subnormal and 1e-46 is 0) gives infinities, and the softmax of those is not a
distribution."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: softmax temperature, ``>= 0``; below ``GREEDY_BELOW`` (``0`` among them) = greedy (argmax).
        top_p: keep the smallest set of tokens whose probability sums to at least ``top_p``, in ``(0, 1]``.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` or ``0`` = all.
        seed: seed of this request's own generator (reproducible sampling); ``None`` = the engine's.
        max_tokens: most tokens generated, ``>= 1``.
        min_tokens: EOS and stop token ids cannot be generated, and stop strings do not end the generation,
            before this many tokens, ``>= 0`` (vLLM's).
        stop: strings that end the generation (the text is cut before the match).
        stop_token_ids: token ids that end the generation (kept in the output, like EOS).
        ignore_eos: keep generating past the model's EOS token.
        logprobs: report each generated token's log-probability and those of the ``logprobs`` most likely
            tokens at its position, ``0 <= logprobs <= MAX_LOGPROBS``; ``None`` = none.
        prompt_logprobs: report each prompt token's log-probability (the first's is ``None``: nothing predicts it)
            and those of the ``prompt_logprobs`` most likely tokens at its position, ``0 <= prompt_logprobs <=
            MAX_LOGPROBS``; ``None`` = none. Every row of the prompt's chunks then returns its ``[V]`` float32
            logits, and the step waits for them.
        min_p: drop tokens less likely than ``min_p`` times the most likely one, in ``[0, 1]``; ``0`` = off.
        presence_penalty: subtracted from the logit of every token the output holds, in ``[-2, 2]``.
        frequency_penalty: subtracted from a token's logit once per time the output holds it, in ``[-2, 2]``.
        repetition_penalty: ``> 0``; the logits of tokens in the prompt or output are divided by it where
            positive and multiplied where negative; ``1`` = off.
        logit_bias: ``{token id: bias}`` (any mapping, or pairs; kept as sorted pairs, zero biases dropped;
            ``None`` = none), each bias in ``[-100, 100]`` added to the token's logit.
        structured_outputs: a constraint on the output (``structured.StructuredOutputs``, or a dict of its
            fields); ``None`` = none. Needs the checkpoint's tokenizer and the llguidance package.
        skip_special_tokens: the output's text leaves the tokenizer's special tokens out (vLLM's); false keeps
            them (a tool-call parser reads markers such as Kimi-K2's ``<|tool_call_begin|>``). A stop or EOS token
            that ends the output is never in its text. Stop strings are matched in the text as it is decoded.

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
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputs | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        so = self.structured_outputs
        if isinstance(so, Mapping):
            known = [*KINDS, "disable_any_whitespace"]
            unknown = sorted(set(so) - set(known))
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {known}")
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**so))
        elif so is not None and not isinstance(so, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs or a dict of its fields, got {so!r}")
        bias = self.logit_bias
        if bias is None:
            object.__setattr__(self, "logit_bias", ())
        elif isinstance(bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(bias.items()))
        elif not isinstance(bias, (list, tuple)) or any(
                not isinstance(pair, (list, tuple)) or len(pair) != 2 for pair in bias):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        else:
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in bias))
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
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 = all tokens), got {self.top_k!r}")
        if self.seed is not None and not valid_seed(self.seed):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for token, value in self.logit_bias:
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_real(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for token {token}")
        object.__setattr__(self, "logit_bias", tuple(sorted(pair for pair in self.logit_bias if pair[1] != 0)))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (a temperature below ``GREEDY_BELOW``)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """True when a penalty applies (its logits depend on the tokens so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """True when its logits are changed before sampling (a penalty or a logit bias)."""
        return self.penalized or bool(self.logit_bias)

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


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax of ``logits / temperature``, cut to ``top_k`` tokens, to those
    at least ``min_p`` times the most likely one and to the ``top_p`` nucleus (not renormalised: the kept
    probabilities sum to at most 1).

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
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        floor = to_device(min_ps, x.device, probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    top_ps = [p.top_p for p in params]
    if any(p < 1 for p in top_ps):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
        ps = to_device(top_ps, x.device, probs.dtype).unsqueeze(1)
        drop_sorted = before >= ps
        drop_sorted[:, 0] = False  # the most likely token stays, whatever top_p (one too small for float32 is 0)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


class TokenCounts:
    """The tokens of the penalized sequences, on the device: one row a sequence, whether each token occurs in its
    prompt (``in_prompt [R, V]`` bool) and how often in its output (``output [R, V]`` int32).

    A row is filled once from the sequence's tokens when it first samples (``open``); from then on the engine counts
    each token sampled for it on the device, right after sampling (``count``). So a step reads no token list from
    the host (the penalties cost the same at the 10th and the 10,000th token), and the overlap schedule's token still
    on the device is counted as soon as it is sampled. Rows are reused once closed; the tensors double when full.

    Args:
        vocab: ``V``, the logits' width.
        device: where the counts live (the logits').
        rows: rows allocated at first.
    """

    def __init__(self, vocab: int, device: torch.device, rows: int = 8) -> None:
        self.vocab = int(vocab)
        self.device = device
        self.in_prompt = torch.zeros(rows, self.vocab, dtype=torch.bool, device=device)
        self.output = torch.zeros(rows, self.vocab, dtype=torch.int32, device=device)
        self._free = list(range(rows - 1, -1, -1))

    def open(self, prompt: list[int], output: list[int]) -> int:
        """A row holding ``prompt``'s and ``output``'s tokens (ids in ``[0, V)``); returns its index."""
        if not self._free:
            n = self.output.shape[0]
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.output = torch.cat([self.output, torch.zeros_like(self.output)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        if prompt:
            self.in_prompt[row].index_fill_(0, to_device(prompt, self.device, torch.int64), True)
        if output:
            self.output[row] = torch.bincount(to_device(output, self.device, torch.int64),
                                              minlength=self.vocab).to(torch.int32)
        return row

    def close(self, row: int) -> None:
        """Zero row ``row`` and give it back."""
        self.in_prompt[row] = False
        self.output[row] = 0
        self._free.append(row)

    def count(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Count one more output token for each of ``rows``: ``tokens [len(rows)]`` int64, on the device."""
        if rows:
            idx = to_device(rows, self.device, torch.int64)
            self.output.index_put_((idx, tokens.to(torch.int64)), torch.ones(len(rows), dtype=torch.int32,
                                                                            device=self.device), accumulate=True)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], counts: TokenCounts | None = None,
                  count_rows: list[int | None] | None = None,
                  banned: list[tuple[int, ...] | None] | None = None) -> torch.Tensor:
    """The logits rows sample from: the logit bias added, the penalties applied (see the module docstring), then
    the banned tokens set to ``-inf``.

    Args:
        logits: ``[N, V]`` raw logits (not modified).
        params: the ``N`` rows' options.
        counts: the penalized sequences' tokens (needed when a row has ``params[i].penalized``).
        count_rows: per row, its row of ``counts`` (``None`` for rows without penalties).
        banned: per row, token ids it may not choose (EOS and stop token ids before ``min_tokens``), or ``None``.

    Returns:
        ``logits`` itself when no row adjusts its logits, else a float32 copy with the rows adjusted (finite:
        a penalty's extreme results are clamped to ``[-1e30, 1e30]``, banned tokens aside).

    Raises:
        ValueError: a penalized row without its row of ``counts``, or a logit-bias or banned token id outside
            ``[0, V)``.
    """
    bans = [(i, t) for i, ids in enumerate(banned or ()) if ids for t in ids]
    if not any(p.adjusts_logits for p in params) and not bans:
        return logits
    x = logits.float().clone()
    n, v = x.shape
    dev = x.device
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if biased:
        bad = sorted({t for _, t, _ in biased if t >= v})
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {v}), got {bad[:5]}")
        rows, ids, values = zip(*biased)
        x.index_put_((to_device(list(rows), dev, torch.int64), to_device(list(ids), dev, torch.int64)),
                     to_device(list(values), dev, x.dtype), accumulate=True)
    hist = [i for i, p in enumerate(params) if p.penalized]
    if hist:
        _penalize(x, params, hist, counts, count_rows)
    if bans:
        bad = sorted({t for _, t in bans if not 0 <= t < v})
        if bad:
            raise ValueError(f"banned token ids must be in [0, {v}), got {bad[:5]}")
        rows, ids = zip(*bans)
        x.index_put_((to_device(list(rows), dev, torch.int64), to_device(list(ids), dev, torch.int64)),
                     torch.tensor(float("-inf"), device=dev))
    return x


def _penalize(x: torch.Tensor, params: list[SamplingParams], hist: list[int], counts: TokenCounts | None,
              count_rows: list[int | None] | None) -> None:
    """Apply the penalties to rows ``hist`` of ``x [N, V]`` float32 in place (see ``adjust_logits``)."""
    dev = x.device
    if counts is None or count_rows is None or any(count_rows[i] is None for i in hist):
        raise ValueError("adjust_logits: a penalized row needs its row of TokenCounts")
    at = to_device([count_rows[i] for i in hist], dev, torch.int64)
    in_prompt = counts.in_prompt.index_select(0, at)
    seen = counts.output.index_select(0, at)
    idx = to_device(hist, dev, torch.int64)
    rows = x.index_select(0, idx).double()  # a penalty's quotient may be past float32's range: clamped below
    rep = to_device([params[i].repetition_penalty for i in hist], dev, rows.dtype).unsqueeze(1)
    rows = torch.where(in_prompt | (seen > 0), torch.where(rows > 0, rows / rep, rows * rep), rows)
    freq = to_device([params[i].frequency_penalty for i in hist], dev, rows.dtype).unsqueeze(1)
    pres = to_device([params[i].presence_penalty for i in hist], dev, rows.dtype).unsqueeze(1)
    rows = rows - freq * seen.to(rows.dtype) - pres * (seen > 0).to(rows.dtype)
    x.index_copy_(0, idx, rows.clamp(-1e30, 1e30).to(x.dtype))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the (unnormalised) distribution ``probs [V]`` with the exponential race
    (``argmax(p / q)``, ``q ~ Exp(1)`` drawn from ``generator``; ``None`` = torch's global one)."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None, counts: TokenCounts | None = None,
           count_rows: list[int | None] | None = None,
           banned: list[tuple[int, ...] | None] | None = None) -> torch.Tensor:
    """One token per row of ``logits``.

    Args:
        logits: ``[N, V]`` float32 next-token logits.
        params: the ``N`` rows' sampling options.
        generators: per row, its request's generator (seeded requests) or ``None`` (the default one).
        default_generator: generator of the unseeded rows (``None`` = torch's global one).
        counts, count_rows, banned: see ``adjust_logits`` (``counts`` only for rows with penalties; the caller
            counts the sampled tokens, ``TokenCounts.count``).

    Returns:
        ``[N]`` int64 token ids, on ``logits.device``.

    Raises:
        ValueError: ``params`` or ``generators`` not of length ``N``; see ``adjust_logits``.
    """
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"sample: {n} logits rows, {len(params)} params, {len(generators)} generators")
    logits = adjust_logits(logits, params, counts, count_rows, banned)
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


GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""The ``generation_config.json`` keys a request's left-out fields default to, and the fields (vLLM's set)."""

def sampling_defaults(directory: str) -> dict[str, float | int]:
    """The sampling defaults of ``directory``'s ``generation_config.json`` (``GENERATION_DEFAULTS``' keys that it
    sets, by field name); ``{}`` without the file.

    Raises:
        ValueError: the file cannot be read, or a value ``SamplingParams`` refuses (the file and key named).
    """
    raw = generation_config(directory)
    out: dict[str, float | int] = {}
    for key, name in GENERATION_DEFAULTS.items():
        if raw.get(key) is None:
            continue
        try:
            SamplingParams(**{name: raw[key]})
        except ValueError as exc:
            raise ValueError(f"{directory}/generation_config.json: {key}: {exc}") from None
        out[name] = raw[key]
    return out
