"""Explaining a ``Plan``: the one-line recommendation, the rich table, the PNG and the JSON document."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from epmoe.files import atomic_path, write_failed
from epmoe.plan.costs import weights_hint
from epmoe.plan.draft import DraftModel
from epmoe.plan.planner import plan
from epmoe.plan.plot import check_plot_path
from epmoe.plan.request import GIB, Plan, PlanRequest, StepEstimate, StrategyPlan, counted
from epmoe.plan.speculative import Speculation, SpeculativeStep, price_speculation

_KIND_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "all_to_all": "A2A"}
_KIND_WORDS = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
               "all_to_all": "all-to-all"}


def describe_collectives(step: StepEstimate | tuple, short: bool = False) -> str:
    """The collectives of a step (or a tuple of ``CollectiveCost``) in words, e.g. ``122 all-reduces + 1
    all-gather`` (``no collectives``); ``short``: ``122 AR + 1 AG``."""
    counts: dict[str, int] = {}
    for c in step.collectives if isinstance(step, StepEstimate) else step:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    if not counts:
        return "none" if short else "no collectives"
    if short:
        return " + ".join(f"{n} {_KIND_SHORT[k]}" for k, n in counts.items())
    return " + ".join(counted(n, _KIND_WORDS[k]) for k, n in counts.items())


def _reason(best: StrategyPlan, other: StrategyPlan | None, i: int, family: str | None) -> str:
    """Why ``best`` beats ``other`` at batch index ``i``; ``family`` names ``other``'s family when it was
    picked as the fastest of the other family (the all-reduce or the all-to-all strategies)."""
    b = best.steps[i]
    name = best.strategy.name
    if other is None:
        return "it is the only strategy planned"  # at every batch: no batch to name
    o, oname = other.steps[i], other.strategy.name
    if not o.memory.fits:
        if family:
            return (f"at batch {b.batch} no {family} strategy fits (the fastest, {oname}, is over by "
                    f"{o.memory.over / GIB:.1f} GiB)")
        return f"at batch {b.batch} {oname} does not fit (over by {o.memory.over / GIB:.1f} GiB)"
    deltas = {"comm": o.comm_ms - b.comm_ms, "expert": o.expert_ms - b.expert_ms,
              "attention": o.attention_ms - b.attention_ms, "engine": o.engine_ms - b.engine_ms}
    part = max(deltas, key=lambda key: deltas[key])
    if part == "engine":
        return (f"at batch {b.batch} the engine's own step costs (logits, sampling, host work; they grow with the "
                f"sequences a rank holds) take {b.engine_ms:.2f} ms against {o.engine_ms:.2f} ms for {oname}")
    if part == "comm":
        return (f"at batch {b.batch} the {describe_collectives(o)} of {oname} cost {o.comm_ms:.2f} ms, more than "
                f"the {describe_collectives(b)} of {name} ({b.comm_ms:.2f} ms)")
    if part == "expert":
        return (f"at batch {b.batch} its routed-expert compute on the busiest rank takes {b.expert_ms:.2f} ms "
                f"against {o.expert_ms:.2f} ms for {oname}")
    return (f"at batch {b.batch} its attention and dense compute takes {b.attention_ms:.2f} ms against "
            f"{o.attention_ms:.2f} ms for {oname}")


def recommend(p: Plan) -> str:
    """One line: the fastest strategy that fits at each batch size, and why.

    The reason compares the chosen strategy with the fastest one of the other family (all-reduce
    strategies against all-to-all ones), or with the next fastest when there is no other family, and
    names the part of the step (communication, expert compute, attention, the engine's own step costs) that differs
    most.

    Example: ``TP8: at batch 1 the 120 all-to-alls of EP8+DPattn cost 3.07 ms, more than the 122
    all-reduces + 1 all-gather of TP8 (1.48 ms)``.
    """
    groups: list[tuple[str, list[int], str]] = []
    for i, batch in enumerate(p.request.batches):
        ranked = sorted(p.strategies, key=lambda s: s.steps[i].total_ms)
        fitting = [s for s in ranked if s.steps[i].memory.fits]
        if not fitting:
            least = min(p.strategies, key=lambda s: s.steps[i].memory.over)
            choice = "nothing fits"
            hint = weights_hint(p.request.expert_format)
            why = (f"at batch {batch} the smallest overshoot is {least.strategy.name} by "
                   f"{least.steps[i].memory.over / GIB:.1f} GiB per GPU; "
                   + (f"add GPUs, use {hint} or a shorter "
                      "--context" if hint else "add GPUs or use a shorter --context"))
        else:
            best = fitting[0]
            # compare across the TP/EP divide (all-reduce vs all-to-all family) when there is one
            best_ar = best.strategy.mode == "all_reduce"
            family = [s for s in ranked if s is not best and (s.strategy.mode == "all_reduce") != best_ar]
            others = sorted(family, key=lambda s: (not s.steps[i].memory.fits, s.steps[i].total_ms)) or [
                s for s in ranked if s is not best]
            label = ("all-to-all" if best.strategy.mode == "all_reduce" else "all-reduce") if family else None
            choice, why = best.strategy.name, _reason(best, others[0] if others else None, i, label)
        if groups and groups[-1][0] == choice:
            groups[-1][1].append(batch)
        else:
            groups.append((choice, [batch], why))
    if len(groups) == 1:
        choice, _, why = groups[0]
        return f"{choice} at every batch size: {why}"
    parts = []
    for choice, batches, why in groups:
        span = f"batch {batches[0]}" if len(batches) == 1 else f"batch {batches[0]}-{batches[-1]}"
        parts.append(f"{choice} for {span} ({why})")
    return "; ".join(parts)


def _why_speculation(st: SpeculativeStep) -> str:
    """What makes a round cost what it does, against a plain decode step."""
    v, d = st.verify, st.decode
    parts = {"experts": v.expert_ms - d.expert_ms, "collectives": v.comm_ms - d.comm_ms,
             "attention and dense": v.attention_ms - d.attention_ms}
    grow = ", ".join(f"{k} {ms:+.2f} ms" for k, ms in sorted(parts.items(), key=lambda kv: -kv[1]))
    drafts = describe_collectives(st.draft_collectives)
    return (f"verify {v.total_ms:.2f} ms ({describe_collectives(v)}, {v.comm_ms:.2f} ms of them) = "
            f"{v.total_ms / d.total_ms:.2f}x the {d.total_ms:.2f} ms decode step ({grow}), plus drafts "
            f"{st.draft_ms:.2f} ms ({drafts})")


def speculation_verdict(sp: Speculation, strategy: str, i: int) -> str:
    """One sentence: whether speculation pays under ``strategy`` at batch index ``i``, and why."""
    st = sp.strategy(strategy).steps[i]
    head = f"under {strategy} at batch {st.batch}: "
    why = _why_speculation(st)
    fits = "" if st.fits else (f" (target and draft do not fit: over by {st.over / GIB:.2f} GiB per GPU with the "
                               f"draft's {st.draft_bytes / GIB:.1f} GiB)")
    if st.accept_length is None:
        return (f"{head}pays when more than {st.break_even:.2f} tokens are accepted per round; {why}{fits}")
    verdict = "pays" if st.pays else "does not pay"
    return (f"{head}{verdict} at accepted length {st.accept_length:g}: {st.tokens_per_s:.1f} against "
            f"{st.plain_tokens_per_s:.1f} tokens/s (break-even {st.break_even:.2f}); {why}{fits}")


def speculation_summary(sp: Speculation, i: int) -> str:
    """One sentence: at batch index ``i``, the fastest way to decode among what fits in GPU memory (plain decoding:
    the target; speculation: target and draft), with or without speculation."""
    options = []
    for plan_s in sp.strategies:
        st = plan_s.steps[i]
        if st.decode.memory.fits:
            options.append((st.plain_tokens_per_s, f"{plan_s.strategy.name} without speculation"))
        if st.tokens_per_s is not None and st.fits:
            options.append((st.tokens_per_s, f"{plan_s.strategy.name} with speculation"))
    batch = sp.strategies[0].steps[i].batch
    if not options:
        return f"at batch {batch} no strategy fits in GPU memory"
    ranked = sorted(options, reverse=True)
    best = f"at batch {batch} the fastest is {ranked[0][1]} ({ranked[0][0]:.1f} tokens/s)"
    return best + (f", then {ranked[1][1]} ({ranked[1][0]:.1f})" if len(ranked) > 1 else "")


def speculation_table(sp: Speculation) -> Table:
    """A rich table: per strategy and batch, decode step, verify step, drafts and their collectives, break-even and
    tokens/s."""
    a = f", accepted length {sp.accept_length:g}" if sp.accept_length is not None else ""
    t = Table(title=f"speculative decoding: {counted(sp.spec_tokens, 'draft token')} per round ({sp.draft.name}){a}",
              caption="ms on the busiest rank (verify collectives: the plan above, same counts); break-even: "
                      "accepted tokens per round at which speculation matches plain decoding; fits: target at verify "
                      "size and draft together")
    for col in ("strategy", "batch", "decode", "verify", "drafts", "draft collectives", "break-even", "tok/s plain",
                "tok/s spec", "pays", "fits"):
        t.add_column(col, justify="left" if col in ("strategy", "draft collectives", "pays", "fits") else "right",
                     no_wrap=True)
    for plan_s in sp.strategies:
        for st in plan_s.steps:
            spec_tps = "" if st.tokens_per_s is None else f"{st.tokens_per_s:.1f}"
            pays = "" if st.pays is None else ("yes" if st.pays else "[red]no[/red]")
            fits = "yes" if st.fits else f"[red]over {st.over / GIB:.2f} GiB[/red]"
            t.add_row(plan_s.strategy.name, str(st.batch), f"{st.decode.total_ms:.2f}", f"{st.verify.total_ms:.2f}",
                      f"{st.draft_ms:.2f}", describe_collectives(st.draft_collectives, short=True),
                      f"{st.break_even:.2f}", f"{st.plain_tokens_per_s:.1f}", spec_tps, pays, fits)
        t.add_section()
    return t


def speculation_to_dict(sp: Speculation) -> dict[str, Any]:
    """A JSON-ready document of the speculation pricing."""
    return {
        "spec_tokens": sp.spec_tokens, "accept_length": sp.accept_length, "draft": sp.draft.name,
        "strategies": [{"name": s.strategy.name, "steps": [{
            "batch": st.batch, "decode_ms": st.decode.total_ms, "verify_ms": st.verify.total_ms,
            "draft_ms": st.draft_ms, "round_ms": st.round_ms, "break_even_accept_length": st.break_even,
            "plain_tokens_per_s": st.plain_tokens_per_s, "tokens_per_s": st.tokens_per_s, "pays": st.pays,
            "draft_bytes_per_gpu": st.draft_bytes, "fits": st.fits,
            "verify_collectives": [{"kind": c.kind, "what": c.what, "count": c.count, "ms_total": c.ms_total}
                                   for c in st.verify.collectives],
            "draft_collectives": [{"kind": c.kind, "what": c.what, "count": c.count, "ms_total": c.ms_total}
                                  for c in st.draft_collectives],
        } for st in s.steps]} for s in sp.strategies],
    }


def _verdict_strategies(sp: Speculation, gpus: int) -> list[str]:
    """The strategies the verdict lines cover: TP over all GPUs and every EP-over-all-GPUs strategy planned."""
    names = [s.strategy.name for s in sp.strategies]
    return [n for n in names if n == f"TP{gpus}" or n.startswith(f"EP{gpus}")]


PLAN_WIDTH = 160
"""Columns ``report_plan`` prints at least, whatever the terminal (or none: a pipe) reports: the plan table's widest
rows (Kimi-K2.5 on 8 GPUs, its collectives column) take about 150; narrower, rich cuts its last columns."""


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """A JSON-ready document of the plan: request, every strategy's steps (ms, bytes) and the recommendation."""
    r = p.request
    strategies = []
    for sp in p.strategies:
        s = sp.strategy
        steps = []
        for st in sp.steps:
            m = st.memory
            steps.append({
                "batch": st.batch, "tokens": st.tokens, "total_ms": st.total_ms, "attention_ms": st.attention_ms,
                "expert_ms": st.expert_ms, "comm_ms": st.comm_ms, "engine_ms": st.engine_ms,
                "collectives": [{"kind": c.kind, "what": c.what, "count": c.count, "bytes_per_call": c.bytes_per_call,
                                 "ms_each": c.ms_each, "ms_total": c.ms_total} for c in st.collectives],
                "memory_bytes": {"weights": m.weights, "expert_weights": m.expert_weights, "kv_cache": m.kv_cache,
                                 "comm_buffers": m.comm_buffers, "graph_pool": m.graph_pool, "total": m.total,
                                 "capacity": m.capacity, "over": m.over},
                "fits": m.fits,
            })
        prefills = [{"input_len": st.tokens, "ttft_ms": st.total_ms, "attention_ms": st.attention_ms,
                     "expert_ms": st.expert_ms, "comm_ms": st.comm_ms, "engine_ms": st.engine_ms,
                     "fits": st.memory.fits} for st in sp.prefills]
        strategies.append({"name": s.name, "description": s.description, "attn_tp": s.attn_tp, "moe_tp": s.moe_tp,
                           "moe_ep": s.moe_ep, "mode": s.mode, "steps": steps, "prefills": prefills})
    return {
        "model": r.spec.source, "model_type": r.spec.model_type, "hardware": r.hardware.name, "gpus": r.gpus,
        "nodes": r.nodes, "batches": list(r.batches), "input_lens": list(r.input_lens), "spec_tokens": r.spec_tokens,
        "redundant": r.redundant,
        "context": r.context, "expert_format": r.expert_format, "dense_format": r.dense_format,
        "mem_fraction": r.mem_fraction, "balancedness": r.balancedness,
        "config_defaults": {"class": r.spec.defaults_class, "fields": dict(r.spec.defaults)},
        "strategies": strategies, "skipped": list(p.skipped), "recommendation": recommend(p),
    }


def plan_table(p: Plan) -> Table:
    """A rich table: one row per strategy and batch size with the step split and memory per GPU (``expert GiB``:
    the routed experts' share, in the expert format of the title, scales included)."""
    r = p.request
    step_kind = "decode" if r.spec_tokens == 0 else f"verify S={r.spec_tokens}"
    t = Table(title=f"{Path(r.spec.source).name} on {r.gpus}x {r.hardware.gpu} ({r.hardware.name}, "
                    f"{counted(r.nodes, 'node')}), {step_kind}, context {r.context}, experts {r.expert_format}, "
                    f"balancedness {r.balancedness}",
              caption="times in ms on the busiest rank; step = attn+dense + experts + comm + engine (the engine's "
                      "own costs a step: logits, sampling, host work, the profile's engine_* terms); AR all-reduce, "
                      "RS reduce-scatter, AG all-gather, A2A all-to-all")
    for col in ("strategy", "batch", "step", "attn+dense", "experts", "comm", "engine", "collectives/step", "GiB/GPU",
                "expert GiB", "fits"):
        t.add_column(col, justify="left" if col in ("strategy", "collectives/step", "fits") else "right",
                     no_wrap=col != "fits")
    for sp in p.strategies:
        for st in sp.steps:
            m = st.memory
            fits = "yes" if m.fits else f"[red]over {m.over / GIB:.1f} GiB[/red]"
            t.add_row(sp.strategy.name, str(st.batch), f"{st.total_ms:.2f}", f"{st.attention_ms:.2f}",
                      f"{st.expert_ms:.2f}", f"{st.comm_ms:.2f}", f"{st.engine_ms:.2f}",
                      describe_collectives(st, short=True),
                      f"{m.total / GIB:.1f} / {m.capacity / GIB:.0f}", f"{m.expert_weights / GIB:.1f}", fits)
        t.add_section()
    return t


def prefill_table(p: Plan) -> Table:
    """A rich table of one prompt's prefill alone per strategy and prompt length (``PlanRequest.input_lens``): the
    time to first token and its split, ms on the busiest rank."""
    r = p.request
    t = Table(title=f"{Path(r.spec.source).name} on {r.gpus}x {r.hardware.gpu} ({r.hardware.name}): one prompt's "
                    f"prefill alone, experts {r.expert_format}",
              caption="TTFT = attn+dense + experts + comm + engine (the profile's engine_step_us and "
                      "engine_prefill_layer_us a layer: 0 where the profile has none); under DP attention one rank "
                      "computes the prompt's attention; fits: the weights and this prompt's cache and activations")
    for col in ("strategy", "prompt tokens", "TTFT", "attn+dense", "experts", "comm", "engine", "fits"):
        t.add_column(col, justify="left" if col in ("strategy", "fits") else "right", no_wrap=True)
    for sp in p.strategies:
        for st in sp.prefills:
            m = st.memory
            t.add_row(sp.strategy.name, str(st.tokens), f"{st.total_ms:.1f}", f"{st.attention_ms:.1f}",
                      f"{st.expert_ms:.1f}", f"{st.comm_ms:.1f}", f"{st.engine_ms:.1f}",
                      "yes" if m.fits else f"[red]over {m.over / GIB:.1f} GiB[/red]")
        t.add_section()
    return t


def plot_plan(p: Plan, path: str | Path, field: str = "path") -> None:
    """Write a figure of step time (ms) against batch size to ``path`` (exactly that name, in the format its suffix
    names: ``.png``, ``.pdf``, ``.svg``, ...; no suffix: PNG), one line per strategy; steps that do not fit are
    drawn as open markers.

    Raises:
        ValueError: ``path`` cannot be written, or its suffix names no format matplotlib writes
            (``plot.check_plot_path``; checked before drawing); the write failing (a read-only or full file
            system), named as ``field`` with the path and the system's reason.
    """
    path, fmt = check_plot_path(field, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for sp in p.strategies:
        xs = [st.batch for st in sp.steps]
        ys = [st.total_ms for st in sp.steps]
        (line,) = ax.plot(xs, ys, "-", label=sp.strategy.name)
        for st in sp.steps:
            ax.plot(st.batch, st.total_ms, "o", color=line.get_color(),
                    markerfacecolor=line.get_color() if st.memory.fits else "none")
    r = p.request
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences per step)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{Path(r.spec.source).name}: {r.gpus}x {r.hardware.name} (open marker: does not fit)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=120)
    plt.close(fig)
    try:
        with atomic_path(path) as tmp:  # a failed write leaves no half file, and an old figure as it was
            tmp.write_bytes(buf.getvalue())
    except OSError as exc:
        raise write_failed(field, path, exc) from exc


