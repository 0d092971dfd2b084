"""``epmoe run``'s report: what each rank and the whole run measured (``RankReport``, ``RunReport``), the
reference check's verdict on half-precision runs (``judge_mismatches``), the JSON file, and the tables it prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

from epmoe.comm import COLLECTIVE_KINDS
from epmoe.engine.config import synthetic_text
from epmoe.plan.request import counted, format_bytes
from epmoe.runtime.near_tie import Divergence, describe


@dataclass
class RankReport:
    """What one rank measured.

    Attributes:
        rank: EP rank.
        prompts: indices of the prompts this rank served.
        tokens: generated token ids per served prompt.
        finish_reasons: why each served prompt stopped (``stop``, ``length``).
        gen_s: wall time of the generation on this rank, seconds.
        steps: engine steps run (every rank runs the same number).
        step_kinds: steps by kind: ``graph_steps`` (one CUDA-graph replay; ``long_context_graph_steps`` of them
            replayed a bucket's long-context graph), ``piecewise_steps`` (piecewise graphs, attention eager),
            ``eager_steps``, ``idle_steps``
            (nothing of its own: joined the collectives with an empty batch); ``preemptions``; with prefix
            caching, ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens, ``Scheduler``'s).
        tokens_per_step: mean tokens this rank fed per step in which it ran the model.
        ttft_ms: time to first token of each served prompt, ms.
        rank_counts: ``[L, G]`` (token, expert) pairs this rank routed to each EP rank (padding rows of
            graph steps not counted).
        rebalances: the EPLB events (dicts of ``RebalanceEvent``), empty without ``--eplb-interval``.
        collectives: kind -> calls per step.
        bytes_per_step: kind -> bytes sent per step by this rank.
        peak_rss_mb: peak resident memory of the process, MiB.
        peak_cuda_mb: peak CUDA memory allocated, MiB (0 on CPU).
        expert_mb: routed-expert weights held by this rank, MiB.
        full_expert_mb: what all routed experts would take, MiB.
        kv: the KV pool report (blocks, tokens, bytes, max concurrency at the model's context).
        speculative: with speculative decoding, this rank's counts (``SpecStats.to_json``: verify steps,
            proposed and accepted tokens, mean accepted length per verify step, acceptance rate), the proposer's
            description and, under ``requests``, the same counts per served prompt; ``None`` without.
        logical_loads: ``[L, E]`` tokens this rank routed per logical expert (``Engine.logical_loads``); empty
            unless ``--save-loads`` asked for them.
    """

    rank: int
    prompts: list[int]
    tokens: list[list[int]]
    finish_reasons: list[str]
    gen_s: float
    steps: int
    step_kinds: dict[str, int]
    tokens_per_step: float
    ttft_ms: list[float]
    rank_counts: list[list[int]]
    rebalances: list[dict]
    collectives: dict[str, float]
    bytes_per_step: dict[str, float]
    peak_rss_mb: float
    peak_cuda_mb: float
    expert_mb: float
    full_expert_mb: float
    kv: dict
    speculative: dict | None = None
    logical_loads: list[list[int]] = field(default_factory=list)


@dataclass
class RunReport:
    """The result of ``run_job``.

    Attributes:
        model: checkpoint directory used.
        model_type: its ``model_type``.
        ep: ranks (the EP size; with ``parallel`` ``tp``, the TP size).
        parallel: ``ep`` (experts expert-parallel) or ``tp`` (tensor-parallel: nothing is routed to ranks, so
            ``routed_tokens_per_step`` is zeros and ``balancedness`` 1).
        device: ``cpu`` or ``cuda``.
        prompts: the prompt strings.
        outputs: generated text per prompt.
        ranks: per-rank reports.
        tokens_per_s: generated tokens over all ranks per second of generation wall time (prefill included).
        balancedness: mean over ranks / max over ranks of routed tokens per rank, averaged over layers.
        routed_tokens_per_step: per EP rank, (token, expert) pairs its slots computed per step and MoE layer.
        matches_reference: generated tokens equal the unsharded transformers model's (``None`` if skipped:
            ``--no-reference``, sampling, dummy weights, or simulated routing). Promised exactly in float32; in
            bf16/fp16 the sharded sums run in another order, so a near-tie between two tokens (or two experts) can
            flip: a prompt whose tokens differ from transformers' run in the same dtype is judged by a float32
            reference (``float32_judged``), and matches when ours equal the float32 tokens.
        mismatches: prompt indices whose tokens differ from the reference (and, in bf16/fp16, from the float32
            reference).
        reference_outputs: token ids the reference generated per prompt (empty if skipped).
        first_mismatch: ``(prompt, step, ours, reference)`` of the first differing token, or ``None``.
        reference_not_finite: ``(prompt, step)`` of the first reference step whose logits hold NaN or infinite
            values (NaN or infinite weights, or activations past the dtype's range), or ``None``: tokens drawn from
            such logits mean nothing, so the check does not pass (its prompts are among ``mismatches``).
        float32_judged: per prompt that differed from the same-dtype reference in a bf16/fp16 run, which side
            equals the float32 reference: ``{"prompt", "epmoe_equals_float32", "reference_equals_float32"}``.
        divergences: per prompt of a bf16/fp16 run whose tokens equal neither reference, its first step that differs
            from the float32 reference measured there (``near_tie.Divergence.to_json``: the token's and the nearest
            router's float32 gaps against how far transformers' own half-precision run moves them); a prompt whose
            divergence is a near-tie (``near_tie``) matches, since rounding alone flips such a choice.
        graphs: whether steps replayed CUDA graphs (decode buckets or piecewise graphs).
        overlap: whether the engine ran the overlap schedule (``EngineConfig.disable_overlap_schedule``).
        speculative: with speculative decoding, the counts over every rank (``SpecStats.to_json``), the
            algorithm, ``K``, the proposer's description and, under ``requests``, each prompt's counts in prompt
            order; ``None`` without.
        dtype: the compute dtype of the run (and of the reference).
        expert_backend: what computed the routed experts (``experts.describe_expert_backend``): the backend's
            name, or for ``triton`` on the CPU that the reference ran.
        expert_storage: how the routed experts were held (``experts.storage.held_as``): their format as
            stored, or the compute dtype and why where they were dequantized on load.
        prefix_cache: with prefix caching on, prompt tokens looked up in the cache and found there, summed over
            the ranks: ``{"queried_tokens", "hit_tokens"}``; ``None`` with it off.
        load_format: ``auto`` (the checkpoint's weights) or ``dummy`` (random ones).
        switched_off: the fast paths the environment turned off (``experts.switches.switched_off``; empty: none).
        moe_routing_simulation: how the tokens were sent to experts instead of by the gates
            (``EngineConfig.moe_routing_simulation``), or ``None``.
        reference_skipped: why the reference check, asked for, did not run (``run.reference_room``: the unsharded
            model does not fit the device), or ``None``; ``matches_reference`` is then ``None``.
        reference_not_asked: why the reference check was not asked for (``--no-reference``, sampling, dummy weights
            or simulated routing, the one that applied), or ``None`` where it was.
        float32_skipped: why the float32 reference that would judge a bf16/fp16 run's differing prompts did not
            run (it does not fit the device), or ``None``; those prompts then stay among ``mismatches``.
    """

    model: str
    model_type: str
    ep: int
    parallel: str
    device: str
    prompts: list[str]
    outputs: list[str]
    ranks: list[RankReport]
    tokens_per_s: float
    balancedness: float
    routed_tokens_per_step: list[float]
    matches_reference: bool | None
    mismatches: list[int] = field(default_factory=list)
    reference_outputs: list[list[int]] = field(default_factory=list)
    first_mismatch: tuple[int, int, int, int] | None = None
    reference_not_finite: tuple[int, int] | None = None
    float32_judged: list[dict] = field(default_factory=list)
    divergences: list[dict] = field(default_factory=list)
    graphs: bool = False
    overlap: bool = False
    speculative: dict | None = None
    dtype: str = "float32"
    expert_backend: str = "reference"
    expert_storage: str = ""
    prefix_cache: dict | None = None
    load_format: str = "auto"
    moe_routing_simulation: str | None = None
    reference_skipped: str | None = None
    reference_not_asked: str | None = None
    float32_skipped: str | None = None
    switched_off: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def judge_mismatches(tokens: list[list[int]], reference: list[list[int]],
                     float32: dict[int, list[int]]) -> tuple[list[int], list[dict]]:
    """Which prompts fail the reference check.

    A prompt fails when its tokens differ from the reference run in the same dtype, unless a float32 reference
    of it is given (bf16/fp16 runs) and our tokens equal that: then transformers' own half-precision run is the
    one that flipped a near-tie.

    Args:
        tokens: our token ids per prompt.
        reference: transformers' token ids per prompt, same dtype as ours.
        float32: prompt index -> transformers' float32 token ids, for prompts that differed (empty in float32).

    Returns:
        The failing prompt indices, and per judged prompt ``{"prompt", "epmoe_equals_float32",
        "reference_equals_float32"}``.
    """
    failing, judged = [], []
    for i, (ours, theirs) in enumerate(zip(tokens, reference)):
        if ours == theirs:
            continue
        if i in float32:
            judged.append({"prompt": i, "epmoe_equals_float32": ours == float32[i],
                           "reference_equals_float32": theirs == float32[i]})
            if ours == float32[i]:
                continue
        failing.append(i)
    return failing, judged


_SHORT = {"all_to_all": "a2a", "all_reduce": "ar", "all_gather": "ag"}


def _accepted(stats: dict) -> str:
    """Mean tokens per verify step, or '-' when nothing was verified."""
    return f"{stats['accepted_length']:.2f}" if stats.get("verify_steps") else "-"


def _rebalances(events: list[dict]) -> str:
    """The EPLB events of a run in one cell: counts by outcome, copies moved, the last commit, why some were
    skipped."""
    done = [e for e in events if e["committed"]]
    skipped = [e for e in events if e.get("skipped")]
    failed = len(events) - len(done) - len(skipped)
    moved = counted(sum(e["copies_moved"] for e in done), "copy", "copies")
    text = f"{len(done)} / {len(skipped)} / {failed}, {moved} moved"
    if done:
        last = done[-1]
        text += (f"; last commit at step {last['step']}: balancedness {last['balancedness_before']:.3f} -> "
                 f"{last['balancedness_after']:.3f}")
    for reason in sorted({e["skipped"] for e in skipped}):
        steps = [e["step"] for e in skipped if e["skipped"] == reason]
        text += f"; skipped at step(s) {', '.join(map(str, steps))}: {reason}"
    return text


def _verdict(report: RunReport) -> str:
    """The reference check in one cell; in bf16/fp16, which side of a differing prompt equals float32."""
    if report.reference_not_finite is not None:
        i, step = report.reference_not_finite
        return (f"NO: the reference's logits hold NaN or infinite values (first at prompt {i}, step {step}): the "
                f"checkpoint's weights, or its activations in {report.dtype}, are not finite, so no run's tokens "
                f"mean anything (prompts {report.mismatches})")
    saved = [j["prompt"] for j in report.float32_judged if j["epmoe_equals_float32"]]
    tied = [d["prompt"] for d in report.divergences if d["near_tie"]]
    if report.matches_reference:
        if not saved and not tied:
            return "YES, token for token"
        parts = []
        if saved:
            parts.append(f"prompts {saved} differ from transformers' {report.dtype} run, but equal its float32 run "
                         f"(its {report.dtype} run rounded a near-tie the other way)")
        if tied:
            parts.append(f"prompts {tied} differ from both transformers runs at a near-tie of the float32 model, "
                         f"which {report.dtype} rounding flips (where the tokens differ, below)")
        return "YES: " + "; ".join(parts) + "; the others token for token"
    i, step, ours, theirs = report.first_mismatch
    verdict = (f"NO: prompts {report.mismatches} differ; first at prompt {i}, step {step}: token {ours} here, "
               f"{theirs} in the reference")
    judged = {j["prompt"]: j for j in report.float32_judged}
    if i in judged:
        side = "transformers' " + report.dtype if judged[i]["reference_equals_float32"] else "neither run"
        verdict += f"; the float32 reference equals {side} there"
    if saved:
        verdict += f"; prompts {saved} equal the float32 reference"
    if tied:
        verdict += f"; prompts {tied} differ from a near-tie (below)"
    if report.float32_skipped is not None:
        verdict += f"; not weighed against float32: {report.float32_skipped}"
    return verdict


def print_run_report(report: RunReport, console: Console | None = None) -> None:
    """Print the outputs, the per-rank table and the summary of a run."""
    if console is None:
        detected = Console()
        console = Console(width=max(detected.width, 110))  # the per-rank table needs ~110 columns
    outputs = Table(title="Generations", show_lines=False)
    outputs.add_column("#", justify="right")
    outputs.add_column("prompt")
    outputs.add_column("continuation")
    outputs.add_column("matches reference")
    spec = report.speculative
    if spec is not None:
        outputs.add_column("accepted length", justify="right")
    by_float32 = {j["prompt"] for j in report.float32_judged if j["epmoe_equals_float32"]}
    tied = {d["prompt"] for d in report.divergences if d["near_tie"]}
    for i, (p, o) in enumerate(zip(report.prompts, report.outputs)):
        match = "-" if report.matches_reference is None else ("no" if i in report.mismatches else "yes")
        if i in by_float32:
            match = "yes (float32)"
        elif i in tied:
            match = "yes (near-tie)"
        extra = [_accepted(spec["requests"][i])] if spec is not None else []
        outputs.add_row(str(i), p, repr(o), match, *extra)
    console.print(outputs)

    tp = report.parallel == "tp"  # every rank computes a slice of every expert: nothing is routed to ranks
    size = "TP" if tp else "EP"
    per_rank = Table(title=f"{size} ranks ({report.model_type}, {size} {report.ep}, {report.device})")
    for col in ("rank", "prompts", "steps g/p/e/i", "batch", "routed", *[_SHORT[k] for k in COLLECTIVE_KINDS],
                "bytes out", "TTFT ms", "experts MiB", "peak MiB"):
        per_rank.add_column(col, justify="right")
    for r in report.ranks:
        routed = report.routed_tokens_per_step[r.rank]
        mem = f"{r.peak_cuda_mb if r.peak_cuda_mb else r.peak_rss_mb:.0f}"
        kinds = r.step_kinds
        ttft = f"{sum(r.ttft_ms) / len(r.ttft_ms):.0f}" if r.ttft_ms else "-"
        per_rank.add_row(
            str(r.rank), str(len(r.prompts)),
            "/".join(str(kinds.get(f"{k}_steps", 0)) for k in ("graph", "piecewise", "eager", "idle")),
            f"{r.tokens_per_step:.1f}", "-" if tp else f"{routed:.1f}",
            *[f"{r.collectives[k]:.0f}" for k in COLLECTIVE_KINDS],
            format_bytes(sum(r.bytes_per_step.values())), ttft,
            f"{r.expert_mb:.2f}/{r.full_expert_mb:.2f}", mem,
        )
    console.print(per_rank)
    console.print(
        "per rank: steps g/p/e/i = CUDA-graph / piecewise-graph / eager / idle engine steps; per step: batch = "
        "tokens fed, routed = "
        + ("- (tensor-parallel experts: every rank computes its slice of every expert)" if tp else
           "(token, expert) pairs computed per MoE layer")
        + ", a2a/ar/ag = all-to-all/all-reduce/all-gather calls (one all-gather per step agrees on the batch), bytes "
        "out = bytes sent; TTFT = mean time to first token; experts MiB = routed-expert weights held / all of them; "
        "peak MiB = " + ("CUDA memory allocated" if report.device == "cuda" else "process RSS")
    )

    summary = Table(title="Summary", show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    summary.add_row("model", report.model)
    summary.add_row("compute dtype", report.dtype)
    synthetic = synthetic_text(report.load_format, report.moe_routing_simulation)
    if synthetic is not None:
        summary.add_row("weights and MoE routing", synthetic)
    summary.add_row("tokens/s (generated, all ranks)", f"{report.tokens_per_s:.1f}")
    preempted = sum(r.step_kinds.get("preemptions", 0) for r in report.ranks)
    kv = report.ranks[0].kv
    summary.add_row("KV cache per rank", f"{counted(kv['blocks'], 'block')} of {counted(kv['block_size'], 'token')} "
                    f"({format_bytes(kv['bytes'])}; {kv['bytes_per_token_layer']} B per token and layer, "
                    f"{kv['kind']}), "
                    f"{counted(kv['max_concurrency'], 'sequence')} of {counted(kv['context'], 'token')} at once")
    summary.add_row("expert backend", report.expert_backend)
    if report.expert_storage:
        summary.add_row("routed experts held as", report.expert_storage)
    if report.switched_off:
        summary.add_row("fast paths switched off by the environment", "; ".join(report.switched_off))
    summary.add_row("CUDA graphs / overlap schedule / preemptions",
                    f"{'on' if report.graphs else 'off'} / {'on' if report.overlap else 'off'} / {preempted}")
    if report.prefix_cache is not None:
        summary.add_row("prefix cache (tokens found / asked for)",
                        f"{report.prefix_cache['hit_tokens']} / {report.prefix_cache['queried_tokens']}")
    if not tp:
        summary.add_row("balancedness (mean/max routed tokens per rank)", f"{report.balancedness:.3f}")
    events = report.ranks[0].rebalances
    if events:
        summary.add_row("live rebalances (committed / skipped / failed)", _rebalances(events))
        failed = [e for e in events if not e["committed"] and not e.get("skipped")]
        if failed:
            summary.add_row(f"first failed rebalance (step {failed[0]['step']})", failed[0]["error"])
    if spec is not None:
        summary.add_row(f"speculative decoding ({spec['algorithm']}, K = {spec['num_tokens']})", spec["proposer"])
        summary.add_row("accepted length (tokens per verify step) / acceptance rate",
                        f"{_accepted(spec)} / {spec['acceptance_rate']:.2f} ({spec['accepted_tokens']} of "
                        f"{counted(spec['draft_tokens'], 'proposed token')}, "
                        f"{counted(spec['verify_steps'], 'verify step')})")
    if report.reference_skipped is not None:
        summary.add_row("matches transformers reference",
                        f"not checked: {report.reference_skipped} (--no-reference does not ask for it)")
    elif report.matches_reference is None:
        summary.add_row("matches transformers reference", f"not checked ({report.reference_not_asked})")
    else:
        verdict = _verdict(report)
        summary.add_row("matches transformers reference", verdict)
        for d in report.divergences:
            summary.add_row("where the tokens differ from float32", describe(Divergence(
                **{k: v for k, v in d.items() if k != "near_tie"}), report.dtype))
    console.print(summary)
