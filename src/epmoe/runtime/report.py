"""Rendering a ``RunReport`` as the tables ``epmoe run`` prints."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from epmoe.comm import COLLECTIVE_KINDS
from epmoe.runtime.run import RunReport

_SHORT = {"all_to_all": "a2a", "all_reduce": "ar", "all_gather": "ag"}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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
    for i, (p, o) in enumerate(zip(report.prompts, report.outputs)):
        match = "-" if report.matches_reference is None else ("no" if i in report.mismatches else "yes")
        outputs.add_row(str(i), p, repr(o), match)
    console.print(outputs)

    per_rank = Table(title=f"EP ranks ({report.model_type}, EP {report.ep}, {report.device})")
    for col in ("rank", "prompts", "batch", "routed", *[_SHORT[k] for k in COLLECTIVE_KINDS], "bytes out",
                "experts MiB", "peak MiB"):
        per_rank.add_column(col, justify="right")
    for r in report.ranks:
        decode = r.batch_tokens[1:] or r.batch_tokens
        routed = report.routed_tokens_per_step[r.rank]
        mem = f"{r.peak_cuda_mb if r.peak_cuda_mb else r.peak_rss_mb:.0f}"
        per_rank.add_row(
            str(r.rank), str(len(r.prompts)), f"{sum(decode) / len(decode):.1f}", f"{routed:.1f}",
            *[f"{r.collectives[k]:.0f}" for k in COLLECTIVE_KINDS],
            _fmt_bytes(sum(r.bytes_per_step.values())),
            f"{r.expert_mb:.2f}/{r.full_expert_mb:.2f}", mem,
        )
    console.print(per_rank)
    console.print(
        "per decode step and rank: batch = tokens fed, routed = (token, expert) pairs computed per MoE layer, "
        "a2a/ar/ag = all-to-all/all-reduce/all-gather calls, bytes out = bytes sent; "
        "experts MiB = routed-expert weights held / all of them; peak MiB = "
        + ("CUDA memory allocated" if report.device == "cuda" else "process RSS")
    )

    summary = Table(title="Summary", show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    summary.add_row("model", report.model)
    summary.add_row("tokens/s (decode, all ranks)", f"{report.tokens_per_s:.1f}")
    summary.add_row("balancedness (mean/max routed tokens per rank)", f"{report.balancedness:.3f}")
    events = report.ranks[0].rebalances
    if events:
        done = [e for e in events if e["committed"]]
        last = events[-1]
        summary.add_row(
            "live rebalances (committed / tried)",
            f"{len(done)} / {len(events)}, {sum(e['copies_moved'] for e in done)} copies moved; last at step "
            f"{last['step']}: {last['balancedness_before']:.3f} -> {last['balancedness_after']:.3f}"
            + ("" if last["committed"] else f" ({last['error']})"),
        )
    if report.matches_reference is None:
        summary.add_row("matches transformers reference", "not checked (--no-reference)")
    else:
        if report.matches_reference:
            verdict = "YES, token for token"
        else:
            i, step, ours, theirs = report.first_mismatch
            verdict = (f"NO: prompts {report.mismatches} differ; first at prompt {i}, step {step}: "
                       f"token {ours} here, {theirs} in the reference")
        summary.add_row("matches transformers reference", verdict)
        summary.add_row("last-step logits rel. error", f"{report.max_logits_rel_err:.2e}")
    console.print(summary)
