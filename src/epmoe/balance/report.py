"""``epmoe balance``: read loads, balance, write the placement, report per layer and plot per-rank loads."""

from __future__ import annotations

import io
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from epmoe.balance.moves import placement_moves, rebalance_with_moves
from epmoe.balance.problem import check_problem, rank_balancedness, rank_loads, rank_max_over_mean
from epmoe.balance.registry import balance, get_balancer
from epmoe.checks import check_int
from epmoe.files import atomic_path, check_output_path, write_failed
from epmoe.integrations.dumps import read_load_dump
from epmoe.integrations.placements import (
    LayeredPlacement,
    check_placement_path,
    load_placement_as,
    save_placement_as,
    sglang_map,
)
from epmoe.placement import ExpertPlacement
from epmoe.plan.plot import check_plot_path
from epmoe.spec import load_moe_spec


@dataclass(frozen=True)
class LayerRow:
    """One layer of the report: balancedness and max/mean rank load before and after, copies moved. A layer whose
    loads are all zero has balancedness 1.0 and max/mean 1.0 (``problem.rank_max_over_mean``: every rank idle
    counts as balanced)."""

    layer: str
    balancedness_before: float
    balancedness_after: float
    max_over_mean_before: float
    max_over_mean_after: float
    moved: int


@dataclass(frozen=True)
class BalanceReport:
    """What ``balance_file`` did.

    Attributes:
        rows: one ``LayerRow`` per layer.
        balancedness_before: mean over layers, before (the ``--from`` placement, else the trivial one).
        balancedness_after: mean over layers, after.
        moves: ``(layer, slot, old_expert, new_expert)`` of every changed slot.
        out: the placement file written; plot: the figure written or None.
    """

    rows: list[LayerRow]
    balancedness_before: float
    balancedness_after: float
    moves: list[tuple[int, int, int, int]]
    out: str
    plot: str | None

    def to_json(self) -> dict:
        """A JSON-ready dict of the report."""
        return asdict(self)

    def table(self):
        """A ``rich.table.Table`` of the per-layer rows and the average."""
        from rich.table import Table

        t = Table(title=f"epmoe balance -> {self.out}")
        for col in ("layer", "bal. before", "bal. after", "max/mean before", "max/mean after", "copies moved"):
            t.add_column(col, justify="right")
        for r in self.rows:
            t.add_row(
                r.layer, f"{r.balancedness_before:.4f}", f"{r.balancedness_after:.4f}",
                f"{r.max_over_mean_before:.3f}", f"{r.max_over_mean_after:.3f}", str(r.moved),
            )
        t.add_row("mean", f"{self.balancedness_before:.4f}", f"{self.balancedness_after:.4f}", "", "",
                  str(len(self.moves)))
        return t


