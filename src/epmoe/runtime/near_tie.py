"""Whether the first token of a half-precision run that differs from the float32 reference is a near-tie there.

In bf16/fp16 the engine's sums run in another order than transformers' (sharded experts, fused kernels), so where the
model's float32 choice is close, rounding alone can flip it: the greedy token, or a router's choice between its
``K``-th and ``(K+1)``-th expert, after which every later value differs. ``epmoe run`` then finds our tokens equal to
neither transformers run. This module weighs such a divergence: the prompt and our tokens up to the first step where
they differ from the float32 reference's are fed (teacher-forced) through the unsharded transformers model in the run's
dtype and in float32, and at that last position it reads

* the token gap: the float32 logit of the reference's greedy token less that of ours;
* per MoE layer, the router gap: the float32 choice value (``routing.router.router_choices``) of the ``K``-th expert
  less that of the ``(K+1)``-th among the kept groups' experts; with expert groups also the last kept group's score
  less the next group's.

Each gap is set against how far transformers' own half-precision run moves the same values there (the largest change
of any logit, or of any of the layer's choice values or group scores): its noise. A token gap within its noise is a
near-tie. A router gap within its noise counts only once it is shown to explain our token: the float32 model is run
again on the last position (the others from its cache) with that choice flipped (``exchanged``: two experts' gate rows
and bias entries exchanged, or the kept group's correction-bias entries lowered by just over the gap), and our token
must then be float32's choice, or within the token noise of it; the router must then pick exactly the flipped
selection (an exact tie, which no exchange flips, or an exchange that flips a second choice too, is not credited). The
nearest such router is kept; a token gap within its noise is weighed first.

What it does not weigh, and counts instead (``unweighed_ties``): router choices within that rounding at earlier
positions (a flip there changes the keys and values every later position reads, and which one our run flipped, if
any, is not known) and group choices of routers without a correction bias (DeepSeek-V2's; nothing flips them alone).
A divergence with no near-tie at its own position stays unexplained, whatever that count: the check does not pass it.
One with a near-tie there passes (rounding at that position alone explains its token). The count is given either way.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
from dataclasses import asdict, dataclass

import torch
from torch import nn

from epmoe.models.layout import family_layout
from epmoe.routing.router import kept_groups, router_choices
from epmoe.spec import MoESpec


@dataclass(frozen=True)
class Probe:
    """One teacher-forced pass of a transformers model.

    Attributes:
        logits: ``[V]`` float32 logits at the last position.
        choices: decoder layer -> the router's choice values ``[P, E]`` and group scores ``[P, n_group]`` (``None``
            without groups) at every position ``P``, float32 (``router_choices`` of the layer's own gate weights).
    """

    logits: torch.Tensor
    choices: dict[int, tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Divergence:
    """The first step where a half-precision run's tokens differ from the float32 reference's, measured there.

    Attributes:
        prompt: prompt index.
        step: generated-token index of the first difference.
        ours: our token there; ``float32``: the float32 reference's.
        token_gap: float32 logit of ``float32`` less that of ``ours`` (>= 0).
        token_noise: the largest change of any logit between the half-precision and float32 runs there (not finite
            where the half-precision pass overflowed: nothing is weighed then; ``None`` in ``to_json``).
        unweighed_ties: router choices within that rounding which the check does not weigh (``unweighed_ties``):
            at earlier positions, where our run may have flipped one unseen, and at this one between the groups of
            a router without a correction bias.
        router_layer: the decoder layer of the nearest router tie within its noise whose exchange leads to our token
            (see the module docstring), or ``None``.
        router_gap: that router's float32 gap, or ``None``.
        router_noise: the largest change of its choice values between the runs, or ``None``.
        experts: the router's ``K``-th and ``(K+1)``-th experts there, which were exchanged, or ``None``.
        groups: the router's last kept group and the next there, which were exchanged, or ``None``.
        exchange_gap: with that tie flipped, float32's choice's logit less that of ours (0: ours is its choice), or
            ``None``.
    """

    prompt: int
    step: int
    ours: int
    float32: int
    token_gap: float
    token_noise: float
    unweighed_ties: int = 0
    router_layer: int | None = None
    router_gap: float | None = None
    router_noise: float | None = None
    experts: tuple[int, int] | None = None
    groups: tuple[int, int] | None = None
    exchange_gap: float | None = None

    @property
    def near_tie(self) -> bool:
        """The token gap is within the half-precision noise there (a finite one), or a router tie within it leads to
        our token."""
        finite = self.token_gap is not None and self.token_noise is not None and math.isfinite(self.token_noise)
        return (finite and self.token_gap <= self.token_noise) or self.router_layer is not None

    def to_json(self) -> dict:
        """A JSON-ready dict, ``near_tie`` included; a gap or noise that is not finite is ``None``."""
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        return {**out, "near_tie": self.near_tie}


@dataclass(frozen=True)
class Tie:
    """A router's choice at the last position whose float32 gap is within the half-precision run's change there.

    Attributes:
        layer: the decoder layer.
        kind: ``experts`` (its ``K``-th and ``(K+1)``-th expert among the kept groups) or ``groups`` (its last kept
            group and the next; weighed only for routers with a correction bias, ``exchanged``).
        first, second: those experts, or those groups.
        gap: their float32 gap (choice values, or group scores).
        noise: the largest change of the layer's choice values, or group scores, between the runs there.
    """

    layer: int
    kind: str
    first: int
    second: int
    gap: float
    noise: float


def router_modules(model: nn.Module, spec: MoESpec) -> dict[int, nn.Module]:
    """The router (gate) module of each MoE decoder layer of a transformers model of ``spec``'s family, by layer
    index: the module ``layers.{i}.{moe_attr}.{gate}`` that ``models.layout.family_layout`` names.

    Raises:
        KeyError: a family without a layout; ValueError: no router module found (named).
    """
    layout = family_layout(spec.model_type)
    name = layout.router["weight"].removesuffix(".weight")
    pattern = re.compile(rf"(?:^|\.)layers\.(\d+)\.{re.escape(layout.moe_attr)}\.{re.escape(name)}$")
    found = {int(m.group(1)): module for path, module in model.named_modules() if (m := pattern.search(path))}
    if not found:
        raise ValueError(f"no router module 'layers.N.{layout.moe_attr}.{name}' in the {spec.model_type} reference "
                         f"model")
    return found


def probe(model: nn.Module, spec: MoESpec, ids: list[int], device: torch.device | str) -> Probe:
    """Feed ``ids`` once through ``model`` (a transformers causal LM of ``spec``): the last position's logits and
    every position's router choice values, computed in float32 from the router's input and its own weights.

    Raises:
        ValueError: as ``router_modules``.
    """
    routers = router_modules(model, spec)
    choices: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def keep(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            choices[layer] = _module_choices(module, spec, args[0])
        return hook

    handles = [module.register_forward_pre_hook(keep(layer)) for layer, module in routers.items()]
    with torch.no_grad():
        try:
            logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
        finally:
            for h in handles:
                h.remove()
    return Probe(logits.cpu(), choices)


def _module_choices(module: nn.Module, spec: MoESpec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A router module's choice values ``[P, E]`` and group scores ``[P, n_group]`` (``None`` without groups) for its
    input rows ``x``, float32 on the CPU, from its weights as they are (``router_choices``)."""
    bias = getattr(module, "bias", None)
    correction = getattr(module, "e_score_correction_bias", None)
    lg = x.reshape(-1, x.shape[-1]).float() @ module.weight.float().T
    lg = lg + (bias.float() if isinstance(bias, torch.Tensor) else 0.0)
    choice, groups = router_choices(spec, lg, correction if isinstance(correction, torch.Tensor) else None)
    return choice.cpu(), None if groups is None else groups.cpu()


def _kept_groups(spec: MoESpec, groups: torch.Tensor) -> torch.Tensor:
    """``[n_group]`` bool: the groups a router keeps at one position (``routing.router.kept_groups``)."""
    return kept_groups(groups[None], spec)[0]


def _eligible(spec: MoESpec, choice: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """The choice values of the kept groups' experts, ``-inf`` elsewhere."""
    if kept is None:
        return choice
    return choice.masked_fill(~kept.repeat_interleave(choice.numel() // kept.numel()), float("-inf"))


def selection(spec: MoESpec, choice: torch.Tensor, groups: torch.Tensor | None) -> frozenset[int]:
    """The experts a router of ``spec`` picks from its choice values and group scores at one position
    (``torch.topk`` among the kept groups' experts, as transformers' routers pick them)."""
    kept = None if groups is None else _kept_groups(spec, groups)
    return frozenset(_eligible(spec, choice, kept).topk(spec.top_k).indices.tolist())


def router_tie(spec: MoESpec, choice: torch.Tensor, groups: torch.Tensor | None) -> tuple[float, int, int]:
    """How close a router's choice was: the value of the lowest expert it picks (``selection``) less that of the
    highest it leaves among the kept groups' experts, with those two experts; an infinite gap (and ``-1``) where no
    expert is left outside the ``K``."""
    eligible = _eligible(spec, choice, None if groups is None else _kept_groups(spec, groups))
    picked = torch.zeros_like(eligible, dtype=torch.bool)
    picked[eligible.topk(spec.top_k).indices] = True
    inside = eligible.masked_fill(~picked, float("inf"))
    outside = eligible.masked_fill(picked, float("-inf"))
    if not bool(torch.isfinite(outside.max())):
        return float("inf"), -1, -1
    first, second = int(inside.argmin()), int(outside.argmax())
    return float(eligible[first] - eligible[second]), first, second


def _cache_names(model: nn.Module) -> tuple[str, str]:
    """The keyword of a transformers model's forward that takes a KV cache, and the output field that returns it
    (``cache`` from transformers 5.2x, ``past_key_values`` before)."""
    named = "cache" in inspect.signature(model.forward).parameters
    return ("cache", "cache") if named else ("past_key_values", "past_key_values")


def exchanged(model: nn.Module, spec: MoESpec, ids: list[int], ties: list[Tie],
              device: torch.device | str) -> list[tuple[torch.Tensor, frozenset[int]]]:
    """For each tie of ``ties`` in turn, flipped in its router for the last position of ``ids`` alone (the positions
    before it from one cached pass of the unchanged model): the ``[V]`` float32 logits there and the experts the
    router then picked (``selection`` of its input and changed weights). Two experts are exchanged by their gate rows
    and bias and correction-bias entries (each takes the other's choice value and weight); two groups by lowering the
    kept one's correction-bias entries by just over the gap, which drops it for the next without touching any other
    value (its experts leave the choice with it). The weights are restored. An exact tie (a gap of 0) is not flipped
    by either: the caller sees its selection unchanged.

    Raises:
        ValueError: a ``groups`` tie of a router without a correction bias.
    """
    if not ties:
        return []
    routers = router_modules(model, spec)
    arg, field = _cache_names(model)
    per = spec.num_experts // spec.n_group
    out = []
    with torch.no_grad():
        # a one-token sequence has no positions before its last: its pass is the last position's alone
        cache = getattr(model(torch.tensor([ids[:-1]], device=device), use_cache=True), field) if len(ids) > 1 \
            else None
        last = torch.tensor([ids[-1:]], device=device)
        for tie in ties:
            module = routers[tie.layer]
            saved = [(t, t.clone()) for n in ("weight", "bias", "e_score_correction_bias")
                     if isinstance(t := getattr(module, n, None), torch.Tensor)]
            a, b = tie.first, tie.second
            if tie.kind == "experts":
                for t, _ in saved:
                    t[[a, b]] = t[[b, a]]
            else:
                bias = getattr(module, "e_score_correction_bias", None)
                if not isinstance(bias, torch.Tensor):
                    raise ValueError(f"layer {tie.layer}'s router has no correction bias to exchange groups {a} and "
                                     f"{b} by")
                bias[a * per:(a + 1) * per] -= tie.gap * 1.01 + 1e-6
            picked: list[frozenset[int]] = []
            hook = module.register_forward_pre_hook(lambda m, args: picked.append(_picked(m, spec, args[0])))
            try:
                cached = {} if cache is None else {arg: copy.deepcopy(cache)}
                out.append((model(last, use_cache=True, **cached).logits[0, -1].float().cpu(), picked[-1]))
            finally:
                hook.remove()
                for t, value in saved:
                    t.copy_(value)
    return out


def _picked(module: nn.Module, spec: MoESpec, x: torch.Tensor) -> frozenset[int]:
    """The experts ``module`` (a router) picks for the last row of ``x`` with its weights as they are."""
    choice, groups = _module_choices(module, spec, x.reshape(-1, x.shape[-1])[-1:])
    return selection(spec, choice[0], None if groups is None else groups[0])


def flipped_selection(spec: MoESpec, choice: torch.Tensor, groups: torch.Tensor | None, tie: Tie) -> frozenset[int]:
    """The experts the router would pick with ``tie`` alone flipped, from its float32 choice values and group scores
    at the position: the other expert in place of ``tie.first``, or the top ``K`` among the kept groups with the
    other group in place of ``tie.first``."""
    if tie.kind == "experts":
        return selection(spec, choice, groups) - {tie.first} | {tie.second}
    kept = _kept_groups(spec, groups)
    kept[tie.first], kept[tie.second] = False, True
    return frozenset(_eligible(spec, choice, kept).topk(spec.top_k).indices.tolist())


def router_ties(full: Probe, half: Probe, spec: MoESpec) -> list[Tie]:
    """The router choices at the last position whose float32 gap is within the half-precision run's change there,
    the nearest (smallest gap over noise) first: each router's experts (``router_tie``), and with groups and a
    correction bias (``MoESpec.correction_bias``: a way to exchange them) its groups (``_group_tie``)."""
    ties = []
    for layer, (choice, groups) in full.choices.items():
        h_choice, h_groups = half.choices[layer]
        choice, groups = choice[-1], None if groups is None else groups[-1]
        noise = float((h_choice[-1] - choice).abs().max())
        gap, i, j = router_tie(spec, choice, groups)
        if gap <= noise < math.inf:  # a change of no finite size measures no rounding (an overflow)
            ties.append(Tie(layer, "experts", i, j, gap, noise))
        if groups is not None and spec.correction_bias and spec.topk_group < groups.numel():
            g_noise = float((h_groups[-1] - groups).abs().max())
            g_gap, first, second = _group_tie(spec, groups)
            if g_gap <= g_noise < math.inf:
                ties.append(Tie(layer, "groups", first, second, g_gap, g_noise))
    return sorted(ties, key=lambda t: t.gap / t.noise if t.noise > 0 else 0.0)


def unweighed_ties(full: Probe, half: Probe, spec: MoESpec) -> int:
    """How many router choices within the half-precision run's rounding this check does not weigh: at every position
    before the last, a router whose expert gap (``router_tie``) or group gap (the last kept group's score less the
    next one's) is within that run's change of the same values there; at the last, its group gap where it has no
    correction bias to exchange the groups by."""
    count = 0
    for layer, (choice, groups) in full.choices.items():
        h_choice, h_groups = half.choices[layer]
        noise = (h_choice - choice).abs().amax(dim=1)
        for p in range(choice.shape[0] - 1):
            if router_tie(spec, choice[p], None if groups is None else groups[p])[0] <= float(noise[p]) < math.inf:
                count += 1
                continue
            if groups is not None and _within(_group_tie(spec, groups[p])[0], h_groups[p] - groups[p]):
                count += 1
        if groups is not None and not spec.correction_bias and _within(_group_tie(spec, groups[-1])[0],
                                                                       h_groups[-1] - groups[-1]):
            count += 1  # no way to exchange them (``router_ties``)
    return count


def _within(gap: float, change: torch.Tensor) -> bool:
    """``gap`` is within the largest of ``change``, a finite one."""
    noise = float(change.abs().max())
    return gap <= noise < math.inf


def _group_tie(spec: MoESpec, groups: torch.Tensor) -> tuple[float, int, int]:
    """The lowest kept group's score less the highest dropped one's, with those two groups; an infinite gap (and
    ``-1``) with every group kept."""
    if spec.topk_group >= groups.numel():
        return float("inf"), -1, -1
    kept = _kept_groups(spec, groups)
    first = int(groups.masked_fill(~kept, float("inf")).argmin())
    second = int(groups.masked_fill(kept, float("-inf")).argmax())
    return float(groups[first] - groups[second]), first, second


def measure(spec: MoESpec, prompt: int, step: int, ours: int, float32_token: int, full: Probe, half: Probe,
            ties: list[Tie], swapped: list[tuple[torch.Tensor, frozenset[int]]]) -> Divergence:
    """The divergence at one position from its float32 (``full``) and half-precision (``half``) probes, the router
    ties there (``router_ties``) and what each tie's exchange gave (``exchanged``). A token gap within its noise is
    the near-tie; else the first tie whose exchange flipped exactly that choice (its selection is
    ``flipped_selection``'s) and brought our token within the token noise of float32's choice explains it."""
    token_gap = float(full.logits.max() - full.logits[ours])
    token_noise = float((half.logits - full.logits).abs().max())
    unweighed = unweighed_ties(full, half, spec)
    if not math.isfinite(token_noise) or token_gap <= token_noise:  # an overflow weighs nothing; else a token tie
        return Divergence(prompt, step, ours, float32_token, token_gap, token_noise, unweighed)
    for tie, (logits, picked) in zip(ties, swapped):
        choice, groups = full.choices[tie.layer]
        if picked != flipped_selection(spec, choice[-1], None if groups is None else groups[-1], tie):
            continue  # the exchange flipped nothing (an exact tie) or more than that choice
        exchange_gap = float(logits.max() - logits[ours])
        if exchange_gap <= token_noise:
            pair = (tie.first, tie.second)
            return Divergence(prompt, step, ours, float32_token, token_gap, token_noise, unweighed, tie.layer, tie.gap,
                              tie.noise, pair if tie.kind == "experts" else None,
                              pair if tie.kind == "groups" else None, exchange_gap)
    return Divergence(prompt, step, ours, float32_token, token_gap, token_noise, unweighed)


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first step where two token lists differ with a token on both sides, or ``None`` (equal, or one a prefix
    of the other: nothing to weigh there)."""
    return next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def describe(d: Divergence, dtype: str) -> str:
    """One sentence on a divergence for the run's summary (prompt, step, both tokens and the measured gaps)."""
    if d.token_noise is None or not math.isfinite(d.token_noise):
        return (f"prompt {d.prompt}, step {d.step}: token {d.ours} here, {d.float32} in float32; transformers' own "
                f"{dtype} pass over those tokens does not hold finite logits there (an overflow), so it measures no "
                f"rounding: not weighed, not a near-tie")
    head = (f"prompt {d.prompt}, step {d.step}: token {d.ours} here, {d.float32} in float32, "
            f"{d.token_gap:.3g} apart in float32 logits against the {d.token_noise:.3g} that transformers' own "
            f"{dtype} run moves them there")
    if d.router_layer is not None:
        what = (f"picks expert {d.experts[0]} over expert {d.experts[1]}" if d.experts is not None
                else f"keeps group {d.groups[0]} over group {d.groups[1]}")
        led = (f"float32 chooses token {d.ours} too" if not d.exchange_gap else
               f"token {d.ours} comes within {d.exchange_gap:.3g} of float32's choice, inside the token's rounding")
        text = (f"{head}; layer {d.router_layer}'s router {what} there by {d.router_gap:.3g} in float32, within the "
                f"{d.router_noise:.3g} that run moves {'its choices' if d.experts is not None else 'its group scores'}"
                f", and with the two exchanged {led}: a near-tie")
    elif d.near_tie:
        text = f"{head}: a near-tie"
    else:
        text = f"{head}, and no router tie within that run's rounding there leads to token {d.ours}: not a near-tie"
    if d.unweighed_ties:
        are = "s are" if d.unweighed_ties != 1 else " is"
        text += (f"; {d.unweighed_ties} router choice{are} within it at earlier positions or between groups, which "
                 f"another summation order may flip unseen and this check does not weigh")
    return text
