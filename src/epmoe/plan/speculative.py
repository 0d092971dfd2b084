"""Speculative decoding priced per strategy: whether drafting ``S`` tokens and verifying them pays.

One round of speculative decoding is ``S`` draft forwards (EAGLE-3 chain, one token per sequence each) and one
verify step of the target over ``S + 1`` positions per sequence, and yields the accepted length ``A`` tokens per
sequence (``1 <= A <= S + 1``: the accepted draft tokens plus the target's own). It pays when
``A / round time > 1 / decode step time``, i.e. when ``A`` exceeds the break-even length
``(verify + drafts) / decode``.

The verify and decode steps are the planner's (``planner.plan`` at ``S`` and at 0 draft tokens): decode is
memory-bound, so the verify step reads mostly the same weights and costs little more, except where the ``S + 1``
times more tokens touch more distinct experts (EP: a larger share of every rank's experts), and every collective
runs the same number of times with ``S + 1`` times the bytes. A dense draft (EAGLE-3 head) is priced as a
roofline of its weights (embedding excluded), KV reads and FLOPs, plus the profile's engine overheads: under TP
attention it is sliced over the GPUs with 2 all-reduces per layer and an all-gather of its logits per forward
(SGLang and vLLM run the draft with the target's TP); under DP attention each GPU runs it whole on its own
sequences, with no collectives. An MoE draft is priced as the planner's decode step of its own model under the
same strategy. The draft's weights and KV cache count against the GPU memory of the verify step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from epmoe.plan.costs import ACT_BYTES, collective_ms, roofline_ms
from epmoe.plan.draft import DraftModel, default_eagle3_draft
from epmoe.plan.planner import collective_link, plan
from epmoe.plan.request import CollectiveCost, PlanRequest, StepEstimate, Strategy, StrategyPlan


@dataclass(frozen=True)
class SpeculativeStep:
    """One round of speculative decoding of one strategy at one batch size, on the busiest rank.

    Attributes:
        batch: sequences.
        decode: the plain decode step (1 position per sequence).
        verify: the verify step (``S + 1`` positions per sequence).
        draft_ms: the ``S`` draft forwards of the round, ms.
        draft_collectives: the collectives of those forwards (counts over the round).
        accept_length: expected tokens per sequence per round (``A``), or None when not given.
        draft_bytes: memory the draft adds on one GPU (its weights and KV cache at the planned context), bytes.
    """

    batch: int
    decode: StepEstimate
    verify: StepEstimate
    draft_ms: float
    draft_collectives: tuple[CollectiveCost, ...]
    accept_length: float | None
    draft_bytes: float = 0.0

    @property
    def over(self) -> float:
        """Bytes per GPU beyond capacity with the draft loaded beside the target at verify size (0 when it fits)."""
        m = self.verify.memory
        return max(0.0, m.total + self.draft_bytes - m.capacity)

    @property
    def fits(self) -> bool:
        """True when target (at verify size) and draft fit in GPU memory together."""
        return self.over == 0.0

    @property
    def round_ms(self) -> float:
        """Verify step plus drafts, ms."""
        return self.verify.total_ms + self.draft_ms

    @property
    def break_even(self) -> float:
        """Accepted length at which speculation matches plain decoding: ``round / decode``."""
        return self.round_ms / self.decode.total_ms

    @property
    def plain_tokens_per_s(self) -> float:
        """Tokens per second of plain decoding, all sequences together."""
        return self.batch * 1e3 / self.decode.total_ms

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second with speculation at ``accept_length`` (None without one)."""
        return None if self.accept_length is None else self.batch * self.accept_length * 1e3 / self.round_ms

    @property
    def pays(self) -> bool | None:
        """True when speculation at ``accept_length`` beats plain decoding (None without one)."""
        return None if self.accept_length is None else self.accept_length > self.break_even


@dataclass(frozen=True)
class SpeculativePlan:
    """A strategy and its speculative rounds at every batch size."""

    strategy: Strategy
    steps: tuple[SpeculativeStep, ...]


@dataclass(frozen=True)
class Speculation:
    """``price_speculation``'s answer.

    Attributes:
        spec_tokens: ``S`` draft tokens per round.
        accept_length: ``A``, or None.
        draft: the draft priced.
        strategies: every strategy planned for both the decode and the verify step.
    """

    spec_tokens: int
    accept_length: float | None
    draft: DraftModel
    strategies: tuple[SpeculativePlan, ...]

    def strategy(self, name: str) -> SpeculativePlan:
        """The rounds of strategy ``name``.

        Raises:
            KeyError: not planned (the planned ones are listed).
        """
        for s in self.strategies:
            if s.strategy.name == name:
                return s
        raise KeyError(f"strategy {name!r} was not planned; planned: "
                       f"{', '.join(s.strategy.name for s in self.strategies)}")