def report_plan(req: PlanRequest, as_json: bool = False, plot_path: str | Path | None = None,
                console: Console | None = None, *, draft: DraftModel | None = None,
                accept_length: float | None = None, engine: str | None = None, model: str | None = None,
                draft_path: str | None = None) -> Plan:
    """Plan ``req`` and report it: the table (or the JSON document), the config fields that took transformers'
    defaults, the skipped strategies, the recommendation and, when ``plot_path`` is given, the figure
    (``plot_plan``). With ``req.spec_tokens >= 1`` also the price of speculative decoding
    (``speculative.price_speculation`` with ``draft`` and ``accept_length``) and whether it pays under TP and EP
    over all GPUs; with ``engine`` (``sglang`` or ``vllm``) the server command line that realises the
    recommendation (``integrations.commands``) for ``model`` (and ``draft_path``).

    Raises:
        ValueError: as ``plan`` or ``price_speculation``, or a ``plot_path`` that cannot be written or whose suffix
            names no format matplotlib writes (``plot.check_plot_path``; checked before planning, named ``--plot``).
    """
    from epmoe.integrations.commands import server_command

    if plot_path is not None:
        check_plot_path("--plot", plot_path)
    p = plan(req)
    if plot_path is not None:  # before anything is printed: a figure that cannot be written fails the command
        plot_plan(p, plot_path, "--plot")
    sp = price_speculation(req, draft, accept_length) if req.spec_tokens else None
    command = server_command(engine, p, model=model, draft_path=draft_path, speculation=sp) if engine else None
    if console is None:
        detected = Console()
        console = Console(width=max(detected.width, PLAN_WIDTH))
    if as_json:
        doc = plan_to_dict(p)
        if sp is not None:
            doc["speculation"] = speculation_to_dict(sp)
        if command is not None:
            doc["command"] = {"engine": engine, "strategy": command.strategy, "argv": command.argv,
                              "notes": command.notes}
        if req.expert_format_note:
            doc["expert_format_note"] = req.expert_format_note
        console.print_json(json.dumps(doc))
    else:
        console.print(plan_table(p))
        if req.expert_format_note:
            console.print(f"routed experts priced in bf16, as epmoe run serves them: {req.expert_format_note}",
                          soft_wrap=True)
        if req.spec.defaults:
            console.print(req.spec.describe_defaults(), soft_wrap=True)
        for why in p.skipped:
            console.print(f"skipped {why}")
        console.print(f"[bold]Recommendation:[/bold] {recommend(p)}", soft_wrap=True)
        if req.input_lens:
            console.print(prefill_table(p))
        if sp is not None:
            console.print(speculation_table(sp))
            for name in _verdict_strategies(sp, req.gpus):
                for i in range(len(req.batches)):
                    console.print(f"[bold]Speculation[/bold] {speculation_verdict(sp, name, i)}", soft_wrap=True)
            for i in range(len(req.batches)):
                console.print(f"[bold]Speculation, overall:[/bold] {speculation_summary(sp, i)}", soft_wrap=True)
        if command is not None:
            console.print(f"[bold]{engine}[/bold] ({command.strategy}):", soft_wrap=True)
            console.print(command.text(), soft_wrap=True, markup=False, highlight=False)
            for note in command.notes:
                console.print(f"  note: {note}", soft_wrap=True)
    if plot_path is not None and not as_json:
        console.print(f"plot written to {plot_path}")
    return p
