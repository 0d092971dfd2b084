"""Expert load recording and load files.

``ExpertLoadRecorder`` counts the tokens sent to every physical slot on each MoE forward on the device only
(``scatter_add_``, or one Triton kernel on CUDA: ``routing.count_triton``; no host sync, CUDA-graph safe: the window
position is a device tensor), keeps the last ``window`` steps, and reduces them to logical loads ``[L, E]``
summed over the EP group on demand.

Load files: JSON (``{"format": "epmoe.loads/1", "load": [[...]]}``; the key ``weight`` of DeepSeek's
EPLB example is read too), safetensors (tensor ``load``), and the CSV of allenai/OLMoE routing counts
(columns ``domain, layer, expert, count``; every (domain, layer) row group becomes one layer).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from epmoe.checks import MAX_DATA_TEXT_BYTES, MAX_EXPERTS, check_positive_int, check_regular_file, read_text_file
from epmoe.files import atomic_path
from epmoe.placement import ExpertPlacement

LOADS_FORMAT = "epmoe.loads/1"


def as_load_array(load: torch.Tensor | np.ndarray, name: str = "load") -> np.ndarray:
    """Validate a logical load table and return it as a float64 array.

    Args:
        load: ``[L, E]`` tokens routed to each logical expert, any real dtype.
        name: the field name used in error messages.

    Returns:
        ``[L, E]`` float64 copy.

    Raises:
        ValueError: complex or boolean values, not 2-D, empty, NaN or infinite entries, negative entries (position
            named), or a layer whose sum (times the expert count, the balancers' headroom) overflows float64.
    """
    raw = load if isinstance(load, torch.Tensor) else np.asarray(load)
    if raw.is_complex() if isinstance(raw, torch.Tensor) else np.iscomplexobj(raw):  # the imaginary part would go
        raise ValueError(f"{name} must hold real loads, got complex values ({raw.dtype})")
    if raw.dtype in (torch.bool, np.bool_):  # true/false are no token counts (as a JSON file's are refused)
        raise ValueError(f"{name} must hold numbers (tokens per expert), got booleans ({raw.dtype})")
    arr = raw.detach().cpu().double().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [num_layers, num_experts], got shape {tuple(arr.shape)}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must have at least one layer and one expert, got shape {tuple(arr.shape)}")
    bad = ~np.isfinite(arr)
    if bad.any():
        layer, expert = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{layer}, {expert}] = {arr[layer, expert]} is not a finite number")
    neg = arr < 0
    if neg.any():
        layer, expert = (int(v) for v in np.argwhere(neg)[0])
        raise ValueError(f"{name}[{layer}, {expert}] = {arr[layer, expert]} is negative; loads count tokens")
    with np.errstate(over="ignore"):
        total = arr.sum(axis=1) * arr.shape[1]
    if not np.isfinite(total).all():
        layer = int(np.argwhere(~np.isfinite(total))[0][0])
        raise ValueError(f"{name}[{layer}] is too large to balance: its entries (up to {arr[layer].max():g}) "
                         "overflow float64 when summed; loads count tokens")
    return arr.copy()


class LoadRecord(NamedTuple):
    """Where the fused kernel adds a forward's routed pairs (``ExpertLoadRecorder.load_record``).

    Attributes:
        counts: ``[W, L, P + 1]`` int64 contiguous window of counts.
        pos: ``[1]`` int64 window position of the current step.
        layer: MoE layer index.
        row_mask: ``[T]`` int64 (1 = count the row), or ``None`` = every row.
    """

    counts: torch.Tensor
    pos: torch.Tensor
    layer: int
    row_mask: torch.Tensor | None


class ExpertLoadRecorder:
    """Windowed per-slot token counts.

    Args:
        num_layers: ``L`` MoE layers.
        num_slots: ``P`` physical slots per layer (global ids ``0 .. P-1``).
        window: steps kept; ``step()`` drops the oldest.
        device: where the counts live (that of the routing tensors).

    Raises:
        ValueError: a count that is not a positive integer.
    """

    def __init__(self, num_layers: int, num_slots: int, window: int = 1, device: torch.device | str = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_slots", num_slots), ("window", window)):
            check_positive_int(name, v)
        self.num_layers, self.num_slots, self.window = num_layers, num_slots, window
        # Column P collects the -1 (no slot) entries and is never read.
        self._counts = torch.zeros(window, num_layers, num_slots + 1, dtype=torch.int64, device=device)
        self._pos = torch.zeros(1, dtype=torch.int64, device=device)
        self._row_mask: torch.Tensor | None = None

    def mask_rows(self, row_mask: torch.Tensor | None) -> None:
        """Count only the rows ``row_mask`` marks (the engine's CUDA-graph batches carry padding rows).

        Args:
            row_mask: ``[T]`` int64, 1 = a real token, 0 = padding; read by every later ``record`` of ``T``
                rows (also inside a CUDA graph, which captures the tensor, not its values); ``None`` =
                every row counts.
        """
        self._row_mask = row_mask

    def record(self, layer_index: int, topk_slots: torch.Tensor) -> None:
        """Add one forward's routing to the current step.

        Args:
            layer_index: MoE layer, ``0 <= layer_index < L``.
            topk_slots: ``[T, K]`` int64 global physical slot ids, -1 = none (on the recorder's device).

        Raises:
            ValueError: ``layer_index`` out of range.
        """
        if not 0 <= layer_index < self.num_layers:
            raise ValueError(f"layer_index ({layer_index}) must lie in [0, {self.num_layers})")
        mask = self._mask_for(topk_slots.shape[0])
        if self._counts.device.type == "cuda":
            from epmoe.routing.count_triton import count_slots_triton

            count_slots_triton(self._counts, self._pos, layer_index, topk_slots.contiguous(), mask)
            return
        flat = topk_slots.reshape(-1)
        idx = torch.where(flat >= 0, flat, self.num_slots)
        offset = (self._pos * self.num_layers + layer_index) * (self.num_slots + 1)
        if mask is not None:
            ones = mask.unsqueeze(1).expand(topk_slots.shape).reshape(-1)
        else:
            ones = torch.ones_like(idx)
        self._counts.view(-1).scatter_add_(0, idx + offset, ones)

    def load_record(self, layer_index: int, num_tokens: int) -> LoadRecord | None:
        """Where a fused CUDA kernel adds a forward's routing of ``num_tokens`` rows to layer ``layer_index``, with
        the same row mask as ``record``; ``None`` on CPU (``record`` counts there).

        Raises:
            ValueError: ``layer_index`` out of range.
        """
        if not 0 <= layer_index < self.num_layers:
            raise ValueError(f"layer_index ({layer_index}) must lie in [0, {self.num_layers})")
        if self._counts.device.type != "cuda":
            return None
        return LoadRecord(self._counts, self._pos, layer_index, self._mask_for(num_tokens))

    def _mask_for(self, num_tokens: int) -> torch.Tensor | None:
        """The row mask for a forward of ``num_tokens`` rows (a mask of another batch's size does not apply)."""
        mask = self._row_mask
        return mask if mask is not None and mask.shape[0] == num_tokens else None

    def step(self) -> None:
        """Advance the window: the oldest step is cleared and receives the next records."""
        self._pos.add_(1).remainder_(self.window)
        self._counts.index_fill_(0, self._pos, 0)

    def reset(self) -> None:
        """Clear every step (e.g. after the placement changed)."""
        self._counts.zero_()

    def current_counts(self) -> torch.Tensor:
        """``[L, P]`` int64 tokens per physical slot recorded since the last ``step()``."""
        return self._counts.index_select(0, self._pos)[0, :, : self.num_slots]

    def slot_counts(self) -> torch.Tensor:
        """``[L, P]`` int64 tokens per physical slot over the window, this process only."""
        return self._counts[:, :, : self.num_slots].sum(0)

    def logical_load(self, placement: ExpertPlacement, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Tokens per logical expert over the window, summed over the EP group.

        Args:
            placement: the placement the slot ids referred to while recording.
            group: EP process group to all-reduce over; None = this process only.

        Returns:
            ``[L, E]`` int64 on the recorder's device.

        Raises:
            ValueError: the placement has another number of layers or slots.
        """
        if placement.num_layers != self.num_layers or placement.num_slots != self.num_slots:
            raise ValueError(
                f"placement covers [{placement.num_layers}, {placement.num_slots}] (layers, slots) but the recorder "
                f"counts [{self.num_layers}, {self.num_slots}]"
            )
        load = slots_to_logical(self.slot_counts(), placement)
        if group is not None:
            dist.all_reduce(load, op=dist.ReduceOp.SUM, group=group)
        return load


def slots_to_logical(slot_counts: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Tokens per logical expert from tokens per physical slot: every copy's count added to its expert.

    Args:
        slot_counts: ``[L, P]`` int64 tokens per slot, recorded while ``placement`` served.
        placement: the placement the slot ids referred to.

    Returns:
        ``[L, E]`` int64 on ``slot_counts``' device.
    """
    load = torch.zeros(placement.num_layers, placement.num_experts, dtype=torch.int64, device=slot_counts.device)
    return load.scatter_add_(1, placement.phy2log.to(slot_counts.device), slot_counts)


class LoadTotals:
    """Tokens routed per physical slot since start, kept across live rebalances as tokens per logical expert (a
    rebalance renumbers the slots: the counts recorded under the old placement are folded into logical loads then).

    Args:
        num_layers, num_slots, num_experts: ``L``, ``P`` (slots of the serving placement; experts under tensor
            parallelism) and ``E``.
        device: where the totals live.

    Attributes:
        slot_totals: ``[L, P]`` int64 tokens per slot since start.
    """

    def __init__(self, num_layers: int, num_slots: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.slot_totals = torch.zeros(num_layers, num_slots, dtype=torch.int64, device=device)
        self._folded = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._slot_totals_folded = torch.zeros_like(self.slot_totals)

    def add(self, slot_counts: torch.Tensor) -> None:
        """Count one step: ``slot_counts [L, P]`` int64 tokens per slot."""
        self.slot_totals += slot_counts

    def fold(self, old: ExpertPlacement) -> None:
        """A new placement committed: keep the counts recorded under ``old`` as logical loads."""
        self._folded += slots_to_logical(self.slot_totals - self._slot_totals_folded, old)
        self._slot_totals_folded = self.slot_totals.clone()

    def logical(self, placement: ExpertPlacement, since_rebalance: bool = False) -> torch.Tensor:
        """``[L, E]`` int64 tokens per logical expert, on the totals' device.

        Args:
            placement: the placement serving now.
            since_rebalance: only since the last committed rebalance (or start); ``False`` = since start.
        """
        since = slots_to_logical(self.slot_totals - self._slot_totals_folded, placement)
        return since if since_rebalance else since + self._folded


def _as_table(load: torch.Tensor) -> torch.Tensor:
    if not isinstance(load, torch.Tensor):
        raise TypeError(f"load must be a torch.Tensor, got {type(load).__name__}")
    if load.dim() != 2:
        raise ValueError(f"load must be 2-D [num_layers, num_experts], got shape {tuple(load.shape)}")
    return load.detach().cpu()


def save_loads(path: str | Path, load: torch.Tensor) -> None:
    """Write ``load [L, E]`` to ``.safetensors`` (tensor ``load``) or JSON, atomically (temp file + rename).

    Raises:
        TypeError, ValueError: ``load`` is not a 2-D tensor.
    """
    load = _as_table(load)
    path = Path(path)
    with atomic_path(path) as tmp:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({"load": load.contiguous()}, str(tmp), metadata={"format": LOADS_FORMAT})
        else:
            tmp.write_text(json.dumps({"format": LOADS_FORMAT, "load": load.tolist()}))


_SHOWN_IDS = 8  # missing expert ids a message lists before "..."


def read_csv_loads(path: str | Path) -> tuple[torch.Tensor, list[str]]:
    """Read the OLMoE routing-count CSV: one layer per (domain, layer) group, in file order. The file is read once.

    Returns:
        ``(load, names)``: ``[L, E]`` float64 counts (validated by ``as_load_array``) and ``L`` names
        ``"domain:layer"``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular UTF-8 file (``checks.read_text_file``), text the csv module cannot parse (a field
            past its size limit), a missing column, a row short of the header's columns or past them, a layer value
            empty or with spaces around it, an expert id that is not an integer, a count that is not a number,
            negative or not finite (the line, layer, expert and value named), an expert repeated in a group (the line
            named), a group without a count for every expert id up to the largest in the file (the layer, the first
            missing ids and how many named), or a layer whose counts overflow float64 when summed.
    """
    path = Path(path)
    text = read_text_file(path, "loads file", MAX_DATA_TEXT_BYTES)
    text = text.removeprefix("\ufeff")  # a spreadsheet's byte-order mark
    if not text.strip():
        raise ValueError(f"loads file {str(path)!r} is empty: the OLMoE CSV has a header 'layer,expert,count' "
                         f"(and optionally 'domain') and a row per layer and expert")
    try:
        groups = _csv_groups(path, text)
    except csv.Error as exc:
        raise ValueError(f"loads file {str(path)!r} could not be read: {exc}") from exc
    num_experts = max(max(g) for g in groups.values()) + 1
    short = {name: [e for e in range(num_experts) if e not in g] for name, g in groups.items() if len(g) < num_experts}
    if short:
        name, missing = next(iter(short.items()))
        shown = ", ".join(map(str, missing[:_SHOWN_IDS])) + (", ..." if len(missing) > _SHOWN_IDS else "")
        more = len(short) - 1
        others = f"; {more} more layer{'s miss' if more > 1 else ' misses'} some too" if more else ""
        raise ValueError(f"loads file {str(path)!r}: layer {name} has no count for {len(missing)} expert(s): {shown} "
                         f"(every layer needs ids 0..{num_experts - 1}, {num_experts - 1} being the largest id in the "
                         f"file){others}")
    load = torch.tensor([[g[e] for e in range(num_experts)] for g in groups.values()], dtype=torch.float64)
    try:
        return torch.from_numpy(as_load_array(load)), list(groups)
    except ValueError as exc:
        raise ValueError(f"loads file {str(path)!r}: {exc}") from exc


def _shown(value: str, most: int = 40) -> str:
    """``value`` quoted for a message, cut to its first ``most`` characters (a 5000-digit id was echoed whole)."""
    return repr(value) if len(value) <= most else repr(value[:most]) + f" ({len(value)} characters)"


def _csv_groups(path: Path, text: str) -> dict[str, dict[int, float]]:
    """The counts of the OLMoE CSV ``text`` (read from ``path``) by layer name and expert id, in file order; the
    row checks of ``read_csv_loads``. Raises ``csv.Error`` where the csv module cannot parse ``text``."""
    groups: dict[str, dict[int, float]] = {}
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = {"layer", "expert", "count"} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"loads file {str(path)!r}: missing column(s) {sorted(missing)}")
    repeated = sorted({c for c in reader.fieldnames if reader.fieldnames.count(c) > 1})
    if repeated:  # DictReader keeps the last column of a name: the others' values were dropped unread
        raise ValueError(f"loads file {str(path)!r}: the header repeats column(s) {repeated}")
    for row in reader:
        line = reader.line_num
        short = [c for c in ("layer", "expert", "count") if row.get(c) is None]
        if short or None in row:  # DictReader fills a short row's last columns with None, keys a long one's rest None
            shown = f"no {', '.join(map(repr, short))} value" if short else "more values than the header has columns"
            raise ValueError(f"loads file {str(path)!r} line {line}: {shown} (the header has "
                             f"{len(reader.fieldnames)} columns)")
        name = f"{row['domain']}:{row['layer']}" if row.get("domain") else str(row["layer"])
        for column in ("domain", "layer"):
            value = row.get(column)
            if value is not None and (value != value.strip() or (column == "layer" and not value)):
                raise ValueError(f"loads file {str(path)!r} line {line}: {column} {value!r} is empty or has spaces "
                                 f"around it (a layer is named by its 'domain' and 'layer' values as written)")
        digits = row["expert"]
        if not re.fullmatch(r"-?[0-9]+", digits):  # ASCII digits as written: int() also takes " 7", "7_0", "٧"
            raise ValueError(f"loads file {str(path)!r} line {line}: layer {name}: expert {_shown(digits)} is not "
                             f"an integer id")
        if len(digits.lstrip("-")) > len(str(MAX_EXPERTS)) or not 0 <= int(digits) < MAX_EXPERTS:
            shown = digits if len(digits) <= 40 else f"{digits[:40]}... ({len(digits)} digits)"
            raise ValueError(f"loads file {str(path)!r} line {line}: expert {shown} is no expert id (ids count from "
                             f"0, at most {MAX_EXPERTS} experts a layer)")
        expert = int(digits)
        try:
            if not row["count"].isascii() or row["count"] != row["count"].strip() or "_" in row["count"]:
                raise ValueError(row["count"])  # float() also takes " 7", "7_0", "٧"
            count = float(row["count"])
        except ValueError as exc:
            raise ValueError(f"loads file {str(path)!r} line {line}: layer {name}, expert {expert}: count "
                             f"{_shown(row['count'])} is not a number") from exc
        if not math.isfinite(count) or count < 0:
            what = "is negative; loads count tokens" if count < 0 else "is not a finite number"
            raise ValueError(f"loads file {str(path)!r} line {line}: layer {name}, expert {expert}: count "
                             f"{_shown(row['count'])} {what}")
        if expert in groups.setdefault(name, {}):
            raise ValueError(f"loads file {str(path)!r} line {line}: expert {expert} repeated in {name}")
        groups[name][expert] = count
    if not groups:
        raise ValueError(f"loads file {str(path)!r} has no rows")
    return groups


def _json_type(value: object) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def read_loads(path: str | Path) -> torch.Tensor:
    """Read a load table written by ``save_loads``, DeepSeek's example JSON, or the OLMoE CSV.

    Returns:
        ``[L, E]`` float64 tokens per logical expert (validated: finite, non-negative).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a directory, device or pipe, an unreadable file, missing field, a ``format`` other than
            ``LOADS_FORMAT``, both ``load`` and ``weight``, ragged rows, or bad values (file and the JSON key used,
            ``load`` or ``weight``, named).
    """
    path = check_regular_file(path, "loads file")
    label = "load"  # how the values are named in messages: the tensor, or the JSON key used
    try:
        if path.suffix == ".csv":
            return read_csv_loads(path)[0]  # validated there
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                if "load" not in f.keys():
                    raise ValueError(f"tensor 'load' is missing; the file holds {sorted(f.keys())}")
                load = f.get_tensor("load")
        else:
            doc = json.loads(read_text_file(path, "loads file", MAX_DATA_TEXT_BYTES))
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object with field 'load' (or 'weight'), got a JSON "
                                 f"{_json_type(doc)}")
            if doc.get("format") not in (None, LOADS_FORMAT):
                raise ValueError(f"field 'format' is {json.dumps(doc['format'])}; this reader knows "
                                 f"{json.dumps(LOADS_FORMAT)}")
            if doc.get("load") is not None and doc.get("weight") is not None:
                raise ValueError("fields 'load' and 'weight' are both given; a loads file holds one of them")
            name = "load" if "load" in doc else "weight"
            label = name
            rows = doc.get(name)
            if rows is None:
                if name in doc:
                    raise ValueError(f"field {name!r} is null; it must be a list of per-layer lists of counts")
                raise ValueError(f"field 'load' (or 'weight') is missing; the object has {sorted(doc)}")
            rectangular = isinstance(rows, list) and all(isinstance(r, list) for r in rows)
            if not rectangular or len({len(r) for r in rows}) > 1:
                raise ValueError(f"field {name!r} must be a list of equally long per-layer lists")
            for layer, row in enumerate(rows):
                for expert, v in enumerate(row):
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise ValueError(f"field {name!r} [layer {layer}, expert {expert}] = {v!r}: loads must be "
                                         "numbers (tokens per expert)")
                    try:
                        float(v)
                    except OverflowError:  # an integer past float64's range: torch.tensor's words name nothing
                        raise ValueError(f"field {name!r} [layer {layer}, expert {expert}] is an integer of "
                                         f"{v.bit_length()} bits, past a float64's range; loads count tokens"
                                         ) from None
            load = torch.tensor(rows, dtype=torch.float64)
        return torch.from_numpy(as_load_array(load, label))
    except (ValueError, TypeError, KeyError) as exc:
        if str(exc).startswith(f"loads file {str(path)!r}"):  # the CSV reader names the file itself
            raise
        raise ValueError(f"loads file {str(path)!r}: {exc}") from exc
    except Exception as exc:  # parser errors of json / safetensors
        raise ValueError(f"loads file {str(path)!r} could not be read: {exc}") from exc
