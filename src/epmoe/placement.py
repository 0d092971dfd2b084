"""Expert placement (expert location metadata): which physical slot holds which logical expert.

An ``ExpertPlacement`` is an immutable, validated value. It is built once, passed explicitly to every
layer that needs it, and replaced (never mutated) by a rebalance. Slots are numbered globally,
``0 .. P-1``; EP rank ``g`` holds the contiguous block ``[g * P/G, (g+1) * P/G)``, the convention of
DeepSeek's EPLB, SGLang and vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch

from epmoe.checks import MAX_EXPERTS, check_int, check_positive_int, check_regular_file, read_text_file
from epmoe.files import atomic_path

PLACEMENT_FORMAT = "epmoe.placement/1"
# the keys of a JSON placement file (``physical_to_logical_map``: SGLang's name of ``phy2log``)
PLACEMENT_KEYS = ("format", "num_experts", "ep_size", "phy2log", "physical_to_logical_map")


def max_redundant_slots(num_experts: int, ep_size: int) -> int:
    """Most redundant slots per layer worth having: ``E * max(G - 1, 1)``, when every rank holds a copy of
    every expert (more copies cannot spread the load further)."""
    return num_experts * max(ep_size - 1, 1)


def _metadata_int(meta: dict[str, str], key: str) -> int | None:
    """A safetensors placement file's integer metadata ``key`` (``None`` when absent).

    Raises:
        ValueError: a value that is not an integer's text (the field named).
    """
    if key not in meta:
        return None
    try:
        return int(meta[key])
    except ValueError:
        raise ValueError(f"metadata field {key!r} must be an integer, got {meta[key]!r}") from None


def placement_file(path: str | Path) -> Path:
    """``path`` of a placement file, checked to be one.

    Raises:
        FileNotFoundError: nothing is there, or a directory (the path and which named).
        ValueError: a path that is not a regular file (a pipe or a device, which reading would block on or exhaust
            memory with; ``checks.check_regular_file``).
    """
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"placement file {str(path)!r} is a directory, not a file")
    return check_regular_file(path, "placement file")


def check_redundant(num_redundant: int, num_experts: int, ep_size: int, name: str = "num_redundant") -> None:
    """Refuse more redundant slots than ``max_redundant_slots``; ``name``: what the caller calls the count.

    Raises:
        ValueError: ``num_redundant`` above the bound (``name``, the value, the bound and its factors named).
    """
    bound = max_redundant_slots(num_experts, ep_size)
    if num_redundant > bound:
        raise ValueError(
            f"{name} ({num_redundant}) exceeds {bound} ({num_experts} experts x {max(ep_size - 1, 1)}): "
            "with that many every rank already holds a copy of every expert"
        )


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Where every physical expert slot lives, for every MoE layer.

    Attributes:
        phy2log: ``[L, P]`` int64, logical expert id held by each physical slot.
        num_experts: ``E``, logical experts per layer.
        ep_size: ``G``, ranks of the EP group; rank ``g`` holds slots ``[g*P/G, (g+1)*P/G)``.

    Derived (cached): ``log2phy [L, E, max_replicas]`` (-1 padded, ascending slot ids),
    ``logcnt [L, E]`` (copies per logical expert), ``slot_rank [P]``.

    Raises (at construction):
        TypeError: ``phy2log`` is not an integer tensor.
        ValueError: wrong rank/shape, an id outside ``[0, E)``, a logical expert with no slot in some
            layer (layer and expert named), ``P`` not divisible by ``ep_size``, ``ep_size`` larger than
            ``P``, or ``ep_size``/``num_experts`` not positive.
    """

    phy2log: torch.Tensor
    num_experts: int
    ep_size: int

    def __post_init__(self) -> None:
        p = self.phy2log
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"phy2log must be a torch.Tensor, got {type(p).__name__}")
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise TypeError(f"phy2log must be an integer tensor, got dtype {p.dtype}")
        if p.dim() != 2:
            raise ValueError(f"phy2log must be 2-D [num_layers, num_slots], got shape {tuple(p.shape)}")
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("ep_size", self.ep_size)
        num_layers, num_slots = p.shape
        if num_layers == 0:
            raise ValueError("phy2log has no layers (shape [0, P]); a placement needs one row per MoE layer")
        p = p.detach().to(device="cpu", dtype=torch.int64, copy=True).contiguous()  # our own copy: immutable
        object.__setattr__(self, "phy2log", p)
        bad = (p < 0) | (p >= self.num_experts)
        if bad.any():  # a wrong id first: it explains the counts below
            layer, slot = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"phy2log[{layer}, {slot}] = {int(p[layer, slot])} is not a logical expert id in [0, "
                f"{self.num_experts})"
            )
        if self.ep_size > num_slots:
            raise ValueError(
                f"EP size ({self.ep_size}) is larger than the number of slots ({num_slots}): "
                f"every rank needs at least one slot"
            )
        if num_slots % self.ep_size:
            raise ValueError(
                f"num_slots ({num_slots}) must be divisible by the EP group size ({self.ep_size})"
            )
        counts = self.logcnt
        missing = (counts == 0).nonzero()
        if len(missing):
            layer, expert = (int(v) for v in missing[0])
            raise ValueError(
                f"layer {layer}: logical expert {expert} has no physical slot "
                f"({len(missing)} (layer, expert) pairs without a slot in all)"
            )

    # ---- shape facts -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """``L``: MoE layers covered."""
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        """``P``: physical slots per layer, over all ranks."""
        return self.phy2log.shape[1]

    @property
    def num_redundant(self) -> int:
        """``R = P - E``: redundant slots per layer."""
        return self.num_slots - self.num_experts

    @property
    def slots_per_rank(self) -> int:
        """``P / G``: slots held by each EP rank."""
        return self.num_slots // self.ep_size

    # ---- derived tables ----------------------------------------------------------------------
    @cached_property
    def logcnt(self) -> torch.Tensor:
        """``[L, E]`` int64: number of physical copies of each logical expert."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        counts.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))
        return counts

    @cached_property
    def log2phy(self) -> torch.Tensor:
        """``[L, E, max_replicas]`` int64: physical slots of each logical expert, ascending, -1 padded."""
        num_layers, num_slots = self.phy2log.shape
        max_rep = int(self.logcnt.max())
        out = torch.full((num_layers, self.num_experts, max_rep), -1, dtype=torch.int64)
        # Sort slots by (expert, slot): stable sort keeps slot order inside an expert.
        order = torch.sort(self.phy2log, dim=1, stable=True).indices
        experts = torch.gather(self.phy2log, 1, order)
        first = torch.cumsum(self.logcnt, dim=1) - self.logcnt
        rank_in_expert = torch.arange(num_slots).expand(num_layers, -1) - torch.gather(first, 1, experts)
        layer_idx = torch.arange(num_layers).unsqueeze(1).expand(-1, num_slots)
        out[layer_idx, experts, rank_in_expert] = order
        return out

    @cached_property
    def slot_rank(self) -> torch.Tensor:
        """``[P]`` int64: the EP rank holding each physical slot."""
        return torch.arange(self.num_slots) // self.slots_per_rank

    # ---- per-rank views ----------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank ({rank}) must lie in [0, ep_size={self.ep_size})")

    def local_slots(self, rank: int) -> range:
        """Global ids of the physical slots that ``rank`` holds (the same on every layer)."""
        self._check_rank(rank)
        s = self.slots_per_rank
        return range(rank * s, (rank + 1) * s)

    def local_experts(self, rank: int) -> torch.Tensor:
        """``[L, P/G]`` int64: the logical expert in each local slot of ``rank``."""
        s = self.local_slots(rank)
        return self.phy2log[:, s.start:s.stop]

    def dispatch_table(self, rank: int) -> torch.Tensor:
        """``[L, E]`` int64: the physical slot ``rank`` sends each logical expert's tokens to.

        A copy on ``rank`` itself is preferred; otherwise the copies are spread deterministically over
        sending ranks (sender ``rank`` uses copy ``rank mod logcnt``), so every replica of a hot expert
        takes an equal share of the senders.
        """
        self._check_rank(rank)
        log2phy = self.log2phy
        pick = torch.remainder(torch.full_like(self.logcnt, rank), self.logcnt)
        table = torch.gather(log2phy, 2, pick.unsqueeze(-1)).squeeze(-1)
        local = (log2phy >= 0) & (self.slot_rank[log2phy.clamp(min=0)] == rank)
        has_local = local.any(dim=-1)
        first_local = torch.gather(log2phy, 2, local.to(torch.int64).argmax(dim=-1, keepdim=True)).squeeze(-1)
        return torch.where(has_local, first_local, table)

    # ---- comparison, checks ------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and self.ep_size == other.ep_size
            and torch.equal(self.phy2log, other.phy2log)
        )

    __hash__ = None  # type: ignore[assignment]

    def check_model(self, num_moe_layers: int, num_experts: int, what: str = "the model") -> None:
        """Check that this placement covers a model with ``num_moe_layers`` layers of ``num_experts``.

        Raises:
            ValueError: the layer or expert count differs (both numbers named).
        """
        if self.num_layers != num_moe_layers:
            raise ValueError(
                f"placement covers {self.num_layers} MoE layer{'' if self.num_layers == 1 else 's'} but {what} has "
                f"{num_moe_layers}"
            )
        if self.num_experts != num_experts:
            raise ValueError(
                f"placement holds {self.num_experts} logical experts per layer but {what} has {num_experts}"
            )

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, ep_size: int, num_experts: int | None = None) -> "ExpertPlacement":
        """Build from a ``[L, P]`` integer map; ``num_experts`` defaults to ``max(phy2log) + 1``.

        Raises:
            ValueError: as the constructor; with ``num_experts`` inferred, a map whose largest id leaves some
                smaller id without a slot names that largest id and its position first (it is the likely
                out-of-range id).
        """
        if num_experts is not None:
            return cls(phy2log=phy2log, num_experts=num_experts, ep_size=ep_size)
        if not isinstance(phy2log, torch.Tensor) or phy2log.numel() == 0:
            raise ValueError("num_experts must be given when phy2log is empty or not a tensor")
        inferred = int(phy2log.max()) + 1
        try:
            return cls(phy2log=phy2log, num_experts=inferred, ep_size=ep_size)
        except ValueError as exc:
            if "has no physical slot" not in str(exc):
                raise
            layer, slot = (int(v) for v in (phy2log == inferred - 1).nonzero()[0])
            raise ValueError(
                f"phy2log[{layer}, {slot}] = {inferred - 1} is the largest id and num_experts is not given, so "
                f"{inferred} experts were assumed; is {inferred - 1} out of range? Then {exc}"
            ) from None

    @classmethod
    def trivial(
        cls,
        num_layers: int,
        num_experts: int,
        ep_size: int,
        num_redundant: int = 0,
        layout: Literal["contiguous", "round_robin"] = "contiguous",
    ) -> "ExpertPlacement":
        """A load-independent placement.

        ``contiguous``: slot ``p`` holds expert ``p mod E`` (rank 0 gets experts ``0..P/G-1``; redundant
        slots repeat experts ``0..R-1``). ``round_robin``: slot ``j`` of rank ``g`` holds expert
        ``(j*G + g) mod E``, so neighbouring experts land on different ranks.

        Raises:
            ValueError: a count is not positive, ``num_redundant`` is negative, an unknown layout, or the
                resulting placement is invalid (e.g. ``E + R`` not divisible by ``ep_size``).
        """
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("ep_size", ep_size)):
            check_positive_int(name, v)
        check_int("num_redundant", num_redundant, 0, wording="a non-negative integer")
        check_redundant(num_redundant, num_experts, ep_size)
        num_slots = num_experts + num_redundant
        if ep_size > num_slots:
            raise ValueError(
                f"EP size ({ep_size}) is larger than the number of slots ({num_slots}): every rank needs at least one "
                "slot"
            )
        if num_slots % ep_size:
            fix = num_redundant + (-num_slots) % ep_size
            raise ValueError(
                f"num_slots ({num_slots} = {num_experts} experts + {num_redundant} redundant) must be "
                f"divisible by the EP group size ({ep_size}); {fix} redundant slots would give {num_experts + fix}"
            )
        if layout == "contiguous":
            row = torch.arange(num_slots) % num_experts
        elif layout == "round_robin":
            per_rank = num_slots // ep_size
            g = torch.arange(ep_size).unsqueeze(1)
            j = torch.arange(per_rank).unsqueeze(0)
            row = ((j * ep_size + g) % num_experts).reshape(-1)
        else:
            raise ValueError(f"layout must be 'contiguous' or 'round_robin', got {layout!r}")
        return cls(phy2log=row.expand(num_layers, -1).clone(), num_experts=num_experts, ep_size=ep_size)

    # ---- files -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the placement to ``path``: ``.safetensors`` (tensor ``phy2log`` + metadata) or JSON.

        The file is written to a temporary name and renamed, so a failed write leaves no half file.
        """
        path = Path(path)
        with atomic_path(path) as tmp:
            if path.suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file(
                    {"phy2log": self.phy2log, "log2phy": self.log2phy, "logcnt": self.logcnt},
                    str(tmp),
                    metadata={"format": PLACEMENT_FORMAT, "num_experts": str(self.num_experts),
                              "ep_size": str(self.ep_size)},
                )
            else:
                doc = {
                    "format": PLACEMENT_FORMAT,
                    "num_experts": self.num_experts,
                    "ep_size": self.ep_size,
                    "phy2log": self.phy2log.tolist(),
                }
                tmp.write_text(json.dumps(doc))

    @classmethod
    def load(cls, path: str | Path, ep_size: int | None = None,
             model_experts: int | None = None) -> "ExpertPlacement":
        """Read a placement written by ``save`` (JSON or safetensors).

        JSON files may also use SGLang's key ``physical_to_logical_map`` for ``phy2log``; any other key is
        refused by name (``PLACEMENT_KEYS`` lists the known ones).

        Args:
            path: the file.
            ep_size: EP size to use when the file names none; must agree when it does.
            model_experts: the model's experts a layer, used when the file names none (an id past them is then named
                as out of range); a file that names its own is read as it says (its user checks it against the model),
                and where it does not hold together the disagreement with the model is named first.

        Raises:
            FileNotFoundError: no such file (or a directory there).
            ValueError: unreadable file, a missing or unknown field, ragged layers, an ``ep_size`` disagreeing
                with the file, or any validation error of the constructor, an out-of-range id named with its
                position before anything else (the file's name is in the message).
        """
        path = placement_file(path)
        text = None if path.suffix == ".safetensors" else read_text_file(path, "placement file")
        try:
            if text is None:
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    if "phy2log" not in f.keys():
                        raise ValueError("tensor 'phy2log' is missing")
                    phy2log = f.get_tensor("phy2log")
                file_ep, num_experts = (_metadata_int(meta, key) for key in ("ep_size", "num_experts"))
            else:
                doc = json.loads(text)
                if not isinstance(doc, dict):
                    raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
                unknown = sorted(k for k in doc if k not in PLACEMENT_KEYS)
                if unknown:
                    raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}; a placement file holds "
                                     f"{', '.join(map(repr, PLACEMENT_KEYS))}")
                rows = doc.get("phy2log", doc.get("physical_to_logical_map"))
                if rows is None:
                    named = next((k for k in ("phy2log", "physical_to_logical_map") if k in doc), None)
                    raise ValueError(f"field {named!r} is null; it must be a list of per-layer lists" if named
                                     else "field 'phy2log' is missing")
                if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
                    raise ValueError("field 'phy2log' must be a list of per-layer lists")
                widths = {len(r) for r in rows}
                if not rows or widths == {0}:
                    raise ValueError(f"field 'phy2log' holds no slots, got {rows!r}: it needs one list of logical "
                                     f"expert ids per MoE layer")
                if len(widths) > 1:
                    lens = [len(r) for r in rows]
                    layer = next(i for i, n in enumerate(lens) if n != lens[0])
                    raise ValueError(f"phy2log layer {layer} has {lens[layer]} slots but layer 0 has {lens[0]}")
                bad = next(((i, j, v) for i, r in enumerate(rows) for j, v in enumerate(r)
                            if not isinstance(v, int) or isinstance(v, bool)), None)
                if bad is not None:
                    raise ValueError(f"phy2log must hold integers only, got phy2log[{bad[0]}, {bad[1]}] = {bad[2]!r}")
                huge = next(((i, j, v) for i, r in enumerate(rows) for j, v in enumerate(r)
                             if abs(v) >= MAX_EXPERTS), None)
                if huge is not None:  # the tables are sized by the largest id: refused before they are made
                    raise ValueError(f"phy2log[{huge[0]}, {huge[1]}] = {huge[2]} is no expert id (at most "
                                     f"{MAX_EXPERTS} experts a layer)")
                phy2log = torch.tensor(rows, dtype=torch.int64)
                if phy2log.dim() != 2:
                    phy2log = phy2log.reshape(len(rows), -1)
                file_ep = doc.get("ep_size")
                num_experts = doc.get("num_experts")
                for key, value in (("ep_size", file_ep), ("num_experts", num_experts)):
                    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                        raise ValueError(f"field {key!r} must be an integer, got {value!r}")
                if "format" in doc and doc["format"] != PLACEMENT_FORMAT:
                    raise ValueError(f"field 'format' is {doc['format']!r}; this reader knows {PLACEMENT_FORMAT!r}")
            for key, value in (("ep_size", file_ep), ("num_experts", num_experts)):
                if value is not None and not 1 <= value <= MAX_EXPERTS:
                    raise ValueError(f"field {key!r} must be a positive integer"
                                     f"{f' up to {MAX_EXPERTS}' if value > 0 else ''}, got {value!r}")
            if file_ep is not None and ep_size is not None and int(file_ep) != ep_size:
                raise ValueError(f"the file is for EP size {file_ep} but EP size {ep_size} was asked for")
            use_ep = int(file_ep) if file_ep is not None else ep_size
            if use_ep is None:
                raise ValueError("field 'ep_size' is missing and no EP size was given")
            given = num_experts if num_experts is not None else model_experts
            try:
                return cls.from_phy2log(phy2log, ep_size=use_ep, num_experts=given)
            except ValueError as exc:  # a file's own count past the model's: that disagreement is the cause
                if num_experts is None or model_experts is None or num_experts == model_experts:
                    raise
                raise ValueError(f"field 'num_experts' is {num_experts} but the model has {model_experts} experts a "
                                 f"layer ({exc})") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"placement file {str(path)!r}: {exc}") from exc
        except Exception as exc:  # safetensors / json parser errors of other types
            raise ValueError(f"placement file {str(path)!r} could not be read: {exc}") from exc
