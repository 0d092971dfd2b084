"""``SamplingParams`` validation and the sampler (greedy, top-k, top-p, seeds, the softmax distribution)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from epmoe.engine.sampling import SamplingParams, probabilities, sample


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -2), ("top_k", 2.0),
    ("max_tokens", 0), ("max_tokens", True), ("min_tokens", -1), ("seed", 1.5), ("seed", "7"),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
])
def test_bad_field_named(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must .* got {re.escape(repr(value))}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


@pytest.mark.parametrize("field, value, shown", [
    ("stop", [""], "('',)"), ("stop", ["ok", 3], "('ok', 3)"), ("stop", 5, "5"),
    ("stop_token_ids", [-1], "(-1,)"), ("stop_token_ids", [1.0], "(1.0,)"), ("stop_token_ids", 5, "5"),
    ("stop_token_ids", [True], "(True,)"),
])
def test_bad_stop(field, value, shown):
    with pytest.raises(ValueError, match=rf"^{field} must .*{re.escape(shown)}"):
        SamplingParams(**{field: value})


def test_stop_normalised():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop=None).stop == () and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.1).greedy


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 3, "max_tokens": 9})
    assert (p.temperature, p.top_k, p.max_tokens) == (0.5, 3, 9)
    with pytest.raises(ValueError, match=r"unknown sampling option\(s\) \['max_new_tokens', 'topp'\]"):
        SamplingParams.from_dict({"topp": 0.5, "max_new_tokens": 3, "temperature": 1.0})
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_dict({"top_p": 2.0})


def test_sample_length_mismatch():
    with pytest.raises(ValueError, match="2 logits rows, 1 params, 2 generators"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None, None])


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_one_are_argmax():
    logits = _logits()
    want = logits.argmax(-1)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits, [SamplingParams(temperature=0)] * 6, [None] * 6), want)
    for t in (0.3, 1.0, 5.0, 100.0):
        got = sample(logits, [SamplingParams(temperature=t, top_k=1)] * 6, [None] * 6, g)
        assert torch.equal(got, want), t
    # mixed rows: greedy rows stay argmax whatever the others do
    params = [SamplingParams(temperature=0), SamplingParams(temperature=50.0)] * 3
    outs = torch.stack([sample(logits, params, [None] * 6, g) for _ in range(20)])
    assert torch.equal(outs[:, 0::2], want[0::2].expand(20, 3))
    assert len(set(outs[:, 1].tolist())) > 1  # temperature 50 over 50 tokens: not always the argmax


def test_top_k_and_top_p_stay_in_the_allowed_set():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().unsqueeze(0)
    g = torch.Generator().manual_seed(3)
    cases = [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.5), {0, 1}),  # 0.4 < 0.5, 0.4 + 0.25 >= 0.5
        (SamplingParams(top_p=0.35), {0}),  # the first token alone has enough mass
        (SamplingParams(top_p=0.85), {0, 1, 2, 3}),
        (SamplingParams(top_k=4, top_p=0.7), {0, 1}),  # top_p over the renormalised top 4: 0.44, 0.72
        (SamplingParams(top_k=0), set(range(6))),
    ]
    for params, allowed in cases:
        draws = sample(logits.expand(400, 6), [params] * 400, [None] * 400, g).tolist()
        assert set(draws) == allowed, (params, sorted(set(draws)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-39), SamplingParams(temperature=9e-6),
                                    SamplingParams(temperature=1.0, top_p=1e-300),
                                    SamplingParams(temperature=1.0, top_p=1e-46)])
def test_a_tiny_temperature_or_top_p_takes_the_most_likely_token(params):
    """Were token 0 at every step: float32 made 1e-39 subnormal and 1e-46 zero, so the logits over the temperature
    were infinite (NaN probabilities) and a top_p of 0 dropped every token. A temperature below 1e-5 is greedy, as
    in vLLM, and top_p keeps the most likely token."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, 1.9]])
    g = torch.Generator().manual_seed(0)
    assert sample(logits.expand(50, 5), [params] * 50, [None] * 50, g).tolist() == [1] * 50
    assert params.greedy == (params.temperature < 1e-5)
    assert not SamplingParams(temperature=1e-5).greedy


def test_seeded_rows_reproducible():
    logits = _logits(rows=4, vocab=30, seed=5)
    params = [SamplingParams(temperature=1.5, top_p=0.95, seed=7)] * 4

    def draw(seed: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed + i) for i in range(4)]
        noise = torch.Generator().manual_seed(1234 + seed)  # the default generator differs between runs
        return [sample(logits, params, gens, noise).tolist() for _ in range(10)]

    first = draw(7)
    assert draw(7) == first
    assert draw(8) != first
    # a seeded row does not depend on the unseeded rows next to it
    mixed = sample(logits, [SamplingParams(temperature=1.5, top_p=0.95, seed=7), SamplingParams(temperature=1.5)] * 2,
                   [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(9), None],
                   torch.Generator().manual_seed(99))
    alone = sample(logits, params, [torch.Generator().manual_seed(7), torch.Generator().manual_seed(1),
                                    torch.Generator().manual_seed(9), torch.Generator().manual_seed(1)])
    assert mixed[0] == alone[0] and mixed[2] == alone[2]


def test_unseeded_rows_share_one_draw_of_the_default_generator():
    # one exponential draw for all the unseeded rows (one launch, not one a row), seeded rows from their own
    logits = _logits(rows=5, vocab=40, seed=2)
    params = [SamplingParams(temperature=0.7)] * 5
    got = sample(logits, params, [None] * 5, torch.Generator().manual_seed(3))
    q = torch.empty(5, 40).exponential_(generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, (probabilities(logits, params) / q).argmax(-1))
    gens = [None, torch.Generator().manual_seed(8), None, None, None]
    mixed = sample(logits, params, gens, torch.Generator().manual_seed(3))
    q[1] = torch.empty(40).exponential_(generator=torch.Generator().manual_seed(8))
    assert torch.equal(mixed, (probabilities(logits, params) / q).argmax(-1))


def test_temperature_one_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = torch.softmax(logits, -1)
    n = 20000
    draws = sample(logits.expand(n, 6), [SamplingParams(temperature=1.0)] * n, [None] * n,
                   torch.Generator().manual_seed(11))
    counts = torch.bincount(draws, minlength=6).double()
    expected = p.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist(), expected.tolist())  # 5 dof: p ~ 0.001
    # temperature 2 flattens: follows softmax(logits / 2), far from softmax(logits)
    draws2 = sample(logits.expand(n, 6), [SamplingParams(temperature=2.0)] * n, [None] * n,
                    torch.Generator().manual_seed(12))
    counts2 = torch.bincount(draws2, minlength=6).double()
    exp2 = torch.softmax(logits / 2, -1).double() * n
    assert float(((counts2 - exp2) ** 2 / exp2).sum()) < 20.5
    assert float(((counts2 - expected) ** 2 / expected).sum()) > 200
