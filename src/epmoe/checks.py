"""Argument checks shared by every module: one implementation of "an integer of at least ``minimum``"."""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path


def is_int(value: object) -> bool:
    """True for an integer (Python or numpy), False for ``bool`` and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def valid_seed(value: object) -> bool:
    """Whether ``value`` is a sampling seed: an integer (not a bool) in ``[0, 2**63)`` (the engine's, ``run``'s, the
    server's and ``bench serve``'s)."""
    return is_int(value) and 0 <= value < 2**63


def check_int(name: str, value: object, minimum: int, *, wording: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``.

    Args:
        name: the field named in the message.
        value: what was given.
        minimum: the smallest accepted value.
        wording: what is expected, said in the message (default ``"an integer >= {minimum}"``).

    Raises:
        ValueError: ``"{name} must be {wording}, got {value!r}"`` for a bool, a non-integer or a smaller value.
    """
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be {wording or f'an integer >= {minimum}'}, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: object) -> int:
    """``check_int(name, value, 1)`` with the message ``"{name} must be a positive integer, got {value!r}"``."""
    return check_int(name, value, 1, wording="a positive integer")


def describe(value: object) -> str:
    """For error messages: a tensor's dtype, shape and device, anything else's type name."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def norm_weight_fits(x, weight, weight_then_cast: bool) -> bool:
    """Whether ``weight`` can be the RMSNorm weight of the float rows ``x [..., D]`` in a kernel that folds the norm:
    a contiguous ``[D]`` float tensor on ``x``'s device, of ``x``'s dtype unless ``weight_then_cast`` (``True``)."""
    return (weight.shape == (x.shape[-1],) and weight.device == x.device and weight.is_contiguous()
            and weight.dtype.is_floating_point and (weight_then_cast is True or weight.dtype == x.dtype))


def check_add_norm(where: str, x: object, residual: object, weight: object, eps: object, weight_then_cast: object,
                   outputs: dict[str, object]) -> None:
    """Check the operands of a residual add and RMSNorm that a kernel computes on its rows (``layer.FoldedNorm``,
    ``engine.gemv.gemv_add_norm``, ``routing.router_triton.NormBefore``): every program of the launch reads the
    rows and the residual while one of them writes the outputs, so no output may share memory with them.

    Args:
        where: the function or class named in the messages.
        x: ``[..., D]`` the rows: a float tensor, contiguous along ``D``.
        residual: ``[..., D]`` of ``x``'s shape, dtype and device, contiguous along ``D``.
        weight: ``[D]`` the norm's weight: a contiguous float tensor on ``x``'s device, of ``x``'s dtype unless
            ``weight_then_cast``.
        eps: the norm's epsilon: a finite real number ``>= 0``.
        weight_then_cast: a bool.
        outputs: name -> tensor the kernel writes (``None`` entries are skipped): each of ``x``'s shape, dtype and
            device, contiguous along ``D``, sharing no memory with ``x``, ``residual`` or another output.

    Raises:
        TypeError: an operand that is not a tensor, or ``weight_then_cast`` not a bool (named).
        ValueError: a shape, dtype, device or layout that does not fit, an ``eps`` that is not a finite real ``>= 0``,
            an output that overlaps an input or another output (named, with the value).
    """
    import torch

    given = [("x", x), ("residual", residual), ("weight", weight)]
    given += [(n, t) for n, t in outputs.items() if t is not None]
    for name, t in given:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(weight_then_cast, bool):
        raise TypeError(f"{where}: weight_then_cast must be a bool, got {weight_then_cast!r}")
    if (isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(float(eps))
            or float(eps) < 0):
        raise ValueError(f"{where}: eps must be a finite real number >= 0, got {eps!r}")
    if x.dim() < 1 or not x.dtype.is_floating_point or (x.shape[-1] > 1 and x.stride(-1) != 1):
        raise ValueError(f"{where}: x {tuple(x.shape)} {x.dtype} strides {x.stride()} must be float rows [..., D], "
                         f"contiguous along D")
    for name, t in (("residual", residual), *outputs.items()):
        if t is None:
            continue
        if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device or (t.shape[-1] > 1 and t.stride(-1) != 1):
            raise ValueError(f"{where}: {name} {tuple(t.shape)} {t.dtype} on {t.device} strides {t.stride()} must "
                             f"match x {tuple(x.shape)} {x.dtype} on {x.device}, contiguous along its last dimension")
    d = x.shape[-1]
    if not norm_weight_fits(x, weight, weight_then_cast):
        raise ValueError(f"{where}: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} must be a "
                         f"contiguous [{d}] float tensor on {x.device} of x's dtype {x.dtype} (any float dtype with "
                         f"weight_then_cast)")
    spans = {name: _byte_span(t) for name, t in (("x", x), ("residual", residual), *outputs.items()) if t is not None}
    names = list(spans)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if (a in outputs or b in outputs) and _overlap(spans[a], spans[b]):
                raise ValueError(f"{where}: {b if b in outputs else a} shares memory with {a if b in outputs else b}: "
                                 f"the kernel's programs read the rows and the residual while one writes the outputs")


def _byte_span(t) -> tuple[int, int]:
    """``[start, end)`` bytes of a tensor's elements in its storage's address space (empty for no elements)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


MAX_EXPERTS = 1 << 20
"""The most experts (and ranks) a layer may have in a placement or loads file or a config.json (routed, shared,
groups): far past any model's, and a bound on the tables a file's ids size before they are made."""