def _dense_draft_forward(req: PlanRequest, s: Strategy, batch: int, draft: DraftModel
                         ) -> tuple[float, list[CollectiveCost]]:
    """One forward of a dense draft: ms on the busiest rank and its collectives."""
    hw, g = req.hardware, req.gpus
    dp = s.mode == "a2a_dp_attn"
    tp = 1 if dp else s.attn_tp
    seqs = math.ceil(batch / g) if dp else batch
    kv_heads_rank = max(1, draft.kv_heads // tp)
    kv_read = seqs * req.context * draft.kv_bytes_per_token * kv_heads_rank / draft.kv_heads
    params = draft.step_params / tp
    ms = roofline_ms(params * draft.dtype_bytes + kv_read, 2 * params * seqs, hw.hbm_bytes_per_s,
                     hw.flops_per_s("bf16"))
    ms += (hw.engine_step_us + draft.num_layers * hw.engine_layer_step_us + seqs * hw.engine_seq_step_us) / 1e3
    colls: list[CollectiveCost] = []
    if tp > 1:
        link = collective_link(req)
        ar = seqs * draft.hidden_size * ACT_BYTES
        colls.append(CollectiveCost("all_reduce", "draft attention and MLP outputs", 2 * draft.num_layers, ar,
                                    collective_ms("all_reduce", ar, g, link)))
        lg = seqs * draft.head_vocab * ACT_BYTES
        colls.append(CollectiveCost("all_gather", "draft logits", 1, lg, collective_ms("all_gather", lg, g, link)))
    return ms, colls


def _dense_draft_bytes(req: PlanRequest, s: Strategy, batch: int, draft: DraftModel) -> float:
    """Weights and KV cache of a dense draft on one GPU: sliced over attention TP, whole under DP attention."""
    dp = s.mode == "a2a_dp_attn"
    tp = 1 if dp else s.attn_tp
    seqs = math.ceil(batch / req.gpus) if dp else batch
    kv = draft.kv_bytes_per_token * max(1, draft.kv_heads // tp) / draft.kv_heads
    return draft.weight_bytes / tp + seqs * req.context * kv


def price_speculation(req: PlanRequest, draft: DraftModel | None = None, accept_length: float | None = None
                      ) -> Speculation:
    """Price speculative decoding with ``req.spec_tokens`` draft tokens for every strategy and batch of ``req``.

    Args:
        req: the plan request, ``spec_tokens >= 1``.
        draft: the draft model (``plan.draft.read_draft``); default the EAGLE-3 head of the target's sizes
            (``default_eagle3_draft``).
        accept_length: expected tokens per sequence per round, ``1 <= A <= S + 1``, or None (then only the
            break-even length is known).

    Returns:
        The ``Speculation``: per strategy and batch, the decode and verify steps, the drafts and the verdict.

    Raises:
        ValueError: ``spec_tokens`` 0, ``accept_length`` outside ``[1, S + 1]``, or as ``plan``.
    """
    s_tokens = req.spec_tokens
    if s_tokens < 1:
        raise ValueError("spec_tokens must be at least 1 to price speculative decoding, got 0")
    if accept_length is not None and not 1 <= accept_length <= s_tokens + 1:
        raise ValueError(f"accept_length must lie in [1, spec_tokens + 1 = {s_tokens + 1}] (tokens per sequence per "
                         f"round, the target's own included), got {accept_length!r}")
    draft = draft or default_eagle3_draft(req.spec)
    verify = plan(req)
    decode = plan(replace(req, spec_tokens=0))
    draft_plans: dict[str, StrategyPlan] = {}
    if draft.spec is not None:
        moe = plan(replace(req, spec=draft.spec, spec_tokens=0, redundant=0))
        draft_plans = {sp.strategy.name: sp for sp in moe.strategies}
    out = []
    for vp, dp in zip(verify.strategies, decode.strategies):
        s = vp.strategy
        if draft.spec is not None and s.name not in draft_plans:
            continue
        steps = []
        for i, (v, d) in enumerate(zip(vp.steps, dp.steps)):
            if draft.spec is not None:
                one = draft_plans[s.name].steps[i]
                ms, colls = one.total_ms, list(one.collectives)
            else:
                ms, colls = _dense_draft_forward(req, s, v.batch, draft)
            round_colls = tuple(replace(c, count=c.count * s_tokens) for c in colls)
            if draft.spec is not None:
                m = draft_plans[s.name].steps[i].memory
                extra = m.weights + m.kv_cache
            else:
                extra = _dense_draft_bytes(req, s, v.batch, draft)
            steps.append(SpeculativeStep(v.batch, d, v, ms * s_tokens, round_colls, accept_length, extra))
        out.append(SpeculativePlan(s, tuple(steps)))
    return Speculation(s_tokens, accept_length, draft, tuple(out))