def _plot_figure(names: list[str], before: torch.Tensor, after: torch.Tensor, fmt: str) -> bytes:
    """The per-rank loads before and after (``[L, G]`` tokens) side by side, as a file of matplotlib format
    ``fmt``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    vmax = float(max(before.max(), after.max(), 1e-12))
    for ax, data, title in ((axes[0], before, "before"), (axes[1], after, "after")):
        im = ax.imshow(data.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"tokens per EP rank, {title}")
        ax.set_xlabel("EP rank")
    axes[0].set_ylabel("layer")
    if len(names) <= 40:
        axes[0].set_yticks(range(len(names)), names, fontsize=7)
    fig.colorbar(im, ax=axes, label="tokens")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _write_outputs(placement: LayeredPlacement, out: Path, figure: bytes | None, plot: Path | None) -> None:
    """Write the placement and the figure: both prepared under new temporary names next to their targets
    (``files.atomic_path``), then renamed once both are written; on an error every temporary file is removed and the
    message names the path the user gave."""
    field, final = "out", out
    try:
        with ExitStack() as stack:
            save_placement_as(placement, stack.enter_context(atomic_path(out)), placement.format)
            if figure is not None and plot is not None:
                field, final = "plot", plot
                stack.enter_context(atomic_path(plot)).write_bytes(figure)
    except OSError as exc:
        raise write_failed(field, final, exc) from exc


def balance_file(
    loads: str | Path,
    ep_size: int,
    num_redundant: int,
    out: str | Path,
    *,
    num_nodes: int = 1,
    num_groups: int = 1,
    algorithm: str = "epmoe",
    from_placement: str | Path | None = None,
    max_moves: int | None = None,
    plot: str | Path | None = None,
    loads_format: str = "auto",
    config: str | Path | None = None,
    iters: tuple[int, int] | None = None,
    out_format: str | None = None,
) -> BalanceReport:
    """Balance the loads in a file and write the placement (and a figure of per-rank loads).

    Without ``from_placement`` the balancer ``algorithm`` runs from scratch and "before" is the trivial
    contiguous placement. With it, ``rebalance_with_moves`` starts from that placement (at most
    ``max_moves`` slots change). Files are written only after everything was computed, each to a temporary
    name and renamed; on any error nothing is written.

    Args:
        loads: loads file or folder, any format of ``integrations.dumps`` (epmoe JSON/safetensors, the OLMoE CSV,
            SGLang stat and per-pass dumps, TensorRT-LLM statistic folders).
        ep_size: ``G`` EP ranks. num_redundant: ``R`` redundant slots per layer.
        out: placement file to write (epmoe ``.json``/``.safetensors``, SGLang ``.json``/``.pt``, TensorRT-LLM
            ``.yaml``).
        num_nodes, num_groups: hierarchical option (see ``balance``).
        algorithm: balancer name. from_placement: current placement file (any format of
            ``integrations.placements``). max_moves: slot budget.
        plot: figure path, or None; its format is its suffix's (``.png``, ``.pdf``, ``.svg``, ...; none: PNG).
        loads_format: one of ``integrations.dumps.LOAD_FORMATS`` (default ``auto``: by content).
        config: the model's ``config.json`` (or checkpoint directory): dense-layer rows are dropped with it and
            the layer and expert counts of the loads and ``from_placement`` checked against it.
        iters: TensorRT-LLM iterations ``(a, b)``, ``a <= i < b``.
        out_format: ``epmoe``, ``sglang`` or ``trtllm``; default from ``out``'s suffix (``.pt`` SGLang, ``.yaml``
            TensorRT-LLM, else epmoe).

    Raises:
        FileNotFoundError: a missing input file.
        ValueError: bad loads, sizes, a placement that does not fit them or that the target server would reject,
            an ``out`` / ``plot`` path that cannot be written, or a ``plot`` suffix that names no format matplotlib
            writes (``plan.plot.check_plot_path``; paths checked before anything is computed; nothing is written
            then).
        KeyError: unknown ``algorithm``.
    """
    out_path = check_output_path("out", out, "a placement file path (.json, .safetensors, .pt or .yaml)")
    fmt = check_placement_path(out_path, out_format)
    plot_path, plot_format = check_plot_path("plot", plot) if plot is not None else (None, None)
    if plot_path is not None and plot_path.resolve() == out_path.resolve():
        raise ValueError(f"plot ({str(plot)!r}) and out ({str(out)!r}) name the same file")
    path = Path(loads)
    for field, target in (("out", out_path), ("plot", plot_path)):
        if target is not None and target.resolve() == path.resolve():
            raise ValueError(f"{field} ({str(target)!r}) names the loads file; write the placement elsewhere")
    spec = load_moe_spec(config) if config is not None else None
    dump = read_load_dump(loads, loads_format, spec=spec, iters=iters)
    load, names = dump.load, list(dump.names)
    check_problem(load, ep_size, num_redundant, num_nodes, num_groups)
    if max_moves is not None:
        check_int("max_moves", max_moves, 0)
    get_balancer(algorithm)
    num_layers, num_experts = load.shape
    num_decoder = spec.num_layers if spec is not None else dump.num_decoder_layers
    if from_placement is not None:
        current = load_placement_as(from_placement, ep_size=ep_size, spec=spec)
        before = current.placement
        if spec is None and current.num_decoder_layers is not None:  # an SGLang map: every decoder layer
            if current.num_decoder_layers != dump.num_decoder_layers:
                raise ValueError(f"from_placement ({str(from_placement)!r}) is an SGLang map over "
                                 f"{current.num_decoder_layers} decoder layers; pass --config to pick its MoE layers")
            before = ExpertPlacement(before.phy2log[list(dump.layers)], before.num_experts, before.ep_size)
        before.check_model(num_layers, num_experts, what=f"loads {str(path)!r}")
        num_decoder = num_decoder if num_decoder is not None else current.num_decoder_layers
        if (before.ep_size, before.num_redundant) != (ep_size, num_redundant):
            raise ValueError(
                f"from_placement ({str(from_placement)!r}) is for EP size {before.ep_size} with "
                f"{before.num_redundant} redundant slots, but ep_size ({ep_size}) and num_redundant ({num_redundant}) "
                "were asked for"
            )
        if num_nodes > 1:
            raise ValueError(f"num_nodes ({num_nodes}) must be 1 with from_placement (movement-aware rebalancing)")
    elif max_moves is not None:
        raise ValueError(f"max_moves ({max_moves}) needs from_placement (the current placement) to count moves from")
    if fmt == "sglang" and num_decoder is None:
        raise ValueError(f"out ({str(out)!r}): SGLang's physical_to_logical_map covers every decoder layer, dense ones "
                         f"included; {str(path)!r} does not say how many the model has: pass --config")
    if from_placement is not None:
        result = rebalance_with_moves(load, before, max_moves=max_moves, algorithm=algorithm)
        after, moves = result.placement, result.moves
    else:
        before = ExpertPlacement.trivial(num_layers, num_experts, ep_size, num_redundant)
        after = balance(load, ep_size, num_redundant, algorithm=algorithm, num_nodes=num_nodes, num_groups=num_groups)
        moves = placement_moves(before, after)
    written = LayeredPlacement(after, dump.layers, num_decoder, fmt)
    if fmt == "sglang":
        sglang_map(written)  # the layer indices fit the decoder layers: checked before anything is written
    rb, ra = rank_loads(load, before), rank_loads(load, after)
    bal_b, bal_a = rank_balancedness(rb), rank_balancedness(ra)
    mom_b, mom_a = rank_max_over_mean(rb), rank_max_over_mean(ra)
    moved = torch.zeros(num_layers, dtype=torch.int64)
    for m in moves:
        moved[m[0]] += 1
    rows = [
        LayerRow(names[i], float(bal_b[i]), float(bal_a[i]), float(mom_b[i]), float(mom_a[i]), int(moved[i]))
        for i in range(num_layers)
    ]
    figure = _plot_figure(names, rb, ra, plot_format) if plot_format is not None else None
    _write_outputs(written, out_path, figure, plot_path)
    return BalanceReport(
        rows=rows,
        balancedness_before=float(bal_b.mean()),
        balancedness_after=float(bal_a.mean()),
        moves=moves,
        out=str(out),
        plot=None if plot is None else str(plot),
    )
