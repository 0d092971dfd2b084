"""The server command line that realises a plan's strategy on SGLang or vLLM (``epmoe plan --engine``).

Flags checked against SGLang 0.5.23 (``sglang/srt/arg_groups/fields``: ``--tp-size``, ``--ep-size``,
``--attn-dp-size`` (it replaces ``--dp-size N --enable-dp-attention``, deprecated there), ``--moe-a2a-backend``,
``--ep-num-redundant-experts``, ``--init-expert-location``, ``--speculative-*``) and vLLM 0.33.0
(``vllm/engine/arg_utils.py``: ``--tensor-parallel-size``, ``--data-parallel-size``, ``--enable-expert-parallel``,
``--all2all-backend``, ``--enable-eplb``, ``--eplb-config``, ``--speculative-config``).
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from epmoe.plan.request import Plan, Strategy
from epmoe.plan.speculative import Speculation

ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class ServerCommand:
    """A server command line and what the user must know about it.

    Attributes:
        strategy: the planned strategy it realises.
        argv: the command, one argument per entry.
        notes: sentences about files it names or flags that differ between versions.
    """

    strategy: str
    argv: tuple[str, ...]
    notes: tuple[str, ...]

    def text(self) -> str:
        """The command as a shell line to paste."""
        return shlex.join(self.argv)


def chosen_strategy(p: Plan) -> tuple[Strategy, str | None]:
    """The strategy a server should run: the fastest fitting one at the most batch sizes (ties: the larger batch);
    when none fits at any batch, the fastest at the largest, with a note saying so."""
    picks = [p.fastest_fitting(i) for i in range(len(p.request.batches))]
    named = [s.strategy.name for s in picks if s is not None]
    if not named:
        last = min(p.strategies, key=lambda s: s.steps[-1].total_ms)
        return last.strategy, (f"no strategy fits in GPU memory at any batch planned; {last.strategy.name} is the "
                               "fastest at the largest batch")
    counts = Counter(named)
    best = max(counts.values())
    name = next(n for n in reversed(named) if counts[n] == best)
    return p.strategy(name).strategy, None


def server_command(engine: str, p: Plan, *, model: str | None = None, draft_path: str | None = None,
                   speculation: Speculation | None = None) -> ServerCommand:
    """The ``engine`` command line for ``chosen_strategy(p)``, with speculation when ``p`` plans it and it pays.

    Args:
        engine: ``sglang`` or ``vllm``.
        p: the plan.
        model: the checkpoint directory to launch (default: the placeholder ``MODEL``, with a note).
        draft_path: the draft's checkpoint for the server (default: the placeholder ``DRAFT``, with a note).
        speculation: the plan's price of speculation (``plan.speculative.price_speculation``): with an accepted
            length, the speculation flags are left out, with a note, where it pays at none of the planned batch
            sizes under the chosen strategy.

    Raises:
        ValueError: an unknown engine.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    req = p.request
    s, note = chosen_strategy(p)
    notes = [note] if note else []
    g, r = req.gpus, req.redundant
    if model is None:
        notes.append(f"MODEL: the checkpoint directory of {Path(req.spec.source).name}")
    path = model or "MODEL"
    speculate = bool(req.spec_tokens)
    if speculate and speculation is not None and speculation.accept_length is not None:
        steps = speculation.strategy(s.name).steps
        if not any(st.pays for st in steps):
            speculate = False
            even = ", ".join(f"{st.break_even:.2f} at batch {st.batch}" for st in steps)
            notes.append(f"speculation left off: at accepted length {speculation.accept_length:g} it pays at no "
                         f"planned batch under {s.name} (break-even {even})")
    if speculate and not draft_path:
        notes.append("DRAFT: the EAGLE-3 draft checkpoint directory")
    placement = "placement.pt"
    if engine == "sglang":
        argv = ["python", "-m", "sglang.launch_server", "--model-path", path, "--tp-size", str(g)]
        if req.nodes > 1:
            argv += ["--nnodes", str(req.nodes)]
        if s.moe_ep > 1:
            argv += ["--ep-size", str(s.moe_ep)]
        if s.mode == "a2a_dp_attn":
            argv += ["--attn-dp-size", str(g)]
            notes.append("SGLang versions before --attn-dp-size take --dp-size "
                         f"{g} --enable-dp-attention instead")
        if s.mode != "all_reduce":
            argv += ["--moe-a2a-backend", "deepep"]
        if r and s.moe_ep > 1:
            argv += ["--ep-num-redundant-experts", str(r), "--init-expert-location", placement]
            notes.append(f"{placement}: epmoe balance --loads DUMP --config CONFIG --ep {s.moe_ep} --redundant {r} "
                         f"--out {placement} (DUMP: SGLang's expert distribution recorder)")
        if speculate:
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                     draft_path or "DRAFT", "--speculative-num-steps",
                     str(req.spec_tokens), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                     str(req.spec_tokens + 1)]
    else:
        dp = s.mode == "a2a_dp_attn"
        argv = ["vllm", "serve", path, "--tensor-parallel-size", str(1 if dp else g)]
        if dp:
            argv += ["--data-parallel-size", str(g)]
        if s.moe_ep > 1:
            argv += ["--enable-expert-parallel"]
            if 1 < s.moe_tp:
                notes.append(f"vLLM spreads experts over all {g} GPUs (EP {g}); {s.name} slices experts "
                             f"{s.moe_tp} ways, which vLLM cannot: this command runs TP1xEP{g}")
        if s.mode != "all_reduce":
            argv += ["--all2all-backend", "deepep_low_latency"]
        if r and s.moe_ep > 1:
            argv += ["--enable-eplb", "--eplb-config", json.dumps({"num_redundant_experts": r})]
            notes.append("EPMOE_EPLB=1 makes vLLM's rearrangement use epmoe's balancer (the epmoe plug-in)")
        if speculate:
            argv += ["--speculative-config", json.dumps({"method": "eagle3", "model": draft_path or "DRAFT",
                                                         "num_speculative_tokens": req.spec_tokens})]
    return ServerCommand(s.name, tuple(argv), tuple(notes))