MAX_SPECULATIVE_TOKENS = 16
"""The most draft tokens a speculative round verifies (``EngineConfig.speculative_num_tokens``) and so the most
``epmoe plan --spec-tokens`` prices."""

MAX_WIDTH = 1 << 20
"""The widest dimension a config.json may give (``hidden_size``, the dense and expert intermediate sizes, the attention
heads and head widths): far past any model's (tens of thousands), a bound on what the planner and doctor size from
it."""

MAX_VOCAB = 1 << 24
"""The largest ``vocab_size`` a config.json may give: far past any model's (a few hundred thousand), a bound on the
embedding and logits the planner and doctor size from it."""

MAX_POSITIONS = 1 << 24
"""The largest ``max_position_embeddings`` a config.json may give: past the longest published context (Llama-4
Scout's 10485760), a bound on what the engine sizes from it (its block tables, and a KV pool of up to
``max_num_seqs`` sequences of that context)."""

MAX_LAYERS = 1 << 16
"""The most decoder layers a config.json may give (``num_hidden_layers``): far past any model's, and a bound on the
per-layer tables the spec and the planner make from it."""

MAX_ARRIVAL_SPAN_S = 86400.0
"""The longest a request rate may spread its arrivals (``epmoe run --request-rate``: the last prompt's arrival on a
rank; ``epmoe bench serve``: the last request's expected arrival), in seconds: one day. A rate so low that the arrivals
would take longer is a typo (``1e-3`` for ``1e3``), refused before anything runs rather than left to wait."""


def check_arrival_span(flag: str, rate: float, arrivals: int, what: str = "prompts") -> None:
    """Refuse a request rate whose ``arrivals`` prompts (one every ``1 / rate`` s after the first) would span more
    than ``MAX_ARRIVAL_SPAN_S``; ``flag`` names the rate and ``what`` the prompts in the message.

    Raises:
        ValueError: the span over the bound, with the rate, the prompts and the span in seconds.
    """
    span = max(arrivals - 1, 0) / rate
    if span > MAX_ARRIVAL_SPAN_S:
        shown = f"{span:.10g} s" if math.isfinite(span) else "more seconds than a float holds"
        raise ValueError(f"{flag} {rate!r} spreads {arrivals} {what} over {shown}, past the "
                         f"{MAX_ARRIVAL_SPAN_S:g} s (one day) a run waits for arrivals; give more requests a second")


def check_regular_file(path: str | Path, what: str) -> Path:
    """``path`` as a ``Path`` if it names a regular file (a symlink to one counts); ``what`` names it in errors.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: a directory, or a path that is not a regular file (a device such as ``/dev/zero``, a pipe, which
            reading would exhaust memory or block on).
    """
    p = Path(path)
    label = f"{what} {str(p)!r}"
    if not p.exists():
        raise FileNotFoundError(f"{label} does not exist")
    if p.is_dir():
        raise ValueError(f"{label} is a directory, not a file")
    if not p.is_file():
        raise ValueError(f"{label} is not a regular file")
    return p


MAX_TEXT_BYTES = 64 << 20
"""Largest text file ``read_text_file`` reads by default: a ``config.json``, a hardware profile or a chat template
is a few KB; more is a wrong path (a log, a checkpoint shard), refused before it fills the memory."""
MAX_DATA_TEXT_BYTES = 4 << 30
"""Largest data file (a loads dump, a benchmark dataset) ``read_text_file`` reads for the readers that pass it."""
_READ_CHUNK = 1 << 20


def read_text_file(path: str | Path, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (``check_regular_file``); ``what`` names it in errors (``"loads
    file"``: ``loads file 'x.json' is a directory``).

    The file is opened without blocking and read in pieces up to ``max_bytes``: a kernel file that would wait for
    data (``/proc/kmsg``) and a file larger than the bound (its size as listed, or as read where a kernel file lists
    none) are refused instead of blocking or filling the memory.

    Args:
        path: the file.
        what: what the file is, for messages.
        max_bytes: the largest size read (bytes; ``MAX_TEXT_BYTES``, or ``MAX_DATA_TEXT_BYTES`` for data files).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: not a regular file (``check_regular_file``), a file that cannot be read (the reason named), one
            with nothing to read without waiting, one larger than ``max_bytes``, or bytes that are not UTF-8 (the
            first bad byte and its position named).
    """
    p = check_regular_file(path, what)
    label = f"{what} {str(p)!r}"
    too_large = f"{label} is larger than {max_bytes} bytes, the most read for a {what}; is it the file meant?"
    try:
        if p.stat().st_size > max_bytes:
            raise ValueError(f"{too_large} (it holds {p.stat().st_size} bytes)")
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        try:
            pieces, size = [], 0
            while size <= max_bytes:
                piece = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - size))
                if not piece:
                    break
                pieces.append(piece)
                size += len(piece)
        finally:
            os.close(fd)
    except BlockingIOError:
        raise ValueError(f"{label} has nothing to read without waiting (a kernel or device file?)") from None
    except OSError as exc:
        raise ValueError(f"{label} cannot be read: {exc.strerror or exc}") from None
    if size > max_bytes:
        raise ValueError(too_large)
    try:
        text = b"".join(pieces).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{label} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at position {exc.start})"
                         ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as ``open`` reads text
